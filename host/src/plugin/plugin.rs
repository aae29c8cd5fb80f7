//! A loaded plugin: its compiled component, what it exports, its limits and fault counts,
//! and the one place where calls into a guest are made.
//!
//! Every call goes through [`Inner::guarded`], which arms the deadline, the fuel and the
//! memory flag, forwards the plugin's output to the log, and turns whatever went wrong
//! into a typed, counted [`Fault`]. Sessions (`session.rs`) own the instances.

use super::bindings::Exports;
use super::fault::{Fault, FaultCounts, FaultKind};
use super::http::HttpGate;
use super::inspect::{LoadError, Shape, role_list};
use super::model::{GenerateCounts, ModelAccess, ModelLink, ModelServer};
use super::output::truncate_utf8;
use super::sandbox::{EPOCH_TICK, Grants, Limits, StoreState};
use super::tape::Tape;
use super::types::{PluginInfo, Role};
use anyhow::{Context, Result};
use std::path::PathBuf;
use std::sync::Arc;
use wasmtime::component::InstancePre;
use wasmtime::{Engine, Store, Trap, UpdateDeadline};

/// How to load one plugin: its file and its sandbox.
#[derive(Debug, Clone, Default)]
pub struct PluginSpec {
    pub path: PathBuf,
    pub limits: Limits,
    pub grants: Grants,
}

/// A loaded plugin. Cheap to clone; clones share fault counts.
#[derive(Clone)]
pub struct Plugin(pub(super) Arc<Inner>);

pub struct Inner {
    /// The runtime's engine (every store of every plugin of a run lives in it).
    engine: Engine,
    /// Whether the engine counts fuel.
    fuel: bool,
    spec: PluginSpec,
    pre: InstancePre<StoreState>,
    shape: Shape,
    sha256: String,
    size: u64,
    info: PluginInfo,
    /// `name@version`, the tag on every fault and log line.
    pub(super) id: String,
    pub(super) faults: FaultCounts,
    /// The exports of the WIT version the plugin was built against.
    pub(super) exports: Exports,
    /// Mixed into every session seed so that two plugins given the same seed still draw
    /// different random streams.
    pub(super) seed_salt: u64,
    /// Every `wasi:http` request of every instance goes through this.
    http: Arc<HttpGate>,
    /// What the plugin's `model.generate` calls came to, its instances together.
    generate: Arc<GenerateCounts>,
    /// Answers the `model.generate` calls of instances whose session has no link of its
    /// own (a plugin tested or called on its own, with a model to ask).
    standalone: std::sync::Mutex<Option<ModelServer>>,
}

impl Plugin {
    /// A plugin of the runtime whose `engine` (counting fuel if `fuel`) compiled and
    /// linked `pre`.
    pub(crate) async fn new(
        engine: Engine,
        fuel: bool,
        spec: PluginSpec,
        pre: InstancePre<StoreState>,
        shape: Shape,
        sha256: String,
        size: u64,
    ) -> Result<Plugin> {
        let path = spec.path.display().to_string();
        let incompatible = |e: wasmtime::Error| LoadError::Invalid {
            path: path.clone(),
            message: e.to_string(),
        };
        let exports = Exports::new(&pre, &shape.wit_version, &shape.roles).map_err(incompatible)?;
        if spec.limits.fuel.is_some() && !fuel {
            anyhow::bail!(
                "plugin {path} sets limits.fuel, but the plugin runtime was built without fuel"
            );
        }
        let file_name = spec
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "plugin".into());
        let http = spec
            .grants
            .http_gate(&file_name, &spec.limits)
            .with_context(|| format!("plugin {path}: allow_http"))?;
        if let Some(grant) = &spec.grants.generate {
            grant
                .check()
                .map_err(|e| anyhow::anyhow!("plugin {path}: generate: {e}"))?;
        }
        let mut inner = Inner {
            http,
            generate: Arc::default(),
            standalone: Default::default(),
            engine,
            fuel,
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
            exports,
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
        inner.http.set_name(&inner.id);
        inner.info = info;
        Ok(Plugin(Arc::new(inner)))
    }

    /// The plugin's outbound HTTP: its grants and what its requests came to.
    pub fn http(&self) -> &HttpGate {
        &self.0.http
    }

    /// What the plugin's `model.generate` calls came to.
    pub fn generate(&self) -> &GenerateCounts {
        &self.0.generate
    }

    /// Answers, from now on, the `model.generate` calls of every instance whose session
    /// was given no link of its own, through a link `server` makes from the instance's
    /// seed. For a plugin outside a rollout; the grant still decides what is answered.
    pub fn serve_model(&self, server: ModelServer) {
        *self.0.standalone.lock().unwrap_or_else(|e| e.into_inner()) = Some(server);
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

    /// An error naming what the plugin exports if `role` is not among it.
    pub(super) fn require(&self, role: Role) -> Result<(), LoadError> {
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
}

impl Inner {
    pub(super) fn fault(&self, call: &'static str, kind: FaultKind, message: String) -> Fault {
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
    /// `link`: where its `model.generate` calls go (its session's trajectory's engine);
    /// `tape`: where its outside answers are recorded (a fork's: already holding those
    /// its replay is to be served).
    pub(super) async fn instantiate(
        &self,
        seed: u64,
        call: &'static str,
        link: Option<ModelLink>,
        tape: Arc<Tape>,
    ) -> Result<(Store<StoreState>, wasmtime::component::Instance), Fault> {
        let link = link.or_else(|| self.standalone_link(seed));
        let model = ModelAccess {
            grant: self.spec.grants.generate.clone(),
            link,
            counts: self.generate.clone(),
            clock: Arc::default(),
            tape,
        };
        let state = StoreState::new(
            &self.id,
            &self.spec.limits,
            &self.spec.grants,
            &self.http,
            model,
            seed ^ self.seed_salt,
        )
        .map_err(|e| self.fault(call, FaultKind::Incompatible, format!("{e:#}")))?;
        let mut store = Store::new(&self.engine, state);
        store.limiter(|state| &mut state.limiter);
        // The deadline is handed out a slice at a time, and the call yields to the executor
        // between slices: a guest that computes until its deadline no longer holds its
        // thread for the whole of it (one looping OpenEnv step kept `/health` and every
        // other session waiting 5.1 s). At the deadline the call traps, unless it waited for
        // the model since: then the deadline moves on by that wait (up to the grant's
        // `max_wait_ms`).
        store.epoch_deadline_callback(|mut ctx| {
            let state = ctx.data_mut();
            if state.epoch_left == 0 {
                let model = &state.model;
                let extra = model.clock().credit(model.max_wait());
                if extra.is_zero() {
                    return Ok(UpdateDeadline::Interrupt);
                }
                state.epoch_left = ticks(extra);
            }
            let slice = state.epoch_left.min(YIELD_TICKS);
            state.epoch_left -= slice;
            Ok(UpdateDeadline::Yield(slice))
        });
        let pre = self.pre.clone();
        let instance = self
            .guarded(&mut store, call, async |store| {
                pre.instantiate_async(store).await
            })
            .await?;
        Ok((store, instance))
    }

    /// A link to the model [`Plugin::serve_model`] gave, if any.
    pub(super) fn standalone_link(&self, seed: u64) -> Option<ModelLink> {
        let standalone = self.standalone.lock().unwrap_or_else(|e| e.into_inner());
        standalone.as_ref().map(|server| server(seed))
    }

    /// Runs one call into the guest under the plugin's limits and classifies its failure.
    pub(super) async fn guarded<R>(
        &self,
        store: &mut Store<StoreState>,
        call: &'static str,
        run: impl AsyncFnOnce(&mut Store<StoreState>) -> wasmtime::Result<R>,
    ) -> Result<R, Fault> {
        let limits = &self.spec.limits;
        store.data_mut().limiter.memory_exceeded = false;
        let total = ticks(limits.timeout());
        let first = total.min(YIELD_TICKS);
        store.data_mut().epoch_left = total - first;
        store.set_epoch_deadline(first);
        if self.fuel {
            let fuel = limits.fuel.unwrap_or(u64::MAX);
            store
                .set_fuel(fuel)
                .map_err(|e| self.fault(call, FaultKind::Trap, e.to_string()))?;
        }
        // The epoch deadline stops running wasm; this outer timeout stops a guest that
        // waits in an async host call (a WASI sleep or poll), which never reaches an
        // epoch check. Two ticks of slack let the epoch trap report first when both apply.
        // Both move on by the time the call waits for the model (`model.generate`).
        let outer = limits.timeout() + 2 * EPOCH_TICK;
        let (clock, max_wait) = {
            let model = &store.data().model;
            (model.clock.clone(), model.max_wait())
        };
        let waited = move || {
            clock
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .waited()
                .min(max_wait)
        };
        store.data().model.clock().begin_call();
        let start = tokio::time::Instant::now();
        let result = {
            let call = run(store);
            tokio::pin!(call);
            loop {
                let before = waited();
                match tokio::time::timeout_at(start + outer + before, &mut call).await {
                    Ok(value) => break Ok(value),
                    // Waiting for the model since: the deadline moves on.
                    Err(_) if waited() > before => continue,
                    Err(elapsed) => break Err(elapsed),
                }
            }
        };
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

    /// Why a result of `bytes` bytes is refused, if it is larger than
    /// `limits.max_output_bytes`.
    pub(super) fn too_large(&self, bytes: usize) -> Option<String> {
        let cap = self.spec.limits.max_output_bytes;
        (bytes > cap).then(|| {
            format!(
                "returned {bytes} bytes, more than the {cap}-byte cap (limits.max_output_bytes)"
            )
        })
    }

    /// A plugin's own `err(...)`: counted, and passed on with its message.
    pub(super) fn guest_error(&self, call: &'static str, message: String) -> Fault {
        let mut message = message;
        truncate_utf8(&mut message, 1024);
        self.fault(call, FaultKind::GuestError, message)
    }

    async fn about_info(&self) -> Result<PluginInfo, Fault> {
        let (mut store, instance) = self
            .instantiate(
                self.seed_salt,
                "about.info",
                None,
                Arc::new(Tape::new(false)),
            )
            .await?;
        let about = self
            .exports
            .about(&mut store, &instance)
            .map_err(|e| self.fault("about.info", FaultKind::Incompatible, e.to_string()))?;
        let info = self
            .guarded(&mut store, "about.info", async |store| {
                about.info(store).await
            })
            .await?;
        let bytes = info.name.len() + info.version.len() + info.description.len();
        if let Some(message) = self.too_large(bytes) {
            return Err(self.fault("about.info", FaultKind::BadOutput, message));
        }
        Ok(info)
    }
}

/// Epoch ticks covering `d` (at least one).
/// Epoch ticks a guest runs between yields to the executor (50 ms).
const YIELD_TICKS: u64 = 5;

fn ticks(d: std::time::Duration) -> u64 {
    (d.as_nanos().div_ceil(EPOCH_TICK.as_nanos()) as u64).max(1)
}
