//! The rollout side of the trainer: a thread that samples one batch per step, as far
//! ahead of the trainer as `rollout.max_staleness` lets it, and hands each to the trainer
//! through the bounded [`RolloutQueue`].
//!
//! With `train.dynamic_sampling` (DAPO), groups whose rewards are all equal teach nothing
//! and are dropped, and more prompts are sampled for up to `train.max_resample` extra
//! rounds.

use super::algorithms;
use super::plan::TrainPlan;
use crate::data::{Cursor, Dataset};
use crate::model::lora::AdapterSnapshot;
use crate::model::{LanguageModel, Mode};
use crate::rollout::queue::RolloutQueue;
use crate::rollout::{BatchStats, Engine, Group, Rewards, RolloutSettings};
use crate::sampler::decode::sample_seed;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use tokio::runtime::Handle;

/// What a run samples with: its data, how rollouts run, and how they are scored (the
/// config side opens them). The model goes beside them: the trainer first attaches or
/// restores its adapter.
#[derive(Clone, Copy)]
pub struct Sources<'a> {
    pub dataset: &'a Dataset,
    pub settings: &'a RolloutSettings,
    pub rewards: &'a Rewards,
    /// With `[gateway]`: batches come from the sessions of agents calling it.
    pub gateway: Option<&'a crate::gateway::train::Link>,
    /// With `[distill]`: the teacher whose log-probs the learner reads.
    pub teacher: Option<&'a super::distill::Teacher>,
}

impl Sources<'_> {
    /// The plugins a rollout calls (trigger, environment, tools, rewards), each once.
    pub fn plugins(&self) -> Vec<&crate::plugin::Plugin> {
        let s = &self.settings.env;
        let mut all: Vec<&crate::plugin::Plugin> = s
            .trigger
            .iter()
            .chain(&s.environment)
            .map(|t| &t.plugin)
            .chain(
                s.tools
                    .iter()
                    .flat_map(|t| t.plugins.iter().map(|p| &p.plugin)),
            )
            .chain(self.rewards.fns.iter().map(|f| f.plugin()))
            .collect();
        // The same plugin may play several parts; two config sections of one file are
        // two plugins (each its own grants), so identity is the plugin, not its name.
        let mut seen = std::collections::HashSet::new();
        all.retain(|p| seen.insert(std::ptr::from_ref(p.http())));
        all
    }
}

/// A rollout batch as the producer hands it over.
pub struct Batch {
    pub step: u64,
    pub groups: Vec<Group>,
    /// Groups dynamic sampling dropped.
    pub dropped: usize,
    pub stats: BatchStats,
    /// The data position after this batch (what a checkpoint after it records).
    pub cursor: Cursor,
}

/// The adapter the producer samples with: the trainer publishes a snapshot of each new
/// version here before it lets the producer use it (see [`AdapterSnapshot`]).
pub struct AdapterBoard(Mutex<Arc<AdapterSnapshot>>);

impl AdapterBoard {
    pub fn new(first: AdapterSnapshot) -> AdapterBoard {
        AdapterBoard(Mutex::new(Arc::new(first)))
    }

    pub fn publish(&self, snapshot: AdapterSnapshot) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Arc::new(snapshot);
    }

    /// The newest snapshot.
    pub fn latest(&self) -> Arc<AdapterSnapshot> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Where the producer starts and what it reports to.
pub struct ProducerOptions<'a> {
    /// The first step to sample, and the data position before it.
    pub step: u64,
    pub cursor: Cursor,
    /// Counts each batch's finished trajectories.
    pub bar: Option<indicatif::ProgressBar>,
    /// Set when the run is interrupted: the batch in flight is abandoned.
    pub cancel: Option<&'a AtomicBool>,
    /// Where the trainer publishes each adapter version.
    pub adapters: &'a AdapterBoard,
}

/// Samples batches into `queue` until it closes or sampling fails (the trainer then sees
/// the error at its next `pop`).
pub fn produce(
    lm: &LanguageModel,
    sources: Sources,
    plan: &TrainPlan,
    queue: &RolloutQueue<Batch>,
    options: ProducerOptions,
    handle: &Handle,
) {
    if let Some(link) = sources.gateway {
        return from_gateway(lm, link, sources, plan, queue, options, handle);
    }
    let mut engine = match Engine::new(lm, sources.settings, sources.rewards, handle.clone()) {
        Ok(e) => e,
        Err(e) => {
            queue.fail(format!("{e:#}"));
            return;
        }
    };
    if let Some(bar) = options.bar {
        engine.set_progress(bar);
    }
    if let Some(flag) = options.cancel {
        engine.set_cancel(flag);
    }
    let b = &plan.batches;
    let mut cursor = options.cursor;
    let _ = queue.produce(options.step, |step, version| {
        // One snapshot for the whole batch (all resampling rounds): every trajectory is
        // labelled with the version it was sampled with, and is that version throughout.
        let adapter = options.adapters.latest();
        debug_assert!(adapter.version >= version);
        let mode = Mode {
            adapter: Some(&adapter),
            ..Mode::INFERENCE
        };
        let mut batch = Batch {
            step,
            groups: Vec::new(),
            dropped: 0,
            stats: BatchStats::default(),
            cursor,
        };
        for round in 0..=b.max_resample {
            let want = b.prompts - batch.groups.len();
            let samples = handle.block_on(sources.dataset.next_batch(&mut cursor, want))?;
            let seed = sample_seed(plan.seed, step as usize, round);
            let (got, stats) = engine.run(&samples, seed, adapter.version, mode)?;
            batch.stats.add(&stats);
            let (kept, dropped) = keep_groups(got, b.dynamic_sampling);
            batch.groups.extend(kept);
            batch.dropped += dropped;
            if !b.dynamic_sampling || batch.groups.len() >= b.prompts {
                break;
            }
        }
        batch.cursor = cursor;
        Ok(batch)
    });
}

/// [`produce`] for a `[gateway]` run: each batch is the next `prompts` task groups the
/// agents finish, sampled by the newest adapter the trainer published.
fn from_gateway(
    lm: &LanguageModel,
    link: &crate::gateway::train::Link,
    sources: Sources,
    plan: &TrainPlan,
    queue: &RolloutQueue<Batch>,
    options: ProducerOptions,
    handle: &Handle,
) {
    let b = &plan.batches;
    // Tasks go on where the checkpoint left the data (a batch's cursor is how far the
    // tasks handed out by then went).
    link.start_tasks(options.cursor);
    let _ = queue.produce(options.step, |step, version| {
        let adapter = options.adapters.latest();
        debug_assert!(adapter.version >= version);
        let mode = Mode {
            adapter: Some(&adapter),
            ..Mode::INFERENCE
        };
        let taken = link.take(
            lm,
            mode,
            adapter.version,
            b.prompts,
            b.max_staleness,
            sources.rewards,
            handle,
            &|| {
                queue.is_closed()
                    || options
                        .cancel
                        .is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
            },
        )?;
        if let Some(bar) = &options.bar {
            bar.set_length(taken.stats.trajectories as u64);
            bar.set_position(taken.stats.trajectories as u64);
        }
        let (groups, dropped) = keep_groups(taken.groups, b.dynamic_sampling);
        Ok(Batch {
            step,
            groups,
            dropped,
            stats: taken.stats,
            cursor: link.tasks_cursor(handle),
        })
    });
}

/// The groups worth training on, and how many were dropped: with dynamic sampling, only
/// groups whose rewards differ (an equal-reward group has zero advantages everywhere).
fn keep_groups(groups: Vec<Group>, dynamic_sampling: bool) -> (Vec<Group>, usize) {
    if !dynamic_sampling {
        return (groups, 0);
    }
    let n = groups.len();
    let kept: Vec<Group> = groups
        .into_iter()
        .filter(|g| {
            let rewards: Vec<f64> = g.trajectories.iter().map(|t| t.reward).collect();
            algorithms::informative(&rewards)
        })
        .collect();
    let dropped = n - kept.len();
    (kept, dropped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rl::learn::tests::trajectory;

    fn group(rewards: &[f64]) -> Group {
        Group {
            sample_id: 0,
            trajectories: rewards.iter().map(|&r| trajectory(r, 1, &[])).collect(),
        }
    }

    #[test]
    fn dynamic_sampling_drops_groups_whose_rewards_are_equal() {
        let groups = || vec![group(&[1.0, 0.0]), group(&[1.0, 1.0]), group(&[0.0, 0.0])];
        let (kept, dropped) = keep_groups(groups(), true);
        assert_eq!((kept.len(), dropped), (1, 2));
        assert_eq!(kept[0].trajectories[1].reward, 0.0);
        let (kept, dropped) = keep_groups(groups(), false);
        assert_eq!((kept.len(), dropped), (3, 0));
    }
}
