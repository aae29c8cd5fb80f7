//! Where a run is ([`Phase`]): loading, warm start, rollout, update, evaluation, done or
//! failed, as the status endpoint and the metrics report it.

use serde::{Deserialize, Serialize};

/// Where a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Reading the config, loading the model and plugins.
    Loading,
    /// Building the built-in model and its supervised warm start.
    WarmStart,
    /// The trainer waits for the step's rollouts.
    Rollout,
    /// The trainer computes advantages and updates the adapter.
    Update,
    Eval,
    Done,
    Failed,
}

impl Phase {
    pub const ALL: [Phase; 7] = [
        Phase::Loading,
        Phase::WarmStart,
        Phase::Rollout,
        Phase::Update,
        Phase::Eval,
        Phase::Done,
        Phase::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Loading => "loading",
            Phase::WarmStart => "warm-start",
            Phase::Rollout => "rollout",
            Phase::Update => "update",
            Phase::Eval => "eval",
            Phase::Done => "done",
            Phase::Failed => "failed",
        }
    }
}
