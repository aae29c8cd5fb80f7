//! `rlhost serve`: the OpenAI-compatible gateway without training. The run config's model
//! (the built-in one by default, with `--adapter` applied) answers Chat Completions on
//! 127.0.0.1; sessions hand out the config's tasks (`/rl/tasks/next`) and are recorded
//! token-exactly; each ended session is written as one JSON line to `--record`.
//!
//! `rlhost serve --tinker` serves the Tinker training API instead, on the same model:
//! clients create LoRA adapters on it, train them with their own loop and sample from them.

use crate::gateway::chat::Renderer;
use crate::gateway::pump::{Job, pump};
use crate::gateway::server;
use crate::gateway::sessions::Finished;
use crate::gateway::state::{Gateway, Tasks};
use crate::sampler::kv_budget::{self, KvBudget};
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
    source: super::source::RunSource,
    /// Where to listen (`127.0.0.1:0` picks a free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:8000")]
    addr: String,
    /// A PEFT LoRA adapter directory to serve on the model (a checkpoint's `adapter/`).
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// The model id clients name in `model` (`GET /v1/models` lists it; default `policy`).
    /// With --tinker: the base model's name in `get_server_capabilities` (default: the run
    /// config's model.path, which is still accepted, as is the model's directory). Recipes
    /// that look a model up by its Hub name (tinker-cookbook's renderers and tokenizers)
    /// need that name here.
    #[arg(long)]
    served_model_name: Option<String>,
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
    /// Listen beyond loopback on purpose: an --addr that is not 127.0.0.1 or ::1 is
    /// refused without it (and warned about with it).
    #[arg(long)]
    public: bool,
    /// Require this key on every route but the health check: `Authorization: Bearer KEY`
    /// (the `openai` client's `api_key`) or `X-API-Key: KEY` (the `tinker` SDK's, whose
    /// keys start with `tml-`). Default: the RLHOST_API_KEY environment variable, if set.
    #[arg(long)]
    api_key: Option<String>,
    /// Seconds a session may stay silent before it is ended (default 600): a gateway
    /// session with no call or end (its record written as timed out), or a Tinker session
    /// with no heartbeat or call (its training clients freed; the SDK heartbeats every
    /// 10 s).
    #[arg(long)]
    session_timeout: Option<f64>,
    /// MiB of keys and values the calls being sampled may hold at once (default 160 on
    /// the CPU, where they are the server's own memory, and 8192 on a GPU). A call that
    /// would pass it while others hold room is told to retry (the gateway's 429) or waits
    /// its turn (Tinker); one that could never fit is refused, naming this flag.
    #[arg(long)]
    kv_budget_mib: Option<u64>,
    /// Serve the Tinker training API (for the official `tinker` SDK: set TINKER_BASE_URL
    /// to the printed URL) instead of the OpenAI-compatible one.
    #[arg(long)]
    tinker: bool,
    /// With --tinker: where checkpoints (`save_state`, `save_weights_for_sampler`) are
    /// written, as `<dir>/<model id>/<weights|sampler_weights>/<name>/` in PEFT's format.
    #[arg(long, default_value = "tinker-checkpoints", requires = "tinker")]
    checkpoints: PathBuf,
    /// With --tinker: the LoRA seed of the first training client created without one
    /// (`create_lora_training_client(seed=None)`), the next taking the next number, so
    /// that a script's run repeats (default: a random seed each, as the hosted service).
    #[arg(long, requires = "tinker")]
    seed: Option<u64>,
}

pub fn run(args: ServeArgs, handle: &Handle, quiet: bool) -> Result<()> {
    if args
        .served_model_name
        .as_deref()
        .is_some_and(|n| n.trim().is_empty())
    {
        anyhow::bail!("--served-model-name must not be empty");
    }
    let key = crate::front::api_key(args.api_key.clone())?;
    crate::front::check_exposure(&args.addr, args.public, key.is_some(), "--addr", "--public")?;
    if args.tinker {
        return tinker(args, key, handle, quiet);
    }
    let mut set = args.source.set.clone();
    if let Some(adapter) = &args.adapter {
        set.push(crate::config::set_path("model.adapter", adapter)?);
    }
    let loaded = super::source::load_config(
        args.source.config.as_deref(),
        &args.source.plugins,
        &set,
        handle,
    )?;
    let setup = super::source::open_run(loaded, &args.source.plugins, handle, quiet, &|| {})?;
    let renderer = Renderer::new(&setup.lm, setup.settings.template_kwargs.clone())?;
    let group_size = args
        .group_size
        .unwrap_or(setup.loaded.config.rollout.group_size);
    if group_size == 0 {
        anyhow::bail!("--group-size must be at least 1");
    }
    let mode = setup.mode();
    let crate::config::setup::Setup {
        mut lm, dataset, ..
    } = setup;
    // The served model's ids are decoded by clients: none past the tokenizer.
    lm.sample_tokens_only();
    let (jobs_tx, jobs_rx) = std::sync::mpsc::channel::<Job>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<Finished>();
    let tasks = Tasks::new(dataset, group_size);
    let served = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| "policy".into());
    let mut gw = Gateway::new(served.clone(), renderer, jobs_tx, done_tx, Some(tasks));
    let mib = kv_budget_mib(&args)?.unwrap_or_else(|| kv_budget::default_mib(&lm.model));
    gw.kv = Some(KvBudget::new(&lm.model, mib));
    let gw = Arc::new(gw);
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
    let addr = server::spawn(gw.clone(), &args.addr, args.max_connections, key)?;
    let timeout = session_timeout(&args)?;
    {
        let gw = Arc::downgrade(&gw);
        std::thread::Builder::new()
            .name("rlhost-reaper".into())
            .spawn(move || {
                while let Some(gw) = gw.upgrade() {
                    gw.end_silent(timeout);
                    drop(gw);
                    std::thread::sleep(timeout.min(std::time::Duration::from_secs(5)));
                }
            })
            .context("cannot start the session reaper")?;
    }
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
        served
    );
    // A ready line for scripts and tests, flushed before the first request can come.
    std::io::stdout().flush()?;
    let interrupted = super::interrupt::arm_saying(
        "\nrlhost serve: interrupted; answering the calls in flight (interrupt again to exit at once)\n",
    );
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

/// `--kv-budget-mib`, checked.
fn kv_budget_mib(args: &ServeArgs) -> Result<Option<u64>> {
    if args.kv_budget_mib == Some(0) {
        anyhow::bail!("--kv-budget-mib must be at least 1 (MiB)");
    }
    Ok(args.kv_budget_mib)
}

/// `--session-timeout`, checked (the gateway's default when not given).
fn session_timeout(args: &ServeArgs) -> Result<std::time::Duration> {
    let silent = args
        .session_timeout
        .unwrap_or(crate::config::GatewaySection::default().session_timeout_s);
    if !(silent.is_finite() && silent > 0.0 && silent < 1e9) {
        anyhow::bail!("--session-timeout must be a number of seconds above 0, got {silent}");
    }
    Ok(std::time::Duration::from_secs_f64(silent))
}

/// `rlhost serve --tinker`: the Tinker API on the run config's model until interrupted.
fn tinker(args: ServeArgs, key: Option<String>, handle: &Handle, quiet: bool) -> Result<()> {
    if args.adapter.is_some() || args.record.is_some() || args.group_size.is_some() {
        anyhow::bail!(
            "--adapter, --record and --group-size are the OpenAI gateway's; with --tinker, clients \
             create their adapters (load one with create_training_client_from_state)"
        );
    }
    let silent = session_timeout(&args)?;
    let kv_budget_mib = kv_budget_mib(&args)?;
    let loaded = super::source::load_config(
        args.source.config.as_deref(),
        &args.source.plugins,
        &args.source.set,
        handle,
    )?;
    let path = loaded.config.model.path.display().to_string();
    let (name, also) = match args.served_model_name.clone() {
        Some(name) => (name, vec![path]),
        None => (path, vec![]),
    };
    let setup = super::source::open_run(loaded, &args.source.plugins, handle, quiet, &|| {})?;
    let dir = setup.lm.dir.clone();
    let serving = crate::tinker::serve(
        setup.lm,
        name.clone(),
        also,
        args.checkpoints.clone(),
        crate::tinker::Listen {
            addr: &args.addr,
            max_connections: args.max_connections,
            key,
            session_timeout: silent,
            kv_budget_mib,
            seed: args.seed,
        },
    )?;
    println!(
        "rlhost serve --tinker: {} as base model `{name}` at http://{} (TINKER_BASE_URL; checkpoints in {})",
        dir.display(),
        serving.addr,
        serving.tinker.root.display()
    );
    std::io::stdout().flush()?;
    let interrupted = super::interrupt::arm_saying(
        "\nrlhost serve --tinker: interrupted; stopping (interrupt again to exit at once)\n",
    );
    watch_model_thread(serving.worker, interrupted)
}

/// Waits for an interrupt (`Ok`) or for the end of the Tinker model's thread, which is an
/// error naming its cause: the thread catches each operation's panic, so its end is a bug
/// or a lost channel, and the server cannot go on. The error ends `serve` with a non-zero
/// status, where a thread's death once left the process to exit with 0.
fn watch_model_thread(
    worker: std::thread::JoinHandle<()>,
    interrupted: &std::sync::atomic::AtomicBool,
) -> Result<()> {
    while !interrupted.load(Ordering::Relaxed) && !worker.is_finished() {
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    if !worker.is_finished() {
        return Ok(());
    }
    let why = match worker.join() {
        Err(panic) => crate::tinker::worker::panic_message(&panic),
        Ok(()) => "its work channel closed".into(),
    };
    anyhow::bail!("rlhost serve --tinker: the model's thread stopped ({why}); the server ends")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// A model thread that panics, or returns, ends `serve --tinker` with an error naming
    /// why; an interrupt ends it cleanly while the thread still runs.
    #[test]
    fn a_dead_model_thread_ends_the_server_with_its_cause() {
        let calm = AtomicBool::new(false);
        let panicked = std::thread::spawn(|| panic!("a weight went missing"));
        let e = watch_model_thread(panicked, &calm).unwrap_err().to_string();
        assert!(
            e.contains("the model's thread stopped (a weight went missing)"),
            "{e}"
        );
        let returned = std::thread::spawn(|| ());
        let e = watch_model_thread(returned, &calm).unwrap_err().to_string();
        assert!(e.contains("its work channel closed"), "{e}");
        let interrupted = AtomicBool::new(true);
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let running = std::thread::spawn(move || {
            let _ = rx.recv();
        });
        assert!(watch_model_thread(running, &interrupted).is_ok());
        drop(tx);
    }
}
