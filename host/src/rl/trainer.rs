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

use super::algorithms::Critic;
use super::checkpoint::{self, TrainerState};
use super::learn::Learner;
use super::optim::AdamW;
use super::plan::{Advantages, EvalPlan, TrainPlan};
pub use super::producer::Sources;
use super::producer::{self, AdapterBoard, Batch, ProducerOptions};
use super::progress::Progress;
use super::run_log::RunLog;
use super::value_head::ValueHead;
use crate::data::Cursor;
use crate::model::LanguageModel;
use crate::rollout::eval::{EvalReport, evaluate};
use crate::rollout::queue::{QueueError, RolloutQueue};
use crate::rollout::{Engine, RolloutSettings};
use crate::sampler::draw::SamplingParams;
use crate::status::{EvalPoint, Phase, StatusHub};
use crate::step::StepMetrics;
use crate::task::Sample;
use anyhow::{Result, bail};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::runtime::Handle;

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

/// Trains `lm` as `plan` says, sampling from `sources`, and `run` says where: the
/// producer thread samples a batch per step while [`Steps`] takes them in turn.
pub fn train(
    lm: &mut LanguageModel,
    sources: Sources,
    plan: &TrainPlan,
    run: &RunOptions,
    handle: &Handle,
) -> Result<Outcome> {
    let (state, opt, critic) = restore(lm, plan, run.resume)?;
    let lm: &LanguageModel = lm;
    let log = RunLog::open(run.out_dir, run.resume.map(|_| state.step))?;
    let held_out = HeldOut::prepare(sources, plan, handle)?;
    run.hub.resume_at(state.step);
    let eval_start = held_out.at_start(lm, sources, run, state.step, handle)?;
    let b = &plan.batches;
    let queue = RolloutQueue::new(b.queue_capacity, b.max_staleness, state.step);
    let progress = Progress::new(state.step, plan.steps, run.quiet);
    let adapters = AdapterBoard::new(lm.model.adapter_snapshot(state.step)?);
    let mut steps = Steps {
        learner: Learner::new(
            &lm.model,
            critic.as_ref(),
            sources.teacher,
            opt,
            plan,
            progress.update_bar(),
        ),
        log,
        last: run
            .stop_after
            .map_or(plan.steps, |n| (state.step + n).min(plan.steps)),
        outcome: Outcome {
            eval_start,
            ..Outcome::default()
        },
        unsaved: None,
        http_seen: BTreeMap::new(),
        lm,
        sources,
        plan,
        run,
        handle,
        critic: critic.as_ref(),
        held_out,
        queue: &queue,
        adapters: &adapters,
        progress: &progress,
    };
    std::thread::scope(|scope| -> Result<()> {
        let producer = scope.spawn(|| {
            let options = ProducerOptions {
                step: state.step,
                cursor: state.cursor,
                bar: progress.rollout_bar(),
                cancel: run.interrupt,
                adapters: &adapters,
            };
            producer::produce(lm, sources, plan, &queue, options, handle)
        });
        let result = steps.run(state.step);
        queue.close();
        let _ = producer.join();
        result
    })?;
    progress.finish();
    Ok(steps.outcome(state.step))
}

/// The trainer's side of one `train` call: it takes the producer's batches one step at a
/// time.
struct Steps<'a> {
    lm: &'a LanguageModel,
    sources: Sources<'a>,
    plan: &'a TrainPlan,
    run: &'a RunOptions<'a>,
    handle: &'a Handle,
    learner: Learner<'a>,
    critic: Option<&'a ValueHead>,
    held_out: HeldOut,
    log: RunLog,
    queue: &'a RolloutQueue<Batch>,
    adapters: &'a AdapterBoard,
    progress: &'a Progress,
    /// This call's last step (1-based).
    last: u64,
    outcome: Outcome,
    /// The last finished step when it has no checkpoint yet.
    unsaved: Option<(u64, Cursor)>,
    /// Each granted plugin's HTTP counts at the last record, `plugin/outcome` → total.
    http_seen: BTreeMap<String, u64>,
}

impl Steps<'_> {
    /// Steps `first..last` (0-based), until the end or an interruption.
    fn run(&mut self, first: u64) -> Result<()> {
        for step in first..self.last {
            if !self.step(step)? {
                break;
            }
        }
        Ok(())
    }

    /// Step `step` (0-based): sample (the producer's batch), score, advantages and update
    /// (the learner), publish the new adapter, evaluate when due, record, checkpoint when
    /// due. `false` when the run stops after it.
    fn step(&mut self, step: u64) -> Result<bool> {
        let t0 = Instant::now();
        self.phase(Phase::Rollout, "waiting for rollouts");
        let next = match next_batch(self.queue, self.run) {
            Ok(next) => next,
            // Sampling failed (every vLLM server gone, say): what was trained is kept, so
            // that the run resumes from its last finished step.
            Err(e) => {
                if let Some((done, cursor)) = self.unsaved.take() {
                    self.save(done, cursor)?;
                    return Err(e.context(format!(
                        "stopped after step {done}, saved as a checkpoint (continue with --resume latest)"
                    )));
                }
                return Err(e);
            }
        };
        let Some(batch) = next else {
            // Interrupted while sampling: the step is abandoned.
            if let Some((done, cursor)) = self.unsaved.take() {
                self.save(done, cursor)?;
            }
            self.outcome.interrupted = true;
            return Ok(false);
        };
        debug_assert_eq!(batch.step, step);
        let rollout_s = t0.elapsed().as_secs_f64();
        self.phase(Phase::Update, "updating the adapter");
        let (mut m, scored) = self.learner.learn(&batch, step)?;
        let done = step + 1;
        self.adapters.publish(self.lm.model.adapter_snapshot(done)?);
        self.queue.publish(done);
        (m.rollout_s, m.step_s) = (rollout_s, t0.elapsed().as_secs_f64());
        if self.held_out.due(done, self.last) {
            self.phase(Phase::Eval, "evaluating on the held-out split");
            self.held_out
                .evaluate_into(&mut m, self.lm, self.sources, self.handle)?;
        }
        m.http_requests = self.http_since_last();
        m.generate_calls = self.with_granted(std::mem::take(&mut m.generate_calls));
        let out_dir = self.run.out_dir;
        self.log.write(&m).map_err(|e| write_failed(e, out_dir))?;
        self.run
            .hub
            .step(&m, scored.iter().flat_map(|g| &g.trajectories));
        self.progress.step(&m, self.plan.steps);
        self.outcome.metrics.push(m);
        let stop = interrupted(self.run);
        if done.is_multiple_of(self.plan.saves.every) || done == self.last || stop {
            self.save(done, batch.cursor)?;
        } else {
            self.unsaved = Some((done, batch.cursor));
        }
        self.outcome.interrupted |= stop;
        Ok(!stop)
    }

    /// What the plugins' HTTP requests came to since the last call, by plugin and outcome:
    /// every granted plugin (zeros included, so that its series has every step), and any
    /// other once it has tried.
    fn http_since_last(&mut self) -> BTreeMap<String, u64> {
        // Totals by name first: two config sections of one plugin file share its name.
        let mut totals = BTreeMap::new();
        for p in self.sources.plugins() {
            let gate = p.http();
            let c = &gate.counts;
            let tried = [&c.answered, &c.denied, &c.failed]
                .iter()
                .any(|n| n.load(std::sync::atomic::Ordering::Relaxed) > 0);
            // A plugin with no grant appears once it tries: its refusals are counted.
            if gate.access().grants.is_empty() && !tried {
                continue;
            }
            for (outcome, n) in [
                ("answered", &c.answered),
                ("denied", &c.denied),
                ("failed", &c.failed),
            ] {
                *totals.entry(format!("{}/{outcome}", p.name())).or_default() +=
                    n.load(std::sync::atomic::Ordering::Relaxed);
            }
        }
        totals
            .into_iter()
            .map(|(key, total)| {
                let before = self.http_seen.insert(key.clone(), total).unwrap_or(0);
                (key, total.saturating_sub(before))
            })
            .collect()
    }

    /// Every plugin with a `generate` grant in `calls`, with zeros where its batch made
    /// no call, so that its series has every step.
    fn with_granted(&self, mut calls: BTreeMap<String, u64>) -> BTreeMap<String, u64> {
        for p in self.sources.plugins() {
            if p.spec().grants.generate.is_some() {
                for outcome in ["answered", "refused", "failed"] {
                    calls.entry(format!("{}/{outcome}", p.name())).or_default();
                }
            }
        }
        calls
    }

    fn phase(&self, phase: Phase, what: &str) {
        self.run.hub.set_phase(phase);
        self.progress.phase(what);
    }

    /// A checkpoint of step `done`, whose batch left the data at `cursor`; the status
    /// server is told.
    fn save(&mut self, done: u64, cursor: Cursor) -> Result<()> {
        let opt = &self.learner.opt;
        let state = TrainerState {
            step: done,
            optimizer_step: opt.step,
            cursor,
            seed: self.plan.seed,
        };
        let out_dir = self.run.out_dir;
        let keep = self.plan.saves.keep_last;
        let head = self.critic.map(|c| c as &dyn checkpoint::Head);
        let dir = checkpoint::save(out_dir, self.lm, head, opt, &state, keep)
            .map_err(|e| write_failed(e, out_dir))?;
        let shown = dir.strip_prefix(out_dir).unwrap_or(&dir);
        self.run.hub.checkpoint(&shown.display().to_string());
        self.outcome.checkpoint = Some(dir);
        self.unsaved = None;
        Ok(())
    }

    /// How the call ended; `first` is the step it started at.
    fn outcome(self, first: u64) -> Outcome {
        let mut outcome = self.outcome;
        outcome.steps_done = outcome.metrics.last().map_or(first, |m| m.step);
        if outcome.interrupted && outcome.checkpoint.is_none() {
            // Interrupted before a step finished in this call: the newest checkpoint is
            // the one this call resumed from, or none.
            outcome.checkpoint = self.run.resume.map(Path::to_path_buf);
        }
        outcome
    }
}

/// A write of the run's records that failed (a full disk, a file-size limit), with what
/// is safe and how to go on: the checkpoints already in place are complete (each is
/// written aside and renamed into place), and the run resumes from the newest.
fn write_failed(e: anyhow::Error, out_dir: &Path) -> anyhow::Error {
    let shown = out_dir.display();
    let next = match checkpoint::resolve(out_dir, "latest") {
        Ok(latest) => format!(
            "the checkpoints written before are intact (the newest: {}); make room, then continue with `rlhost train --resume latest --out {shown}` and the same config",
            latest.dir.display()
        ),
        Err(_) => format!(
            "no checkpoint had been written yet; make room and start again (`--overwrite` to reuse {shown})"
        ),
    };
    anyhow::anyhow!("{e:#}; {next}")
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
            Err(QueueError::Abandoned) => return Ok(None),
            Err(e) => bail!("{e}"),
        }
    }
}

/// The adapter, optimizer, position and (PPO) value head to start from: a checkpoint's,
/// or a fresh adapter (unless the model came with one) at step 0.
fn restore(
    lm: &mut LanguageModel,
    plan: &TrainPlan,
    resume: Option<&Path>,
) -> Result<(TrainerState, AdamW, Option<ValueHead>)> {
    let mut state = TrainerState::default();
    match resume {
        Some(dir) => state = checkpoint::load_into(dir, &mut lm.model)?,
        None if lm.model.lora.is_none() => lm.model.attach_lora(&plan.lora, plan.seed)?,
        None => {}
    }
    let model = &lm.model;
    let critic = match plan.advantages {
        Advantages::Critic(kind) => {
            let head = ValueHead::new(model, kind == Critic::Separate, plan.seed ^ 0xc1)?;
            if let Some(dir) = resume {
                head.load(dir)?;
            }
            Some(head)
        }
        Advantages::Group { .. } => None,
    };
    let mut params = model.lora_vars();
    params.extend(critic.iter().flat_map(ValueHead::vars));
    let mut opt = AdamW::new(params, plan.optimizer)?;
    if let Some(dir) = resume {
        checkpoint::load_optimizer(dir, &mut opt, state.optimizer_step)?;
    }
    if state.step >= plan.steps {
        bail!(
            "the checkpoint is at step {} and train.steps is {}: nothing left to do (raise train.steps to continue)",
            state.step,
            plan.steps
        );
    }
    Ok((state, opt, critic))
}

/// Evaluation on the held-out split every `train.eval_every` steps and at the end:
/// greedy, one sample per prompt, with the run's tools and rewards.
struct HeldOut {
    plan: EvalPlan,
    /// The run's seed, which the engine derives each prompt's seed from.
    seed: u64,
    samples: Vec<(u64, Sample)>,
    settings: RolloutSettings,
}

impl HeldOut {
    fn prepare(sources: Sources, train: &TrainPlan, handle: &Handle) -> Result<HeldOut> {
        let plan = &train.eval;
        let samples = if plan.every > 0 {
            let mut s = handle.block_on(sources.dataset.eval_samples())?;
            if s.is_empty() {
                bail!(
                    "{}: train.eval_every = {} but the held-out split is empty; set data.eval_size (or eval_fraction, eval_path), or eval_every = 0",
                    train.source,
                    plan.every
                );
            }
            if plan.prompts > 0 {
                s.truncate(plan.prompts);
            }
            s
        } else {
            Vec::new()
        };
        // One greedy answer a prompt, a chain, never a tree.
        let settings = RolloutSettings {
            group_size: 1,
            sampling: SamplingParams {
                temperature: 0.0,
                ..sources.settings.sampling.clone()
            },
            tree: None,
            ..sources.settings.clone()
        };
        Ok(HeldOut {
            plan: *plan,
            seed: train.seed,
            samples,
            settings,
        })
    }

    /// Whether step `done` (1-based) evaluates; `last` is this call's last step.
    fn due(&self, done: u64, last: u64) -> bool {
        let every = self.plan.every;
        every > 0 && (done.is_multiple_of(every) || done == last)
    }

    /// The model before the first update, evaluated when the run starts at step 0 and
    /// kept in `RUN/eval_start.json`, so that the run can end with "before → after" also
    /// when it was resumed.
    fn at_start(
        &self,
        lm: &LanguageModel,
        sources: Sources,
        run: &RunOptions,
        step: u64,
        handle: &Handle,
    ) -> Result<Option<EvalReport>> {
        if self.plan.every == 0 {
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
        let report = self.evaluate(lm, sources, handle)?;
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
    fn evaluate(
        &self,
        lm: &LanguageModel,
        sources: Sources,
        handle: &Handle,
    ) -> Result<EvalReport> {
        let engine = Engine::new(lm, &self.settings, sources.rewards, handle.clone())?;
        let (r, _) = evaluate(
            &engine,
            &self.samples,
            self.plan.prompts_per_call,
            self.seed,
            crate::model::Mode::INFERENCE,
            |_, _| {},
        )?;
        Ok(r)
    }

    /// Adds `eval_accuracy`, `eval_reward`, `eval_tool_use` and `eval_s` to `m`.
    fn evaluate_into(
        &self,
        m: &mut StepMetrics,
        lm: &LanguageModel,
        sources: Sources,
        handle: &Handle,
    ) -> Result<()> {
        let r = self.evaluate(lm, sources, handle)?;
        m.eval_accuracy = r.accuracy;
        m.eval_reward = Some(r.reward_mean);
        m.eval_tool_use = Some(r.tool_use_rate);
        m.eval_malformed_call_rate = r.malformed_call_rate;
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
            plan: EvalPlan {
                every,
                prompts: 0,
                prompts_per_call: 1,
            },
            seed: 0,
            samples: Vec::new(),
            settings: RolloutSettings {
                group_size: 1,
                sampling: SamplingParams::default(),
                limits: Default::default(),
                template_kwargs: Default::default(),
                env: Default::default(),
                remote: None,
                tree: None,
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
        abandoned.abandon();
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
