//! The plugin platform: untrusted WebAssembly components behind the versioned
//! `rlhost:plugin` contract (`wit/`), run by wasmtime in a sandbox.
//!
//! - [`runtime`]: the engine, its epoch ticker, the linker and the compile cache.
//! - [`sandbox`]: limits, grants and what each store holds.
//! - [`clock`]: the virtual clocks a plugin reads.
//! - [`plugin`]: a loaded plugin; every guest call goes through it.
//! - `session`: per-trajectory trigger sessions and episodes, dataset and reward handles,
//!   one [`Session`] shape for the four roles.
//! - [`fault`]: typed, counted plugin faults.
//! - [`fork`]: a session forked into another with the same state, by replay.
//! - [`tape`]: an instance's HTTP and `model.generate` answers, recorded for its forks.
//! - [`inspect`]: what a component file is, checked before it runs.
//! - [`http`]: plugins' outbound HTTP (`wasi:http`), sent only as granted.
//! - [`net`]: outbound HTTP grants (`allow_http`) and the check each request passes.
//! - [`model`]: `model.generate`, a plugin asking the run's model as granted.
//! - [`conformance`]: `rlhost plugin test`, the contract checked role by role.
//! - [`scaffold`]: `rlhost plugin new`, a project in Rust, Python, JavaScript or C.
//! - [`bindings`]: generated bindings, one module per WIT version, and the one place
//!   that picks the version a plugin was built against.

pub mod bindings;
pub mod cache;
pub mod clock;
pub mod conformance;
pub mod fault;
pub mod fork;
pub mod http;
pub mod inspect;
pub mod model;
pub mod net;
mod output;
#[allow(clippy::module_inception)]
pub mod plugin;
pub mod runtime;
pub mod sandbox;
pub mod scaffold;
pub mod schema;
mod session;
pub mod tape;
pub mod types;

pub use fault::{Fault, FaultCounts, FaultKind};
pub use fork::ForkError;
pub use inspect::LoadError;
pub use plugin::{Plugin, PluginSpec};
pub use runtime::{PluginRuntime, RuntimeOptions};
pub use sandbox::{DirGrant, Grants, Limits};
pub use session::{
    DatasetSource, EnvironmentEpisode, RewardScorer, Session, ToolsSession, TriggerSession,
};
pub use types::{
    Component, FunctionSpec, Message, PluginInfo, Role, Sample, StepResult, Transcript,
};
