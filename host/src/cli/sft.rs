//! `rlhost sft`: supervised fine-tuning of a LoRA adapter on chat conversations (loss on
//! the assistant's tokens only), e.g. a warm start before RL. Writes the adapter in PEFT's
//! format, and with `--merge` a merged model directory that `model.path` can point at.

use crate::config::LoadedConfig;
use crate::config::setup::display;
use crate::data::rows::{ReadOptions, RowKeys, read_file};
use crate::data::{Format, OnBadRow};
use crate::model::{LanguageModel, peft};
use crate::rl::sft::{SftSchedule, conversation_row, train};
use anyhow::{Context, Result, bail};
use candle_core::DType;
use clap::Args;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct SftArgs {
    /// The run config: its [model], [lora] and rollout.template_kwargs are used.
    #[arg(long)]
    config: PathBuf,
    /// Conversations: JSONL/JSON/CSV/Parquet rows with `messages` (RL2's SFT format).
    #[arg(long)]
    data: PathBuf,
    /// Where to write the adapter.
    #[arg(long)]
    out: PathBuf,
    /// Also write the base model with the adapter merged in, as a model directory.
    #[arg(long)]
    merge: Option<PathBuf>,
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Conversations per optimizer step.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    #[arg(long, default_value_t = 0)]
    warmup_steps: u64,
    #[arg(long, default_value_t = 1.0)]
    max_grad_norm: f64,
    #[arg(long, default_value_t = 8192)]
    micro_batch_tokens: usize,
    /// Override a config value (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
}

pub fn run(args: SftArgs, quiet: bool) -> Result<()> {
    let loaded = LoadedConfig::load(&args.config, &args.set)?;
    let c = &loaded.config;
    let format = Format::of(&args.data, None)?;
    let keys = RowKeys {
        prompt: &c.data.prompt_key,
        messages: &c.data.messages_key,
        // Conversations are the data here: no prompt built, no answer wanted.
        template: None,
        answer: None,
        tests: None,
    };
    let rows = read_file(
        &args.data,
        format,
        &ReadOptions {
            keys,
            on_bad_row: OnBadRow::Error,
            max_samples: None,
        },
    )?;
    let model_dir = loaded.resolve(&c.model.path);
    let file = loaded.path.display().to_string();
    let at = c.model.placement(&file)?;
    let mut lm =
        LanguageModel::open(&model_dir, &at).with_context(|| format!("{file}: model.path"))?;
    match &c.model.adapter {
        Some(a) => peft::load_adapter(&mut lm.model, &loaded.resolve(a))?,
        None => lm.model.attach_lora(&c.lora.to_config(), c.run.seed)?,
    }
    let mut train_rows = Vec::with_capacity(rows.samples.len());
    for (i, s) in rows.samples.iter().enumerate() {
        let row = conversation_row(&lm, &s.messages, &c.rollout.template_kwargs)
            .with_context(|| format!("{}: row {}", args.data.display(), i + 1))?;
        train_rows.push(row);
    }
    if train_rows.is_empty() {
        bail!("{}: no conversations", args.data.display());
    }
    let tokens: usize = train_rows.iter().map(|r| r.tokens.len()).sum();
    if !quiet {
        eprintln!(
            "sft: {} conversations, {tokens} tokens, {} epochs",
            train_rows.len(),
            args.epochs
        );
    }
    let schedule = SftSchedule {
        epochs: args.epochs,
        batch_rows: args.batch,
        lr: args.lr,
        warmup_steps: args.warmup_steps,
        max_grad_norm: args.max_grad_norm,
        micro_batch_tokens: args.micro_batch_tokens,
        // As the RL update does (`train.pack_sequences`).
        pack_sequences: c.train.pack_sequences,
        seed: c.run.seed,
    };
    let t0 = std::time::Instant::now();
    let losses = train(&lm.model, &train_rows, &schedule, |step, total, loss| {
        if !quiet && (step % 10 == 0 || step == total) {
            eprintln!("step {step}/{total}  loss {loss:.4}");
        }
        Ok(())
    })?;
    peft::save_adapter(&lm.model, &args.out, Some(&model_dir.display().to_string()))?;
    if let Some(merged) = &args.merge {
        peft::export_merged(&lm.model, &model_dir, merged, DType::F32)?;
    }
    println!(
        "sft: {} steps in {:.1} s, loss {:.4} -> {:.4}; adapter in {}{}",
        losses.len(),
        t0.elapsed().as_secs_f64(),
        losses.first().copied().unwrap_or(f32::NAN),
        losses.last().copied().unwrap_or(f32::NAN),
        display(&args.out),
        args.merge
            .as_ref()
            .map(|m| format!(", merged model in {}", display(m)))
            .unwrap_or_default()
    );
    Ok(())
}
