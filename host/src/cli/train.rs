//! `rlhost train`: the main job. Rollouts with the config's tools and rewards, GRPO-family
//! updates of a LoRA adapter, metrics to `RUN/metrics.jsonl`, checkpoints to
//! `RUN/checkpoints/`, and `--resume latest` to continue an interrupted run.

use crate::config::LoadedConfig;
use crate::config::setup::{Setup, display, out_dir};
use crate::rl::{checkpoint, trainer};
use crate::status::{Phase, StatusHub, server};
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
    /// Serve the status endpoint and dashboard here (read-only). Port 0 picks a free
    /// port. Without the flag, 127.0.0.1:8787 is tried first and a free port used if it
    /// is taken; the URL is printed either way.
    #[arg(long, value_name = "ADDR:PORT")]
    status_addr: Option<String>,
    /// Do not serve a status endpoint.
    #[arg(long, conflicts_with = "status_addr")]
    no_status: bool,
    /// Keep serving the status endpoint this many seconds after the run ends (to look at
    /// the finished dashboard).
    #[arg(long, value_name = "SECONDS", default_value_t = 0)]
    status_linger: u64,
}

/// The address tried when `--status-addr` is not given.
const DEFAULT_STATUS_ADDR: &str = "127.0.0.1:8787";

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
    let hub = StatusHub::new(
        &StatusHub::run_id(&args.config),
        &loaded.config.model.path.display().to_string(),
        &display(&args.config),
        train.steps,
    );
    let server = serve_status(&args, &hub)?;
    // The URL is shown once the config, plugins and data have checked out (a bad input
    // gets its one error line and nothing else), before the slow part.
    let announced = std::cell::Cell::new(false);
    let announce = || {
        if let Some(server) = &server
            && !announced.replace(true)
        {
            eprintln!("status: {}", server.url());
        }
    };
    let result = (|| -> Result<Vec<trainer::StepMetrics>> {
        let warm_start = || {
            hub.set_phase(Phase::WarmStart);
            announce();
        };
        let mut setup = Setup::open_announcing(loaded, &args.plugins, handle, quiet, &warm_start)?;
        announce();
        write_plugins(&out, &setup)?;
        let run = trainer::RunOptions {
            out_dir: &out,
            resume: resume.as_deref(),
            stop_after: args.stop_after,
            quiet,
            hub: &hub,
        };
        trainer::train(&mut setup, &train, &run, handle)
    })();
    match &result {
        Ok(_) => hub.set_phase(Phase::Done),
        Err(e) => hub.fail(&format!("{e:#}")),
    }
    if announced.get() && args.status_linger > 0 {
        if !quiet {
            eprintln!(
                "run ended; the status endpoint stays up for {} s",
                args.status_linger
            );
        }
        std::thread::sleep(std::time::Duration::from_secs(args.status_linger));
    }
    let metrics = result?;
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

/// Starts the status server unless `--no-status` (the caller prints its URL, even with
/// `--quiet`: with port 0 it is the only way to find it).
fn serve_status(
    args: &TrainArgs,
    hub: &std::sync::Arc<StatusHub>,
) -> Result<Option<server::Server>> {
    if args.no_status {
        return Ok(None);
    }
    let server = match &args.status_addr {
        Some(addr) => server::spawn(hub.clone(), addr)?,
        None => server::spawn(hub.clone(), DEFAULT_STATUS_ADDR).or_else(|e| {
            tracing::info!("{e:#}; using a free port");
            server::spawn(hub.clone(), "127.0.0.1:0")
        })?,
    };
    Ok(Some(server))
}

/// `RUN/plugins.json`: each plugin the run loaded, with its file's sha256, so a run
/// records exactly which tool and reward code produced it.
fn write_plugins(out: &std::path::Path, setup: &Setup) -> Result<()> {
    let list: Vec<serde_json::Value> = setup
        .plugins
        .iter()
        .map(|(name, p)| {
            serde_json::json!({
                "name": name,
                "id": p.id(),
                "path": display(&p.spec().path),
                "sha256": p.sha256(),
                "size": p.size(),
                "wit_version": p.wit_version(),
                "roles": p.roles().iter().map(|r| r.to_string()).collect::<Vec<_>>(),
            })
        })
        .collect();
    crate::model::peft::write_atomic(
        &out.join("plugins.json"),
        serde_json::to_string_pretty(&list)?.as_bytes(),
    )
}
