//! The record of one training step, as the trainer publishes it: a line of
//! `metrics.jsonl`, and what the status server, Prometheus and TensorBoard show. A neutral
//! module that both sides read, so that status never imports the trainer.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A step's trees: their mean leaves and depth, and the forks their branches took.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TreeFigures {
    /// Trajectories per prompt (its tree's leaves), mean over the batch.
    pub leaves: f64,
    /// Branch points on a trajectory's path, mean over the trajectories.
    pub depth: f64,
    pub branch_points: u64,
    /// With `branch_at = "entropy"`: branch points measured, whether or not they branched.
    #[serde(default)]
    pub probes: u64,
    /// Sessions forked for branches, those that failed (their branches ended there),
    /// and the seconds the forks took (summed; on the worker pool).
    pub forks: u64,
    pub fork_failures: u64,
    pub fork_s: f64,
    /// Deferred forks replayed at a branch's first call to the forked session, and the
    /// seconds those replays took (inside the calls).
    #[serde(default)]
    pub replays: u64,
    #[serde(default)]
    pub replay_s: f64,
}

/// One step's figures, one line of `metrics.jsonl`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: u64,
    pub epoch: u64,
    pub adapter_version: u64,
    pub reward_mean: f64,
    pub reward_std: f64,
    /// Mean of each reward component.
    pub rewards: BTreeMap<String, f64>,
    /// Mean of the `correct` component when a reward gives one.
    pub accuracy: Option<f64>,
    pub loss: f64,
    pub policy_loss: f64,
    pub kl: f64,
    pub entropy: f64,
    pub clip_fraction: f64,
    /// Mean per-token KL of the policy before the batch's first step to the policy at
    /// each step (k3): how far the batch's epochs and mini-batches moved it.
    #[serde(default)]
    pub approx_kl: f64,
    /// The sampler's log-probs against the trainer's before the update (vLLM or another
    /// kernel): mean k3 KL, mean |difference| and the largest token ratio over trained
    /// tokens. `None` where the sampler's log-probs stand in for a recomputation.
    #[serde(default)]
    pub rollout_kl: Option<f64>,
    #[serde(default)]
    pub rollout_logp_diff: Option<f64>,
    #[serde(default)]
    pub rollout_max_ratio: Option<f64>,
    /// With vLLM servers: seconds this step's batch spent writing its adapter version and
    /// loading it on the servers.
    #[serde(default)]
    pub adapter_load_s: Option<f64>,
    /// With vLLM servers: requests of this step's batch sent again after a fault the
    /// server got over or not (a 5xx, a reset connection, a malformed answer).
    #[serde(default)]
    pub vllm_retries: Option<u64>,
    /// On-policy distillation: the mean per-token reverse KL to the teacher over the
    /// sampled tokens, log π_student − log π_teacher (the student's log-probs as sampled).
    #[serde(default)]
    pub teacher_kl: Option<f64>,
    /// PPO: the critic's mean per-token clipped value loss.
    #[serde(default)]
    pub value_loss: Option<f64>,
    /// Tokens this step's batch sampled, each once (a tree's shared segment counts
    /// once): what learning is measured against when groups differ in shape.
    #[serde(default)]
    pub sampled_tokens: u64,
    /// Tree rollouts (`[rollout.tree]`): the shape of this step's trees and what forking
    /// cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tree: Option<TreeFigures>,
    pub grad_norm: f64,
    /// Optimizer steps the update took. A mini-batch with nothing to learn from (every
    /// advantage 0, and no KL, value or distillation term) takes none, so that the adapter
    /// does not drift on AdamW's momentum when there is nothing to learn.
    #[serde(default)]
    pub optimizer_steps: usize,
    pub lr: f64,
    pub response_tokens: f64,
    pub turns: f64,
    pub tool_calls: f64,
    pub truncated: f64,
    pub groups: usize,
    pub groups_dropped: usize,
    /// Groups trained on whose rewards were all equal: every advantage 0, nothing learned
    /// from them (a run whose groups are mostly flat has no signal; see `groups_dropped`).
    #[serde(default)]
    pub groups_flat: usize,
    pub trajectories: usize,
    /// Faults in this step's rollouts, `plugin/kind` → count.
    pub faults: BTreeMap<String, u64>,
    /// Function calls (`rollout.tools`) in this step's rollouts by how they went: `ok`,
    /// `tool_error`, `fault`, or a malformed call's kind (`bad_json`, `no_name`,
    /// `bad_arguments`, `unclosed`, `unknown_function`, `invalid_arguments`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub function_calls: BTreeMap<String, u64>,
    /// The share of the step's function calls that were malformed (`None` without any).
    #[serde(default)]
    pub malformed_call_rate: Option<f64>,
    /// Plugins' outbound HTTP since the previous step's record (rollouts, scoring and
    /// held-out evaluation alike), `plugin/outcome` → count: `answered`, `denied` (a grant,
    /// an address or the in-flight cap), `failed`. Every plugin with an `allow_http` grant,
    /// and any other once it has tried.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub http_requests: BTreeMap<String, u64>,
    /// Plugins' `model.generate` calls of the step's batch (its trajectories' sessions and
    /// scoring), `plugin/outcome` → count: `answered`, `refused` (outside the grant),
    /// `failed` (the model could not answer). Every plugin with a `generate` grant (zeros
    /// included), and any other that tried.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub generate_calls: BTreeMap<String, u64>,
    /// Seconds each plugin's calls of the step's batch waited for their answers, summed
    /// (calls overlap one another and the decoding), by plugin name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub generate_wait_s: BTreeMap<String, f64>,
    /// The calls the step's batch answered, the tokens sampled for them (never trained
    /// on) and the decoding time spent on them alone (local engine; see `BatchStats`).
    #[serde(default)]
    pub generate_answered: u64,
    #[serde(default)]
    pub generate_tokens: u64,
    #[serde(default)]
    pub generate_s: f64,
    pub sampled_tokens_per_s: f64,
    /// Seconds the decoder sat idle while sampling this step's batch because every live
    /// trajectory waited on a tool or environment call.
    #[serde(default)]
    pub tool_wait_s: f64,
    /// `tool_wait_s` over the batch's sampling time: the tools' share of the critical path.
    #[serde(default)]
    pub tool_wait_share: f64,
    /// Seconds the batch's tool and environment calls took (trigger firings, function
    /// calls, environment steps; not scoring), summed (they overlap one another and the
    /// decoding): over `tool_calls` × trajectories, the time of one call.
    #[serde(default)]
    pub tool_busy_s: f64,
    /// Seconds the trainer waited for this step's batch: rollouts are sampled while it
    /// updates and evaluates, so this is what sampling did not hide, not the batch's
    /// sampling time (`sampled_tokens_per_s` gives that).
    pub rollout_s: f64,
    pub update_s: f64,
    pub step_s: f64,
    /// Held-out figures, on the steps `train.eval_every` evaluates.
    pub eval_accuracy: Option<f64>,
    pub eval_reward: Option<f64>,
    pub eval_tool_use: Option<f64>,
    /// Held-out share of malformed function calls (with `rollout.tools`).
    #[serde(default)]
    pub eval_malformed_call_rate: Option<f64>,
    pub eval_s: Option<f64>,
}
