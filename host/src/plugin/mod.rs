//! The plugin platform: untrusted WebAssembly components behind the versioned
//! `rlhost:plugin` contract (`wit/`), run by wasmtime in a sandbox.
//!
//! - [`runtime`]: the engine, its epoch ticker, the linker and the compile cache.
//! - [`sandbox`]: limits, grants and what each store holds.
//! - [`plugin`]: a loaded plugin and its per-trajectory sessions.
//! - [`fault`]: typed, counted plugin faults.
//! - [`inspect`]: what a component file is, checked before it runs.
//! - [`bindings`]: generated bindings, one module per WIT version.

pub mod bindings;
pub mod cache;
pub mod fault;
pub mod inspect;
mod output;
#[allow(clippy::module_inception)]
pub mod plugin;
pub mod runtime;
pub mod sandbox;
pub mod types;

pub use fault::{Fault, FaultCounts, FaultKind};
pub use inspect::LoadError;
pub use plugin::{
    DatasetSource, EnvironmentEpisode, Plugin, PluginSpec, RewardScorer, TriggerSession,
};
pub use runtime::{PluginRuntime, RuntimeOptions};
pub use sandbox::{DirGrant, Grants, Limits};
pub use types::{Component, Message, PluginInfo, Role, Sample, StepResult, Trajectory};
