//! The GRPO-family trainer: rollouts → rewards → advantages → update, step after step.
//!
//! How this trainer simplifies the textbook (nanochat's habit of saying so up front):
//! - One process: the rollout producer (a thread) and the trainer share the model; the
//!   producer sees each new adapter the moment the trainer publishes it.
//! - The reference policy is the same weights with adapters off: no second model.
//! - With `max_staleness = 0` (the default) step s trains on rollouts sampled by the
//!   adapter of step s exactly (ratio 1 on the first pass); larger values let the
//!   producer run ahead and the update corrects with truncated importance sampling.
//! - Every seed is derived from (run seed, step), so a resumed run takes the same next
//!   step as an uninterrupted one.

use super::algorithms::{self, Aggregation, Estimator, KlEstimator};
use super::checkpoint::{self, TrainerState};
use super::optim::{AdamW, AdamWConfig, lr_at};
use super::update::{Row, UpdateConfig, UpdateStats, update};
use crate::config::setup::Setup;
use crate::data::Cursor;
use crate::model::generate::sample_seed;
use crate::model::lora::seeded;
use crate::model::sample::SamplingParams;
use crate::rollout::eval::evaluate;
use crate::rollout::queue::RolloutQueue;
use crate::rollout::{BatchStats, Engine, Group, RolloutSettings};
use crate::step::StepMetrics;
use crate::status::tensorboard::EventWriter;
use crate::status::{Phase, StatusHub};
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;
use tokio::runtime::Handle;

/// `[train]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSection {
    /// Optimizer steps (one rollout batch each).
    pub steps: u64,
    pub lr: f64,
    pub warmup_steps: u64,
    /// The cosine schedule ends at `min_lr_ratio · lr`.
    pub min_lr_ratio: f64,
    pub weight_decay: f64,
    pub max_grad_norm: f64,
    /// Passes (optimizer steps) over each rollout batch.
    pub updates_per_batch: usize,
    pub micro_batch_tokens: usize,
    pub estimator: Estimator,
    pub adv_eps: f64,
    pub clip_low: f64,
    pub clip_high: f64,
    pub aggregation: Aggregation,
    /// Dr. GRPO's constant for `seq-mean-token-sum-norm` (0: rollout.max_total_tokens).
    pub norm_constant: f64,
    pub kl_coef: f64,
    pub kl_estimator: KlEstimator,
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
            steps: 100,
            lr: 1e-5,
            warmup_steps: 0,
            min_lr_ratio: 0.0,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            updates_per_batch: 1,
            micro_batch_tokens: 4096,
            estimator: Estimator::Grpo,
            adv_eps: 1e-6,
            clip_low: 0.2,
            clip_high: 0.28,
            aggregation: Aggregation::TokenMean,
            norm_constant: 0.0,
            kl_coef: 0.0,
            kl_estimator: KlEstimator::K3,
            kl_in_reward: false,
            dynamic_sampling: false,
            max_resample: 2,
            overlong: Overlong::None,
            overlong_cache: 0,
            tis_cap: 2.0,
            eval_every: 0,
            eval_prompts: 64,
            save_every: 10,
            keep_last: 3,
        }
    }
}

/// A rollout batch as the producer hands it over.
struct Batch {
    step: u64,
    groups: Vec<Group>,
    dropped: usize,
    stats: BatchStats,
    /// The data position after this batch (what a checkpoint after it records).
    cursor: Cursor,
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
}

/// Runs `[train]` from `setup` as `run` says.
pub fn train(
    setup: &mut Setup,
    train: &TrainSection,
    run: &RunOptions,
    handle: &Handle,
) -> Result<Outcome> {
    let RunOptions {
        out_dir,
        resume,
        stop_after,
        quiet,
        hub,
        interrupt,
    } = *run;
    let interrupted = || interrupt.is_some_and(|f| f.load(Ordering::Relaxed));
    let seed = setup.loaded.config.run.seed;
    std::fs::create_dir_all(out_dir)
        .with_context(|| format!("cannot create the run directory {}", out_dir.display()))?;
    let mut state = TrainerState::default();
    match resume {
        Some(dir) => {
            state = checkpoint::load_into(dir, &mut setup.lm.model)?;
        }
        None if setup.lm.model.lora.is_none() => {
            let lora = setup.loaded.config.lora.to_config();
            setup.lm.model.attach_lora(&lora, seed)?;
        }
        None => {}
    }
    let mut opt = AdamW::new(
        setup.lm.model.lora_vars(),
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
    let c = &setup.loaded.config;
    let cfg = UpdateConfig {
        clip_low: train.clip_low,
        clip_high: train.clip_high,
        aggregation: train.aggregation,
        norm_constant: if train.norm_constant > 0.0 {
            train.norm_constant
        } else {
            c.rollout.max_total_tokens as f64
        },
        // In the reward or in the loss, never both.
        kl_coef: if train.kl_in_reward {
            0.0
        } else {
            train.kl_coef
        },
        kl_estimator: train.kl_estimator,
        tis_cap: train.tis_cap,
        max_grad_norm: train.max_grad_norm,
        micro_batch_tokens: train.micro_batch_tokens,
        updates_per_batch: train.updates_per_batch,
        progress: None,
    };
    let metrics_path = out_dir.join("metrics.jsonl");
    if resume.is_some() {
        // What a crash left: rows of steps after the checkpoint (they are written before
        // it, and will be taken again) and half-written temporary files.
        checkpoint::clean_temporaries(out_dir)?;
        trim_metrics(&metrics_path, state.step)?;
    }
    let mut metrics_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&metrics_path)
        .with_context(|| format!("cannot write {}", metrics_path.display()))?;
    // One event file per invocation; TensorBoard merges a resumed run's files by step.
    let mut tensorboard = EventWriter::create(&out_dir.join("tensorboard"))?;
    if resume.is_some() {
        // TensorBoard drops the older files' points from this step on.
        tensorboard.session_start(state.step + 1)?;
    }
    hub.resume_at(state.step);
    let queue: RolloutQueue<Batch> = RolloutQueue::new(
        c.rollout.queue_capacity,
        c.rollout.max_staleness,
        state.step,
    );
    let prompts = c.rollout.prompts_per_step;
    let eval_samples = if train.eval_every > 0 {
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
    // Evaluation samples one greedy answer per prompt.
    let eval_settings = RolloutSettings {
        group_size: 1,
        sampling: SamplingParams {
            temperature: 0.0,
            ..setup.settings.sampling.clone()
        },
        ..setup.settings.clone()
    };
    let lora_dropout = setup.loaded.config.lora.dropout > 0.0;
    let max_total_tokens = c.rollout.max_total_tokens;
    let setup: &Setup = setup;
    let mut outcome = Outcome::default();
    let progress = Progress::new(state.step, train.steps, quiet);
    let cfg = UpdateConfig {
        progress: progress.update_bar(),
        ..cfg
    };
    std::thread::scope(|scope| -> Result<()> {
        let producer = scope.spawn(|| {
            let mut engine =
                match Engine::new(&setup.lm, &setup.settings, &setup.rewards, handle.clone()) {
                    Ok(e) => e,
                    Err(e) => {
                        queue.fail(format!("{e:#}"));
                        return;
                    }
                };
            if let Some(bar) = progress.rollout_bar() {
                engine.set_progress(bar);
            }
            if let Some(flag) = interrupt {
                engine.set_cancel(flag);
            }
            let mut cursor = state.cursor;
            let _ = queue.produce(state.step, |step, version| {
                let mut groups = Vec::new();
                let mut dropped = 0;
                let mut stats = BatchStats::default();
                for round in 0..=train.max_resample {
                    let want = prompts - groups.len();
                    let samples = handle.block_on(setup.dataset.next_batch(&mut cursor, want))?;
                    let (got, s) = engine.run(
                        &samples,
                        sample_seed(seed, step as usize, round),
                        version,
                        crate::model::Mode::INFERENCE,
                    )?;
                    stats.add(&s);
                    for g in got {
                        let rewards: Vec<f64> = g.trajectories.iter().map(|t| t.reward).collect();
                        if train.dynamic_sampling && !algorithms::informative(&rewards) {
                            dropped += 1;
                        } else {
                            groups.push(g);
                        }
                    }
                    if !train.dynamic_sampling || groups.len() >= prompts {
                        break;
                    }
                }
                Ok(Batch {
                    step,
                    groups,
                    dropped,
                    stats,
                    cursor,
                })
            });
        });
        // A checkpoint of step `done`, whose batch left the data at `cursor`.
        let save = |done: u64, cursor: Cursor, opt: &AdamW| -> Result<PathBuf> {
            let st = TrainerState {
                step: done,
                optimizer_step: opt.step,
                cursor,
                seed,
            };
            let dir = checkpoint::save(out_dir, &setup.lm, opt, &st, train.keep_last)?;
            hub.checkpoint(
                &dir.strip_prefix(out_dir)
                    .unwrap_or(&dir)
                    .display()
                    .to_string(),
            );
            Ok(dir)
        };
        // The last finished step when it has no checkpoint yet.
        let mut unsaved: Option<(u64, Cursor)> = None;
        let result = (|| -> Result<()> {
            let last = stop_after.map_or(train.steps, |n| (state.step + n).min(train.steps));
            for step in state.step..last {
                let t0 = Instant::now();
                hub.set_phase(Phase::Rollout);
                progress.phase("waiting for rollouts");
                // An interruption while the rollouts are sampled abandons this step: the
                // last finished one is checkpointed below.
                let batch = loop {
                    if interrupted() {
                        break None;
                    }
                    match queue.pop_timeout(std::time::Duration::from_millis(100)) {
                        Ok(Some(batch)) => break Some(batch),
                        Ok(None) => {}
                        // The producer gave up its batch because of the interruption.
                        Err(_) if interrupted() => break None,
                        Err(e) => bail!("{e}"),
                    }
                };
                let Some(batch) = batch else {
                    // Abandoned: the last finished step is saved unless it just was.
                    if let Some((done, cursor)) = unsaved.take() {
                        outcome.checkpoint = Some(save(done, cursor, &opt)?);
                    }
                    outcome.interrupted = true;
                    break;
                };
                debug_assert_eq!(batch.step, step);
                let rollout_s = t0.elapsed().as_secs_f64();
                hub.set_phase(Phase::Update);
                progress.phase("updating the adapter");
                let lr = lr_at(
                    step,
                    train.steps,
                    train.warmup_steps,
                    train.lr,
                    train.min_lr_ratio,
                );
                let u0 = Instant::now();
                let dropout = lora_dropout
                    .then(|| Mutex::new(seeded(sample_seed(seed ^ 0xd0, step as usize, 0))));
                let (_, mut m, scored) = learn(
                    &setup.lm.model,
                    &mut opt,
                    &batch,
                    train,
                    &cfg,
                    lr,
                    step,
                    max_total_tokens,
                    dropout.as_ref(),
                )?;
                queue.publish(step + 1);
                m.update_s = u0.elapsed().as_secs_f64();
                m.rollout_s = rollout_s;
                m.step_s = t0.elapsed().as_secs_f64();
                m.lr = lr;
                m.epoch = batch.cursor.epoch;
                m.adapter_version = step + 1;
                let done = step + 1;
                if train.eval_every > 0 && (done % train.eval_every == 0 || done == last) {
                    hub.set_phase(Phase::Eval);
                    progress.phase("evaluating on the held-out split");
                    let engine =
                        Engine::new(&setup.lm, &eval_settings, &setup.rewards, handle.clone())?;
                    let (r, _) = evaluate(
                        &engine,
                        &eval_samples,
                        prompts,
                        seed,
                        crate::model::Mode::INFERENCE,
                        |_, _| {},
                    )?;
                    m.eval_accuracy = r.accuracy;
                    m.eval_reward = Some(r.reward_mean);
                    m.eval_tool_use = Some(r.tool_use_rate);
                    m.eval_s = Some(r.wall_s);
                }
                serde_json::to_writer(&mut metrics_file, &m)?;
                metrics_file.write_all(b"\n")?;
                metrics_file.flush()?;
                tensorboard.scalars(m.step, &crate::status::figures::scalars(&m))?;
                tensorboard.flush()?;
                hub.step(&m, scored.iter().flat_map(|g| &g.trajectories));
                progress.step(&m, train.steps);
                outcome.metrics.push(m);
                let stop = interrupted();
                if done % train.save_every.max(1) == 0 || done == last || stop {
                    outcome.checkpoint = Some(save(done, batch.cursor, &opt)?);
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
        // Interrupted before a step finished in this call: the last checkpoint is the
        // one this call resumed from, or none.
        outcome.checkpoint = resume.map(Path::to_path_buf);
    }
    Ok(outcome)
}

/// Drops the rows of `metrics.jsonl` after `step` (a crash between writing a step's row
/// and its checkpoint leaves rows the resumed run takes again). A torn last line goes too.
fn trim_metrics(path: &Path, step: u64) -> Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let mut kept = String::with_capacity(text.len());
    for line in text.lines() {
        let row_step = serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|v| v.get("step").and_then(|s| s.as_u64()));
        if row_step.is_some_and(|s| s <= step) {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    if kept != text {
        crate::model::peft::write_atomic(path, kept.as_bytes())?;
    }
    Ok(())
}

/// Step progress: on a terminal, an indicatif bar over steps (reward, loss, ETA), one
/// counting the batch's finished rollouts (with what the trainer is doing) and one the
/// update's micro-batches; one line per step otherwise (logs and CI keep a readable
/// record).
struct Progress {
    /// Steps, the batch's rollouts, the update's micro-batches.
    bars: Option<[indicatif::ProgressBar; 3]>,
    quiet: bool,
}

impl Progress {
    fn new(done: u64, total: u64, quiet: bool) -> Progress {
        let bars = crate::progress::enabled(quiet).then(|| {
            let multi = indicatif::MultiProgress::new();
            let steps = multi.add(crate::progress::bar(
                total,
                "train   {bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
            ));
            steps.set_position(done);
            let rollout = multi.add(crate::progress::bar(
                0,
                "rollout {bar:30} {pos}/{len} trajectories  {msg}",
            ));
            let update = multi.add(crate::progress::bar(
                0,
                "update  {bar:30} {pos}/{len} micro-batches",
            ));
            [steps, rollout, update]
        });
        Progress { bars, quiet }
    }

    /// The bar the rollout engine advances, when there is a terminal.
    fn rollout_bar(&self) -> Option<indicatif::ProgressBar> {
        self.bars.as_ref().map(|[_, r, _]| r.clone())
    }

    /// The bar the update advances, when there is a terminal.
    fn update_bar(&self) -> Option<indicatif::ProgressBar> {
        self.bars.as_ref().map(|[_, _, u]| u.clone())
    }

    fn phase(&self, what: &str) {
        if let Some([_, rollout, _]) = &self.bars {
            rollout.set_message(format!("(trainer: {what})"));
        }
    }

    fn step(&self, m: &StepMetrics, total: u64) {
        let line = format!(
            "reward {:.3}{}  loss {:.4}  kl {:.4}  len {:.1}  tools {:.2}  {:.1} s/step",
            m.reward_mean,
            m.accuracy
                .map(|a| format!("  acc {a:.3}"))
                .unwrap_or_default(),
            m.loss,
            m.kl,
            m.response_tokens,
            m.tool_calls,
            m.step_s
        );
        match &self.bars {
            Some([steps, _, _]) => {
                steps.set_position(m.step);
                steps.set_message(line);
            }
            None if !self.quiet => eprintln!("step {}/{total}  {line}", m.step),
            None => {}
        }
    }

    fn finish(&self) {
        if let Some([steps, rollout, update]) = &self.bars {
            rollout.finish_and_clear();
            update.finish_and_clear();
            steps.finish();
        }
    }
}

/// Rewards → advantages → update; the step's metrics and the groups as scored (with any
/// overlong or KL components added).
#[allow(clippy::too_many_arguments)]
fn learn(
    model: &crate::model::Model,
    opt: &mut AdamW,
    batch: &Batch,
    train: &TrainSection,
    cfg: &UpdateConfig,
    lr: f64,
    step: u64,
    max_total_tokens: usize,
    dropout: Option<&Mutex<rand::rngs::StdRng>>,
) -> Result<(UpdateStats, StepMetrics, Vec<Group>)> {
    let mut groups = batch.groups.clone();
    if train.overlong == Overlong::Penalty {
        // Length after the prompt against the room `max_total_tokens` left it.
        for t in groups.iter_mut().flat_map(|g| g.trajectories.iter_mut()) {
            let len = t.completion_tokens().len();
            let room = max_total_tokens.saturating_sub(t.prompt_len);
            let p = algorithms::overlong_penalty(len, room, train.overlong_cache);
            t.rewards.insert("overlong".into(), p);
            t.reward += p;
        }
    }
    let mut kl_mean = None;
    if train.kl_in_reward && train.kl_coef > 0.0 {
        let all: Vec<&crate::rollout::Trajectory> = groups
            .iter()
            .flat_map(|g| &g.trajectories)
            .filter(|t| t.tokens.len() >= 2)
            .collect();
        let rows: Vec<Row> = all
            .iter()
            .map(|t| Row {
                trajectory: t,
                advantage: 0.0,
                stale: false,
            })
            .collect();
        let kls = super::update::sequence_kl(model, &rows, cfg)?;
        let tokens: usize = all.iter().map(|t| t.sampled_tokens()).sum();
        kl_mean = Some(kls.iter().sum::<f64>() / tokens.max(1) as f64);
        let by_key: std::collections::HashMap<(u64, usize), f64> = all
            .iter()
            .zip(&kls)
            .map(|(t, k)| ((t.sample_id, t.index), *k))
            .collect();
        for t in groups.iter_mut().flat_map(|g| g.trajectories.iter_mut()) {
            let k = by_key.get(&(t.sample_id, t.index)).copied().unwrap_or(0.0);
            t.rewards.insert("kl_penalty".into(), -train.kl_coef * k);
            t.reward -= train.kl_coef * k;
        }
    }
    let rewards: Vec<Vec<f64>> = groups
        .iter()
        .map(|g| g.trajectories.iter().map(|t| t.reward).collect())
        .collect();
    let advantages = algorithms::advantages(&rewards, train.estimator, train.adv_eps);
    let trajectories: Vec<_> = groups.iter().flat_map(|g| &g.trajectories).collect();
    let rows: Vec<Row> = trajectories
        .iter()
        .zip(&advantages)
        .filter(|(t, _)| !(train.overlong == Overlong::Filter && t.truncated))
        .filter(|(t, _)| t.sampled_tokens() > 0)
        .map(|(t, a)| Row {
            trajectory: t,
            advantage: *a,
            stale: t.version < step,
        })
        .collect();
    let stats = if rows.is_empty() {
        UpdateStats::default()
    } else {
        update(model, opt, &rows, cfg, lr, dropout)?
    };
    let n = trajectories.len().max(1) as f64;
    let mean = |f: &dyn Fn(&crate::rollout::Trajectory) -> f64| {
        trajectories.iter().map(|t| f(t)).sum::<f64>() / n
    };
    let reward_mean = mean(&|t| t.reward);
    let reward_std = mean(&|t| (t.reward - reward_mean).powi(2)).sqrt();
    let components = crate::rollout::trajectory::component_means(trajectories.iter().copied());
    let mut faults: BTreeMap<String, u64> = BTreeMap::new();
    for t in &trajectories {
        for f in &t.faults {
            *faults
                .entry(format!("{}/{}", f.plugin, f.kind))
                .or_default() += 1;
        }
    }
    let m = StepMetrics {
        step: step + 1,
        reward_mean,
        reward_std,
        accuracy: components.get("correct").copied(),
        rewards: components,
        loss: stats.loss,
        policy_loss: stats.policy_loss,
        kl: kl_mean.unwrap_or(stats.kl),
        entropy: stats.entropy,
        clip_fraction: stats.clip_fraction,
        grad_norm: stats.grad_norm,
        response_tokens: mean(&|t| t.sampled_tokens() as f64),
        turns: mean(&|t| t.turns as f64),
        tool_calls: mean(&|t| t.tool_calls as f64),
        truncated: mean(&|t| f64::from(u8::from(t.truncated))),
        groups: groups.len(),
        groups_dropped: batch.dropped,
        trajectories: trajectories.len(),
        faults,
        sampled_tokens_per_s: batch.stats.sampled_tokens as f64 / batch.stats.wall_s.max(1e-9),
        ..Default::default()
    };
    Ok((stats, m, groups))
}

/// The run directory's checkpoint folder.
pub fn checkpoints_dir(out_dir: &Path) -> PathBuf {
    out_dir.join("checkpoints")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 19: after a crash, rows of steps past the checkpoint were taken again.
    #[test]
    fn rows_past_the_checkpoint_and_torn_lines_are_dropped() {
        let dir = std::env::temp_dir().join(format!("rlhost-trim-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("metrics.jsonl");
        std::fs::write(
            &path,
            "{\"step\":1,\"loss\":0.5}\n{\"step\":2}\n{\"step\":3}\n{\"step\":4}\n{\"st",
        )
        .unwrap();
        trim_metrics(&path, 2).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"step\":1,\"loss\":0.5}\n{\"step\":2}\n"
        );
        // Nothing to drop: the file is left as it is; no file: nothing to do.
        trim_metrics(&path, 2).unwrap();
        trim_metrics(&dir.join("none.jsonl"), 2).unwrap();
        assert!(!dir.join("none.jsonl").exists());
    }
}
