//! A loaded plugin and its sessions: one trigger session or environment episode per
//! trajectory, one dataset source and one reward scorer per run.
//!
//! Every session owns a fresh `Store` and instance, so sessions never share memory and a
//! fault in one cannot corrupt another. Every call goes through [`Inner::guarded`], which
//! arms the deadline, the fuel and the memory flag, forwards the plugin's output to the
//! log, and turns whatever went wrong into a typed, counted [`Fault`]. A faulted instance
//! is dropped; the session's next call opens a fresh one with the same config and sample.

use super::bindings::v0_1_0::{self as v0, wit};
use super::fault::{Fault, FaultCounts, FaultKind};
use super::inspect::{LoadError, Shape, role_list};
use super::runtime::{EPOCH_TICK, PluginRuntime};
use super::sandbox::{Grants, Limits, StoreState};
use super::types::{Component, PluginInfo, Role, Sample, StepResult, Trajectory};
use anyhow::Result;
use std::path::PathBuf;
use std::sync::Arc;
use wasmtime::component::{InstancePre, ResourceAny};
use wasmtime::{Store, Trap};

/// How to load one plugin: its file and its sandbox.
#[derive(Debug, Clone, Default)]
pub struct PluginSpec {
    pub path: PathBuf,
    pub limits: Limits,
    pub grants: Grants,
}

/// The most stop patterns a trigger may declare, and the longest one. The host matches
/// them at every decoded token, so they must stay few and short.
const MAX_STOP_PATTERNS: usize = 32;
const MAX_STOP_PATTERN_BYTES: usize = 256;
/// The most reward components one score may have.
const MAX_COMPONENTS: usize = 64;

/// A loaded plugin. Cheap to clone; clones share fault counts.
#[derive(Clone)]
pub struct Plugin(Arc<Inner>);

struct Inner {
    runtime: Arc<PluginRuntime>,
    spec: PluginSpec,
    pre: InstancePre<StoreState>,
    shape: Shape,
    sha256: String,
    size: u64,
    info: PluginInfo,
    /// `name@version`, the tag on every fault and log line.
    id: String,
    faults: FaultCounts,
    indices: Indices,
    /// Mixed into every session seed so that two plugins given the same seed still draw
    /// different random streams.
    seed_salt: u64,
}

/// Export indices for `rlhost:plugin@0.1.0`, looked up once per plugin. A later WIT
/// version adds its own set and an enum over them.
struct Indices {
    about: v0::about::GuestIndices,
    trigger: Option<v0::trigger::GuestIndices>,
    environment: Option<v0::environment::GuestIndices>,
    dataset: Option<v0::dataset::GuestIndices>,
    reward: Option<v0::reward::GuestIndices>,
}

fn wasm_err(e: wasmtime::Error) -> String {
    e.to_string()
}

impl Plugin {
    pub(crate) async fn new(
        runtime: Arc<PluginRuntime>,
        spec: PluginSpec,
        pre: InstancePre<StoreState>,
        shape: Shape,
        sha256: String,
        size: u64,
    ) -> Result<Plugin> {
        let path = spec.path.display().to_string();
        let incompatible = |e: wasmtime::Error| LoadError::Invalid {
            path: path.clone(),
            message: wasm_err(e),
        };
        let has = |role| shape.roles.contains(&role);
        let indices = Indices {
            about: v0::about::GuestIndices::new(&pre).map_err(incompatible)?,
            trigger: has(Role::Trigger)
                .then(|| v0::trigger::GuestIndices::new(&pre))
                .transpose()
                .map_err(incompatible)?,
            environment: has(Role::Environment)
                .then(|| v0::environment::GuestIndices::new(&pre))
                .transpose()
                .map_err(incompatible)?,
            dataset: has(Role::Dataset)
                .then(|| v0::dataset::GuestIndices::new(&pre))
                .transpose()
                .map_err(incompatible)?,
            reward: has(Role::Reward)
                .then(|| v0::reward::GuestIndices::new(&pre))
                .transpose()
                .map_err(incompatible)?,
        };
        if spec.fuel_required() && !runtime.fuel {
            anyhow::bail!(
                "plugin {path} sets limits.fuel, but the plugin runtime was built without fuel"
            );
        }
        let file_name = spec
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "plugin".into());
        let mut inner = Inner {
            runtime,
            pre,
            shape,
            seed_salt: u64::from_str_radix(&sha256[..16], 16).unwrap_or(0),
            sha256,
            size,
            info: PluginInfo {
                name: file_name.clone(),
                version: "?".into(),
                description: String::new(),
            },
            id: file_name,
            faults: FaultCounts::default(),
            indices,
            spec,
        };
        // Ask the plugin who it is; this also proves that it starts inside its limits
        // and that its grants can be opened.
        let info = inner
            .about_info()
            .await
            .map_err(|fault| anyhow::anyhow!("plugin {path} fails to start: {fault}"))?;
        if info.name.is_empty() || info.name.chars().any(char::is_whitespace) {
            anyhow::bail!(
                "plugin {path} calls itself {:?}: a plugin name must be non-empty and have no spaces",
                info.name
            );
        }
        inner.id = format!("{}@{}", info.name, info.version);
        inner.info = info;
        Ok(Plugin(Arc::new(inner)))
    }

    pub fn info(&self) -> &PluginInfo {
        &self.0.info
    }

    /// `name@version`.
    pub fn id(&self) -> &str {
        &self.0.id
    }

    pub fn name(&self) -> &str {
        &self.0.info.name
    }

    pub fn roles(&self) -> &[Role] {
        &self.0.shape.roles
    }

    pub fn wit_version(&self) -> &str {
        &self.0.shape.wit_version
    }

    pub fn imports(&self) -> &[String] {
        &self.0.shape.imports
    }

    pub fn exports(&self) -> &[String] {
        &self.0.shape.exports
    }

    pub fn sha256(&self) -> &str {
        &self.0.sha256
    }

    pub fn size(&self) -> u64 {
        self.0.size
    }

    pub fn spec(&self) -> &PluginSpec {
        &self.0.spec
    }

    pub fn faults(&self) -> &FaultCounts {
        &self.0.faults
    }

    fn require(&self, role: Role) -> Result<(), LoadError> {
        if self.0.shape.roles.contains(&role) {
            Ok(())
        } else {
            Err(LoadError::MissingRole {
                plugin: self.0.id.clone(),
                path: self.0.spec.path.display().to_string(),
                wanted: role,
                exported: role_list(&self.0.shape.roles),
            })
        }
    }

    /// Opens a trigger session for one trajectory. `seed` seeds the plugin's randomness.
    pub async fn open_trigger(
        &self,
        config: &str,
        sample: &Sample,
        seed: u64,
    ) -> Result<TriggerSession> {
        self.require(Role::Trigger)?;
        let mut session = TriggerSession {
            plugin: self.clone(),
            config: config.to_string(),
            sample: wit::Sample::from(sample),
            seed,
            live: None,
            stop_patterns: Vec::new(),
        };
        session.stop_patterns = session.ensure_open().await?.1;
        Ok(session)
    }

    /// Opens an environment episode for one trajectory.
    pub async fn open_environment(
        &self,
        config: &str,
        sample: &Sample,
        seed: u64,
    ) -> Result<EnvironmentEpisode> {
        self.require(Role::Environment)?;
        let mut episode = EnvironmentEpisode {
            plugin: self.clone(),
            config: config.to_string(),
            sample: wit::Sample::from(sample),
            seed,
            live: None,
        };
        episode.ensure_open().await?;
        Ok(episode)
    }

    /// Opens the plugin's dataset for the run's `seed`.
    pub async fn open_dataset(&self, config: &str, seed: u64) -> Result<DatasetSource> {
        self.require(Role::Dataset)?;
        let mut source = DatasetSource {
            plugin: self.clone(),
            config: config.to_string(),
            seed,
            live: None,
            len: 0,
        };
        source.len = source.ensure_open().await?.1;
        Ok(source)
    }

    /// Opens the plugin's reward function.
    pub async fn open_reward(&self, config: &str) -> Result<RewardScorer> {
        self.require(Role::Reward)?;
        let mut scorer = RewardScorer {
            plugin: self.clone(),
            config: config.to_string(),
            live: None,
        };
        scorer.ensure_open().await?;
        Ok(scorer)
    }
}

impl PluginSpec {
    fn fuel_required(&self) -> bool {
        self.limits.fuel.is_some()
    }
}

/// One live instance and the resource a session holds in it.
struct Live<G> {
    store: Store<StoreState>,
    guest: G,
    handle: ResourceAny,
}

impl Inner {
    fn fault(&self, call: &'static str, kind: FaultKind, message: String) -> Fault {
        self.faults.record(kind);
        let fault = Fault {
            plugin: self.id.clone(),
            call,
            kind,
            message,
        };
        // Debug, not warn: the caller decides how a fault shows (a tool-error text, a
        // fallback score, a counted metric); a run with a flaky plugin must not drown
        // its log.
        tracing::debug!("{fault}");
        fault
    }

    /// A fresh store and instance, with randomness seeded from `seed`.
    async fn instantiate(
        &self,
        seed: u64,
        call: &'static str,
    ) -> Result<(Store<StoreState>, wasmtime::component::Instance), Fault> {
        let state = StoreState::new(
            &self.id,
            &self.spec.limits,
            &self.spec.grants,
            seed ^ self.seed_salt,
        )
        .map_err(|e| self.fault(call, FaultKind::Incompatible, format!("{e:#}")))?;
        let mut store = Store::new(&self.runtime.engine, state);
        store.limiter(|state| &mut state.limiter);
        store.epoch_deadline_trap();
        let pre = self.pre.clone();
        let instance = self
            .guarded(&mut store, call, async |store| {
                pre.instantiate_async(store).await
            })
            .await?;
        Ok((store, instance))
    }

    /// Runs one call into the guest under the plugin's limits and classifies its failure.
    async fn guarded<R>(
        &self,
        store: &mut Store<StoreState>,
        call: &'static str,
        run: impl AsyncFnOnce(&mut Store<StoreState>) -> wasmtime::Result<R>,
    ) -> Result<R, Fault> {
        let limits = &self.spec.limits;
        store.data_mut().limiter.memory_exceeded = false;
        let ticks = limits.timeout().as_nanos().div_ceil(EPOCH_TICK.as_nanos()) as u64;
        store.set_epoch_deadline(ticks.max(1));
        if self.runtime.fuel {
            let fuel = limits.fuel.unwrap_or(u64::MAX);
            store
                .set_fuel(fuel)
                .map_err(|e| self.fault(call, FaultKind::Trap, wasm_err(e)))?;
        }
        // The epoch deadline stops running wasm; this outer timeout stops a guest that
        // waits in an async host call (a WASI sleep or poll), which never reaches an
        // epoch check. Two ticks of slack let the epoch trap report first when both apply.
        let outer = limits.timeout() + 2 * EPOCH_TICK;
        let result = tokio::time::timeout(outer, run(store)).await;
        let stderr_tail = store.data_mut().flush_output();
        match result {
            Ok(Ok(value)) => Ok(value),
            Err(_) => Err(self.fault(
                call,
                FaultKind::Timeout,
                format!(
                    "no answer within the {} ms deadline (limits.timeout_ms); it was waiting in a host call",
                    limits.timeout_ms
                ),
            )),
            Ok(Err(error)) => {
                let (kind, message) = self.classify(store, &error);
                let message = match stderr_tail {
                    Some(tail) if kind == FaultKind::Trap => format!("{message}; stderr: {tail}"),
                    _ => message,
                };
                Err(self.fault(call, kind, message))
            }
        }
    }

    fn classify(&self, store: &Store<StoreState>, error: &wasmtime::Error) -> (FaultKind, String) {
        let limits = &self.spec.limits;
        if store.data().limiter.memory_exceeded {
            return (
                FaultKind::OutOfMemory,
                format!(
                    "memory would grow past the {} MiB cap (limits.memory_mib)",
                    limits.memory_mib
                ),
            );
        }
        match error.downcast_ref::<Trap>() {
            Some(Trap::Interrupt) => (
                FaultKind::Timeout,
                format!(
                    "still running at the {} ms deadline (limits.timeout_ms)",
                    limits.timeout_ms
                ),
            ),
            Some(Trap::OutOfFuel) => (
                FaultKind::Timeout,
                format!(
                    "ran out of fuel ({} units, limits.fuel)",
                    limits.fuel.unwrap_or(u64::MAX)
                ),
            ),
            Some(trap) => (FaultKind::Trap, trap.to_string()),
            None => (FaultKind::Trap, error.to_string()),
        }
    }

    /// Rejects a result larger than `limits.max_output_bytes`.
    fn check_size(&self, call: &'static str, bytes: usize) -> Result<(), Fault> {
        let cap = self.spec.limits.max_output_bytes;
        if bytes > cap {
            return Err(self.fault(
                call,
                FaultKind::BadOutput,
                format!(
                    "returned {bytes} bytes, more than the {cap}-byte cap (limits.max_output_bytes)"
                ),
            ));
        }
        Ok(())
    }

    /// A plugin's own `err(...)`: counted, and passed on with its message.
    fn guest_error(&self, call: &'static str, message: String) -> Fault {
        let mut message = message;
        truncate_utf8(&mut message, 1024);
        self.fault(call, FaultKind::GuestError, message)
    }

    async fn about_info(&self) -> Result<PluginInfo, Fault> {
        let (mut store, instance) = self.instantiate(self.seed_salt, "about.info").await?;
        let about = self
            .indices
            .about
            .load(&mut store, &instance)
            .map_err(|e| self.fault("about.info", FaultKind::Incompatible, wasm_err(e)))?;
        let info = self
            .guarded(&mut store, "about.info", async |store| {
                about.call_info(store).await
            })
            .await?;
        self.check_size(
            "about.info",
            info.name.len() + info.version.len() + info.description.len(),
        )?;
        Ok(info.into())
    }
}

fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
}

/// One trajectory's trigger session.
pub struct TriggerSession {
    plugin: Plugin,
    config: String,
    sample: wit::Sample,
    seed: u64,
    live: Option<Live<v0::trigger::Guest>>,
    stop_patterns: Vec<String>,
}

impl TriggerSession {
    /// The literal strings after which the host calls [`TriggerSession::fire`].
    pub fn stop_patterns(&self) -> &[String] {
        &self.stop_patterns
    }

    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    /// Opens an instance if there is none (first use, or after a fault); returns it and
    /// its stop patterns.
    async fn ensure_open(&mut self) -> Result<(&mut Live<v0::trigger::Guest>, Vec<String>), Fault> {
        let inner = &*self.plugin.0;
        let mut patterns = Vec::new();
        if self.live.is_none() {
            let (mut store, instance) = inner.instantiate(self.seed, "trigger.open").await?;
            let guest = inner
                .indices
                .trigger
                .as_ref()
                .expect("role checked")
                .load(&mut store, &instance)
                .map_err(|e| inner.fault("trigger.open", FaultKind::Incompatible, wasm_err(e)))?;
            let (config, sample) = (&self.config, &self.sample);
            let handle = inner
                .guarded(&mut store, "trigger.open", async |store| {
                    guest.session().call_open(store, config, sample).await
                })
                .await?
                .map_err(|message| inner.guest_error("trigger.open", message))?;
            patterns = inner
                .guarded(&mut store, "trigger.stop-patterns", async |store| {
                    guest.session().call_stop_patterns(store, handle).await
                })
                .await?;
            if patterns.len() > MAX_STOP_PATTERNS
                || patterns
                    .iter()
                    .any(|p| p.is_empty() || p.len() > MAX_STOP_PATTERN_BYTES)
            {
                return Err(inner.fault(
                    "trigger.stop-patterns",
                    FaultKind::BadOutput,
                    format!(
                        "declared {} stop patterns; at most {MAX_STOP_PATTERNS} are allowed, each 1 to {MAX_STOP_PATTERN_BYTES} bytes",
                        patterns.len()
                    ),
                ));
            }
            self.live = Some(Live {
                store,
                guest,
                handle,
            });
        }
        Ok((self.live.as_mut().expect("opened above"), patterns))
    }

    /// Runs the tool on everything generated so far. `Ok(None)`: nothing to append.
    pub async fn fire(&mut self, text: &str) -> Result<Option<String>, Fault> {
        let inner = self.plugin.0.clone();
        let (live, _) = self.ensure_open().await?;
        let Live {
            store,
            guest,
            handle,
        } = live;
        let handle = *handle;
        let result = inner
            .guarded(store, "trigger.fire", async |store| {
                guest.session().call_fire(store, handle, text).await
            })
            .await;
        let output = match result {
            Ok(Ok(output)) => output,
            Ok(Err(message)) => return Err(inner.guest_error("trigger.fire", message)),
            Err(fault) => {
                self.live = None;
                return Err(fault);
            }
        };
        if let Err(fault) = inner.check_size("trigger.fire", output.as_ref().map_or(0, String::len))
        {
            self.live = None;
            return Err(fault);
        }
        Ok(output)
    }
}

/// One trajectory's environment episode.
pub struct EnvironmentEpisode {
    plugin: Plugin,
    config: String,
    sample: wit::Sample,
    seed: u64,
    live: Option<Live<v0::environment::Guest>>,
}

impl EnvironmentEpisode {
    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    async fn ensure_open(&mut self) -> Result<&mut Live<v0::environment::Guest>, Fault> {
        let inner = &*self.plugin.0;
        if self.live.is_none() {
            let (mut store, instance) = inner.instantiate(self.seed, "environment.open").await?;
            let guest = inner
                .indices
                .environment
                .as_ref()
                .expect("role checked")
                .load(&mut store, &instance)
                .map_err(|e| {
                    inner.fault("environment.open", FaultKind::Incompatible, wasm_err(e))
                })?;
            let (config, sample) = (&self.config, &self.sample);
            let handle = inner
                .guarded(&mut store, "environment.open", async |store| {
                    guest.episode().call_open(store, config, sample).await
                })
                .await?
                .map_err(|message| inner.guest_error("environment.open", message))?;
            self.live = Some(Live {
                store,
                guest,
                handle,
            });
        }
        Ok(self.live.as_mut().expect("opened above"))
    }

    /// Answers the assistant's latest turn.
    pub async fn step(&mut self, assistant: &str) -> Result<StepResult, Fault> {
        let inner = self.plugin.0.clone();
        let Live {
            store,
            guest,
            handle,
        } = self.ensure_open().await?;
        let handle = *handle;
        let result = inner
            .guarded(store, "environment.step", async |store| {
                guest.episode().call_step(store, handle, assistant).await
            })
            .await;
        let step: StepResult = match result {
            Ok(Ok(step)) => step.into(),
            Ok(Err(message)) => return Err(inner.guest_error("environment.step", message)),
            Err(fault) => {
                self.live = None;
                return Err(fault);
            }
        };
        let bytes: usize = step
            .messages
            .iter()
            .map(|m| m.role.len() + m.content.len())
            .sum();
        let problem = if let Some(m) = step
            .messages
            .iter()
            .find(|m| m.role != "tool" && m.role != "user")
        {
            Some(format!(
                "returned a message with role `{}`; an environment may only add `tool` or `user` messages",
                m.role
            ))
        } else if step.reward.is_some_and(|r| !r.is_finite()) {
            Some(format!(
                "returned a reward of {}; rewards must be finite",
                step.reward.unwrap_or_default()
            ))
        } else {
            None
        };
        let checked = match problem {
            Some(message) => Err(inner.fault("environment.step", FaultKind::BadOutput, message)),
            None => inner.check_size("environment.step", bytes),
        };
        if let Err(fault) = checked {
            self.live = None;
            return Err(fault);
        }
        Ok(step)
    }
}

/// An opened dataset.
pub struct DatasetSource {
    plugin: Plugin,
    config: String,
    seed: u64,
    live: Option<Live<v0::dataset::Guest>>,
    len: u64,
}

impl DatasetSource {
    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    /// How many samples the dataset has (asked once, when opened).
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    async fn ensure_open(&mut self) -> Result<(&mut Live<v0::dataset::Guest>, u64), Fault> {
        let inner = &*self.plugin.0;
        let mut len = self.len;
        if self.live.is_none() {
            let (mut store, instance) = inner.instantiate(self.seed, "dataset.open").await?;
            let guest = inner
                .indices
                .dataset
                .as_ref()
                .expect("role checked")
                .load(&mut store, &instance)
                .map_err(|e| inner.fault("dataset.open", FaultKind::Incompatible, wasm_err(e)))?;
            let (config, seed) = (&self.config, self.seed);
            let handle = inner
                .guarded(&mut store, "dataset.open", async |store| {
                    guest.source().call_open(store, config, seed).await
                })
                .await?
                .map_err(|message| inner.guest_error("dataset.open", message))?;
            len = inner
                .guarded(&mut store, "dataset.len", async |store| {
                    guest.source().call_len(store, handle).await
                })
                .await?;
            self.live = Some(Live {
                store,
                guest,
                handle,
            });
        }
        Ok((self.live.as_mut().expect("opened above"), len))
    }

    /// The sample at `index`, which must be below [`DatasetSource::len`].
    pub async fn get(&mut self, index: u64) -> Result<Sample, Fault> {
        let inner = self.plugin.0.clone();
        if index >= self.len {
            return Err(Fault {
                plugin: inner.id.clone(),
                call: "dataset.get",
                kind: FaultKind::BadOutput,
                message: format!("index {index} is past the dataset's {} samples", self.len),
            });
        }
        let (
            Live {
                store,
                guest,
                handle,
            },
            _,
        ) = self.ensure_open().await?;
        let handle = *handle;
        let result = inner
            .guarded(store, "dataset.get", async |store| {
                guest.source().call_get(store, handle, index).await
            })
            .await;
        let sample = match result {
            Ok(Ok(sample)) => sample,
            Ok(Err(message)) => return Err(inner.guest_error("dataset.get", message)),
            Err(fault) => {
                self.live = None;
                return Err(fault);
            }
        };
        let bytes = sample.metadata.len()
            + sample
                .messages
                .iter()
                .map(|m| m.role.len() + m.content.len())
                .sum::<usize>();
        let checked = inner.check_size("dataset.get", bytes).and_then(|()| {
            match serde_json::from_str::<serde_json::Value>(&sample.metadata) {
                Ok(metadata @ serde_json::Value::Object(_)) => Ok(Sample {
                    messages: sample.messages.into_iter().map(Into::into).collect(),
                    metadata,
                }),
                Ok(_) | Err(_) => Err(inner.fault(
                    "dataset.get",
                    FaultKind::BadOutput,
                    format!("sample {index} has metadata that is not a JSON object"),
                )),
            }
        });
        if checked.is_err() {
            self.live = None;
        }
        checked
    }
}

/// An opened reward function.
pub struct RewardScorer {
    plugin: Plugin,
    config: String,
    live: Option<Live<v0::reward::Guest>>,
}

impl RewardScorer {
    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    async fn ensure_open(&mut self) -> Result<&mut Live<v0::reward::Guest>, Fault> {
        let inner = &*self.plugin.0;
        if self.live.is_none() {
            let (mut store, instance) = inner.instantiate(inner.seed_salt, "reward.open").await?;
            let guest = inner
                .indices
                .reward
                .as_ref()
                .expect("role checked")
                .load(&mut store, &instance)
                .map_err(|e| inner.fault("reward.open", FaultKind::Incompatible, wasm_err(e)))?;
            let config = &self.config;
            let handle = inner
                .guarded(&mut store, "reward.open", async |store| {
                    guest.scorer().call_open(store, config).await
                })
                .await?
                .map_err(|message| inner.guest_error("reward.open", message))?;
            self.live = Some(Live {
                store,
                guest,
                handle,
            });
        }
        Ok(self.live.as_mut().expect("opened above"))
    }

    /// Scores one trajectory into named components.
    pub async fn score(&mut self, trajectory: &Trajectory) -> Result<Vec<Component>, Fault> {
        let inner = self.plugin.0.clone();
        let trajectory = wit::Trajectory::from(trajectory);
        let Live {
            store,
            guest,
            handle,
        } = self.ensure_open().await?;
        let handle = *handle;
        let result = inner
            .guarded(store, "reward.score", async |store| {
                guest.scorer().call_score(store, handle, &trajectory).await
            })
            .await;
        let components: Vec<Component> = match result {
            Ok(Ok(components)) => components.into_iter().map(Into::into).collect(),
            Ok(Err(message)) => return Err(inner.guest_error("reward.score", message)),
            Err(fault) => {
                self.live = None;
                return Err(fault);
            }
        };
        let valid_name = |name: &str| {
            !name.is_empty()
                && name.len() <= 64
                && name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
        };
        let problem = if components.len() > MAX_COMPONENTS {
            Some(format!(
                "returned {} components; at most {MAX_COMPONENTS} are allowed",
                components.len()
            ))
        } else if let Some(c) = components.iter().find(|c| !c.value.is_finite()) {
            Some(format!(
                "component `{}` is {}; reward components must be finite",
                c.name, c.value
            ))
        } else if let Some(c) = components.iter().find(|c| !valid_name(&c.name)) {
            Some(format!(
                "component name {:?} is not lowercase letters, digits, `_` or `-`",
                c.name
            ))
        } else {
            None
        };
        if let Some(message) = problem {
            self.live = None;
            return Err(inner.fault("reward.score", FaultKind::BadOutput, message));
        }
        Ok(components)
    }
}
