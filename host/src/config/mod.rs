//! The run config: a TOML file as the user wrote it, with `--set section.key=value`
//! overrides from the command line, checked section by section.
//!
//! Every section rejects unknown keys by name (a typo such as `grup_size` must not
//! silently fall back to a default), and errors point at the file and line. The values
//! here are raw; [`setup`] turns them into working objects (model, plugins, dataset,
//! rollout settings), ripgrep's low-args → high-args flow.
//!
//! This file reads a config (the file, its `--set` overrides, the checks across
//! sections); `sections.rs` holds the sections as the user writes them (`train.rs`
//! `[train]`), `ranges.rs` every number's range, and `plan.rs` the one conversion into
//! the trainer's plan.
//!
//! ```toml
//! [run]
//! seed = 1
//! [model]
//! path = "models/qwen2.5-0.5b-instruct"
//! [data]
//! plugin = "countdown"
//! [rollout]
//! group_size = 8
//! trigger = "calculator"
//! [plugins.countdown]
//! path = "plugins/dist/countdown.wasm"
//! [plugins.calculator]
//! path = "plugins/dist/calculator.wasm"
//! timeout_ms = 2000
//! [[rewards]]
//! plugin = "countdown"
//! weights = { correct = 1.0, format = 0.1 }
//! ```

pub mod builtin;
pub use crate::openenv::settings as openenv;
mod plan;
mod ranges;
pub mod reference;
mod sections;
pub mod setup;
mod train;

use anyhow::{Context, Result, bail};
pub use sections::*;
use std::path::{Path, PathBuf};
pub use train::TrainSection;

/// A config file read and checked, with where it came from.
#[derive(Debug, Clone)]
pub struct LoadedConfig {
    pub config: RunConfig,
    pub path: PathBuf,
    /// The file's folder: relative paths in the config start here.
    pub base_dir: PathBuf,
}

impl LoadedConfig {
    /// Reads `path`, applies `overrides` (`section.key=value`, the value in TOML syntax or
    /// a bare string), and checks the result.
    pub fn load(path: &Path, overrides: &[String]) -> Result<LoadedConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config file {}", path.display()))?;
        let base_dir = path
            .parent()
            .map(|p| {
                if p.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    p
                }
            })
            .unwrap_or(Path::new("."))
            .to_path_buf();
        LoadedConfig::from_text(&text, path, &base_dir, overrides, |_| Ok(()))
    }

    /// A config from `text`, shown as `path` in messages, with relative paths starting at
    /// `base_dir`; `adjust` may change it after the overrides and before the checks (the
    /// built-in runs point their plugins at the files found on this machine).
    pub fn from_text(
        text: &str,
        path: &Path,
        base_dir: &Path,
        overrides: &[String],
        adjust: impl FnOnce(&mut RunConfig) -> Result<()>,
    ) -> Result<LoadedConfig> {
        let mut config = parse(text, overrides)
            .map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e.to_string().trim_end()))?;
        adjust(&mut config)?;
        let loaded = LoadedConfig {
            config,
            path: path.to_path_buf(),
            base_dir: base_dir.to_path_buf(),
        };
        loaded.check()?;
        Ok(loaded)
    }

    /// A path from the config, relative to its folder.
    pub fn resolve(&self, p: &Path) -> PathBuf {
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.base_dir.join(p)
        }
    }

    /// Checks what serde cannot: references between sections and value ranges.
    fn check(&self) -> Result<()> {
        let c = &self.config;
        let file = self.path.display();
        c.data
            .validate()
            .with_context(|| format!("{file}: [data]"))?;
        ranges::check_ranges(c).map_err(|e| anyhow::anyhow!("{file}: {e}"))?;
        let r = &c.rollout;
        c.train
            .check(r.prompts_per_step * r.group_size)
            .map_err(|e| anyhow::anyhow!("{file}: {e}"))?;
        for (key, name) in [
            ("rollout.trigger", &r.trigger),
            ("rollout.environment", &r.environment),
            ("data.plugin", &c.data.plugin),
        ] {
            if let Some(name) = name
                && !c.plugins.contains_key(name)
            {
                bail!(
                    "{file}: {key} = \"{name}\" names no plugin; add a [plugins.{name}] section with its `path`{}",
                    known(&c.plugins)
                );
            }
        }
        for (i, name) in r.tools.iter().enumerate() {
            if !c.plugins.contains_key(name) {
                bail!(
                    "{file}: rollout.tools[{i}] = \"{name}\" names no plugin; add a [plugins.{name}] section with its `path`{}",
                    known(&c.plugins)
                );
            }
            if r.tools[..i].contains(name) {
                bail!("{file}: rollout.tools names \"{name}\" twice");
            }
        }
        if let Some(name) = r.tools_config.keys().find(|k| !r.tools.contains(k)) {
            bail!(
                "{file}: rollout.tools_config.{name}: `{name}` is not in rollout.tools ({:?}); configure the tools the run uses",
                r.tools
            );
        }
        if let Some((name, _)) = r.tools_config.iter().find(|(_, v)| !v.is_object()) {
            bail!("{file}: rollout.tools_config.{name} must be a table, e.g. {name} = {{}}");
        }
        for (i, reward) in c.rewards.iter().enumerate() {
            reward
                .check(&c.plugins)
                .map_err(|e| anyhow::anyhow!("{file}: rewards[{i}].{e}"))?;
        }
        if let Some(d) = &c.distill {
            d.check(&c.train)
                .map_err(|e| anyhow::anyhow!("{file}: {e}"))?;
        }
        for (key, v) in [
            ("rollout.trigger_config", &r.trigger_config),
            ("rollout.environment_config", &r.environment_config),
        ] {
            if !v.is_object() {
                bail!("{file}: {key} must be a table, e.g. {key} = {{}}");
            }
        }
        if let Some(g) = &c.gateway {
            if !(g.session_timeout_s > 0.0 && g.session_timeout_s <= 86_400.0) {
                bail!(
                    "{file}: gateway.session_timeout_s is {}; it must be above 0 and at most a day (86400)",
                    g.session_timeout_s
                );
            }
            if g.max_connections == 0 {
                bail!("{file}: gateway.max_connections must be at least 1");
            }
            if g.served_model_name.is_empty() {
                bail!("{file}: gateway.served_model_name must not be empty");
            }
            if r.openenv.is_some() || r.environment.is_some() || r.trigger.is_some() {
                bail!(
                    "{file}: [gateway] trains on the sessions of agents that call it: [rollout.openenv], rollout.environment and rollout.trigger sample rollouts of their own; keep one or the other (rollout.tools stay, for the held-out evaluation; rollout.engine = \"vllm\" samples the agents' calls on the servers)"
                );
            }
        }
        if let Some(tree) = &r.tree {
            tree.settings(r.group_size, c.sampling.max_new_tokens)
                .map_err(|e| anyhow::anyhow!("{file}: {e}"))?;
            let replayed = r
                .openenv
                .as_ref()
                .map(|o| o.fork == crate::openenv::settings::ForkBy::Replay);
            if replayed == Some(false) || c.gateway.is_some() {
                bail!(
                    "{file}: [rollout.tree] branches trajectories by forking their sessions; {} cannot be forked, so keep one or the other",
                    if c.gateway.is_some() {
                        "a [gateway] agent's session"
                    } else {
                        "an OpenEnv server's episode ([rollout.openenv]; set rollout.openenv.fork = \"replay\" if the server's episodes follow from their reset's seed)"
                    }
                );
            }
            // Every leaf of a batch holds a session at its end: a fork that waited for a
            // place its own batch holds would wait out its timeout.
            if let Some(o) = r.openenv.as_ref().filter(|_| replayed == Some(true)) {
                let leaves = r.group_size * r.prompts_per_step;
                if leaves > o.max_sessions {
                    bail!(
                        "{file}: [rollout.tree] with rollout.openenv.fork = \"replay\" opens a session for every leaf: {} prompts × group_size {} = {leaves} sessions, rollout.openenv.max_sessions is {}; raise it (and the server's own cap) or lower rollout.prompts_per_step",
                        r.prompts_per_step,
                        r.group_size,
                        o.max_sessions
                    );
                }
            }
            if c.distill.is_some() || c.train.algorithm == crate::rl::algorithms::Algorithm::Ppo {
                bail!(
                    "{file}: [rollout.tree] trains each tree with its own advantages (rollout.tree.advantage), which {} replaces; keep one or the other",
                    if c.distill.is_some() {
                        "[distill]'s per-token teacher term"
                    } else {
                        "train.algorithm = \"ppo\"'s critic"
                    }
                );
            }
            let multi_turn = r.environment.is_some() || !r.tools.is_empty() || r.openenv.is_some();
            if r.trigger.is_none() && !multi_turn {
                bail!(
                    "{file}: [rollout.tree] branches after tool results, but the run has no rollout.trigger, rollout.tools, rollout.environment or [rollout.openenv] to give any"
                );
            }
            if tree.branch_at == crate::rollout::tree::BranchAt::Turn && !multi_turn {
                bail!(
                    "{file}: rollout.tree.branch_at = \"turn\" branches where a new assistant turn starts, but a trigger's output goes on within the turn; use branch_at = \"result\", or rollout.tools or rollout.environment"
                );
            }
        }
        if let Some(o) = &r.openenv {
            o.check()
                .map_err(|e| anyhow::anyhow!("{file}: rollout.openenv.{e}"))?;
            if let Some(name) = &r.environment {
                bail!(
                    "{file}: rollout.environment = \"{name}\" and [rollout.openenv] both name the environment; keep one"
                );
            }
            if o.action.kind == openenv::ActionKind::Call && !r.tools.is_empty() {
                bail!(
                    "{file}: rollout.openenv.action.kind = \"call\" reads the model's function calls as the server's actions, and rollout.tools runs them in plugins; keep one"
                );
            }
        }
        if r.engine == EngineKind::Vllm {
            let v = &r.vllm;
            if v.servers.is_empty() {
                bail!(
                    "{file}: rollout.engine = \"vllm\" needs rollout.vllm.servers, e.g. servers = [\"http://127.0.0.1:8000\"] (bash scripts/vllm.sh start MODEL_DIR 8000 starts one)"
                );
            }
            if let Some(bad) = v.servers.iter().find(|u| !u.starts_with("http://")) {
                bail!(
                    "{file}: rollout.vllm.servers: {bad:?} is not an http:// base URL (https is not supported: vLLM servers are reached on a trusted network)"
                );
            }
            if !(v.timeout_s > 0.0 && v.timeout_s.is_finite()) {
                bail!("{file}: rollout.vllm.timeout_s must be a positive number of seconds");
            }
            if v.max_in_flight == 0 {
                bail!("{file}: rollout.vllm.max_in_flight must be at least 1");
            }
            if v.model.is_empty() {
                bail!(
                    "{file}: rollout.vllm.model must name the served model (--served-model-name)"
                );
            }
        }
        c.model.choices(&file.to_string())?;
        c.lora
            .to_config()
            .validate()
            .with_context(|| format!("{file}: [lora]"))?;
        Ok(())
    }
}

/// A `--set` override that a command-line flag stands for: `key=value` with the value
/// in TOML syntax (`--steps 3` is `train.steps=3`).
pub fn set_value(key: &str, value: impl Into<toml::Value>) -> String {
    format!("{key}={}", value.into())
}

/// A `--set` override for a path flag: made absolute, since the config resolves relative
/// paths against its own folder, not the current directory the user typed it in.
pub fn set_path(key: &str, path: &Path) -> Result<String> {
    let abs = std::path::absolute(path)
        .with_context(|| format!("{key}: cannot make {} absolute", path.display()))?;
    Ok(set_value(key, abs.to_string_lossy().into_owned()))
}

/// Parses the file, then the file with the overrides: errors in the file itself keep its
/// own line numbers.
fn parse(text: &str, overrides: &[String]) -> Result<RunConfig> {
    let mut table: toml::Table = text.parse()?;
    if overrides.is_empty() {
        return Ok(toml::from_str(text)?);
    }
    for o in overrides {
        let (key, value) = o
            .split_once('=')
            .with_context(|| format!("--set {o:?}: expected section.key=value"))?;
        let value = parse_value(value.trim());
        let parts: Vec<&str> = key.trim().split('.').collect();
        if parts.iter().any(|p| p.is_empty()) {
            bail!("--set {o:?}: the key must look like section.key");
        }
        let mut t = &mut table;
        for p in &parts[..parts.len() - 1] {
            let entry = t
                .entry(p.to_string())
                .or_insert_with(|| toml::Value::Table(Default::default()));
            t = entry
                .as_table_mut()
                .with_context(|| format!("--set {o:?}: `{p}` is not a table"))?;
        }
        t.insert(parts[parts.len() - 1].to_string(), value);
    }
    let merged = toml::to_string(&table)?;
    toml::from_str(&merged).map_err(|e| {
        // A mistake in the file itself is shown with the file's own line numbers, unless
        // an override fixes it (e.g. a missing key given with --set).
        match toml::from_str::<RunConfig>(text) {
            Err(file_error) if file_error.message() == e.message() => file_error.into(),
            _ => anyhow::anyhow!(
                "{} (with --set {})",
                e.message(),
                overrides.join(", --set ")
            ),
        }
    })
}

/// A `--set` value: TOML (`3`, `true`, `"x"`, `[1, 2]`, `{ a = 1 }`), else a bare string.
fn parse_value(s: &str) -> toml::Value {
    format!("v = {s}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(s.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[model]
path = "m"
[data]
path = "d.jsonl"
[rollout]
group_size = 4
trigger = "calc"
[plugins.calc]
path = "calc.wasm"
timeout_ms = 100
[[rewards]]
plugin = "calc"
weights = { correct = 1.0 }
"#;

    fn load(text: &str, overrides: &[&str]) -> Result<LoadedConfig> {
        let dir = std::env::temp_dir().join(format!("rlhost-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = dir.join(format!("{n}.toml"));
        std::fs::write(&path, text).unwrap();
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        LoadedConfig::load(&path, &overrides)
    }

    /// `[rollout.tree]` (issue 67): a tree that fits the group loads; each way it cannot
    /// work is one line naming the key.
    #[test]
    fn a_tree_is_checked_against_the_group_and_the_run() {
        let tree = format!("{BASE}[rollout.tree]\nchains = 1\n");
        let c = load(&tree, &[]).unwrap().config;
        let t = c.rollout.tree.unwrap();
        assert_eq!((t.chains, t.branch_factor, t.max_depth), (1, 2, 2));
        for (set, want) in [
            (
                "rollout.tree.chains=2",
                "2 chains × branch_factor 2 ^ max_depth 2 = 8 leaves do not fit rollout.group_size = 4",
            ),
            (
                "rollout.tree.branch_factor=0",
                "rollout.tree.branch_factor = 0: a branch point splits",
            ),
            (
                "rollout.tree.branch_factor=1",
                "rollout.tree.branch_factor = 1",
            ),
            ("rollout.tree.max_depth=0", "rollout.tree.max_depth = 0"),
            ("rollout.tree.chains=0", "rollout.tree.chains = 0"),
            (
                "rollout.tree.branch_at=\"turn\"",
                "a trigger's output goes on within the turn",
            ),
            (
                "train.algorithm=\"ppo\"",
                "train.algorithm = \"ppo\"'s critic",
            ),
        ] {
            let e = format!("{:#}", load(&tree, &[set]).unwrap_err());
            assert!(e.contains(want), "{set}: {e}");
        }
        let long = [
            "rollout.tree.branch_at=\"entropy\"",
            "rollout.tree.entropy_window=600",
        ];
        let e = format!("{:#}", load(&tree, &long).unwrap_err());
        assert!(
            e.contains("rollout.tree.entropy_window = 600: the rule reads that many tokens of one turn, so it must be 1 to sampling.max_new_tokens (512)"),
            "{e}"
        );
        let no_tool = tree.replace("trigger = \"calc\"\n", "");
        let e = format!("{:#}", load(&no_tool, &[]).unwrap_err());
        assert!(
            e.contains(
                "no rollout.trigger, rollout.tools, rollout.environment or [rollout.openenv]"
            ),
            "{e}"
        );
        // An OpenEnv server's episodes branch only by replay, with a session for every
        // leaf of a batch.
        let served = format!(
            "{no_tool}[rollout.openenv]\nurl = \"http://127.0.0.1:9\"\nallow = [\"http://127.0.0.1:9\"]\n"
        );
        let e = format!("{:#}", load(&served, &[]).unwrap_err());
        assert!(e.contains("set rollout.openenv.fork = \"replay\""), "{e}");
        let replay = ["rollout.openenv.fork=\"replay\""];
        let e = format!("{:#}", load(&served, &replay).unwrap_err());
        assert!(
            e.contains(
                "8 prompts × group_size 4 = 32 sessions, rollout.openenv.max_sessions is 16"
            ),
            "{e}"
        );
        let room = [replay[0], "rollout.openenv.max_sessions=32"];
        load(&served, &room).unwrap();
    }

    #[test]
    fn reads_sections_with_defaults() {
        let c = load(BASE, &[]).unwrap().config;
        assert_eq!(c.rollout.group_size, 4);
        assert_eq!(c.rollout.prompts_per_step, 8);
        assert_eq!(c.plugins["calc"].limits().timeout_ms, 100);
        assert_eq!(c.plugins["calc"].limits().memory_mib, 256);
        assert_eq!(c.sampling.temperature, 1.0);
        assert_eq!(c.rewards[0].default_weight, 1.0);
    }

    #[test]
    fn an_unknown_key_is_named_with_its_line() {
        let text = BASE.replace("group_size = 4", "grup_size = 4");
        let e = format!("{:#}", load(&text, &[]).unwrap_err());
        assert!(e.contains("unknown field `grup_size`"), "{e}");
        assert!(e.contains("line 7"), "{e}");
    }

    #[test]
    fn overrides_replace_and_add_values() {
        let c = load(
            BASE,
            &[
                "rollout.group_size=2",
                "run.seed = 9",
                "sampling.stop=[\"</answer>\"]",
                "model.path=other dir",
            ],
        )
        .unwrap()
        .config;
        assert_eq!((c.rollout.group_size, c.run.seed), (2, 9));
        assert_eq!(c.sampling.stop, ["</answer>"]);
        assert_eq!(c.model.path, PathBuf::from("other dir"));
        let e = format!("{:#}", load(BASE, &["rollout.grup=1"]).unwrap_err());
        assert!(
            e.contains("unknown field `grup`") && e.contains("--set rollout.grup=1"),
            "{e}"
        );
        assert!(load(BASE, &["nonsense"]).is_err());
    }

    /// Issue 65: a `[[rewards]]` entry is a plugin or a reward model, never both or
    /// neither, and a reward model takes no plugin settings.
    #[test]
    fn a_reward_is_a_plugin_or_a_model() {
        let set = |entry: &str| format!("rewards=[{entry}]");
        for (entry, want) in [
            (
                "{plugin = \"calc\", model = \"runs/rm\"}",
                "rewards[0].plugin and model are both set",
            ),
            ("{weights = {rm = 1.0}}", "rewards[0].plugin or model"),
            (
                "{model = \"runs/rm\", config = {x = 1}}",
                "rewards[0].config is for reward plugins",
            ),
            (
                "{model = \"runs/rm\", fallback = 1.0}",
                "rewards[0].fallback is for reward plugins",
            ),
            (
                "{plugin = \"judge\"}",
                "rewards[0].plugin = \"judge\" names no plugin",
            ),
            (
                "{model = \"runs/rm\", weights = {score = 1.0}}",
                "rewards[0].weights.score: a reward model has one component, `rm`",
            ),
        ] {
            let e = format!("{:#}", load(BASE, &[&set(entry)]).unwrap_err());
            assert!(e.contains(want), "{entry}: {e}");
        }
        let ok = load(BASE, &[&set("{model = \"runs/rm\", weights = {rm = 2.0}}")]).unwrap();
        assert_eq!(ok.config.rewards[0].model.as_deref(), Some("runs/rm"));
    }

    #[test]
    fn references_to_missing_plugins_are_errors() {
        let text = BASE.replace("trigger = \"calc\"", "trigger = \"calculator\"");
        let e = format!("{:#}", load(&text, &[]).unwrap_err());
        assert!(
            e.contains("rollout.trigger = \"calculator\" names no plugin")
                && e.contains("[plugins.calculator]"),
            "{e}"
        );
        let e = format!("{:#}", load(BASE, &["model.device=\"gpu\""]).unwrap_err());
        assert!(
            e.contains("model.device = \"gpu\"") && e.contains("\"cuda:N\""),
            "{e}"
        );
        let e = format!("{:#}", load(BASE, &["model.dtype=\"fp8\""]).unwrap_err());
        assert!(
            e.contains("model.dtype = \"fp8\"") && e.contains("\"bf16\""),
            "{e}"
        );
        let e = format!("{:#}", load(BASE, &["rollout.group_size=0"]).unwrap_err());
        assert!(e.contains("group_size"), "{e}");
    }

    /// `[gateway]` reads with its defaults; bad values and rollouts of the run's own
    /// beside it are named.
    #[test]
    fn a_gateway_section_is_checked() {
        let text =
            BASE.replace("trigger = \"calc\"\n", "") + "[gateway]\nwhile_updating = \"refuse\"\n";
        let g = load(&text, &[]).unwrap().config.gateway.unwrap();
        assert_eq!(
            (g.addr.as_str(), g.served_model_name.as_str()),
            ("127.0.0.1:8000", "policy")
        );
        assert_eq!(g.while_updating, WhileUpdating::Refuse);
        for (set, want) in [
            ("gateway.session_timeout_s=0", "gateway.session_timeout_s"),
            ("gateway.max_connections=0", "gateway.max_connections"),
            (
                "gateway.served_model_name=\"\"",
                "gateway.served_model_name",
            ),
            (
                "rollout.trigger=\"calc\"",
                "[gateway] trains on the sessions",
            ),
            ("gateway.while_updating=\"drop\"", "while_updating"),
        ] {
            let e = format!("{:#}", load(&text, &[set]).unwrap_err());
            assert!(e.contains(want), "{set}: {e}");
        }
        // vLLM servers may sample the agents' calls.
        let on_vllm = [
            "rollout.engine=\"vllm\"",
            "rollout.vllm.servers=[\"http://127.0.0.1:9\"]",
        ];
        assert!(load(&text, &on_vllm).unwrap().config.gateway.is_some());
    }

    /// Issue 19: `lr = -1` trained by gradient ascent, `lr = nan` failed steps later, and
    /// `max_new_tokens = 0` still sampled a token.
    #[test]
    fn numbers_out_of_range_are_named() {
        for (set, key) in [
            ("train.lr=-1", "train.lr = -1 is out of range"),
            ("train.lr=nan", "train.lr = NaN is out of range"),
            ("train.lr=0", "train.lr = 0"),
            ("sampling.max_new_tokens=0", "sampling.max_new_tokens = 0"),
            ("sampling.temperature=-0.5", "sampling.temperature"),
            ("sampling.top_p=0", "sampling.top_p"),
            ("train.clip_low=1", "train.clip_low"),
            ("train.adv_eps=0", "train.adv_eps"),
            ("train.adv_eps=-1e-4", "train.adv_eps"),
            ("train.mini_batches=0", "train.mini_batches"),
            ("train.epochs_per_batch=0", "train.epochs_per_batch"),
            ("train.min_lr_ratio=2", "train.min_lr_ratio"),
            ("train.keep_last=0", "train.keep_last"),
            ("train.max_grad_norm=inf", "train.max_grad_norm"),
            ("lora.alpha=0", "lora.alpha"),
            ("rollout.max_total_tokens=1", "rollout.max_total_tokens"),
            ("rollout.env_reward_weight=nan", "rollout.env_reward_weight"),
            ("plugins.calc.memory_mib=0", "plugins.calc.memory_mib"),
            (
                "rewards=[{plugin=\"calc\", fallback=nan}]",
                "rewards[0].fallback",
            ),
        ] {
            let e = format!("{:#}", load(BASE, &[set]).unwrap_err());
            assert!(e.contains(key) && e.contains("expected"), "{set}: {e}");
        }
        // The edges that are allowed.
        for set in [
            "train.max_grad_norm=0",
            "sampling.temperature=0",
            "train.kl_coef=0",
            "rollout.max_tool_calls=0",
        ] {
            load(BASE, &[set]).unwrap_or_else(|e| panic!("{set}: {e:#}"));
        }
    }

    /// Issue 21: settings that contradict each other are named with the fix; the defaults
    /// are TRL's (adv_eps 1e-4) and RL2's (k1 in the reward); the former name of
    /// `epochs_per_batch` still reads.
    #[test]
    fn update_settings_are_checked_together() {
        use crate::rl::algorithms::{KlEstimator, Scale};
        let c = load(BASE, &[]).unwrap().config;
        assert_eq!(c.train.adv_eps, 1e-4);
        assert_eq!(c.train.kl_reward_estimator, KlEstimator::K1);
        assert_eq!(c.train.scale(), Scale::Group);
        let e = format!(
            "{:#}",
            load(
                BASE,
                &[
                    "train.estimator=\"dr-grpo\"",
                    "train.scale_rewards=\"batch\""
                ]
            )
            .unwrap_err()
        );
        assert!(
            e.contains("dr-grpo") && e.contains("estimator = \"grpo\""),
            "{e}"
        );
        let batch = c.rollout.prompts_per_step * c.rollout.group_size;
        let too_many = format!("train.mini_batches={}", batch + 1);
        let e = format!("{:#}", load(BASE, &[&too_many]).unwrap_err());
        assert!(
            e.contains("train.mini_batches") && e.contains("lower it"),
            "{e}"
        );
        let ok = format!("train.mini_batches={batch}");
        load(BASE, &[&ok, "train.scale_rewards=\"batch\""]).unwrap();
        let e = format!(
            "{:#}",
            load(
                BASE,
                &["train.algorithm=\"ppo\"", "train.scale_rewards=\"group\""]
            )
            .unwrap_err()
        );
        assert!(e.contains("drop scale_rewards") && e.contains("ppo"), "{e}");
        let c = load(BASE, &["train.updates_per_batch=3"]).unwrap().config;
        assert_eq!(c.train.epochs_per_batch, 3);
    }

    #[test]
    fn a_missing_section_is_named() {
        let text = BASE.replace("[model]\npath = \"m\"\n", "");
        let e = format!("{:#}", load(&text, &[]).unwrap_err());
        assert!(e.contains("missing field `model`"), "{e}");
    }
}
