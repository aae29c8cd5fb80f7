//! The trainer's settings, resolved: `[train]` together with the run and rollout
//! settings it depends on, converted once by `config` and grouped by the part of a step
//! that reads them. Nothing under `rl/` reads the config file itself.

use super::algorithms::{Critic, Estimator, Overlong, Scale};
use super::optim::{AdamWConfig, lr_at};
use super::update::UpdateConfig;
use crate::model::LoraConfig;

/// One run's training, as the trainer reads it.
#[derive(Debug, Clone)]
pub struct TrainPlan {
    /// Optimizer steps, one rollout batch each.
    pub steps: u64,
    /// The run's seed: the adapter's initialisation, each step's shuffle and dropout, and
    /// the sampler derive from it.
    pub seed: u64,
    /// The adapter a run without one starts with.
    pub lora: LoraConfig,
    pub schedule: Schedule,
    pub optimizer: AdamWConfig,
    pub batches: Batches,
    pub shaping: Shaping,
    pub advantages: Advantages,
    /// On-policy distillation from a teacher (`[distill]`), when the run has one.
    pub distill: Option<Distill>,
    /// How groups sampled as trees are trained (`[rollout.tree]`): their advantages
    /// replace `advantages`' for them.
    pub tree: Option<super::tree_rows::TreeTraining>,
    pub update: UpdateConfig,
    pub eval: EvalPlan,
    pub saves: Saves,
    /// The config's file, for the messages that point at a setting.
    pub source: String,
}

impl TrainPlan {
    /// The room the rollouts really have: `rollout.max_total_tokens` clamped to the
    /// model's context when the model opened. The overlong penalty measures against it,
    /// and so does Dr. GRPO's constant where the config left it to the limit
    /// (`norm_from_limit`, `train.norm_constant = 0`).
    pub fn within_room(&mut self, room: usize, norm_from_limit: bool) {
        if room < self.shaping.max_total_tokens {
            self.shaping.max_total_tokens = room;
            if norm_from_limit {
                self.update.norm_constant = room as f64;
            }
        }
    }
}

/// The learning rate: linear warm-up, then a cosine to `min_lr_ratio · lr`.
#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    pub lr: f64,
    pub warmup_steps: u64,
    pub min_lr_ratio: f64,
}

impl Schedule {
    /// The rate at `step` (0-based) of a run of `total` steps.
    pub fn at(&self, step: u64, total: u64) -> f64 {
        lr_at(step, total, self.warmup_steps, self.lr, self.min_lr_ratio)
    }
}

/// How each step's rollout batch is gathered.
#[derive(Debug, Clone, Copy)]
pub struct Batches {
    /// Prompts (groups) per batch.
    pub prompts: usize,
    /// Finished batches that may wait for the trainer.
    pub queue_capacity: usize,
    /// How many adapter versions rollouts may run ahead of the trainer (0: on-policy).
    pub max_staleness: u64,
    /// DAPO's dynamic sampling: drop groups whose rewards are all equal and sample more
    /// prompts, for up to `max_resample` extra rounds.
    pub dynamic_sampling: bool,
    pub max_resample: usize,
}

/// What is done to the rewards before advantages.
#[derive(Debug, Clone, Copy)]
pub struct Shaping {
    pub overlong: Overlong,
    /// The overlong penalty's ramp, in tokens.
    pub overlong_cache: usize,
    /// The room a trajectory has (`rollout.max_total_tokens`).
    pub max_total_tokens: usize,
    /// β of a KL penalty put in the reward (GRPO with `kl_in_reward`); `None` when the
    /// KL, if any, is in the loss (PPO puts it in its token rewards itself).
    pub kl_penalty: Option<f64>,
}

/// Where advantages come from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Advantages {
    /// The group-baseline family: centred by `estimator`'s baseline, divided by `scale`'s
    /// std plus `eps`.
    Group {
        estimator: Estimator,
        scale: Scale,
        eps: f64,
    },
    /// PPO: GAE over the critic's values, per token (the update computes them).
    Critic(Critic),
}

/// On-policy distillation: each sampled token's advantage gains −coef·(log π_student −
/// log π_teacher) (`rl::distill`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Distill {
    /// α, the weight of the per-token reverse KL.
    pub coef: f64,
    /// Keep the task's group advantages beside the teacher's term (else they are 0, and
    /// the rewards are only reported).
    pub task_reward: bool,
}

/// Held-out evaluation.
#[derive(Debug, Clone, Copy)]
pub struct EvalPlan {
    /// Every this many steps and at the end (0: never).
    pub every: u64,
    /// Held-out prompts per evaluation (0: the whole split).
    pub prompts: usize,
    /// Prompts per rollout call while evaluating.
    pub prompts_per_call: usize,
}

/// Checkpoints.
#[derive(Debug, Clone, Copy)]
pub struct Saves {
    /// Every this many steps (and at the end).
    pub every: u64,
    /// Checkpoints kept; older ones are deleted.
    pub keep_last: usize,
}
