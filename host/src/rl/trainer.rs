//! The GRPO-family trainer: rollouts → rewards → advantages → update, step after step.
//!
//! How this trainer simplifies the textbook (nanochat's habit of saying so up front):
//! - One process: the rollout producer (a thread) and the trainer share the model; after
//!   each update the trainer publishes a snapshot of the adapter, and the producer samples
//!   each batch from one snapshot (so a batch is exactly the version it is labelled with,
//!   while the optimizer writes the live adapter).
//! - The reference policy is the same weights with adapters off: no second model.
//! - With `max_staleness = 0` (the default) step s trains on rollouts sampled by the
//!   adapter of step s exactly (ratio 1 on the first pass); larger values let the
//!   producer run ahead and the update corrects with truncated importance sampling.
//! - Every seed is derived from (run seed, step), so a resumed run takes the same next
//!   step as an uninterrupted one.

use super::algorithms::{Aggregation, Estimator, KlEstimator, Scale};
use super::checkpoint::{self, TrainerState};
use super::learn::Learner;
use super::optim::{AdamW, AdamWConfig};
use super::producer::{self, AdapterBoard, Batch, ProducerOptions};
use super::progress::Progress;
use super::run_log::RunLog;
use super::update::{OldLogps, PpoConfig, UpdateConfig};
use super::value_head::ValueHead;
use crate::config::setup::Setup;
use crate::data::Cursor;
use crate::model::lora::AdapterSnapshot;
use crate::model::sample::SamplingParams;
use crate::rollout::engine::ABANDONED;
use crate::rollout::eval::{EvalReport, evaluate};
use crate::rollout::queue::RolloutQueue;
use crate::rollout::{Engine, RolloutSettings};
use crate::sample::Sample;
use crate::status::{EvalPoint, Phase, StatusHub};
use crate::step::StepMetrics;
use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::runtime::Handle;

/// `[train]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSection {
    /// `grpo`: the group-baseline family (`estimator` says which); `ppo`: a value head
    /// and GAE over token rewards.
    pub algorithm: Algorithm,
    /// Optimizer steps (one rollout batch each).
    pub steps: u64,
    pub lr: f64,
    pub warmup_steps: u64,
    /// The cosine schedule ends at `min_lr_ratio · lr`.
    pub min_lr_ratio: f64,
    pub weight_decay: f64,
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
    pub micro_batch_tokens: usize,
    /// Recompute each layer's activations in the backward instead of keeping them: about
    /// a third more compute for most of the step's activation memory.
    pub gradient_checkpointing: bool,
    pub estimator: Estimator,
    /// What the baseline-centred rewards are divided by: `group` std, `batch` std or
    /// `none` (default: the estimator's own, `group` for grpo and `none` for the others).
    pub scale_rewards: Option<Scale>,
    /// Added to the std before dividing (TRL's 1e-4).
    pub adv_eps: f64,
    pub clip_low: f64,
    pub clip_high: f64,
    pub aggregation: Aggregation,
    /// Dr. GRPO's constant for `seq-mean-token-sum-norm` (0: rollout.max_total_tokens).
    pub norm_constant: f64,
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
    pub tis_cap: f64,
    /// PPO: GAE's discount γ and λ.
    pub gamma: f64,
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
    pub keep_last: usize,
}

impl TrainSection {
    /// The advantages' scale: the one set, else the estimator's own.
    pub fn scale(&self) -> Scale {
        self.scale_rewards
            .unwrap_or_else(|| self.estimator.default_scale())
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
        if self.mini_batches > batch {
            return Err(format!(
                "train.mini_batches = {} is more than the {batch} trajectories of a rollout batch (rollout.prompts_per_step × group_size); lower it",
                self.mini_batches
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Algorithm {
    Grpo,
    Ppo,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Critic {
    Shared,
    Separate,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Overlong {
    None,
    Filter,
    Penalty,
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

/// Where and how one `rlhost train` invocation runs.
pub struct RunOptions<'a> {
    /// The run directory (metrics, checkpoints, TensorBoard files).
    pub out_dir: &'a Path,
    /// A checkpoint to continue from.
    pub resume: Option<&'a Path>,
    /// End this invocation early after this many steps (with a checkpoint).
    pub stop_after: Option<u64>,
    pub quiet: bool,
    /// What the status server shows.
    pub hub: &'a StatusHub,
    /// Set by SIGINT/SIGTERM: the step in flight is finished (or, while its rollouts are
    /// still being sampled, abandoned), a checkpoint is written, and the run ends.
    pub interrupt: Option<&'a AtomicBool>,
}

/// How a `train` call ended.
#[derive(Debug, Default)]
pub struct Outcome {
    /// The metrics of the steps this call took.
    pub metrics: Vec<StepMetrics>,
    /// Ended early by an interruption (after a checkpoint of the last finished step).
    pub interrupted: bool,
    /// The steps the run has completed (this call's and those before it).
    pub steps_done: u64,
    /// The newest checkpoint when the call ended: the last one it wrote, else (when
    /// interrupted before its first step) the one it resumed from.
    pub checkpoint: Option<PathBuf>,
    /// The held-out evaluation of the model before the run's first update (also when
    /// this call resumed the run), when the run evaluates.
    pub eval_start: Option<EvalReport>,
}

/// Runs `[train]` from `setup` as `run` says: each step samples a batch (the producer
/// thread), scores it, computes advantages and updates the adapter (the [`Learner`]),
/// evaluates on the held-out split when due, publishes the step's record, and writes a
/// checkpoint when due.
pub fn train(
    setup: &mut Setup,
    train: &TrainSection,
    run: &RunOptions,
    handle: &Handle,
) -> Result<Outcome> {
    let (state, opt, critic) = restore(setup, train, run.resume)?;
    let mut log = RunLog::open(run.out_dir, run.resume.map(|_| state.step))?;
    let held_out = HeldOut::prepare(setup, train, handle)?;
    run.hub.resume_at(state.step);
    let eval_start = held_out.at_start(setup, run, state.step, handle)?;
    let setup: &Setup = setup;
    let c = &setup.loaded.config;
    let queue = RolloutQueue::new(
        c.rollout.queue_capacity,
        c.rollout.max_staleness,
        state.step,
    );
    let progress = Progress::new(state.step, train.steps, run.quiet);
    let mut learner = Learner::new(
        &setup.lm.model,
        critic.as_ref(),
        opt,
        train,
        update_config(setup, train, progress.update_bar()),
        c.rollout.max_total_tokens,
        c.run.seed,
    );
    let saver = Saver {
        setup,
        run,
        train,
        critic: critic.as_ref(),
    };
    let adapters = AdapterBoard::new(AdapterSnapshot::take(&setup.lm.model, state.step)?);
    let last = run
        .stop_after
        .map_or(train.steps, |n| (state.step + n).min(train.steps));
    let mut outcome = Outcome {
        eval_start,
        ..Outcome::default()
    };
    // The last finished step when it has no checkpoint yet.
    let mut unsaved: Option<(u64, Cursor)> = None;
    std::thread::scope(|scope| -> Result<()> {
        let producer = scope.spawn(|| {
            let options = ProducerOptions {
                step: state.step,
                cursor: state.cursor,
                bar: progress.rollout_bar(),
                cancel: run.interrupt,
                adapters: &adapters,
            };
            producer::produce(setup, train, &queue, options, handle)
        });
        let result = (|| -> Result<()> {
            for step in state.step..last {
                let t0 = Instant::now();
                run.hub.set_phase(Phase::Rollout);
                progress.phase("waiting for rollouts");
                let Some(batch) = next_batch(&queue, run)? else {
                    // Interrupted while sampling: the step is abandoned.
                    if let Some((done, cursor)) = unsaved.take() {
                        outcome.checkpoint = Some(saver.save(&learner.opt, done, cursor)?);
                    }
                    outcome.interrupted = true;
                    break;
                };
                debug_assert_eq!(batch.step, step);
                let rollout_s = t0.elapsed().as_secs_f64();
                run.hub.set_phase(Phase::Update);
                progress.phase("updating the adapter");
                let (mut m, scored) = learner.learn(&batch, step)?;
                adapters.publish(AdapterSnapshot::take(&setup.lm.model, step + 1)?);
                queue.publish(step + 1);
                (m.rollout_s, m.step_s) = (rollout_s, t0.elapsed().as_secs_f64());
                let done = step + 1;
                if held_out.due(done, last) {
                    run.hub.set_phase(Phase::Eval);
                    progress.phase("evaluating on the held-out split");
                    held_out.evaluate_into(&mut m, setup, handle)?;
                }
                log.write(&m)?;
                run.hub
                    .step(&m, scored.iter().flat_map(|g| &g.trajectories));
                progress.step(&m, train.steps);
                outcome.metrics.push(m);
                let stop = interrupted(run);
                if done.is_multiple_of(train.save_every.max(1)) || done == last || stop {
                    outcome.checkpoint = Some(saver.save(&learner.opt, done, batch.cursor)?);
                    unsaved = None;
                } else {
                    unsaved = Some((done, batch.cursor));
                }
                if stop {
                    outcome.interrupted = true;
                    break;
                }
            }
            Ok(())
        })();
        queue.close();
        let _ = producer.join();
        result
    })?;
    progress.finish();
    outcome.steps_done = outcome.metrics.last().map_or(state.step, |m| m.step);
    if outcome.interrupted && outcome.checkpoint.is_none() {
        // Interrupted before a step finished in this call: the newest checkpoint is the
        // one this call resumed from, or none.
        outcome.checkpoint = run.resume.map(Path::to_path_buf);
    }
    Ok(outcome)
}

fn interrupted(run: &RunOptions) -> bool {
    run.interrupt.is_some_and(|f| f.load(Ordering::Relaxed))
}

/// The batch of the next step, or `None` when the run is interrupted while it is being
/// sampled (the producer then abandons it).
fn next_batch(queue: &RolloutQueue<Batch>, run: &RunOptions) -> Result<Option<Batch>> {
    loop {
        match queue.pop_timeout(Duration::from_millis(100)) {
            Ok(Some(batch)) => return Ok(Some(batch)),
            Ok(None) if interrupted(run) => return Ok(None),
            Ok(None) => {}
            // The producer gave up its batch because of the interruption; any other
            // failure is reported as it is, interrupted or not.
            Err(e) if e.to_string().ends_with(ABANDONED) => return Ok(None),
            Err(e) => bail!("{e}"),
        }
    }
}

/// The adapter, optimizer, position and (PPO) value head to start from: a checkpoint's,
/// or a fresh adapter (unless the model came with one) at step 0.
fn restore(
    setup: &mut Setup,
    train: &TrainSection,
    resume: Option<&Path>,
) -> Result<(TrainerState, AdamW, Option<ValueHead>)> {
    let mut state = TrainerState::default();
    match resume {
        Some(dir) => state = checkpoint::load_into(dir, &mut setup.lm.model)?,
        None if setup.lm.model.lora.is_none() => {
            let c = &setup.loaded.config;
            setup
                .lm
                .model
                .attach_lora(&c.lora.to_config(), c.run.seed)?;
        }
        None => {}
    }
    let model = &setup.lm.model;
    let critic = match train.algorithm {
        Algorithm::Ppo => {
            let seed = setup.loaded.config.run.seed ^ 0xc1;
            let head = ValueHead::new(model, train.critic == Critic::Separate, seed)?;
            if let Some(dir) = resume {
                head.load(dir)?;
            }
            Some(head)
        }
        Algorithm::Grpo => None,
    };
    let mut params = model.lora_vars();
    params.extend(critic.iter().flat_map(ValueHead::vars));
    let mut opt = AdamW::new(
        params,
        AdamWConfig {
            weight_decay: train.weight_decay,
            ..AdamWConfig::default()
        },
    )?;
    if let Some(dir) = resume {
        checkpoint::load_optimizer(dir, &mut opt, state.optimizer_step)?;
    }
    if state.step >= train.steps {
        bail!(
            "the checkpoint is at step {} and train.steps is {}: nothing left to do (raise train.steps to continue)",
            state.step,
            train.steps
        );
    }
    Ok((state, opt, critic))
}

/// `[train]`'s update settings.
fn update_config(
    setup: &Setup,
    train: &TrainSection,
    progress: Option<indicatif::ProgressBar>,
) -> UpdateConfig {
    UpdateConfig {
        clip_low: train.clip_low,
        clip_high: train.clip_high,
        aggregation: train.aggregation,
        norm_constant: if train.norm_constant > 0.0 {
            train.norm_constant
        } else {
            setup.loaded.config.rollout.max_total_tokens as f64
        },
        // In the reward or in the loss, never both.
        kl_coef: if train.kl_in_reward {
            0.0
        } else {
            train.kl_coef
        },
        kl_estimator: train.kl_estimator,
        reward_kl_estimator: train.kl_reward_estimator,
        // The sampler records log-probs at its temperature, and at 1 when greedy.
        temperature: match setup.settings.sampling.temperature {
            t if t > 0.0 => f64::from(t),
            _ => 1.0,
        },
        tis_cap: train.tis_cap,
        max_grad_norm: train.max_grad_norm,
        micro_batch_tokens: train.micro_batch_tokens,
        mini_batches: train.mini_batches,
        epochs: train.epochs_per_batch,
        old_logps: train.old_logps,
        ppo: (train.algorithm == Algorithm::Ppo).then_some(PpoConfig {
            gamma: train.gamma,
            lam: train.lam,
            vf_coef: train.vf_coef,
            value_clip: train.value_clip,
            whiten: train.whiten_advantages,
            kl_reward_coef: if train.kl_in_reward {
                train.kl_coef
            } else {
                0.0
            },
        }),
        progress,
    }
}

/// Writes checkpoints of this run and tells the status server.
struct Saver<'a> {
    setup: &'a Setup,
    run: &'a RunOptions<'a>,
    train: &'a TrainSection,
    critic: Option<&'a ValueHead>,
}

impl Saver<'_> {
    /// A checkpoint of step `done`, whose batch left the data at `cursor`.
    fn save(&self, opt: &AdamW, done: u64, cursor: Cursor) -> Result<PathBuf> {
        let state = TrainerState {
            step: done,
            optimizer_step: opt.step,
            cursor,
            seed: self.setup.loaded.config.run.seed,
        };
        let out_dir = self.run.out_dir;
        let dir = checkpoint::save(
            out_dir,
            &self.setup.lm,
            self.critic,
            opt,
            &state,
            self.train.keep_last,
        )?;
        let shown = dir.strip_prefix(out_dir).unwrap_or(&dir);
        self.run.hub.checkpoint(&shown.display().to_string());
        Ok(dir)
    }
}

/// Evaluation on the held-out split every `train.eval_every` steps and at the end:
/// greedy, one sample per prompt, with the run's tools and rewards.
struct HeldOut {
    every: u64,
    samples: Vec<(u64, Sample)>,
    settings: RolloutSettings,
}

impl HeldOut {
    fn prepare(setup: &Setup, train: &TrainSection, handle: &Handle) -> Result<HeldOut> {
        let samples = if train.eval_every > 0 {
            let mut s = handle.block_on(setup.dataset.eval_samples())?;
            if s.is_empty() {
                bail!(
                    "{}: train.eval_every = {} but the held-out split is empty; set data.eval_size (or eval_fraction, eval_path), or eval_every = 0",
                    setup.loaded.path.display(),
                    train.eval_every
                );
            }
            if train.eval_prompts > 0 {
                s.truncate(train.eval_prompts);
            }
            s
        } else {
            Vec::new()
        };
        let settings = RolloutSettings {
            group_size: 1,
            sampling: SamplingParams {
                temperature: 0.0,
                ..setup.settings.sampling.clone()
            },
            ..setup.settings.clone()
        };
        Ok(HeldOut {
            every: train.eval_every,
            samples,
            settings,
        })
    }

    /// Whether step `done` (1-based) evaluates; `last` is this call's last step.
    fn due(&self, done: u64, last: u64) -> bool {
        self.every > 0 && (done.is_multiple_of(self.every) || done == last)
    }

    /// The model before the first update, evaluated when the run starts at step 0 and
    /// kept in `RUN/eval_start.json`, so that the run can end with "before → after" also
    /// when it was resumed.
    fn at_start(
        &self,
        setup: &Setup,
        run: &RunOptions,
        step: u64,
        handle: &Handle,
    ) -> Result<Option<EvalReport>> {
        if self.every == 0 {
            return Ok(None);
        }
        let path = run.out_dir.join(EVAL_START);
        if step > 0 {
            // Resumed: what the first call measured, if it got that far.
            return Ok(std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok()));
        }
        run.hub.set_phase(Phase::Eval);
        if !run.quiet {
            eprintln!(
                "evaluating the starting model on {} held-out prompts",
                self.samples.len()
            );
        }
        let report = self.evaluate(setup, handle)?;
        run.hub.eval_start(&EvalPoint {
            step: 0,
            accuracy: report.accuracy,
            reward: report.reward_mean,
            tool_use: Some(report.tool_use_rate),
        });
        crate::model::peft::write_atomic(&path, &serde_json::to_vec_pretty(&report)?)?;
        Ok(Some(report))
    }

    /// Greedy rollouts of the held-out prompts with the current adapter.
    fn evaluate(&self, setup: &Setup, handle: &Handle) -> Result<EvalReport> {
        let engine = Engine::new(&setup.lm, &self.settings, &setup.rewards, handle.clone())?;
        let c = &setup.loaded.config;
        let (r, _) = evaluate(
            &engine,
            &self.samples,
            c.rollout.prompts_per_step,
            c.run.seed,
            crate::model::Mode::INFERENCE,
            |_, _| {},
        )?;
        Ok(r)
    }

    /// Adds `eval_accuracy`, `eval_reward`, `eval_tool_use` and `eval_s` to `m`.
    fn evaluate_into(&self, m: &mut StepMetrics, setup: &Setup, handle: &Handle) -> Result<()> {
        let r = self.evaluate(setup, handle)?;
        m.eval_accuracy = r.accuracy;
        m.eval_reward = Some(r.reward_mean);
        m.eval_tool_use = Some(r.tool_use_rate);
        m.eval_s = Some(r.wall_s);
        Ok(())
    }
}

/// The run directory's record of the held-out evaluation before the first update.
pub const EVAL_START: &str = "eval_start.json";

/// The run directory's checkpoint folder.
pub fn checkpoints_dir(out_dir: &Path) -> PathBuf {
    out_dir.join("checkpoints")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_out_evaluation_is_due_every_n_steps_and_at_the_end() {
        let held_out = |every| HeldOut {
            every,
            samples: Vec::new(),
            settings: RolloutSettings {
                group_size: 1,
                sampling: SamplingParams::default(),
                limits: Default::default(),
                template_kwargs: Default::default(),
                trigger: None,
                environment: None,
            },
        };
        let due: Vec<u64> = (1..=7).filter(|&d| held_out(3).due(d, 7)).collect();
        assert_eq!(due, [3, 6, 7]);
        assert!((1..=7).all(|d| !held_out(0).due(d, 7)));
    }

    #[test]
    fn an_interruption_while_waiting_abandons_the_step() {
        let queue: RolloutQueue<Batch> = RolloutQueue::new(1, 0, 0);
        let flag = AtomicBool::new(false);
        let hub = StatusHub::new("r", "m", "c", 1);
        let run = RunOptions {
            out_dir: Path::new("."),
            resume: None,
            stop_after: None,
            quiet: true,
            hub: &hub,
            interrupt: Some(&flag),
        };
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(150));
                flag.store(true, Ordering::Relaxed);
            });
            assert!(next_batch(&queue, &run).unwrap().is_none());
        });
        // The producer giving its batch up is the interruption, not a failure.
        let abandoned: RolloutQueue<Batch> = RolloutQueue::new(1, 0, 0);
        abandoned.fail(ABANDONED.into());
        assert!(next_batch(&abandoned, &run).unwrap().is_none());
        // A producer that failed for another reason is an error, interrupted or not.
        queue.fail("the dataset plugin died".into());
        for interrupted in [false, true] {
            flag.store(interrupted, Ordering::Relaxed);
            let e = next_batch(&queue, &run).err().map(|e| e.to_string());
            assert!(
                e.as_deref()
                    .is_some_and(|e| e.contains("the dataset plugin died")),
                "{e:?}"
            );
        }
    }
}
