//! Rollouts: the sampling engine joined with the plugins.
//!
//! - [`engine`]: the trajectory state machine: group sampling with what answers turns in
//!   the loop, their calls on a worker pool, token-in/token-out; [`live`] is one
//!   trajectory while it samples, [`start`] how a batch's trajectories start.
//! - [`env`]: the environment seam, what answers a trajectory's turns: trigger and
//!   environment plugins, function calling (`rollout.tools`), an OpenEnv server.
//! - [`settings`]: what the engine needs besides the model; [`stats`]: where a batch's
//!   time went.
//! - [`tool_calls`]: reading the calls a model writes, in each model family's format.
//! - [`turns`]: continuing a conversation with the chat template, turn by turn.
//! - [`render`]: a sample's prompt and inserted text as token ids, specials escaped.
//! - [`trajectory`]: what a finished rollout holds (tokens, log-probs, loss mask, spans).
//! - [`tree`]: tree rollouts' settings and a trajectory's place in its group's tree.
//! - [`reward`]: reward plugins' components, weighted and summed.
//! - [`asks`]: plugins' `model.generate` calls, sampled beside a batch's trajectories.
//! - [`queue`]: the bounded queue between the rollout side and the trainer, with
//!   adapter versions and a staleness bound.

pub mod asks;
pub mod engine;
pub mod env;
pub mod eval;
pub mod live;
pub mod queue;
pub mod render;
pub mod reward;
pub mod settings;
mod start;
pub mod stats;
pub mod tool_calls;
pub mod trajectory;
pub mod tree;
pub mod turns;

pub use engine::Engine;
pub use env::Answerers;
pub use env::tools::ToolSpec;
pub use reward::{RewardSpec, Rewards, Scored};
pub use settings::{RolloutLimits, RolloutSettings};
pub use stats::BatchStats;
pub use trajectory::{FaultRecord, Group, SpanKind, StopReason, TokenSpan, Trajectory};
