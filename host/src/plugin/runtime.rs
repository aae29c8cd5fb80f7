//! The plugin runtime: one wasmtime `Engine` with its epoch ticker, the `Linker` that
//! offers plugins WASI and the host functions, and the compiled-component cache.

use super::bindings;
use super::cache::ComponentCache;
use super::inspect::{self, LoadError};
use super::plugin::{Plugin, PluginSpec};
use super::sandbox::{EPOCH_TICK, StoreState};
use anyhow::{Context, Result};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use wasmtime::component::Linker;
use wasmtime::{Config, Enabled, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

/// How the engine is built; the same options must be used to reuse cached artifacts.
#[derive(Debug, Clone)]
pub struct RuntimeOptions {
    /// Count fuel in every store. Required if any plugin sets `limits.fuel`; it costs
    /// ~30% per call, so it is off unless asked for.
    pub fuel: bool,
    /// Where compiled components are cached; `None` disables the cache.
    pub cache_dir: Option<PathBuf>,
    /// Reuse instance slots from a pool (see [`pooling`]); on by default.
    pub pooling: bool,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        RuntimeOptions {
            fuel: false,
            cache_dir: None,
            pooling: true,
        }
    }
}

/// The most instances alive at once (sessions across all plugins). A rollout batch of 64
/// prompts × 8 samples holds 512 trigger sessions.
pub const MAX_LIVE_INSTANCES: u32 = 512;

/// The pooling allocator's configuration.
///
/// A fresh session is a fresh instance. wasmtime's default (on-demand) allocator maps each
/// instance's linear memory anew and unmaps it afterwards; the pool keeps slots mapped and
/// reuses them, and with `pagemap_scan` (Linux 6.7+) copies the image back over only the
/// pages the last instance dirtied, so the next one starts with its pages resident. That
/// last part needs the vendored wasmtime's patch (vendor/README.md): 48.0.8 gave up after
/// 32 dirty regions and decommitted the rest, and CPython dirties hundreds. Measured with
/// `cargo bench --bench plugin_calls` (2-core VM): a fresh Python session takes 1 page
/// fault instead of ~430 and costs 0.41 ms (1.34 ms on demand); with its first call,
/// 0.66–0.70 ms (2.2–2.4 ms), against 37–38 ms for a `python3` subprocess doing the
/// same work.
fn pooling(pagemap_scan: bool) -> PoolingAllocationConfig {
    let mut pool = PoolingAllocationConfig::new();
    pool.total_component_instances(MAX_LIVE_INSTANCES)
        // A componentize-py component holds ~10 core instances but one or two memories.
        // Each memory slot reserves 4 GiB of address space (not memory): 4 TiB in all.
        .total_core_instances(16 * MAX_LIVE_INSTANCES)
        .total_memories(2 * MAX_LIVE_INSTANCES)
        .total_tables(4 * MAX_LIVE_INSTANCES)
        .total_stacks(MAX_LIVE_INSTANCES)
        // CPython's function table has tens of thousands of entries.
        .table_elements(200_000);
    if pagemap_scan {
        // Without pagemap_scan, keeping memory resident means a `memset` of the whole
        // kept size at every reuse, which would cost more than the page faults it saves.
        pool.pagemap_scan(Enabled::Yes)
            .linear_memory_keep_resident(64 << 20)
            .table_keep_resident(1 << 20);
    }
    pool
}

/// Shared by every plugin of a run.
pub struct PluginRuntime {
    pub(crate) engine: Engine,
    pub(crate) linker: Linker<StoreState>,
    cache: Option<ComponentCache>,
    pub(crate) fuel: bool,
}

impl PluginRuntime {
    pub fn new(options: &RuntimeOptions) -> Result<Arc<Self>> {
        let mut config = Config::new();
        config.wasm_component_model(true);
        // Calls are made with `call_async` (wasmtime 48 always supports it) so that a
        // plugin waiting in a WASI host call (a sleep, a poll) can be cancelled by dropping
        // its future at the deadline; epoch interruption alone only stops running wasm.
        // Wall-clock deadlines: each store traps once the epoch passes its deadline.
        // ~10% per call, much cheaper than fuel.
        config.epoch_interruption(true);
        config.consume_fuel(options.fuel);
        // wasmtime's default wasm stack (512 KiB) turns unbounded recursion into a
        // stack-overflow trap long before the host's own stack is at risk.
        let engine = if options.pooling {
            // pagemap_scan needs Linux 6.7+; elsewhere the pool still saves the mapping.
            config.allocation_strategy(InstanceAllocationStrategy::Pooling(pooling(true)));
            Engine::new(&config).or_else(|e| {
                tracing::debug!("pooling without pagemap_scan: {e}");
                config.allocation_strategy(InstanceAllocationStrategy::Pooling(pooling(false)));
                Engine::new(&config)
            })
        } else {
            Engine::new(&config)
        }
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        spawn_epoch_ticker(&engine);

        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .context("cannot link WASI")?;
        // `wasi:http` for every plugin: what a request may reach is the plugin's grant
        // (none: every request refused), not whether it imports the interface.
        wasmtime_wasi_http::p2::add_only_http_to_linker_async(&mut linker)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .context("cannot link wasi:http")?;
        bindings::add_to_linker(&mut linker)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .context("cannot link the host functions")?;

        let cache = options
            .cache_dir
            .as_deref()
            .map(|dir| ComponentCache::new(dir, &engine));
        Ok(Arc::new(PluginRuntime {
            engine,
            linker,
            cache,
            fuel: options.fuel,
        }))
    }

    /// Compiles (or loads from the cache) the component at `spec.path`, checks that it
    /// fits this host, and asks it who it is.
    pub async fn load(&self, spec: PluginSpec) -> Result<Plugin> {
        let path = spec.path.clone();
        let wasm = inspect::read_wasm(&path)?;
        let sha256 = hex::encode(Sha256::digest(&wasm));
        let started = Instant::now();
        let (component, cached) = self.compile(&path, &wasm, &sha256)?;
        tracing::debug!(
            "{} {} in {:.0?}",
            if cached { "loaded cached" } else { "compiled" },
            path.display(),
            started.elapsed()
        );
        let shape = inspect::shape(&path, &self.engine, &component)?;
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| LoadError::Invalid {
                path: path.display().to_string(),
                message: format!("cannot link: {e}"),
            })?;
        Plugin::new(
            self.engine.clone(),
            self.fuel,
            spec,
            pre,
            shape,
            sha256,
            wasm.len() as u64,
        )
        .await
    }

    fn compile(
        &self,
        path: &Path,
        wasm: &[u8],
        sha256: &str,
    ) -> Result<(wasmtime::component::Component, bool), LoadError> {
        let compiled = match &self.cache {
            Some(cache) => cache.load_or_compile(&self.engine, wasm, sha256),
            None => wasmtime::component::Component::new(&self.engine, wasm).map(|c| (c, false)),
        };
        compiled.map_err(|e| LoadError::Invalid {
            path: path.display().to_string(),
            message: e.to_string(),
        })
    }
}

/// Advances `engine`'s epoch every [`EPOCH_TICK`] until the engine is dropped. Holding
/// only a weak reference lets the engine (and this thread) go away with the runtime.
fn spawn_epoch_ticker(engine: &Engine) {
    let weak = engine.weak();
    std::thread::Builder::new()
        .name("rlhost-epoch".into())
        .spawn(move || {
            loop {
                std::thread::sleep(EPOCH_TICK);
                match weak.upgrade() {
                    Some(engine) => engine.increment_epoch(),
                    None => break,
                }
            }
        })
        .expect("cannot spawn the epoch ticker thread");
}
