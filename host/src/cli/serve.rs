//! `rlhost serve`: the OpenAI-compatible gateway without training. The run config's model
//! (the built-in one by default, with `--adapter` applied) answers Chat Completions on
//! 127.0.0.1; sessions hand out the config's tasks (`/rl/tasks/next`) and are recorded
//! token-exactly; each ended session is written as one JSON line to `--record`.

use crate::gateway::chat::Renderer;
use crate::gateway::pump::{Job, pump};
use crate::gateway::server::{self, Gateway, Tasks};
use crate::gateway::sessions::Finished;
use anyhow::{Context, Result};
use clap::Args;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::runtime::Handle;

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    source: super::RunSource,
    /// Where to listen (`127.0.0.1:0` picks a free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:8000")]
    addr: String,
    /// A PEFT LoRA adapter directory to serve on the model (a checkpoint's `adapter/`).
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// The model id clients name in `model` (`GET /v1/models` lists it).
    #[arg(long, default_value = "policy")]
    served_model_name: String,
    /// Sessions handed out per task by `/rl/tasks/next` (default: the config's
    /// rollout.group_size).
    #[arg(long)]
    group_size: Option<usize>,
    /// Append each ended session (its rows of token ids and log-probs, drifts, reward and
    /// transcript) to this JSONL file.
    #[arg(long)]
    record: Option<PathBuf>,
    /// Connections served at once.
    #[arg(long, default_value_t = server::MAX_CONNECTIONS)]
    max_connections: usize,
}

pub fn run(args: ServeArgs, handle: &Handle, quiet: bool) -> Result<()> {
    let mut set = args.source.set.clone();
    if let Some(adapter) = &args.adapter {
        set.push(crate::config::set_path("model.adapter", adapter)?);
    }
    let loaded = super::load_config(
        args.source.config.as_deref(),
        &args.source.plugins,
        &set,
        handle,
    )?;
    let setup = super::open_run(loaded, &args.source.plugins, handle, quiet, &|| {})?;
    let renderer = Renderer::new(&setup.lm, setup.settings.template_kwargs.clone())?;
    let group_size = args
        .group_size
        .unwrap_or(setup.loaded.config.rollout.group_size);
    if group_size == 0 {
        anyhow::bail!("--group-size must be at least 1");
    }
    let mode = setup.mode();
    let crate::config::setup::Setup { lm, dataset, .. } = setup;
    let (jobs_tx, jobs_rx) = std::sync::mpsc::channel::<Job>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<Finished>();
    let tasks = Tasks::new(dataset, group_size);
    let gw = Arc::new(Gateway::new(
        args.served_model_name.clone(),
        renderer,
        jobs_tx,
        done_tx,
        Some(tasks),
    ));
    let record = match &args.record {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("cannot open --record {}", path.display()))?,
        ),
        None => None,
    };
    let addr = server::spawn(gw.clone(), &args.addr, args.max_connections)?;
    // Ended sessions are written as they come, one line each, flushed: a reader of the
    // file never sees half a session.
    let record_path = args.record.clone();
    std::thread::Builder::new()
        .name("rlhost-record".into())
        .spawn(move || {
            let Some(mut file) = record else {
                for _ in done_rx {}
                return;
            };
            for finished in done_rx {
                let mut line = serde_json::to_vec(&finished).expect("a session is JSON");
                line.push(b'\n');
                if let Err(e) = file.write_all(&line) {
                    let path = record_path.as_deref().unwrap_or_else(|| "?".as_ref());
                    tracing::error!("cannot write session to {}: {e}", path.display());
                }
            }
        })
        .context("cannot start the record thread")?;
    println!(
        "rlhost serve: {} at http://{addr}/v1 (model `{}`)",
        lm.dir.display(),
        args.served_model_name
    );
    // A ready line for scripts and tests, flushed before the first request can come.
    std::io::stdout().flush()?;
    let interrupted = super::interrupt::arm();
    let pumped = pump(&lm, mode, &jobs_rx, 0, &|| {
        interrupted.load(Ordering::Relaxed)
    })?;
    if !quiet {
        let s = gw.status();
        eprintln!(
            "rlhost serve: stopped after {} requests ({} forwards), {} sessions ended, {} drifts",
            pumped.requests, pumped.forwards, s["sessions"]["ended"], s["drifts"]
        );
    }
    Ok(())
}
