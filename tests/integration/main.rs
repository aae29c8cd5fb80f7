//! End-to-end tests with real plugins built from `plugins/`.
//!
//! - `plugins`: each example plugin's behaviour through the real host.
//! - `builtin`: the self-made default model, built small.
//! - `code_tests`: the code-tests reward scoring hostile solutions case by case.
//! - `sandbox`: the hostile suite; every escape or abuse is contained and typed.
//! - `http`: plugins' outbound HTTP through the host's gate to a real loopback server.
//! - `cli`: the `rlhost` binary: `plugin inspect`, `plugin call`, loading errors.
//! - `conformance`: `rlhost plugin test` on every example plugin, in every language.
//! - `scaffold`: `rlhost plugin new` in every language and role: builds, passes the test.
//! - `model_cli`: `rlhost generate` and `rlhost export` on the fixture models.
//! - `rollout`: the rollout engine with the real tools and environments in the loop.
//! - `tools`: native function calling with the real `units` tools plugin: calls run,
//!   answered as `tool` messages token-exactly, malformed ones counted by kind.
//! - `units_task`: the units task's answers are the functions', a small built-in model
//!   learns to call them, `--plugin units.wasm` picks the run.
//! - `data`: the dataset module with a real dataset plugin.
//! - `faults`: remote engines against servers that misbehave, through a fault-injecting
//!   proxy: each fault refused or retried as the book's table says, the server named.
//! - `docs`: the handbook's and the README's links, anchors and includes resolve.
//! - `preference`: `rlhost dpo` on the fixture model: learning, exact resume, bad pairs.
//! - `distill`: on-policy distillation from an `sft`-taught teacher, as an adapter and as
//!   a model folder; teachers that cannot teach named.
//! - `init`: `rlhost init` writes a config that runs, from a model, a data file and plugins.
//! - `install`: `scripts/install.sh` and the installed binary, run outside the checkout.
//! - `openenv`: `rlhost env serve` driven by OpenEnv's own Python client.
//! - `status`: a training run's status endpoint, `rlhost status`, and the dashboard in
//!   a real headless Chromium.

mod builtin;
mod cli;
mod code_task;
mod code_tests;
mod conformance;
mod data;
mod distill;
mod docs;
mod faults;
mod fork;
mod gateway;
mod generate;
mod http;
mod init;
mod install;
mod model_cli;
mod openenv;
mod openenv_train;
mod plugins;
mod preference;
mod rollout;
mod rollout_cli;
mod sandbox;
mod scaffold;
mod server_faults;
mod status;
mod tinker;
mod tools;
mod train_cli;
mod tree;
mod units_task;
mod vllm;

use rlhost::plugin::{Limits, Plugin, PluginRuntime, PluginSpec, RuntimeOptions};
use std::sync::{Arc, OnceLock};

/// A multi-threaded runtime for one test (plugin calls run on its workers while the
/// test's thread decodes).
fn tokio_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// One runtime for all in-process tests (and one with fuel metering), sharing the
/// compile cache with the CLI tests.
fn runtime(fuel: bool) -> Arc<PluginRuntime> {
    static PLAIN: OnceLock<Arc<PluginRuntime>> = OnceLock::new();
    static FUEL: OnceLock<Arc<PluginRuntime>> = OnceLock::new();
    let cell = if fuel { &FUEL } else { &PLAIN };
    cell.get_or_init(|| {
        PluginRuntime::new(&RuntimeOptions {
            fuel,
            cache_dir: Some(rlhost_tests::cache_dir()),
            ..RuntimeOptions::default()
        })
        .expect("plugin runtime")
    })
    .clone()
}

/// Loads plugins/dist/NAME.wasm with these limits.
async fn load_with(name: &str, limits: Limits) -> Plugin {
    runtime(limits.fuel.is_some())
        .load(PluginSpec {
            path: rlhost_tests::plugin(name),
            limits,
            grants: Default::default(),
        })
        .await
        .unwrap_or_else(|e| panic!("cannot load {name}: {e:#}"))
}

async fn load(name: &str) -> Plugin {
    load_with(name, Limits::default()).await
}
