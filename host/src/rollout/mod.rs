//! Rollouts: the sampling engine joined with the plugins.
//!
//! - [`engine`]: group sampling with trigger sessions and environment episodes in the
//!   loop, plugin calls on a worker pool, token-in/token-out.
//! - [`openenv`]: episodes against an OpenEnv server (`[rollout.openenv]`), its
//!   protocol's messages and settings read from [`crate::openenv`].
//! - [`tools`]: native function calling: the run's `tools` plugins, their functions in
//!   the prompt, one turn's calls run and answered as `tool` messages.
//! - [`turns`]: continuing a conversation with the chat template, turn by turn.
//! - [`render`]: a sample's prompt and inserted text as token ids, specials escaped.
//! - [`trajectory`]: what a finished rollout holds (tokens, log-probs, loss mask, spans).
//! - [`reward`]: reward plugins' components, weighted and summed.
//! - [`asks`]: plugins' `model.generate` calls, sampled beside a batch's trajectories.
//! - [`queue`]: the bounded queue between the rollout side and the trainer, with
//!   adapter versions and a staleness bound.

pub mod asks;
pub mod engine;
pub mod eval;
pub mod openenv;
pub mod queue;
pub mod render;
pub mod reward;
pub mod tool_calls;
pub mod tools;
pub mod trajectory;
pub mod turns;

pub use engine::{BatchStats, Engine, RolloutLimits, RolloutSettings};
pub use reward::{RewardSpec, Rewards, Scored};
pub use tools::ToolSpec;
pub use trajectory::{FaultRecord, Group, Span, SpanKind, StopReason, Trajectory};
