//! Held-out evaluation: the same rollouts as training (tools, environments, rewards), on
//! the eval split, summarised as accuracy, tool-use rate, malformed function calls and
//! rewards. Used by
//! `rlhost eval` and by the trainer every `train.eval_every` steps.

use super::{Engine, Trajectory};
use crate::model::Mode;
use crate::sampler::decode::sample_seed;
use crate::task::Sample;
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What an evaluation measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EvalReport {
    pub prompts: usize,
    pub trajectories: usize,
    /// Mean of the `correct` reward component, when a reward gives one.
    pub accuracy: Option<f64>,
    /// Share of trajectories with at least one tool call.
    pub tool_use_rate: f64,
    /// Share of function calls (`rollout.tools`) that were malformed; `None` without any.
    #[serde(default)]
    pub malformed_call_rate: Option<f64>,
    pub reward_mean: f64,
    pub rewards: BTreeMap<String, f64>,
    pub response_tokens: f64,
    pub wall_s: f64,
}

/// Rolls out `samples` in batches of `per_batch` prompts with `engine` (whose settings
/// say how many samples per prompt and at what temperature); `on_batch(done, total)`
/// after each batch. Seeds depend on `seed` and the batch index only, so the same
/// adapter gives the same report.
pub fn evaluate(
    engine: &Engine,
    samples: &[(u64, Sample)],
    per_batch: usize,
    seed: u64,
    mode: Mode,
    mut on_batch: impl FnMut(usize, usize),
) -> Result<(EvalReport, Vec<Trajectory>)> {
    let t0 = std::time::Instant::now();
    let mut all = Vec::new();
    let per = per_batch.max(1);
    for (b, batch) in samples.chunks(per).enumerate() {
        let (groups, _) = engine.run(batch, sample_seed(seed, b, usize::MAX - 1), 0, mode)?;
        all.extend(groups.into_iter().flat_map(|g| g.trajectories));
        on_batch((b * per + batch.len()).min(samples.len()), samples.len());
    }
    let n = all.len().max(1) as f64;
    let rewards = super::trajectory::component_means(all.iter());
    let report = EvalReport {
        prompts: samples.len(),
        trajectories: all.len(),
        accuracy: rewards.get("correct").copied(),
        tool_use_rate: all.iter().filter(|t| t.tool_calls > 0).count() as f64 / n,
        malformed_call_rate: super::env::tools::malformed_rate(
            all.iter().flat_map(|t| &t.call_kinds),
        ),
        reward_mean: all.iter().map(|t| t.reward).sum::<f64>() / n,
        response_tokens: all.iter().map(|t| t.sampled_tokens() as f64).sum::<f64>() / n,
        rewards,
        wall_s: t0.elapsed().as_secs_f64(),
    };
    Ok((report, all))
}
