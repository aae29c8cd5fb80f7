//! The trainers on preference pairs: `rlhost dpo` (preference optimisation of the
//! adapter, [`crate::rl::dpo`]) and `rlhost rm` (a Bradley–Terry reward model,
//! [`crate::rl::reward_model`]), on the pairs of `data.path`, with the run config's
//! `[model]`, `[lora]`, `[train]`, `[pairs]` and `[dpo]` or `[rm]`. Metrics to
//! `RUN/metrics.jsonl` and TensorBoard under TRL's names, checkpoints to
//! `RUN/checkpoints/` (`--resume latest` continues exactly), the adapter (with the reward
//! model's score head) in PEFT's format in `RUN/adapter` at the end.

use crate::config::LoadedConfig;
use crate::config::setup::{display, out_dir};
use crate::config::{set_path, set_value};
use crate::data::pairs::{self, PairKeys};
use crate::data::{Format, order};
use crate::model::{LanguageModel, peft};
use crate::rl::checkpoint::{self, TrainerState};
use crate::rl::dpo::{Dpo, PairMetrics, PairRows, PairSchedule, StepRecord, reference_adapter};
use crate::rl::preference::PairLossSettings;
use crate::rl::reward_model::{Rm, ScoreHead};
use crate::rl::run_log::RunLog;
use crate::status::{EvalPoint, Phase, StatusHub};
use crate::step::StepMetrics;
use anyhow::{Context, Result, bail};
use clap::Args;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct PairsArgs {
    /// The run config: its [model], [lora], [data], [train], [pairs] and [dpo] or [rm]
    /// sections.
    #[arg(long)]
    config: PathBuf,
    /// Continue from `latest` (the run directory's newest checkpoint) or a checkpoint folder.
    #[arg(long, value_name = "latest|DIR")]
    resume: Option<String>,
    /// Start afresh in a run directory that holds a run (its metrics, checkpoints and
    /// TensorBoard files are deleted first).
    #[arg(long, conflicts_with = "resume")]
    overwrite: bool,
    /// Overrides run.out_dir.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Overrides train.steps.
    #[arg(long)]
    steps: Option<u64>,
    /// Stop after this many steps of this invocation (the schedule still spans
    /// train.steps; continue with --resume latest).
    #[arg(long, value_name = "N")]
    stop_after: Option<u64>,
    /// Override a config value, e.g. --set dpo.beta=0.2 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    #[command(flatten)]
    status: super::train::StatusArgs,
}

/// Which trainer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Objective {
    Dpo,
    Rm,
}

impl Objective {
    fn name(self) -> &'static str {
        match self {
            Objective::Dpo => "dpo",
            Objective::Rm => "rm",
        }
    }
}

/// The trainer a command runs.
enum Trainer<'a> {
    Dpo(Dpo<'a>),
    Rm(Rm<'a>),
}

impl Trainer<'_> {
    fn step(&mut self, pairs: &[PairRows]) -> Result<StepRecord> {
        match self {
            Trainer::Dpo(t) => t.step(pairs),
            Trainer::Rm(t) => t.step(pairs),
        }
    }

    fn evaluate(&self, pairs: &[PairRows]) -> Result<PairMetrics> {
        match self {
            Trainer::Dpo(t) => {
                crate::rl::dpo::evaluate(t.model, t.reference.as_ref(), pairs, &t.loss, &t.schedule)
            }
            Trainer::Rm(t) => {
                crate::rl::reward_model::evaluate(t.model, &t.head, pairs, t.center, &t.schedule)
            }
        }
    }

    /// Steps done, and the optimizer.
    fn position(&mut self) -> (&mut u64, &mut crate::rl::optim::AdamW) {
        match self {
            Trainer::Dpo(t) => (&mut t.step, &mut t.opt),
            Trainer::Rm(t) => (&mut t.step, &mut t.opt),
        }
    }

    fn head(&self) -> Option<&dyn checkpoint::Head> {
        match self {
            Trainer::Dpo(_) => None,
            Trainer::Rm(t) => Some(&t.head),
        }
    }
}

pub fn run(
    kind: Objective,
    args: PairsArgs,
    handle: &tokio::runtime::Handle,
    quiet: bool,
) -> Result<()> {
    let mut set = args.set.clone();
    if let Some(steps) = args.steps {
        set.push(set_value("train.steps", steps as i64));
    }
    if let Some(out) = &args.out {
        set.push(set_path("run.out_dir", out)?);
    }
    let loaded = LoadedConfig::load(&args.config, &set)?;
    let c = &loaded.config;
    let file = display(&loaded.path);
    let checked = match kind {
        Objective::Dpo => c.dpo.validate(),
        Objective::Rm => c.rm.validate(),
    };
    checked
        .and_then(|()| c.pairs.validate())
        .map_err(|e| anyhow::anyhow!("{file}: {e}"))?;
    if c.train.steps == 0 {
        bail!("{file}: train.steps is 0; nothing to train");
    }
    args.status.check()?;
    let hub = StatusHub::new(
        &StatusHub::run_id(&loaded.path),
        &c.model.path.display().to_string(),
        &file,
        c.train.steps,
    );
    // Served once the config and the pairs have checked out: a bad input gets its one
    // error line and nothing else.
    let mut server = None;
    let result = (|| -> Result<()> {
        let (source, held_out) = read_pairs(&loaded)?;
        let out = out_dir(&loaded);
        let written = ["metrics.jsonl", "config.toml", "adapter"];
        let resume =
            super::train::start_or_resume(&out, args.resume.as_deref(), args.overwrite, &written)?;
        let model_key = || format!("{file}: model.path = \"{}\"", c.model.path.display());
        // A built-in model is the one its built-in run trains from with this seed.
        let model_dir = match crate::builtin::recipe(&c.model.path).with_context(model_key)? {
            Some(recipe) => crate::config::builtin::build_model(recipe, c.run.seed, handle, quiet)
                .with_context(model_key)?,
            None => loaded.resolve(&c.model.path),
        };
        let at = c.model.placement(&file)?;
        let mut lm =
            LanguageModel::open(&model_dir, &at).with_context(|| format!("{file}: model.path"))?;
        let mut state = TrainerState {
            seed: c.run.seed,
            ..TrainerState::default()
        };
        match (&resume, &c.model.adapter) {
            (Some(dir), _) => {
                state = checkpoint::load_into(dir, &mut lm.model)?;
                if state.seed != c.run.seed {
                    bail!(
                        "--resume {}: the checkpoint's run.seed is {} and the config's {}; the order of pairs follows the seed, so a resumed run keeps it",
                        display(dir),
                        state.seed,
                        c.run.seed
                    );
                }
            }
            (None, Some(a)) => peft::load_adapter(&mut lm.model, &loaded.resolve(a))?,
            (None, None) => lm.model.attach_lora(&c.lora.to_config(), c.run.seed)?,
        }
        if state.step >= c.train.steps {
            bail!(
                "the checkpoint is at step {} and train.steps is {}: nothing left to do (raise train.steps to continue)",
                state.step,
                c.train.steps
            );
        }
        let kwargs = &c.rollout.template_kwargs;
        let keys = (c.pairs.chosen_key.as_str(), c.pairs.rejected_key.as_str());
        let tokenize = |loaded: &pairs::LoadedPairs| -> Result<Vec<PairRows>> {
            loaded
                .samples
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    PairRows::of(&lm, p, kwargs, c.pairs.max_length, keys)
                        .with_context(|| loaded.origins.locate(i))
                })
                .collect()
        };
        let all = tokenize(&source)?;
        let (train_rows, eval_rows): (Vec<PairRows>, Vec<PairRows>) = match &held_out {
            HeldOut::File(held) => (all, tokenize(held)?),
            HeldOut::Rows(eval) => all.into_iter().enumerate().partition_map(eval),
        };
        server = super::train::serve_status(&args.status, &hub)?;
        if let Some(server) = &server {
            eprintln!("status: {}", server.url());
            args.status.wait_for_viewer(&hub, &server.url(), quiet);
        }
        let loss = PairLossSettings {
            loss: c.dpo.loss,
            beta: c.dpo.beta,
            label_smoothing: c.dpo.label_smoothing,
            simpo_gamma: c.dpo.simpo_gamma,
        };
        let t = &c.train;
        let schedule = PairSchedule {
            steps: t.steps,
            pairs_per_step: c.pairs.per_step,
            lr: t.lr,
            warmup_steps: t.warmup_steps,
            min_lr_ratio: t.min_lr_ratio,
            weight_decay: t.weight_decay,
            max_grad_norm: t.max_grad_norm,
            micro_batch_tokens: t.micro_batch_tokens,
            pack_sequences: t.pack_sequences,
            seed: c.run.seed,
            shuffle: c.data.shuffle,
        };
        let mut trainer = match kind {
            Objective::Dpo => {
                let mut dpo = Dpo::new(&lm.model, loss, schedule)?;
                // Continuing an adapter: it is the reference, as loaded (on resume too).
                if let Some(a) = &c.model.adapter {
                    dpo.reference = Some(reference_adapter(&lm.model, &loaded.resolve(a))?);
                }
                Trainer::Dpo(dpo)
            }
            Objective::Rm => {
                let head = match &resume {
                    Some(dir) => ScoreHead::load(&lm.model, dir)?,
                    None => ScoreHead::new(&lm.model, c.run.seed)?,
                };
                let center = c.rm.center_rewards_coefficient;
                Trainer::Rm(Rm::new(&lm.model, head, center, schedule)?)
            }
        };
        if let Some(dir) = &resume {
            let (step, opt) = trainer.position();
            checkpoint::load_optimizer(dir, opt, state.optimizer_step)?;
            *step = state.step;
        }
        std::fs::create_dir_all(&out)
            .with_context(|| format!("cannot create the run directory {}", out.display()))?;
        peft::write_atomic(&out.join("config.toml"), toml::to_string(c)?.as_bytes())?;
        let mut log = RunLog::open(&out, resume.as_ref().map(|_| state.step))?;
        let name = kind.name();
        if !quiet {
            let what = match kind {
                Objective::Dpo => format!("{:?} loss, beta {}", c.dpo.loss, c.dpo.beta),
                Objective::Rm => "Bradley-Terry reward model".to_string(),
            };
            eprintln!(
                "{name} ({what}): {} training pairs, {} held out; model {}; run directory {}",
                train_rows.len(),
                eval_rows.len(),
                display(&model_dir),
                display(&out)
            );
        }
        let held = |trainer: &Trainer| -> Result<Option<PairMetrics>> {
            if eval_rows.is_empty() {
                return Ok(None);
            }
            Ok(Some(trainer.evaluate(&eval_rows)?))
        };
        let from = *trainer.position().0;
        hub.resume_at(from);
        hub.set_phase(Phase::Eval);
        let first = held(&trainer)?;
        if let Some(e) = &first {
            hub.eval_start(&EvalPoint {
                step: from,
                accuracy: Some(e.rewards_accuracies),
                reward: e.rewards_margins,
                tool_use: None,
            });
        }
        let bar = crate::progress::enabled(quiet).then(|| {
            let bar = crate::progress::bar(
                t.steps,
                &format!(
                    "{name:<7} {{bar:30}} {{pos}}/{{len}} steps  {{msg}}  [{{elapsed_precise}} < {{eta_precise}}]"
                ),
            );
            bar.set_position(from);
            bar
        });
        let stop_at = args.stop_after.map(|n| from + n);
        let t0 = std::time::Instant::now();
        let mut last_eval = first.clone();
        while *trainer.position().0 < t.steps {
            hub.set_phase(Phase::Update);
            let t_step = std::time::Instant::now();
            let mut record = trainer.step(&train_rows)?;
            let step = record.step;
            let last = step == t.steps;
            if (t.eval_every > 0 && step % t.eval_every == 0) || last {
                hub.set_phase(Phase::Eval);
                record.eval = held(&trainer)?;
                last_eval = record.eval.clone().or(last_eval);
            }
            let mut scalars = record.train.scalars("");
            scalars.extend([
                ("grad_norm".into(), record.grad_norm),
                ("lr".into(), record.lr),
            ]);
            if let Some(e) = &record.eval {
                scalars.extend(e.scalars("eval/"));
            }
            log.write_row(step, &record, &scalars)?;
            hub.step(
                &step_metrics(&record, t_step.elapsed().as_secs_f64()),
                std::iter::empty(),
            );
            let line = format!(
                "loss {:.4}  acc {:.2}  margin {:.3}",
                record.train.loss, record.train.rewards_accuracies, record.train.rewards_margins
            );
            match &bar {
                Some(bar) => {
                    bar.set_position(step);
                    bar.set_message(line);
                }
                None if !quiet => eprintln!("step {step}/{}  {line}", t.steps),
                None => {}
            }
            let stopping = stop_at == Some(step);
            if last || stopping || (t.save_every > 0 && step % t.save_every == 0) {
                let st = TrainerState {
                    step,
                    optimizer_step: step,
                    cursor: Default::default(),
                    seed: c.run.seed,
                };
                let head = trainer.head();
                let opt = match &trainer {
                    Trainer::Dpo(d) => &d.opt,
                    Trainer::Rm(r) => &r.opt,
                };
                let saved = checkpoint::save(&out, &lm, head, opt, &st, t.keep_last)?;
                hub.checkpoint(&display(&saved));
            }
            if stopping && !last {
                if let Some(bar) = &bar {
                    bar.finish_and_clear();
                }
                println!(
                    "{name}: stopped after step {step} of {} (--stop-after); continue with --resume latest",
                    t.steps
                );
                return Ok(());
            }
        }
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
        let adapter = out.join("adapter");
        // Absolute, so that a run elsewhere can tell whether it has the same base
        // (`[[rewards]] model` checks it).
        let base = std::fs::canonicalize(&model_dir)
            .unwrap_or_else(|_| model_dir.clone())
            .display()
            .to_string();
        match &trainer {
            Trainer::Dpo(_) => peft::save_adapter(&lm.model, &adapter, Some(&base))?,
            Trainer::Rm(rm) => rm.save(&adapter, Some(&base))?,
        }
        println!(
            "{name}: {} steps in {:.1} s; {} in {}",
            t.steps,
            t0.elapsed().as_secs_f64(),
            match kind {
                Objective::Dpo => "adapter",
                Objective::Rm => "reward model (adapter and score head)",
            },
            display(&adapter)
        );
        if let (Some(a), Some(b)) = (&first, &last_eval) {
            println!(
                "held-out ({} pairs), {} -> step {}: {} accuracy {:.1}% -> {:.1}%, margin {:.3} -> {:.3}, loss {:.4} -> {:.4}",
                b.pairs,
                if from == 0 {
                    "start".to_string()
                } else {
                    format!("step {from}")
                },
                t.steps,
                match kind {
                    Objective::Dpo => "preference",
                    Objective::Rm => "pairwise",
                },
                100.0 * a.rewards_accuracies,
                100.0 * b.rewards_accuracies,
                a.rewards_margins,
                b.rewards_margins,
                a.loss,
                b.loss
            );
        }
        Ok(())
    })();
    match &result {
        Ok(()) => hub.set_phase(Phase::Done),
        Err(e) => hub.fail(&format!("{e:#}")),
    }
    if server.is_some() && result.is_ok() {
        args.status.linger(quiet);
    }
    result
}

/// A step of a pair trainer as the status endpoint, Prometheus and the dashboard show a
/// training step: the reward is the mean implicit reward margin (DPO's β·Δlog-ratio, the
/// reward model's r_chosen − r_rejected), the accuracy the pairwise accuracy, and the
/// reward components TRL's `rewards/chosen`, `rewards/rejected` and `rewards/margins`;
/// the held-out figures the same of the held-out pairs.
fn step_metrics(r: &StepRecord, step_s: f64) -> StepMetrics {
    StepMetrics {
        step: r.step,
        epoch: r.epoch as u64,
        adapter_version: r.step,
        reward_mean: r.train.rewards_margins,
        rewards: [
            ("chosen", r.train.rewards_chosen),
            ("rejected", r.train.rewards_rejected),
            ("margins", r.train.rewards_margins),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect(),
        accuracy: Some(r.train.rewards_accuracies),
        loss: r.train.loss,
        policy_loss: r.train.loss,
        grad_norm: r.grad_norm,
        lr: r.lr,
        update_s: step_s,
        step_s,
        eval_accuracy: r.eval.as_ref().map(|e| e.rewards_accuracies),
        eval_reward: r.eval.as_ref().map(|e| e.rewards_margins),
        ..StepMetrics::default()
    }
}

/// Where the held-out pairs are: a file of their own (`data.eval_path`), or rows of
/// `data.path` (a seeded share: `data.eval_size` or `data.eval_fraction`, else 10% up to
/// 64), by index, sorted.
enum HeldOut {
    File(pairs::LoadedPairs),
    Rows(Vec<usize>),
}

/// Splits `(index, row)`s into the rows not held out and those held out.
trait PartitionMap {
    fn partition_map(self, held: &[usize]) -> (Vec<PairRows>, Vec<PairRows>);
}

impl<I: Iterator<Item = (usize, PairRows)>> PartitionMap for I {
    fn partition_map(self, held: &[usize]) -> (Vec<PairRows>, Vec<PairRows>) {
        let (eval, train): (Vec<_>, Vec<_>) =
            self.partition(|(i, _)| held.binary_search(i).is_ok());
        let rows = |v: Vec<(usize, PairRows)>| v.into_iter().map(|(_, r)| r).collect();
        (rows(train), rows(eval))
    }
}

fn read_pairs(loaded: &LoadedConfig) -> Result<(pairs::LoadedPairs, HeldOut)> {
    let c = &loaded.config;
    let file = display(&loaded.path);
    let d = &c.data;
    if d.plugin.is_some() {
        bail!("{file}: the pair trainers read their pairs from data.path, not a dataset plugin");
    }
    let path = loaded.resolve(d.path.as_ref().with_context(|| {
        format!("{file}: data.path is not set; the preference pairs are read from it")
    })?);
    let keys = PairKeys {
        prompt: &d.prompt_key,
        messages: &d.messages_key,
        chosen: &c.pairs.chosen_key,
        rejected: &c.pairs.rejected_key,
        margin: c.pairs.margin_key.as_deref(),
    };
    let read = |p: &std::path::Path, max| -> Result<pairs::LoadedPairs> {
        pairs::read(p, Format::of(p, d.format)?, keys, d.on_bad_row, max)
    };
    let all = read(&path, d.max_samples)?;
    if let Some(e) = &d.eval_path {
        let held = read(&loaded.resolve(e), None)?;
        return Ok((all, HeldOut::File(held)));
    }
    let len = all.samples.len();
    let k = d.eval_count(len);
    if k >= len {
        bail!(
            "{file}: holding out {k} pairs for evaluation leaves none of the {len} to train on: lower data.eval_size or data.eval_fraction"
        );
    }
    let (_, eval) = order::split(len as u64, k as u64, c.run.seed);
    Ok((
        all,
        HeldOut::Rows(eval.into_iter().map(|i| i as usize).collect()),
    ))
}
