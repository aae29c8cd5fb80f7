//! The sandbox every plugin instance runs in: its limits, its grants, and the per-store
//! state (WASI context, captured output, memory limiter) behind them.
//!
//! Defaults deny everything. A plugin gets no files, no network, no environment
//! variables, no arguments and no inherited stdio; what it prints is captured and capped;
//! its memory, its time per call and the size of what it returns are capped; its
//! randomness is seeded and its clocks virtual ([`super::clock`]), so rollouts are
//! reproducible. Grants widen this only when the run
//! config names them.

use super::clock::VirtualTime;
use super::http::{GateHooks, HttpAccess, HttpGate};
use super::model::{GenerateGrant, ModelAccess};
use super::net::HttpGrants;
use super::output::CappedPipe;
use super::tape::Tape;
use anyhow::{Context, Result};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use wasmtime::component::ResourceTable;
use wasmtime::{ResourceLimiter, StoreLimits, StoreLimitsBuilder};
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};
use wasmtime_wasi_http::{WasiHttpCtx, WasiHttpCtxView, WasiHttpView};

/// How often the ticker thread advances the engine's epoch. Deadlines are rounded up to
/// whole ticks, so 10 ms keeps a 1 s deadline within 1%, for the price of one atomic
/// increment 100 times a second.
pub const EPOCH_TICK: Duration = Duration::from_millis(10);

/// Resource caps for one plugin. Every field has a default; a run config or a CLI flag
/// may override each one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Linear memory per instance, in MiB. 256 MiB holds the Python code tool (CPython
    /// starts at ~20 MiB) with room for model-written code, and keeps 32 concurrent
    /// sessions under 8 GiB.
    pub memory_mib: u64,
    /// Wall-clock deadline per call, in milliseconds. A tool call is on the rollout's
    /// critical path: 5 s is long for a calculator and enough for a small Python script.
    pub timeout_ms: u64,
    /// Optional fuel (wasm instructions, roughly) per call, for budgets that do not depend
    /// on machine speed. Off by default: it slows every call by ~30%.
    pub fuel: Option<u64>,
    /// Most bytes a call may return, strings and lists summed. A tool's output goes into
    /// the model's context, so 1 MiB is already far more than useful.
    pub max_output_bytes: usize,
    /// Most bytes of stdout and stderr kept per call (each); the rest is dropped and
    /// counted. Keeps a plugin that floods its output from flooding the host's log.
    pub max_log_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory_mib: 256,
            timeout_ms: 5_000,
            fuel: None,
            max_output_bytes: 1 << 20,
            max_log_bytes: 64 << 10,
        }
    }
}

impl Limits {
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    pub fn memory_bytes(&self) -> usize {
        usize::try_from(self.memory_mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX)
    }
}

/// Capabilities a plugin gets only when the run config names them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Grants {
    /// Host directories mounted read-only, e.g. a dataset the plugin reads.
    pub read_only_dirs: Vec<DirGrant>,
    /// Outbound HTTP destinations (`wasi:http`), Spin's `allowed_outbound_hosts` shape
    /// ([`super::net`]); none: every request is refused.
    pub allow_http: Vec<String>,
    /// Cap on each HTTP request body and each response body, in bytes.
    pub max_http_bytes: u64,
    /// HTTP requests in flight at once, the plugin's instances together.
    pub max_http_in_flight: usize,
    /// `model.generate`: none, every call refused.
    pub generate: Option<GenerateGrant>,
}

impl Default for Grants {
    fn default() -> Self {
        Grants {
            read_only_dirs: Vec::new(),
            allow_http: Vec::new(),
            max_http_bytes: 1 << 20,
            max_http_in_flight: 4,
            generate: None,
        }
    }
}

impl Grants {
    /// HTTP grants as a config section or the command line gives them, the caps left
    /// unset taking their defaults; no directories.
    pub fn http(
        allow_http: &[String],
        max_bytes: Option<u64>,
        max_in_flight: Option<usize>,
    ) -> Grants {
        let d = Grants::default();
        Grants {
            allow_http: allow_http.to_vec(),
            max_http_bytes: max_bytes.unwrap_or(d.max_http_bytes),
            max_http_in_flight: max_in_flight.unwrap_or(d.max_http_in_flight),
            ..d
        }
    }

    /// The plugin's HTTP gate: its grants read (an entry that does not read is the
    /// error), each request's deadline nine tenths of the call's, so that the plugin
    /// hears of a timeout before its call is cut off.
    pub fn http_gate(&self, plugin: &str, limits: &Limits) -> Result<Arc<HttpGate>> {
        let grants = HttpGrants::parse(&self.allow_http).map_err(|e| anyhow::anyhow!(e))?;
        Ok(HttpGate::new(
            plugin,
            HttpAccess {
                grants,
                max_bytes: self.max_http_bytes,
                deadline: limits.timeout() * 9 / 10,
                max_in_flight: self.max_http_in_flight.max(1),
            },
        ))
    }
}

/// One read-only directory: `host` on this machine, seen by the plugin as `guest`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DirGrant {
    pub host: PathBuf,
    pub guest: String,
}

impl std::str::FromStr for DirGrant {
    type Err = String;

    /// `HOST[:GUEST]`; the guest path defaults to `/data`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (host, guest) = match s.split_once(':') {
            Some((host, guest)) => (host, guest),
            None => (s, "/data"),
        };
        if host.is_empty() || guest.is_empty() {
            return Err(format!("`{s}` is not HOST_DIR[:GUEST_PATH]"));
        }
        Ok(DirGrant {
            host: host.into(),
            guest: guest.into(),
        })
    }
}

/// Wraps [`StoreLimits`] to remember whether the memory cap was hit: with
/// `trap_on_grow_failure` the resulting error is not a `Trap` variant, so without this
/// flag an out-of-memory fault could not be told apart from any other trap.
pub struct Limiter {
    inner: StoreLimits,
    pub memory_exceeded: bool,
}

impl ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let result = self.inner.memory_growing(current, desired, maximum);
        if !matches!(result, Ok(true)) {
            self.memory_exceeded = true;
        }
        result
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.inner.table_growing(current, desired, maximum)
    }

    fn instances(&self) -> usize {
        self.inner.instances()
    }

    fn tables(&self) -> usize {
        self.inner.tables()
    }

    fn memories(&self) -> usize {
        self.inner.memories()
    }
}

/// What one plugin instance's `Store` holds.
pub struct StoreState {
    wasi: WasiCtx,
    table: ResourceTable,
    pub limiter: Limiter,
    pub stdout: CappedPipe,
    pub stderr: CappedPipe,
    /// `name@version`, for log lines the plugin writes through `host.log`.
    pub plugin: String,
    /// Bytes logged through `host.log` so far; capped like stdout.
    logged: usize,
    max_log_bytes: usize,
    /// The first line logged at `warn` or above since the session last took it: a reward
    /// says there why a trajectory lost points (the first failed test), and the host keeps
    /// it in the trajectory's record.
    note: Option<String>,
    /// `wasi:http`: every request goes through the plugin's gate.
    http: WasiHttpCtx,
    http_hooks: GateHooks,
    /// `model.generate`: the grant, the session's link to the engine, the counts.
    pub model: ModelAccess,
    /// Epoch ticks of the call's deadline not yet handed to the store: the deadline is
    /// given out a slice at a time, and the call yields to the executor between slices.
    pub epoch_left: u64,
    /// What the instance's clocks have read.
    pub time: VirtualTime,
}

impl StoreState {
    /// The instance's record of its HTTP and `model.generate` answers (a fork replays
    /// them).
    pub fn tape(&self) -> &Arc<Tape> {
        &self.model.tape
    }
}

impl StoreState {
    /// A fresh sandbox for one instance. `seed` seeds the plugin's randomness: the same
    /// seed gives the same random numbers, so a rollout can be replayed.
    pub fn new(
        plugin: &str,
        limits: &Limits,
        grants: &Grants,
        http: &Arc<HttpGate>,
        model: ModelAccess,
        seed: u64,
    ) -> Result<Self> {
        let stdout = CappedPipe::new(limits.max_log_bytes);
        let stderr = CappedPipe::new(limits.max_log_bytes);
        let mut wasi = WasiCtxBuilder::new();
        // No `inherit_args`, `inherit_env` or `inherit_stdio`: the builder starts with
        // none of them, so the plugin sees no arguments, no environment variables (no API
        // keys, no paths), and an empty stdin.
        wasi.stdout(stdout.clone()).stderr(stderr.clone());
        // Network off in this version. The builder already denies every address; turning
        // the socket families off as well makes the refusal immediate and explicit.
        wasi.allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false);
        // `wasi:random` seeded from the run: reproducible rollouts. Plugins that need
        // secrets have no business in a training sandbox.
        wasi.secure_random(StdRng::seed_from_u64(seed))
            .insecure_random(StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15))
            .insecure_random_seed(u128::from(seed) << 64 | u128::from(!seed));
        // Clocks too: virtual, one step a reading ([`super::clock`]).
        let time = VirtualTime::default();
        wasi.wall_clock(time.wall())
            .monotonic_clock(time.monotonic());
        // No preopened directories unless granted, and then read-only.
        for grant in &grants.read_only_dirs {
            wasi.preopened_dir(&grant.host, &grant.guest, FsPerms::ReadOnly)
                .map_err(|e| anyhow::anyhow!("{e}"))
                .with_context(|| {
                    format!(
                        "cannot grant read-only directory {} (as {})",
                        grant.host.display(),
                        grant.guest
                    )
                })?;
        }
        let limits_inner = StoreLimitsBuilder::new()
            .memory_size(limits.memory_bytes())
            // Fail the grow with a trap instead of returning -1 to the guest: guests
            // (Rust's allocator, CPython) abort on -1 anyway, and a trap is reported at
            // the point of the grow, with the flag above set.
            .trap_on_grow_failure(true)
            .build();
        Ok(StoreState {
            wasi: wasi.build(),
            table: ResourceTable::new(),
            limiter: Limiter {
                inner: limits_inner,
                memory_exceeded: false,
            },
            stdout,
            stderr,
            plugin: plugin.to_string(),
            logged: 0,
            max_log_bytes: limits.max_log_bytes,
            note: None,
            http: WasiHttpCtx::new(),
            http_hooks: GateHooks {
                gate: http.clone(),
                tape: model.tape.clone(),
            },
            model,
            epoch_left: 0,
            time,
        })
    }

    /// Forwards what the plugin printed since the last call to the host's log, tagged with
    /// its name, and returns the end of stderr: the last two lines that are not Rust's
    /// "run with RUST_BACKTRACE" note, which is where a panic or a Python traceback says
    /// what went wrong.
    pub fn flush_output(&mut self) -> Option<String> {
        let plugin = &self.plugin;
        let out = self.stdout.take();
        let err = self.stderr.take();
        for line in out.text.lines() {
            tracing::info!(target: "plugin", plugin = %plugin, "stdout: {line}");
        }
        for line in err.text.lines() {
            tracing::info!(target: "plugin", plugin = %plugin, "stderr: {line}");
        }
        for (stream, dropped) in [("stdout", out.dropped), ("stderr", err.dropped)] {
            if dropped > 0 {
                tracing::warn!(target: "plugin", plugin = %plugin,
                    "{stream}: {dropped} more bytes dropped (cap: limits.max_log_bytes)");
            }
        }
        let mut tail: Vec<&str> = err
            .text
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty() && !line.starts_with("note: run with"))
            .rev()
            .take(2)
            .collect();
        tail.reverse();
        (!tail.is_empty()).then(|| tail.join(" "))
    }
}

/// The longest note kept from a plugin's log for a trajectory's record.
const MAX_NOTE_BYTES: usize = 1024;

impl StoreState {
    /// The first `warn` or `error` line logged since the last call of this.
    pub(super) fn take_note(&mut self) -> Option<String> {
        self.note.take()
    }
}

impl WasiView for StoreState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl WasiHttpView for StoreState {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        WasiHttpCtxView {
            ctx: &mut self.http,
            table: &mut self.table,
            hooks: &mut self.http_hooks,
        }
    }
}

impl StoreState {
    /// A line the plugin logged through the host's `log` import.
    pub(super) fn log_line(&mut self, level: tracing::Level, message: &str) {
        // Same cap as stdout: a plugin must not be able to flood the host's log through
        // the import either.
        if self.logged >= self.max_log_bytes {
            return;
        }
        if level <= tracing::Level::WARN && self.note.is_none() {
            let mut note = message.to_string();
            super::output::truncate_utf8(&mut note, MAX_NOTE_BYTES);
            self.note = Some(note);
        }
        self.logged += message.len();
        let plugin = &self.plugin;
        match level {
            tracing::Level::TRACE => {
                tracing::trace!(target: "plugin", plugin = %plugin, "{message}")
            }
            tracing::Level::DEBUG => {
                tracing::debug!(target: "plugin", plugin = %plugin, "{message}")
            }
            tracing::Level::INFO => tracing::info!(target: "plugin", plugin = %plugin, "{message}"),
            tracing::Level::WARN => tracing::warn!(target: "plugin", plugin = %plugin, "{message}"),
            tracing::Level::ERROR => {
                tracing::error!(target: "plugin", plugin = %plugin, "{message}")
            }
        }
        if self.logged >= self.max_log_bytes {
            tracing::warn!(target: "plugin", plugin = %plugin,
                "log cap of {} bytes reached; further lines dropped", self.max_log_bytes);
        }
    }
}
