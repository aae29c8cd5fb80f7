//! `rlhost train`: the main job. Rollouts with the config's tools and rewards, GRPO-family
//! updates of a LoRA adapter, metrics to `RUN/metrics.jsonl`, checkpoints to
//! `RUN/checkpoints/`, and `--resume latest` to continue an interrupted run.

use crate::config::LoadedConfig;
use crate::config::setup::{Setup, display, out_dir};
use crate::rl::{checkpoint, trainer};
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use tokio::runtime::Handle;

#[derive(Debug, Args)]
pub struct TrainArgs {
    /// The run config (TOML).
    #[arg(long)]
    config: PathBuf,
    /// A plugin component to load; a trigger or environment replaces the config's.
    #[arg(long = "plugin", value_name = "FILE.wasm")]
    plugins: Vec<PathBuf>,
    /// Override a config value, e.g. --set train.steps=20 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Continue from `latest` (the run directory's newest checkpoint) or a checkpoint folder.
    #[arg(long, value_name = "latest|DIR")]
    resume: Option<String>,
    /// Overrides run.out_dir.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Overrides train.steps.
    #[arg(long)]
    steps: Option<u64>,
    /// Overrides run.seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop after this many steps of this invocation, as an interruption would (the
    /// schedule still spans train.steps; continue with --resume latest). For
    /// time-sliced jobs.
    #[arg(long, value_name = "N")]
    stop_after: Option<u64>,
}

pub fn run(args: TrainArgs, handle: &Handle, quiet: bool) -> Result<()> {
    let mut set = args.set.clone();
    if let Some(steps) = args.steps {
        set.push(format!("train.steps={steps}"));
    }
    if let Some(seed) = args.seed {
        set.push(format!("run.seed={seed}"));
    }
    if let Some(out) = &args.out {
        let abs = std::path::absolute(out)?;
        set.push(format!(
            "run.out_dir={}",
            toml::Value::String(abs.display().to_string())
        ));
    }
    let loaded = LoadedConfig::load(&args.config, &set)?;
    let out = out_dir(&loaded);
    let resume = match &args.resume {
        Some(spec) => Some(checkpoint::resolve(&out, spec)?),
        None => None,
    };
    let train = loaded.config.train.clone();
    std::fs::create_dir_all(&out)
        .with_context(|| format!("cannot create the run directory {}", out.display()))?;
    // The resolved config, as this run used it.
    crate::model::peft::write_atomic(
        &out.join("config.toml"),
        toml::to_string(&loaded.config)?.as_bytes(),
    )?;
    let mut setup = Setup::open(loaded, &args.plugins, handle, quiet)?;
    let metrics = trainer::train(
        &mut setup,
        &train,
        &out,
        resume.as_deref(),
        args.stop_after,
        handle,
        quiet,
    )?;
    if let (Some(first), Some(last)) = (metrics.first(), metrics.last()) {
        println!(
            "trained steps {}..{}: reward {:.3} -> {:.3}{}",
            first.step,
            last.step,
            first.reward_mean,
            last.reward_mean,
            match (first.accuracy, last.accuracy) {
                (Some(a), Some(b)) => format!(", accuracy {a:.3} -> {b:.3}"),
                _ => String::new(),
            }
        );
    }
    println!("run directory: {}", display(&out));
    Ok(())
}
