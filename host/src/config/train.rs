//! `[train]` as the user wrote it and its checks; [`super::plan`] turns it into the
//! trainer's plan.

use crate::rl::algorithms::{
    Aggregation, Algorithm, Critic, Estimator, KlEstimator, Overlong, Scale,
};
use crate::rl::update::OldLogps;
use serde::{Deserialize, Serialize};

/// `[train]`.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSection {
    /// `grpo`: the group-baseline family (`estimator` says which); `ppo`: a value head
    /// and GAE over token rewards.
    pub algorithm: Algorithm,
    /// Optimizer steps (one rollout batch each).
    pub steps: u64,
    /// The peak learning rate of AdamW (the adapter's parameters).
    pub lr: f64,
    /// Steps of linear warm-up from 0 to `lr` before the cosine decay.
    pub warmup_steps: u64,
    /// The cosine schedule ends at `min_lr_ratio · lr`.
    pub min_lr_ratio: f64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// Clip the gradient's global norm to this (0: no clipping).
    pub max_grad_norm: f64,
    /// Passes over each rollout batch (`updates_per_batch` is its former name).
    #[serde(alias = "updates_per_batch")]
    pub epochs_per_batch: usize,
    /// Optimizer steps per pass: the batch is shuffled (seeded by run seed and step) into
    /// this many nearly equal mini-batches.
    pub mini_batches: usize,
    /// The ratio's denominator when a batch takes more than one step: `recompute` (a
    /// forward pass before the first step) or `sampler` (the log-probs the sampler kept).
    pub old_logps: OldLogps,
    /// Tokens per forward/backward pass; a mini-batch is split into micro-batches of
    /// at most this many (gradients accumulate), the memory knob of the update.
    pub micro_batch_tokens: usize,
    /// Pack trajectories into the rows of a micro-batch one after another (attention
    /// keeps them apart, positions start again at each) instead of padding each to the
    /// longest: fewer tokens a step where lengths vary, the same update to rounding.
    pub pack_sequences: bool,
    /// Recompute each layer's activations in the backward instead of keeping them: about
    /// a third more compute for most of the step's activation memory.
    pub gradient_checkpointing: bool,
    /// The advantage estimator of `algorithm = "grpo"` (the choices and their formulas
    /// are listed; TRL's and RL2's names for them are in the book).
    pub estimator: Estimator,
    /// What the baseline-centred rewards are divided by: `group` std, `batch` std or
    /// `none` (default: the estimator's own, `group` for grpo and `none` for the others).
    #[schemars(example = &"batch")]
    pub scale_rewards: Option<Scale>,
    /// Added to the std before dividing (TRL's 1e-4).
    pub adv_eps: f64,
    /// The ratio's lower clip is `1 − clip_low` (PPO/GRPO's ε; DAPO decouples the two).
    pub clip_low: f64,
    /// The ratio's upper clip is `1 + clip_high` (DAPO's clip-higher: larger than
    /// `clip_low`).
    pub clip_high: f64,
    /// How per-token losses become the batch's loss (the choices are listed).
    pub aggregation: Aggregation,
    /// Dr. GRPO's constant for `seq-mean-token-sum-norm` (0: rollout.max_total_tokens).
    pub norm_constant: f64,
    /// The KL penalty's weight β against the reference (the model without the adapter);
    /// 0: no reference pass at all.
    pub kl_coef: f64,
    /// The KL estimator in the loss (k3, TRL's and RL2's loss default).
    pub kl_estimator: KlEstimator,
    /// The KL estimator in the reward when `kl_in_reward` (k1, as RL2, TRL's RLOO and
    /// verl put in the reward).
    pub kl_reward_estimator: KlEstimator,
    /// Put the KL penalty in the reward (r − β·Σ_t KL_t, component `kl_penalty`, before
    /// advantages) instead of the loss.
    pub kl_in_reward: bool,
    /// DAPO: drop groups whose rewards are all equal and sample more prompts.
    pub dynamic_sampling: bool,
    /// Extra rollout rounds dynamic sampling may take per step.
    pub max_resample: usize,
    /// What to do with trajectories a length limit cut off: `none`, `filter` (not
    /// trained on) or `penalty` (DAPO's soft overlong punishment, component `overlong`).
    pub overlong: Overlong,
    /// The penalty's ramp, in tokens before `sampling.max_new_tokens`.
    pub overlong_cache: usize,
    /// The cap of the truncated importance weights min(e^{old − sampler}, cap) that
    /// correct stale rows (`rollout.max_staleness` > 0) when `old_logps = "recompute"`
    /// and `rollout_correction = "none"` (`token_tis` caps at `rollout_correction_cap`).
    pub tis_cap: f64,
    /// How the update corrects for the sampler's log-probs differing from the trainer's
    /// (another engine, as vLLM, or other kernels): `none`, `token_tis` (truncated
    /// per-token importance weights) or `seq_mis` (sequences whose ratio leaves
    /// [rollout_correction_min, rollout_correction_cap] are masked).
    pub rollout_correction: CorrectionKind,
    /// `seq_mis`: sequences whose sampler/trainer ratio is above this are masked;
    /// `token_tis`: the weights' cap.
    pub rollout_correction_cap: f64,
    /// `seq_mis`: sequences whose sampler/trainer ratio is below this are masked.
    pub rollout_correction_min: f64,
    /// PPO: GAE's discount γ and λ.
    pub gamma: f64,
    /// PPO: GAE's λ (the bias/variance trade of the advantage).
    pub lam: f64,
    /// PPO: the value loss's weight (the critic trains through the shared adapter).
    pub vf_coef: f64,
    /// PPO: how far a value may move from the old value before its loss is clipped.
    pub value_clip: f64,
    /// PPO: whiten advantages over the batch's action tokens.
    pub whiten_advantages: bool,
    /// PPO: the critic trains through the policy's adapter (`shared`) or one of its own
    /// (`separate`: a second forward pass per micro-batch).
    pub critic: Critic,
    /// Evaluate on the held-out split every this many steps and at the end (0: never):
    /// greedy, one sample per prompt, with the run's tools and rewards. Adds
    /// `eval_accuracy`, `eval_reward` and `eval_tool_use` to that step's metrics.
    pub eval_every: u64,
    /// Held-out prompts per evaluation (0: the whole split).
    pub eval_prompts: usize,
    /// Write a checkpoint every this many steps (and at the end).
    pub save_every: u64,
    /// Checkpoints kept; older ones are deleted once a newer one is written.
    pub keep_last: usize,
}

impl TrainSection {
    /// The advantages' scale: the one set, else the estimator's own.
    pub fn scale(&self) -> Scale {
        self.scale_rewards
            .unwrap_or_else(|| self.estimator.default_scale())
    }

    /// What makes a training run unable to learn from the start, refused before it
    /// starts: a group-baseline estimator with one trajectory per prompt (each is its own
    /// baseline, so every advantage is 0).
    pub fn check_learnable(&self, group_size: usize) -> std::result::Result<(), String> {
        if self.algorithm == Algorithm::Grpo
            && group_size < 2
            && matches!(
                self.estimator,
                Estimator::Grpo | Estimator::DrGrpo | Estimator::Rloo
            )
        {
            let name = match self.estimator {
                Estimator::Grpo => "grpo",
                Estimator::DrGrpo => "dr-grpo",
                _ => "rloo",
            };
            return Err(format!(
                "rollout.group_size = {group_size} with train.estimator = \"{name}\": a group of one trajectory is its own baseline, so every advantage is 0 and the run cannot learn; set rollout.group_size to 2 or more, or train with one sample per prompt using estimator = \"reinforce\" (the batch mean as baseline) or algorithm = \"ppo\" (a critic)"
            ));
        }
        Ok(())
    }

    /// What serde and the ranges cannot check: settings that contradict each other or
    /// the rollout batch of `batch` trajectories.
    pub fn check(&self, batch: usize) -> std::result::Result<(), String> {
        let scale = format!("{:?}", self.scale()).to_lowercase();
        if self.algorithm == Algorithm::Ppo && self.scale_rewards.is_some() {
            return Err(format!(
                "train.scale_rewards = \"{scale}\" with algorithm = \"ppo\": PPO's advantages come from the critic (whiten them with whiten_advantages); drop scale_rewards"
            ));
        }
        if self.algorithm == Algorithm::Grpo
            && self.estimator == Estimator::DrGrpo
            && self.scale() != Scale::None
        {
            return Err(format!(
                "train.estimator = \"dr-grpo\" with scale_rewards = \"{scale}\": Dr. GRPO is GRPO without the std; use estimator = \"grpo\" to divide by it, or drop scale_rewards"
            ));
        }
        if self.rollout_correction != CorrectionKind::None {
            if self.old_logps == OldLogps::Sampler {
                return Err(
                    "train.rollout_correction with old_logps = \"sampler\": the ratio would compare the sampler's log-probs with themselves; use old_logps = \"recompute\"".into(),
                );
            }
            if !(self.rollout_correction_cap >= 1.0 && self.rollout_correction_cap.is_finite()) {
                return Err("train.rollout_correction_cap must be a number of at least 1".into());
            }
            if !(0.0..=1.0).contains(&self.rollout_correction_min) {
                return Err("train.rollout_correction_min must be in [0, 1]".into());
            }
        }
        if self.mini_batches > batch {
            return Err(format!(
                "train.mini_batches = {} is more than the {batch} trajectories of a rollout batch (rollout.prompts_per_step × group_size); lower it",
                self.mini_batches
            ));
        }
        Ok(())
    }
}

/// `train.rollout_correction`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CorrectionKind {
    None,
    TokenTis,
    SeqMis,
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection {
            algorithm: Algorithm::Grpo,
            steps: 100,
            lr: 1e-5,
            warmup_steps: 0,
            min_lr_ratio: 0.0,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            epochs_per_batch: 1,
            mini_batches: 1,
            old_logps: OldLogps::Recompute,
            micro_batch_tokens: 4096,
            pack_sequences: false,
            gradient_checkpointing: false,
            estimator: Estimator::Grpo,
            scale_rewards: None,
            adv_eps: 1e-4,
            clip_low: 0.2,
            clip_high: 0.28,
            aggregation: Aggregation::TokenMean,
            norm_constant: 0.0,
            kl_coef: 0.0,
            kl_estimator: KlEstimator::K3,
            kl_reward_estimator: KlEstimator::K1,
            kl_in_reward: false,
            dynamic_sampling: false,
            max_resample: 2,
            overlong: Overlong::None,
            overlong_cache: 0,
            tis_cap: 2.0,
            rollout_correction: CorrectionKind::None,
            // TRL's vllm_importance_sampling_cap default.
            rollout_correction_cap: 2.0,
            rollout_correction_min: 0.0,
            // TRL's PPO defaults.
            gamma: 1.0,
            lam: 0.95,
            vf_coef: 0.1,
            value_clip: 0.2,
            whiten_advantages: true,
            critic: Critic::Shared,
            eval_every: 0,
            eval_prompts: 64,
            save_every: 10,
            keep_last: 3,
        }
    }
}
