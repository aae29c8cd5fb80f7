//! `rlhost export`: an adapter as a merged Hugging Face model directory (for transformers,
//! vLLM and friends), or re-saved in PEFT's format.

use crate::model::{Model, Placement, peft};
use anyhow::{Context, Result, bail};
use candle_core::DType;
use clap::Args;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// The base model directory.
    #[arg(long)]
    model: PathBuf,
    /// The PEFT LoRA adapter directory.
    #[arg(long)]
    adapter: PathBuf,
    /// Fold the adapter into the weights and write a full model directory.
    #[arg(long)]
    merge: bool,
    /// Output directory (created; files in it are replaced).
    #[arg(long)]
    out: PathBuf,
    /// dtype of the merged weights: f32, bf16 or f16 (default: as config.json says).
    #[arg(long)]
    dtype: Option<String>,
}

pub fn run(args: ExportArgs) -> Result<()> {
    let mut model = Model::load(&args.model, &Placement::CPU)?;
    peft::load_adapter(&mut model, &args.adapter)
        .with_context(|| format!("loading adapter {}", args.adapter.display()))?;
    if !args.merge {
        peft::save_adapter(&model, &args.out, args.model.to_str())?;
        eprintln!("adapter written to {}", args.out.display());
        return Ok(());
    }
    let name = args
        .dtype
        .clone()
        .or_else(|| model.cfg.stored_dtype.clone())
        .unwrap_or_else(|| "float32".into());
    let dtype = match name.as_str() {
        "f32" | "float32" => DType::F32,
        "bf16" | "bfloat16" => DType::BF16,
        "f16" | "float16" => DType::F16,
        other => bail!("--dtype {other:?}: use f32, bf16 or f16"),
    };
    peft::export_merged(&model, &args.model, &args.out, dtype)?;
    eprintln!("merged model ({name}) written to {}", args.out.display());
    Ok(())
}
