//! `rlhost train`: the main job. Rollouts with the config's tools and rewards, GRPO-family
//! updates of a LoRA adapter, metrics to `RUN/metrics.jsonl`, checkpoints to
//! `RUN/checkpoints/`, and `--resume latest` to continue an interrupted run.

use super::interrupt;
use crate::config::setup::{Setup, display, out_dir};
use crate::config::{LoadedConfig, set_path, set_value};
use crate::rl::{checkpoint, trainer};
use crate::status::{Phase, StatusHub, server};
use anyhow::{Context, Result, bail};
use clap::Args;
use std::path::{Path, PathBuf};
use tokio::runtime::Handle;

#[derive(Debug, Args)]
pub struct TrainArgs {
    #[command(flatten)]
    source: super::source::RunSource,
    /// Continue from `latest` (the run directory's newest checkpoint) or a checkpoint folder.
    #[arg(long, value_name = "latest|DIR")]
    resume: Option<String>,
    /// Start afresh in a run directory that holds a run: its metrics, checkpoints and
    /// TensorBoard files are deleted first.
    #[arg(long, conflicts_with = "resume")]
    overwrite: bool,
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
    #[command(flatten)]
    status: StatusArgs,
}

/// The status endpoint's flags, shared by the commands that train (`train`, `dpo`, `rm`).
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Serve the status endpoint and dashboard here (read-only). Port 0 picks a free
    /// port. Without the flag, 127.0.0.1:8787 is tried first and a free port used if it
    /// is taken; the URL is printed either way.
    #[arg(long, value_name = "ADDR:PORT")]
    pub status_addr: Option<String>,
    /// Let --status-addr bind an address other than loopback. The server has no
    /// authentication: whoever reaches the port reads the run's config, prompts,
    /// trajectories and metrics.
    #[arg(long, requires = "status_addr")]
    pub status_public: bool,
    /// Do not serve a status endpoint.
    #[arg(long, conflicts_with = "status_addr")]
    pub no_status: bool,
    /// Keep serving the status endpoint this many seconds after the run ends (to look at
    /// the finished dashboard).
    #[arg(long, value_name = "SECONDS", default_value_t = 0)]
    pub status_linger: u64,
    /// Before the first step, wait up to this many seconds for a dashboard (a reader of
    /// `/events`) to connect, so that it shows the run from its start: for a demo or a
    /// recording. Training starts when one connects or the time is up.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 0,
        conflicts_with = "no_status"
    )]
    pub status_wait: u64,
}

impl StatusArgs {
    /// Refuses an address beyond loopback without `--status-public`.
    pub fn check(&self) -> Result<()> {
        match &self.status_addr {
            Some(addr) => check_exposure(addr, self.status_public),
            None => Ok(()),
        }
    }

    /// Holds the run up to `--status-wait` seconds until a dashboard reads `/events`.
    pub fn wait_for_viewer(&self, hub: &StatusHub, url: &str, quiet: bool) {
        if self.status_wait == 0 {
            return;
        }
        if !quiet {
            eprintln!(
                "waiting up to {} s for a dashboard at {url} before the first step",
                self.status_wait
            );
        }
        let until = std::time::Instant::now() + std::time::Duration::from_secs(self.status_wait);
        while hub.viewers() == 0 {
            if std::time::Instant::now() >= until {
                if !quiet {
                    eprintln!(
                        "no dashboard connected in {} s; training starts",
                        self.status_wait
                    );
                }
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Keeps the endpoint up `--status-linger` seconds after a run that ended.
    pub fn linger(&self, quiet: bool) {
        if self.status_linger == 0 {
            return;
        }
        if !quiet {
            eprintln!(
                "run ended; the status endpoint stays up for {} s",
                self.status_linger
            );
        }
        std::thread::sleep(std::time::Duration::from_secs(self.status_linger));
    }
}

/// The address tried when `--status-addr` is not given.
const DEFAULT_STATUS_ADDR: &str = "127.0.0.1:8787";

pub fn run(args: TrainArgs, handle: &Handle, quiet: bool) -> Result<()> {
    args.status.check()?;
    let mut set = args.source.set.clone();
    if let Some(steps) = args.steps {
        set.push(set_value("train.steps", steps as i64));
    }
    if let Some(seed) = args.seed {
        set.push(set_value("run.seed", seed as i64));
    }
    if let Some(out) = &args.out {
        set.push(set_path("run.out_dir", out)?);
    }
    let loaded = super::source::load_config(
        args.source.config.as_deref(),
        &args.source.plugins,
        &set,
        handle,
    )?;
    // A distillation run learns from its teacher whatever its groups' rewards are.
    if loaded.config.distill.is_none() {
        loaded
            .config
            .train
            .check_learnable(loaded.config.rollout.group_size)
            .map_err(|e| anyhow::anyhow!("{}: {e}", display(&loaded.path)))?;
    }
    let out = out_dir(&loaded);
    let written = [
        "metrics.jsonl",
        trainer::EVAL_START,
        "config.toml",
        "plugins.json",
    ];
    let resume = start_or_resume(&out, args.resume.as_deref(), args.overwrite, &written)?;
    if let Some(dir) = &resume {
        check_resume(&out, dir, &loaded)?;
    }
    let mut plan = loaded.config.train_plan(&loaded.path);
    let norm_from_limit = loaded.config.train.norm_constant <= 0.0;
    std::fs::create_dir_all(&out)
        .with_context(|| format!("cannot create the run directory {}", out.display()))?;
    // The resolved config, as this run used it (on resume, the checks above ensured that
    // nothing a checkpoint fixes has changed, so this is what is in effect).
    crate::model::peft::write_atomic(
        &out.join("config.toml"),
        toml::to_string(&loaded.config)?.as_bytes(),
    )?;
    let hub = StatusHub::new(
        &StatusHub::run_id(&loaded.path),
        &loaded.config.model.path.display().to_string(),
        &display(&loaded.path),
        plan.steps,
    );
    let server = serve_status(&args.status, &hub)?;
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
    let result = (|| -> Result<trainer::Outcome> {
        let warm_start = || {
            hub.set_phase(Phase::WarmStart);
            announce();
        };
        let mut setup =
            super::source::open_run(loaded, &args.source.plugins, handle, quiet, &warm_start)?;
        announce();
        if !quiet {
            let at = setup.lm.model.placement();
            eprintln!("model: {} on {}", display(&setup.lm.dir), at.describe());
        }
        write_plugins(&out, &setup)?;
        if let Some(server) = &server {
            args.status.wait_for_viewer(&hub, &server.url(), quiet);
        }
        // Printed even with --quiet: the agents need the address (`127.0.0.1:0` picks it).
        if let Some(url) = setup.open_gateway()? {
            eprintln!(
                "gateway: {url} (agents take tasks from POST {}/rl/tasks/next)",
                url.trim_end_matches("/v1")
            );
        }
        // From here on an interruption has something to save.
        let run = trainer::RunOptions {
            out_dir: &out,
            resume: resume.as_deref(),
            stop_after: args.stop_after,
            quiet,
            hub: &hub,
            interrupt: Some(interrupt::arm()),
        };
        plan.within_room(setup.settings.limits.max_total_tokens, norm_from_limit);
        let (lm, sources) = setup.train_parts();
        let outcome = trainer::train(lm, sources, &plan, &run, handle);
        interrupt::disarm();
        if let Some(link) = &setup.gateway {
            let s = link.gw.status();
            eprintln!(
                "gateway: {} sessions ended, {} calls ({} continued their session's row, {} drifted), {} malformed tool calls, {} abandoned, {} refused while updating, {} stale rows and {} timed-out sessions left out",
                s["sessions"]["ended"],
                s["session_calls"],
                s["extended_calls"],
                s["drifts"],
                s["malformed_tool_calls"],
                s["abandoned_calls"],
                s["refused_while_updating"],
                s["stale_rows"],
                s["timed_out_sessions"]
            );
        }
        outcome
    })();
    match &result {
        Ok(_) => hub.set_phase(Phase::Done),
        Err(e) => hub.fail(&format!("{e:#}")),
    }
    let interrupted = result.as_ref().is_ok_and(|o| o.interrupted);
    if announced.get() && !interrupted {
        args.status.linger(quiet);
    }
    let outcome = result?;
    let metrics = &outcome.metrics;
    if let (Some(first), Some(last)) = (metrics.first(), metrics.last()) {
        println!(
            "trained steps {}..{}: training-batch reward {:.3} -> {:.3}{}",
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
    if let Some(line) = held_out_line(&outcome) {
        println!("{line}");
    }
    println!("run directory: {}", display(&out));
    if outcome.interrupted {
        let signal = interrupt::signal();
        let saved = match &outcome.checkpoint {
            Some(dir) => format!(
                "checkpoint {} is in place; continue with --resume latest",
                display(dir)
            ),
            None => "no step had finished, so there is no checkpoint yet".to_string(),
        };
        return Err(interrupt::Interrupted {
            signal,
            message: format!(
                "interrupted by {} after step {}: {saved}",
                interrupt::signal_name(signal),
                outcome.steps_done
            ),
        }
        .into());
    }
    Ok(())
}

/// "held-out (N prompts, greedy): accuracy A% -> B%, tool use C% -> D%, reward E -> F",
/// from the evaluation before the first update to the run's last one.
fn held_out_line(outcome: &trainer::Outcome) -> Option<String> {
    let start = outcome.eval_start.as_ref()?;
    let end = outcome
        .metrics
        .iter()
        .rev()
        .find(|m| m.eval_reward.is_some())?;
    let pct = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:.1}%", 100.0 * v));
    // With functions, how many of the calls were malformed (none made: `-`).
    let malformed = if start.malformed_call_rate.is_some() || end.eval_malformed_call_rate.is_some()
    {
        format!(
            ", malformed calls {} -> {}",
            pct(start.malformed_call_rate),
            pct(end.eval_malformed_call_rate)
        )
    } else {
        String::new()
    };
    Some(format!(
        "held-out ({} prompts, greedy), start -> step {}: accuracy {} -> {}, tool use {} -> {}{malformed}, reward {:.3} -> {:.3}",
        start.prompts,
        end.step,
        pct(start.accuracy),
        pct(end.eval_accuracy),
        pct(Some(start.tool_use_rate)),
        pct(end.eval_tool_use),
        start.reward_mean,
        end.eval_reward.unwrap_or(f64::NAN)
    ))
}

/// The checkpoint a run continues from (`--resume`, its fallback warning printed), or
/// `None` for a fresh start. A fresh start in a folder that holds a run is refused unless
/// `overwrite`, which first deletes what a run wrote there: its checkpoints, TensorBoard
/// files and the files `written` names (other files stay). `rlhost dpo` and `rm` start
/// the same way.
pub(super) fn start_or_resume(
    out: &Path,
    resume: Option<&str>,
    overwrite: bool,
    written: &[&str],
) -> Result<Option<PathBuf>> {
    if let Some(spec) = resume {
        let resolved = checkpoint::resolve(out, spec)?;
        if let Some(warning) = &resolved.warning {
            eprintln!("warning: {warning}");
        }
        return Ok(Some(resolved.dir));
    }
    if checkpoint::holds_a_run(out) {
        if !overwrite {
            bail!(
                "{} holds a run already; continue it with --resume latest, choose another directory with --out, or pass --overwrite to delete it and start again",
                display(out)
            );
        }
        for name in written.iter().chain(&["checkpoints", "tensorboard"]) {
            let path = out.join(name);
            checkpoint::remove(&path)
                .with_context(|| format!("--overwrite: cannot delete {}", path.display()))?;
        }
    }
    Ok(None)
}

/// Refuses a resume whose config changes what the checkpoint fixes: the model, the
/// adapter (`[lora]`: its shape and scaling are the checkpoint's) and the seed (every
/// sampling, data-order and dropout seed derives from it). Such a change would be ignored
/// or would silently make a different run. Other keys (steps, learning rate, limits) may
/// change and take effect.
fn check_resume(out: &Path, checkpoint_dir: &Path, loaded: &LoadedConfig) -> Result<()> {
    let now = &loaded.config;
    let state = checkpoint::read_state(checkpoint_dir)?;
    let mut changes = Vec::new();
    if state.seed != now.run.seed {
        changes.push(format!("run.seed: {} -> {}", state.seed, now.run.seed));
    }
    let recorded = out.join("config.toml");
    if let Ok(text) = std::fs::read_to_string(&recorded) {
        let then: crate::config::RunConfig = toml::from_str(&text).with_context(|| {
            format!(
                "{} (the run's recorded config) cannot be read back",
                recorded.display()
            )
        })?;
        changes.extend(section_changes(
            "model",
            &toml::Value::try_from(ModelKeys::of(&then))?,
            &toml::Value::try_from(ModelKeys::of(now))?,
        ));
        changes.extend(section_changes(
            "lora",
            &toml::Value::try_from(&then.lora)?,
            &toml::Value::try_from(&now.lora)?,
        ));
    }
    if !changes.is_empty() {
        bail!(
            "--resume {}: the config changes what the checkpoint fixes ({}); a resumed run keeps the model, the adapter's [lora] settings and the seed: undo the change, or start a new run with another --out",
            display(checkpoint_dir),
            changes.join(", ")
        );
    }
    Ok(())
}

/// The `[model]` keys a checkpoint depends on (the device is free to change).
#[derive(serde::Serialize)]
struct ModelKeys<'a> {
    path: &'a Path,
    adapter: Option<&'a Path>,
}

impl<'a> ModelKeys<'a> {
    fn of(c: &'a crate::config::RunConfig) -> ModelKeys<'a> {
        ModelKeys {
            path: &c.model.path,
            adapter: c.model.adapter.as_deref(),
        }
    }
}

/// `section.key: old -> new` for each key whose value differs.
fn section_changes(section: &str, then: &toml::Value, now: &toml::Value) -> Vec<String> {
    let empty = toml::Table::new();
    let (a, b) = (
        then.as_table().unwrap_or(&empty),
        now.as_table().unwrap_or(&empty),
    );
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| {
            let show = |v: Option<&toml::Value>| v.map_or("(unset)".to_string(), |v| v.to_string());
            format!("{section}.{k}: {} -> {}", show(a.get(k)), show(b.get(k)))
        })
        .collect()
}

/// Starts the status server unless `--no-status` (the caller prints its URL, even with
/// `--quiet`: with port 0 it is the only way to find it).
pub fn serve_status(
    args: &StatusArgs,
    hub: &std::sync::Arc<StatusHub>,
) -> Result<Option<server::Running>> {
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

/// Binding beyond loopback needs `--status-public`, and then a warning says what is
/// exposed: the server has no authentication.
fn check_exposure(addr: &str, public: bool) -> Result<()> {
    use std::net::ToSocketAddrs;
    let resolved: Vec<std::net::SocketAddr> = addr
        .to_socket_addrs()
        .with_context(|| {
            format!(
                "--status-addr {addr}: not an address (expected HOST:PORT, e.g. 127.0.0.1:8787)"
            )
        })?
        .collect();
    let exposed: Vec<String> = resolved
        .iter()
        .filter(|a| !a.ip().is_loopback())
        .map(|a| a.ip().to_string())
        .collect();
    if exposed.is_empty() {
        return Ok(());
    }
    if !public {
        bail!(
            "--status-addr {addr} listens beyond this machine ({}), and the status server has no authentication: anyone who can reach it reads the run's config, prompts, trajectories and metrics. Use 127.0.0.1 (and an SSH tunnel to watch from elsewhere), or add --status-public to expose it on purpose",
            exposed.join(", ")
        );
    }
    eprintln!(
        "warning: the status server listens on {addr} ({}) without authentication: anyone who can reach it reads the run's config, prompts, trajectories, rewards and metrics",
        exposed.join(", ")
    );
    Ok(())
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
