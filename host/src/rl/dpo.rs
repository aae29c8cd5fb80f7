//! `rlhost dpo`: direct preference optimisation of the LoRA adapter on preference pairs
//! ([`crate::data::pairs`]), with the losses of [`super::preference`].
//!
//! How it reads next to TRL's `DPOTrainer` with PEFT:
//! - the reference model is the same model with its adapter off ([`Mode::BASE`]), as
//!   TRL does for a new PEFT adapter: no second copy of the weights. A run that continues
//!   an adapter (`model.adapter`, an SFT warm start say) takes that adapter as it was
//!   loaded for the reference, as TRL does: a snapshot of its tensors, not a second model
//!   ([`reference_adapter`]). Its log-probs are taken in a forward pass of their own without
//!   a gradient graph, on the same packed batch as the policy's (SimPO runs none);
//! - a completion's log-prob is the sum over its learned tokens (the assistant's, as
//!   [`super::sft::completion_row`] marks them), TRL's `logps`;
//! - a step takes `pairs.per_step` pairs in a seeded order (a new order each epoch);
//!   its micro-batches hold whole pairs (a pair's loss needs both completions), up to
//!   `train.micro_batch_tokens`, and their gradients add up to the step's mean loss;
//! - nothing is truncated: a pair longer than `pairs.max_length` is refused when the data is
//!   read (a cut reply is not the reply that was preferred).
//!
//! The trainer's position is the step alone: the order of pairs is a function of the seed
//! and the epoch, so a checkpoint's step says which pairs come next and a resumed run
//! takes exactly the steps the uninterrupted one would.

use super::optim::{Accumulator, AdamW, AdamWConfig, clip_grad_norm, lr_at};
use super::packing;
use super::preference::{PairLoss, PairLossSettings, Sides, pair_loss, reward_metrics};
use super::sft::{SftRow, batch, completion_row, sized};
use crate::data::pairs::Pair;
use crate::model::lora::AdapterSnapshot;
use crate::model::{LanguageModel, Mode, Model, peft};
use anyhow::{Context, Result, bail};
use candle_core::Tensor;
use serde_json::{Map, Value as Json};

/// A pair as training tokens: the prompt and each completion, loss on the completion's
/// assistant turns.
#[derive(Debug, Clone)]
pub struct PairRows {
    pub chosen: SftRow,
    pub rejected: SftRow,
    pub margin: Option<f32>,
}

impl PairRows {
    /// The tokens of `pair`; a side longer than `max_length` tokens (prompt included) is an
    /// error naming it (`keys`: the chosen and rejected columns' names).
    pub fn of(
        lm: &LanguageModel,
        pair: &Pair,
        kwargs: &Map<String, Json>,
        max_length: usize,
        keys: (&str, &str),
    ) -> Result<PairRows> {
        let side = |completion, key: &str| -> Result<SftRow> {
            let row = completion_row(lm, &pair.prompt, completion, kwargs)
                .with_context(|| format!("\"{key}\""))?;
            if row.tokens.len() > max_length {
                bail!(
                    "\"{key}\" is {} tokens with its prompt, over pairs.max_length ({max_length}); raise it or leave the pair out (pairs are not cut: a cut reply is not the one that was preferred)",
                    row.tokens.len()
                );
            }
            if row.loss_mask.iter().skip(1).all(|&m| m == 0) {
                bail!("\"{key}\" has no assistant token to score");
            }
            Ok(row)
        };
        Ok(PairRows {
            chosen: side(&pair.chosen, keys.0)?,
            rejected: side(&pair.rejected, keys.1)?,
            margin: pair.margin,
        })
    }
}

/// The summed log-probs of each row's learned tokens, `[N]` (with the gradient graph
/// `mode` builds), and each row's count of them, all rows in one forward.
pub fn sequence_logps(
    model: &Model,
    rows: &[SftRow],
    pack: bool,
    mode: Mode,
) -> Result<(Tensor, Vec<f32>)> {
    let layout = packing::micro_batches(&sized(rows)?, pack, usize::MAX).remove(0);
    let b = batch(rows, &layout, model.device())?;
    let hidden = model.forward_batch(&b.input, &b.attn, &b.pos, mode)?;
    let (logp, _) = model.logprobs(&hidden, &b.target)?;
    // Row i's sum is its slots' masked log-probs: one [N, L·T] selection matrix (rows may
    // share a lane when packed) times the flattened log-probs.
    let (n, cells) = (rows.len(), layout.lanes * layout.width);
    let mut select = vec![0f32; n * cells];
    let mut tokens = vec![0f32; n];
    for s in &layout.slots {
        let at = s.lane * layout.width + s.start;
        for k in 0..s.len {
            let m = f32::from(rows[s.row].loss_mask[k + 1]);
            select[s.row * cells + at + k] = m;
            tokens[s.row] += m;
        }
    }
    let select = Tensor::from_vec(select, (n, cells), model.device())?;
    let sums = select
        .matmul(
            &logp
                .to_dtype(candle_core::DType::F32)?
                .reshape((cells, 1))?,
        )?
        .squeeze(1)?;
    Ok((sums, tokens))
}

/// The adapter saved in `dir` (the one a run started from) as a set the forward reads in
/// place of the live adapter: the reference of a run that continues an adapter.
pub fn reference_adapter(model: &Model, dir: &std::path::Path) -> Result<AdapterSnapshot> {
    let read = peft::read_pairs(model, dir)?;
    let live: std::collections::HashMap<String, candle_core::TensorId> = model
        .projections()
        .into_iter()
        .filter_map(|(path, _, lin)| lin.lora.as_ref().map(|l| (path, l.lora_a.as_tensor().id())))
        .collect();
    let mut pairs = Vec::new();
    for (module, a, b) in read.pairs {
        let id = live.get(&module).with_context(|| {
            format!(
                "{}: `{module}` has no adapter in the model being trained",
                dir.display()
            )
        })?;
        pairs.push((*id, a, b));
    }
    if pairs.len() != live.len() {
        bail!(
            "{}: the adapter covers {} projections and the one being trained {}",
            dir.display(),
            pairs.len(),
            live.len()
        );
    }
    // Read from the folder and never written: on a GPU its half-precision casts and
    // joined pairs are made once for the run, not at every reference forward.
    Ok(AdapterSnapshot::from_pairs(0, pairs)
        .with_scaling(Some(read.cfg.scaling()))
        .frozen())
}

/// How a run over preference pairs (DPO or a reward model) steps: `[pairs]` and `[train]`.
#[derive(Debug, Clone, Copy)]
pub struct PairSchedule {
    pub steps: u64,
    pub pairs_per_step: usize,
    pub lr: f64,
    pub warmup_steps: u64,
    pub min_lr_ratio: f64,
    pub weight_decay: f64,
    pub max_grad_norm: f64,
    pub micro_batch_tokens: usize,
    pub pack_sequences: bool,
    pub seed: u64,
    /// A new seeded order of the pairs each epoch (`data.shuffle`), else the file's.
    pub shuffle: bool,
}

/// One batch's loss and TRL's metrics.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PairMetrics {
    pub loss: f64,
    pub rewards_chosen: f64,
    pub rewards_rejected: f64,
    pub rewards_margins: f64,
    pub rewards_accuracies: f64,
    /// DPO: mean summed log-probs of the completions under the policy (`logps/chosen`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logps_chosen: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logps_rejected: Option<f64>,
    pub pairs: usize,
}

impl PairMetrics {
    /// TensorBoard's scalars under TRL's names, with `prefix` (`""` or `"eval/"`).
    pub fn scalars(&self, prefix: &str) -> Vec<(String, f64)> {
        [
            ("loss", Some(self.loss)),
            ("rewards/chosen", Some(self.rewards_chosen)),
            ("rewards/rejected", Some(self.rewards_rejected)),
            ("rewards/margins", Some(self.rewards_margins)),
            ("rewards/accuracies", Some(self.rewards_accuracies)),
            ("logps/chosen", self.logps_chosen),
            ("logps/rejected", self.logps_rejected),
        ]
        .into_iter()
        .filter_map(|(k, v)| Some((format!("{prefix}{k}"), v?)))
        .collect()
    }
}

/// What a pass over some pairs collects.
#[derive(Default)]
pub(super) struct Tally {
    pub loss: f64,
    pub chosen_rewards: Vec<f32>,
    pub rejected_rewards: Vec<f32>,
    /// DPO's summed log-probs of the completions (`None`: not a DPO pass).
    pub logps: Option<(f64, f64)>,
}

impl Tally {
    pub(super) fn metrics(&self) -> PairMetrics {
        let n = self.chosen_rewards.len();
        let [c, r, m, a] = reward_metrics(&self.chosen_rewards, &self.rejected_rewards);
        PairMetrics {
            loss: self.loss,
            rewards_chosen: c.1,
            rewards_rejected: r.1,
            rewards_margins: m.1,
            rewards_accuracies: a.1,
            logps_chosen: self.logps.map(|l| l.0 / n.max(1) as f64),
            logps_rejected: self.logps.map(|l| l.1 / n.max(1) as f64),
            pairs: n,
        }
    }
}

/// The pair losses of `pairs` (chosen rows first, then rejected, in one forward each for
/// the policy and the reference), their sum scaled by `scale`, and what they add to
/// `tally`. With `grad`, the scaled sum's gradients are returned.
fn forward_pairs(
    model: &Model,
    reference: Option<&AdapterSnapshot>,
    pairs: &[&PairRows],
    loss: &PairLossSettings,
    Pass { pack, grad, scale }: Pass,
    tally: &mut Tally,
) -> Result<Option<candle_core::backprop::GradStore>> {
    let rows: Vec<SftRow> = pairs
        .iter()
        .map(|p| p.chosen.clone())
        .chain(pairs.iter().map(|p| p.rejected.clone()))
        .collect();
    let n = pairs.len();
    let mode = if grad { Mode::TRAIN } else { Mode::INFERENCE };
    let (logps, tokens) = sequence_logps(model, &rows, pack, mode)?;
    let reference = if loss.loss.uses_reference() {
        let mode = match reference {
            None => Mode::BASE,
            Some(set) => Mode {
                adapter: Some(set),
                ..Mode::INFERENCE
            },
        };
        Some(sequence_logps(model, &rows, pack, mode)?.0)
    } else {
        None
    };
    let tokens = Tensor::from_vec(tokens, 2 * n, model.device())?;
    let halves =
        |t: &Tensor| -> Result<(Tensor, Tensor)> { Ok((t.narrow(0, 0, n)?, t.narrow(0, n, n)?)) };
    let (lc, lr) = halves(&logps)?;
    let (tc, tr) = halves(&tokens)?;
    let refs = reference.as_ref().map(halves).transpose()?;
    let out = pair_loss(
        &Sides {
            chosen: &lc,
            rejected: &lr,
        },
        refs.as_ref()
            .map(|(c, r)| Sides {
                chosen: c,
                rejected: r,
            })
            .as_ref(),
        &Sides {
            chosen: &tc,
            rejected: &tr,
        },
        loss,
    )?;
    let total = (out.loss.sum_all()? * scale)?;
    tally.loss += total.to_scalar::<f32>()? as f64;
    tally
        .chosen_rewards
        .extend(out.chosen_rewards.to_vec1::<f32>()?);
    tally
        .rejected_rewards
        .extend(out.rejected_rewards.to_vec1::<f32>()?);
    let (c, r) = tally.logps.get_or_insert((0.0, 0.0));
    *c += lc.sum_all()?.to_scalar::<f32>()? as f64;
    *r += lr.sum_all()?.to_scalar::<f32>()? as f64;
    Ok(if grad { Some(total.backward()?) } else { None })
}

/// How a pass over pairs runs: packed or padded, with gradients (training) or not, and
/// the share of the step's mean loss each pair's loss is (1 / the step's pairs).
#[derive(Clone, Copy)]
pub(super) struct Pass {
    pub pack: bool,
    pub grad: bool,
    pub scale: f64,
}

/// `pairs` in micro-batches of whole pairs whose rows fit `budget` tokens (lanes × the
/// longest row, as [`packing::micro_batches`] counts a padded batch); a pair over it is a
/// micro-batch of its own.
pub(super) fn micro_batches<'a>(pairs: &[&'a PairRows], budget: usize) -> Vec<Vec<&'a PairRows>> {
    let mut out: Vec<Vec<&PairRows>> = Vec::new();
    let mut longest = 0;
    for &p in pairs {
        let len = p.chosen.tokens.len().max(p.rejected.tokens.len());
        let fits = out
            .last()
            .is_some_and(|last| longest.max(len) * 2 * (last.len() + 1) <= budget);
        if fits {
            longest = longest.max(len);
            out.last_mut().expect("checked").push(p);
        } else {
            longest = len;
            out.push(vec![p]);
        }
    }
    out
}

/// The mean loss and TRL's metrics of `pairs` under the current adapter, no gradients
/// (`reference`: as [`Dpo::reference`]).
pub fn evaluate(
    model: &Model,
    reference: Option<&AdapterSnapshot>,
    pairs: &[PairRows],
    loss: &PairLossSettings,
    schedule: &PairSchedule,
) -> Result<PairMetrics> {
    evaluate_with(pairs, schedule, |mb, pass, tally| {
        forward_pairs(model, reference, mb, loss, pass, tally).map(|_| ())
    })
}

/// The mean loss and metrics of `pairs` for a trainer over pairs, no gradients:
/// `forward(micro_batch, pass, tally)` adds each micro-batch's share.
pub(super) fn evaluate_with(
    pairs: &[PairRows],
    schedule: &PairSchedule,
    mut forward: impl FnMut(&[&PairRows], Pass, &mut Tally) -> Result<()>,
) -> Result<PairMetrics> {
    let all: Vec<&PairRows> = pairs.iter().collect();
    let mut tally = Tally::default();
    let pass = Pass {
        pack: schedule.pack_sequences,
        grad: false,
        scale: 1.0 / pairs.len().max(1) as f64,
    };
    for mb in micro_batches(&all, schedule.micro_batch_tokens) {
        forward(&mb, pass, &mut tally)?;
    }
    Ok(tally.metrics())
}

/// The pairs of step `step` (0-based): `pairs_per_step` of them in the seeded order of
/// the epoch they fall in (the file's order without `shuffle`), the next epoch's order
/// continuing where one ends.
pub fn step_pairs(len: usize, step: u64, per_step: usize, seed: u64, shuffle: bool) -> Vec<usize> {
    let ids: Vec<u64> = (0..len as u64).collect();
    let start = step * per_step as u64;
    let mut out = Vec::with_capacity(per_step);
    let mut order: Option<(u64, Vec<u64>)> = None;
    for k in start..start + per_step as u64 {
        let (epoch, at) = (k / len as u64, (k % len as u64) as usize);
        if order.as_ref().is_none_or(|(e, _)| *e != epoch) {
            order = Some((
                epoch,
                crate::data::order::epoch_order(&ids, seed, epoch, shuffle),
            ));
        }
        out.push(order.as_ref().expect("set above").1[at] as usize);
    }
    out
}

/// One optimizer step's record.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepRecord {
    pub step: u64,
    pub epoch: f64,
    #[serde(flatten)]
    pub train: PairMetrics,
    pub grad_norm: f64,
    pub lr: f64,
    /// The held-out pairs' metrics, on the steps that evaluate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval: Option<PairMetrics>,
}

/// The trainer: the model with its adapter, the optimizer and where it stands.
pub struct Dpo<'a> {
    pub model: &'a Model,
    pub opt: AdamW,
    pub loss: PairLossSettings,
    pub schedule: PairSchedule,
    /// The reference's adapter when the run continues one ([`reference_adapter`]); `None`:
    /// the base model.
    pub reference: Option<AdapterSnapshot>,
    /// Steps done.
    pub step: u64,
}

impl<'a> Dpo<'a> {
    /// A trainer over the model's adapter (attached or loaded before).
    pub fn new(model: &'a Model, loss: PairLossSettings, schedule: PairSchedule) -> Result<Self> {
        let opt = optimizer(model.lora_vars(), &schedule)?;
        if loss.loss == PairLoss::Robust && !(0.0..0.5).contains(&loss.label_smoothing) {
            bail!("the robust loss needs label_smoothing in [0, 0.5)");
        }
        Ok(Dpo {
            model,
            opt,
            loss,
            schedule,
            reference: None,
            step: 0,
        })
    }

    /// Takes the next step on `pairs` and returns its record (without evaluation).
    pub fn step(&mut self, pairs: &[PairRows]) -> Result<StepRecord> {
        let (model, reference, loss) = (self.model, self.reference.as_ref(), &self.loss);
        let pack = self.schedule.pack_sequences;
        take_step(
            &mut self.opt,
            &mut self.step,
            &self.schedule,
            pairs,
            |mb, scale, tally| {
                let pass = Pass {
                    pack,
                    grad: true,
                    scale,
                };
                let grads = forward_pairs(model, reference, mb, loss, pass, tally)?;
                Ok(grads.expect("a training pass returns gradients"))
            },
        )
    }
}

/// The optimizer for `params` with `[train]`'s weight decay; an error without any.
pub(super) fn optimizer(
    params: Vec<(String, candle_core::Var)>,
    s: &PairSchedule,
) -> Result<AdamW> {
    if params.is_empty() {
        bail!("the model has no adapter to train: attach one first");
    }
    Ok(AdamW::new(
        params,
        AdamWConfig {
            weight_decay: s.weight_decay,
            ..AdamWConfig::default()
        },
    )?)
}

/// One optimizer step of a trainer over pairs (DPO, a reward model): the pairs of step
/// `*step` in micro-batches, `forward(micro_batch, scale, tally)` giving each one's
/// gradients of its share (`scale` = 1 / the step's pairs) of the step's mean loss, then
/// clipping, the schedule's learning rate and AdamW. A non-finite gradient norm stops the
/// run before the adapter changes.
pub(super) fn take_step(
    opt: &mut AdamW,
    step: &mut u64,
    s: &PairSchedule,
    pairs: &[PairRows],
    mut forward: impl FnMut(&[&PairRows], f64, &mut Tally) -> Result<candle_core::backprop::GradStore>,
) -> Result<StepRecord> {
    let chosen = step_pairs(pairs.len(), *step, s.pairs_per_step, s.seed, s.shuffle);
    let batch: Vec<&PairRows> = chosen.iter().map(|&i| &pairs[i]).collect();
    let params = opt.params().to_vec();
    let mut acc = Accumulator::new(params.len());
    let mut tally = Tally::default();
    let scale = 1.0 / batch.len() as f64;
    for mb in micro_batches(&batch, s.micro_batch_tokens) {
        acc.add(&params, &forward(&mb, scale, &mut tally)?)?;
    }
    let mut grads = acc.take(&params)?;
    let grad_norm = clip_grad_norm(&mut grads, s.max_grad_norm)?;
    if !grad_norm.is_finite() {
        bail!(
            "step {}: the gradient norm is {grad_norm}; the adapter was not changed (lower train.lr, or check the pairs)",
            *step + 1
        );
    }
    let lr = lr_at(*step, s.steps, s.warmup_steps, s.lr, s.min_lr_ratio);
    opt.update(&grads, lr)?;
    *step += 1;
    Ok(StepRecord {
        step: *step,
        epoch: (*step * s.pairs_per_step as u64) as f64 / pairs.len() as f64,
        train: tally.metrics(),
        grad_norm,
        lr,
        eval: None,
    })
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::model::{Placement, fixtures};
    use crate::task::Message;

    fn pair(q: &str, c: &str, r: &str) -> Pair {
        Pair {
            prompt: vec![Message::new("user", q)],
            chosen: vec![Message::new("assistant", c)],
            rejected: vec![Message::new("assistant", r)],
            margin: None,
        }
    }

    /// DPO's sigmoid loss at β 0.5.
    fn sigmoid() -> PairLossSettings {
        PairLossSettings {
            loss: PairLoss::Sigmoid,
            beta: 0.5,
            label_smoothing: 0.0,
            simpo_gamma: 0.0,
        }
    }

    /// Two pairs a step at a constant `lr`, padded, no weight decay.
    fn two_pairs_a_step(steps: u64, lr: f64) -> PairSchedule {
        PairSchedule {
            steps,
            pairs_per_step: 2,
            lr,
            warmup_steps: 0,
            min_lr_ratio: 1.0,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            micro_batch_tokens: 8192,
            pack_sequences: false,
            seed: 1,
            shuffle: true,
        }
    }

    /// Three short one-turn conversations of the fixture model, as training rows.
    pub(in crate::rl) fn three_rows(lm: &LanguageModel) -> Vec<SftRow> {
        [("hi", "hello there"), ("2+2?", "4"), ("name?", "a model")]
            .iter()
            .map(|(q, a)| {
                completion_row(
                    lm,
                    &[Message::new("user", *q)],
                    &[Message::new("assistant", *a)],
                    &Map::new(),
                )
                .unwrap()
            })
            .collect()
    }

    /// A row's summed log-prob is the same alone, padded beside others and packed with
    /// them.
    #[test]
    fn sequence_logps_are_the_rows_own_whatever_the_batch() {
        let lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
        let rows = three_rows(&lm);
        let alone: Vec<f32> = rows
            .iter()
            .map(|r| {
                sequence_logps(&lm.model, std::slice::from_ref(r), false, Mode::INFERENCE)
                    .unwrap()
                    .0
                    .to_vec1::<f32>()
                    .unwrap()[0]
            })
            .collect();
        for pack in [false, true] {
            let (all, tokens) = sequence_logps(&lm.model, &rows, pack, Mode::INFERENCE).unwrap();
            for (a, b) in alone.iter().zip(all.to_vec1::<f32>().unwrap()) {
                assert!((a - b).abs() < 1e-4, "pack {pack}: {a} vs {b}");
            }
            let want: Vec<f32> = rows
                .iter()
                .map(|r| r.loss_mask[1..].iter().map(|&m| m as f32).sum())
                .collect();
            assert_eq!(tokens, want);
        }
    }

    /// Step k's pairs are the seeded epoch order's, across epoch ends, and a fresh call
    /// gives the same (what an exact resume relies on).
    #[test]
    fn step_pairs_walk_the_epochs_in_seeded_order() {
        let all: Vec<usize> = (0..5).flat_map(|s| step_pairs(4, s, 3, 9, true)).collect();
        // 15 picks over 4 pairs: each epoch of 4 is a permutation.
        for epoch in all.chunks(4).filter(|c| c.len() == 4) {
            let mut e = epoch.to_vec();
            e.sort();
            assert_eq!(e, [0, 1, 2, 3]);
        }
        assert_eq!(step_pairs(4, 3, 3, 9, true), all[9..12]);
    }

    /// Issue 65: the losses, TRL's reward metrics and every LoRA gradient on a fixed batch
    /// against TRL's own trainers (`scripts/preference_reference.py`: `DPOTrainer` for
    /// sigmoid, robust and IPO, `CPOTrainer` for SimPO), on the fixture model with its
    /// PEFT adapter (non-zero, so the policy is not the reference).
    #[test]
    fn dpo_matches_trls_trainers_on_the_fixture_batch() {
        let fixtures = fixtures::model_dir("qwen2").join("../..");
        let meta: Json = serde_json::from_str(
            &std::fs::read_to_string(fixtures.join("preference_reference.json")).unwrap(),
        )
        .unwrap();
        let grads_ref = candle_core::safetensors::load(
            fixtures.join("preference_reference.safetensors"),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let mut lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
        crate::model::peft::load_adapter(
            &mut lm.model,
            &fixtures::model_dir("qwen2").join("adapter"),
        )
        .unwrap();
        let ids = |v: &Json| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        let rows: Vec<PairRows> = meta["pairs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                let prompt = ids(&p["prompt_ids"]);
                let side = |key: &str| {
                    let c = ids(&p[key]);
                    let mut loss_mask = vec![0u8; prompt.len()];
                    loss_mask.extend(std::iter::repeat_n(1u8, c.len()));
                    SftRow {
                        tokens: prompt.iter().chain(&c).copied().collect(),
                        loss_mask,
                    }
                };
                PairRows {
                    chosen: side("chosen_ids"),
                    rejected: side("rejected_ids"),
                    margin: None,
                }
            })
            .collect();
        let beta = meta["beta"].as_f64().unwrap();
        for (name, loss) in [
            ("sigmoid", PairLoss::Sigmoid),
            ("robust", PairLoss::Robust),
            ("ipo", PairLoss::Ipo),
            ("simpo", PairLoss::Simpo),
        ] {
            let case = &meta["cases"][name];
            let settings = PairLossSettings {
                loss,
                beta,
                label_smoothing: case["label_smoothing"].as_f64().unwrap(),
                simpo_gamma: case["simpo_gamma"].as_f64().unwrap_or(0.0),
            };
            let refs: Vec<&PairRows> = rows.iter().collect();
            let mut tally = Tally::default();
            let pass = Pass {
                pack: false,
                grad: true,
                scale: 1.0 / rows.len() as f64,
            };
            let grads = forward_pairs(&lm.model, None, &refs, &settings, pass, &mut tally)
                .unwrap()
                .unwrap();
            let want = case["loss"].as_f64().unwrap();
            assert!(
                (tally.loss - want).abs() < 1e-5,
                "{name}: loss {} vs TRL {want}",
                tally.loss
            );
            let m = tally.metrics();
            for (key, got) in [
                ("rewards/chosen", m.rewards_chosen),
                ("rewards/rejected", m.rewards_rejected),
                ("rewards/margins", m.rewards_margins),
                ("rewards/accuracies", m.rewards_accuracies),
            ] {
                let want = case["metrics"][key].as_f64().unwrap();
                assert!(
                    (got - want).abs() < 1e-5,
                    "{name}: {key} {got} vs TRL {want}"
                );
            }
            let mut compared = 0;
            for (var_name, var) in lm.model.lora_vars() {
                let want = &grads_ref[&format!("{name}/{var_name}")];
                let got = grads.get(var.as_tensor()).unwrap();
                let (diff, scale) = (fixtures::max_diff(got, want), fixtures::max_abs(want));
                assert!(
                    diff <= 1e-4 * scale.max(1e-3),
                    "{name}: {var_name} grad off by {diff} (max {scale})"
                );
                compared += 1;
            }
            assert_eq!(
                compared,
                grads_ref
                    .keys()
                    .filter(|k| k.starts_with(&format!("{name}/")))
                    .count()
            );
        }
    }

    /// A run that continues an adapter takes it as loaded for the reference (TRL's rule
    /// for a PEFT model that holds one): at the start the policy is the reference, every
    /// reward is 0 and the loss is log 2, while the base model as reference would not
    /// give that (the fixture adapter is not zero).
    #[test]
    fn a_continued_adapter_is_its_own_reference() {
        let dir = fixtures::model_dir("qwen2").join("adapter");
        let mut lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
        crate::model::peft::load_adapter(&mut lm.model, &dir).unwrap();
        let kw = Map::new();
        let pairs: Vec<PairRows> = [pair("2+2?", "4", "5"), pair("3+3?", "6", "7")]
            .iter()
            .map(|p| PairRows::of(&lm, p, &kw, 512, ("chosen", "rejected")).unwrap())
            .collect();
        let (loss, schedule) = (sigmoid(), two_pairs_a_step(1, 1e-3));
        let set = reference_adapter(&lm.model, &dir).unwrap();
        let own = evaluate(&lm.model, Some(&set), &pairs, &loss, &schedule).unwrap();
        assert!((own.loss - std::f64::consts::LN_2).abs() < 1e-6, "{own:?}");
        assert!(own.rewards_chosen.abs() < 1e-6 && own.rewards_rejected.abs() < 1e-6);
        let base = evaluate(&lm.model, None, &pairs, &loss, &schedule).unwrap();
        assert!(base.rewards_chosen.abs() > 1e-3, "{base:?}");
    }

    /// At the start the adapter is zero (PEFT's B = 0), so the policy is the reference:
    /// every implicit reward is 0 and the sigmoid loss is log 2. A few steps on one pair
    /// raise its margin and accuracy.
    #[test]
    fn dpo_starts_at_log_two_and_learns_a_pair() {
        let mut lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
        lm.model
            .attach_lora(&crate::model::LoraConfig::default(), 3)
            .unwrap();
        let kw = Map::new();
        let pairs: Vec<PairRows> = [pair("2+2?", "4", "5"), pair("3+3?", "6", "7")]
            .iter()
            .map(|p| PairRows::of(&lm, p, &kw, 512, ("chosen", "rejected")).unwrap())
            .collect();
        let (loss, schedule) = (sigmoid(), two_pairs_a_step(20, 5e-3));
        let start = evaluate(&lm.model, None, &pairs, &loss, &schedule).unwrap();
        assert!(
            (start.loss - std::f64::consts::LN_2).abs() < 1e-5,
            "{start:?}"
        );
        assert_eq!(start.rewards_margins, 0.0);
        let mut dpo = Dpo::new(&lm.model, loss, schedule).unwrap();
        for _ in 0..20 {
            dpo.step(&pairs).unwrap();
        }
        let end = evaluate(&lm.model, None, &pairs, &loss, &schedule).unwrap();
        assert!(end.loss < 0.3 && end.rewards_accuracies == 1.0, "{end:?}");
    }
}
