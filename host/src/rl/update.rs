//! One policy update from a batch of scored trajectories. The batch is split into
//! `mini_batches` (shuffled with a seed, anew each epoch) and passed over `epochs` times;
//! each mini-batch is one optimizer step. Within a mini-batch the rows become
//! micro-batches sized by tokens (several rows a lane where they fit, [`packing`]), each
//! micro-batch's loss weighted so that the accumulated gradient equals the mini-batch's
//! aggregated loss exactly; gradients are then clipped and AdamW steps.
//!
//! Per token t of trajectory i (only tokens the model sampled, `loss_mask` 1):
//! loss_it = −min(ρ·A_i, clip(ρ, 1 − ε_low, 1 + ε_high)·A_i) · w_it + β · KL_it,
//! ρ = exp(logps − old_logps), w_it = min(exp(old_logps − behavior_logps), cap) for
//! trajectories sampled by an older adapter (1 otherwise). `old_logps` is the policy
//! before this batch's first step: recomputed once before it (`old_logps = "recompute"`,
//! RL2's and verl's way), or what the sampler recorded (`"sampler"`; then w = 1). With one
//! mini-batch and one epoch the recomputation would equal `logps`, so `logps` itself is
//! used, detached: ρ = 1 and the step is the plain policy gradient.
//!
//! Every log-prob here is scored at the sampling temperature T, log softmax(z / T): the
//! distribution the sampler drew from and recorded its log-probs under (TRL's
//! `_get_per_token_logps_and_entropies` and verl's actor divide the logits by T the same
//! way), so that ratios, truncated-IS weights and KL compare one distribution with itself.

use super::algorithms::{
    Aggregation, KlEstimator, RolloutCorrection, clipped_surrogate, gae, kl, rollout_mismatch,
    rollout_weights, truncated_is, value_loss, whiten,
};
use super::optim::{Accumulator, AdamW, clip_grad_norm};
use super::packing::{self, Layout};
use super::value_head::ValueHead;
use crate::model::{Mode, Model};
use crate::rollout::Trajectory;
use anyhow::{Result, bail};
use candle_core::{Device, Tensor};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};
use std::sync::Mutex;

/// Where the ratio's denominator comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum OldLogps {
    /// A forward pass with the adapter as it was before the batch's first step.
    Recompute,
    /// The log-probs the sampler recorded (no extra pass; they differ from a recomputation
    /// by the decode kernels' rounding, and for stale rows by the adapter version).
    Sampler,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UpdateConfig {
    pub clip_low: f64,
    pub clip_high: f64,
    pub aggregation: Aggregation,
    /// Dr. GRPO's constant C for `seq-mean-token-sum-norm`.
    pub norm_constant: f64,
    /// KL coefficient in the loss (0: no reference forward at all).
    pub kl_coef: f64,
    /// The KL estimator in the loss.
    pub kl_estimator: KlEstimator,
    /// The KL estimator in the reward ([`sequence_kl`]).
    pub reward_kl_estimator: KlEstimator,
    /// The temperature the trajectories were sampled at: every log-prob is scored at it.
    pub temperature: f64,
    pub tis_cap: f64,
    /// Weights for the sampler's log-probs differing from the trainer's, on every row
    /// (in place of `tis_cap`'s weights for stale rows, which it covers).
    pub rollout_correction: RolloutCorrection,
    pub max_grad_norm: f64,
    /// Most padded tokens (lanes × longest lane) per forward/backward.
    pub micro_batch_tokens: usize,
    /// Pack several rows into each lane of a micro-batch (no padding between them;
    /// attention keeps them apart) instead of one row a lane padded to the longest.
    #[serde(default = "packs")]
    pub pack_sequences: bool,
    /// Optimizer steps per pass over the batch (each on a share of the rows).
    pub mini_batches: usize,
    /// Passes over the batch.
    pub epochs: usize,
    pub old_logps: OldLogps,
    /// PPO with a critic instead of the batch's advantages (`train.algorithm = "ppo"`).
    pub ppo: Option<PpoConfig>,
    /// Counts forward/backward passes over micro-batches (a terminal's progress bar).
    #[serde(skip)]
    pub progress: Option<indicatif::ProgressBar>,
}

fn packs() -> bool {
    false
}

/// PPO's settings: GAE(γ, λ) over token rewards, the clipped value loss and its weight.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PpoConfig {
    pub gamma: f64,
    pub lam: f64,
    /// The value loss's weight in the one loss the shared adapter descends.
    pub vf_coef: f64,
    /// The value's clip range around the old value.
    pub value_clip: f64,
    /// Whiten the advantages over the batch's action tokens (verl always does).
    pub whiten: bool,
    /// β of the per-token KL penalty in the token rewards (0: none), estimated with
    /// `reward_kl_estimator` from the sampler's log-probs.
    pub kl_reward_coef: f64,
}

/// What changes from one step's update to the next.
pub struct StepInputs<'a> {
    pub lr: f64,
    /// Shuffles the mini-batches.
    pub seed: u64,
    /// LoRA dropout's generator (training only, when `lora.dropout > 0`).
    pub dropout: Option<&'a Mutex<StdRng>>,
}

/// One trajectory to learn from.
#[derive(Clone, Copy)]
pub struct Row<'t> {
    pub trajectory: &'t Trajectory,
    pub advantage: f64,
    /// Per-token terms added to `advantage`, `tokens − 1` long like the row's targets
    /// (on-policy distillation's −α·(log π_student − log π_teacher)); empty for none.
    pub token_advantages: &'t [f32],
    /// Sampled by an older adapter version: importance-corrected.
    pub stale: bool,
    /// Completion tokens before it are not trained in this row: a tree's segment that an
    /// earlier row trains (`rollout.tree.shared_prefix = "once"`); 0 for all.
    pub trained_from: usize,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct UpdateStats {
    /// Mean over the first epoch's mini-batches of their aggregated loss (each measured
    /// before its own step).
    pub loss: f64,
    /// Mean over trained tokens of the surrogate alone (first epoch).
    pub policy_loss: f64,
    /// Mean per-token KL to the reference in the loss (first epoch).
    pub kl: f64,
    pub entropy: f64,
    /// Share of trained tokens whose ratio was clipped, over every step.
    pub clip_fraction: f64,
    /// Mean per-token k3 estimate of KL(old ‖ current) over every step, each measured
    /// before its step: how far the epochs moved the policy from the sampled one.
    pub approx_kl: f64,
    /// Mean over the steps of the gradient norm before clipping.
    pub grad_norm: f64,
    pub tokens: usize,
    pub micro_batches: usize,
    /// Optimizer steps taken, of `steps.len()` planned: a mini-batch with nothing to learn
    /// from (every advantage 0, and no KL, value or distillation term) takes none.
    pub optimizer_steps: usize,
    /// PPO: mean per-token clipped value loss (first epoch) and the share of tokens where
    /// the clipped value term was the larger (every step).
    pub value_loss: Option<f64>,
    pub value_clip_fraction: Option<f64>,
    /// How far the sampler's log-probs were from the trainer's before the first step,
    /// over trained tokens (first epoch): the mean k3 estimate of the KL, the mean
    /// |difference| and the largest ratio e^{old − rollout}. `None` when the sampler's
    /// log-probs stand in for the trainer's (`old_logps = "sampler"`).
    pub rollout_kl: Option<f64>,
    pub rollout_logp_diff: Option<f64>,
    pub rollout_max_ratio: Option<f64>,
    /// Each optimizer step in order.
    pub steps: Vec<MiniStats>,
}

/// One optimizer step of an update.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MiniStats {
    pub epoch: usize,
    /// Its rows, as indices into the update's rows.
    pub rows: Vec<usize>,
    /// The mini-batch's aggregated loss before the step.
    pub loss: f64,
    pub clip_fraction: f64,
    pub approx_kl: f64,
    pub grad_norm: f64,
}

/// Inputs, targets, loss mask and sampler log-probs of one row, each `tokens − 1` long:
/// target k is token k + 1; it is trained on when the model sampled it.
struct RowArrays {
    input: Vec<u32>,
    target: Vec<u32>,
    mask: Vec<f32>,
    behavior: Vec<f32>,
}

/// [`row_arrays`] of a row, its completion tokens before `trained_from` left out of the
/// loss (target k is completion token k + 1 − prompt_len).
fn arrays_of(row: &Row) -> RowArrays {
    let t = row.trajectory;
    let mut a = row_arrays(t);
    let before = (t.prompt_len + row.trained_from)
        .saturating_sub(1)
        .min(a.mask.len());
    a.mask[..before].fill(0.0);
    a
}

fn row_arrays(t: &Trajectory) -> RowArrays {
    let n = t.tokens.len();
    let mut mask = vec![0f32; n - 1];
    let mut behavior = vec![0f32; n - 1];
    for (c, lp) in t.logps.iter().enumerate() {
        if let Some(lp) = lp {
            let k = t.prompt_len + c - 1;
            mask[k] = 1.0;
            behavior[k] = *lp;
        }
    }
    RowArrays {
        input: t.tokens[..n - 1].to_vec(),
        target: t.tokens[1..].to_vec(),
        mask,
        behavior,
    }
}

/// A micro-batch, `[L, T]`: the rows of its [`Layout`] packed into `L` lanes (several
/// rows a lane with `train.pack_sequences`, else one), padded on the right to the longest
/// lane.
struct Micro {
    /// Which rows (indices into the update's rows) sit where.
    layout: Layout,
    input: Tensor,
    target: Tensor,
    /// Each token's sequence id within its lane, 0 for padding: the attention mask that
    /// keeps packed rows apart.
    attn: Tensor,
    /// Positions from 0 at each row's first token.
    pos: Tensor,
    mask: Tensor,
    /// Per-token weight making Σ over the mini-batch's micro-batches its aggregate.
    weight: Tensor,
    /// Each token's advantage: its row's, plus the row's per-token term if it has one.
    advantages: Tensor,
}

impl Micro {
    fn shape(&self) -> (usize, usize) {
        (self.layout.lanes, self.layout.width)
    }

    /// `[L, T]` of per-row values (each `tokens − 1` long, indexed like the update's
    /// rows) where their rows sit, zero elsewhere.
    fn pad(&self, per_row: &[Vec<f32>], device: &Device) -> Result<Tensor> {
        let v = self.layout.place(|s, k| per_row[s.row][k]);
        Ok(Tensor::from_vec(v, self.shape(), device)?)
    }

    /// `[L, T]` holding `value(row)` at each of a row's tokens, zero elsewhere.
    fn spread(&self, value: impl Fn(usize) -> f32, device: &Device) -> Result<Tensor> {
        let v = self.layout.place(|s, _| value(s.row));
        Ok(Tensor::from_vec(v, self.shape(), device)?)
    }

    /// Each row's values of an `[L, T]` result, `(row, tokens − 1 values)`.
    fn unpack(&self, x: &Tensor) -> Result<Vec<(usize, Vec<f32>)>> {
        Ok(self.layout.unpack(&x.to_vec2::<f32>()?))
    }
}

/// The micro-batches of the mini-batch `subset` (indices into `rows`), its loss weights
/// aggregating over the subset alone ([`packing::micro_batches`] lays them out).
fn micro_batches(
    rows: &[Row],
    arrays: &[RowArrays],
    subset: &[usize],
    cfg: &UpdateConfig,
    device: &Device,
) -> Result<Vec<Micro>> {
    let total_tokens: f32 = subset
        .iter()
        .map(|&i| arrays[i].mask.iter().sum::<f32>())
        .sum();
    let b_total = subset.len() as f64;
    // Each row's per-token weight, a multiple of its loss mask.
    let weight_of = |mask: &[f32]| -> f32 {
        let len: f32 = mask.iter().sum();
        (match cfg.aggregation {
            Aggregation::TokenMean => 1.0 / total_tokens.max(1.0) as f64,
            Aggregation::SeqMeanTokenMean => 1.0 / (len.max(1.0) as f64 * b_total),
            Aggregation::SeqMeanTokenSum => 1.0 / b_total,
            Aggregation::SeqMeanTokenSumNorm => 1.0 / (b_total * cfg.norm_constant),
        }) as f32
    };
    let weights: Vec<f32> = arrays.iter().map(|a| weight_of(&a.mask)).collect();
    let sized: Vec<(usize, usize)> = subset.iter().map(|&i| (i, arrays[i].input.len())).collect();
    packing::micro_batches(&sized, cfg.pack_sequences, cfg.micro_batch_tokens)
        .into_iter()
        .map(|layout| {
            let shape = (layout.lanes, layout.width);
            let ids = |v: Vec<u32>| Tensor::from_vec(v, shape, device);
            let floats = |v: Vec<f32>| Tensor::from_vec(v, shape, device);
            Ok(Micro {
                input: ids(layout.place(|s, k| arrays[s.row].input[k]))?,
                target: ids(layout.place(|s, k| arrays[s.row].target[k]))?,
                attn: ids(layout.sequence_ids())?,
                pos: ids(layout.positions())?,
                mask: floats(layout.place(|s, k| arrays[s.row].mask[k]))?,
                weight: floats(layout.place(|s, k| arrays[s.row].mask[k] * weights[s.row]))?,
                advantages: floats(layout.place(|s, k| {
                    let row = &rows[s.row];
                    row.advantage as f32 + row.token_advantages.get(k).copied().unwrap_or(0.0)
                }))?,
                layout,
            })
        })
        .collect()
}

/// Log-probs of the targets and entropies, `[B, T]` each, at temperature `temperature`:
/// log softmax(h·Wᵀ / T) = log softmax((h / T)·Wᵀ), so the hidden state is scaled before
/// the head (one `[B, T, H]` multiply instead of one over `[B, T, V]` logits).
fn logps(model: &Model, m: &Micro, mode: Mode, temperature: f64) -> Result<(Tensor, Tensor)> {
    let hidden = model.forward_batch(&m.input, &m.attn, &m.pos, mode)?;
    score(model, &hidden, m, temperature)
}

/// [`logps`] from the last hidden state `[B, T, H]`.
fn score(model: &Model, hidden: &Tensor, m: &Micro, temperature: f64) -> Result<(Tensor, Tensor)> {
    if temperature != 1.0 {
        return Ok(model.logprobs(&(hidden / temperature)?, &m.target)?);
    }
    Ok(model.logprobs(hidden, &m.target)?)
}

/// PPO's per-token targets, fixed for the whole update (each row `tokens − 1` long).
struct PpoTargets {
    advantages: Vec<Vec<f32>>,
    returns: Vec<Vec<f32>>,
    old_values: Vec<Vec<f32>>,
    /// Mean per-token KL put into the rewards (0 without KL in the reward).
    kl: f64,
}

/// Token rewards (the outcome reward on each row's last action, −β·KL on every action),
/// GAE over the action tokens from the critic's values before any step (`old_values`)
/// and, optionally, whitening over the batch.
#[allow(clippy::too_many_arguments)]
fn ppo_targets(
    model: &Model,
    rows: &[Row],
    arrays: &[RowArrays],
    behavior: &[Vec<f32>],
    micros: &[&Micro],
    old_values: Vec<Vec<f32>>,
    p: &PpoConfig,
    cfg: &UpdateConfig,
) -> Result<PpoTargets> {
    // Per-token KL of the sampler's policy to the reference, for KL in the reward.
    let mut kls = vec![Vec::new(); rows.len()];
    for m in micros.iter().filter(|_| p.kl_reward_coef > 0.0) {
        let k = reward_kl(model, m, behavior, cfg)?;
        for (i, row) in m.unpack(&k)? {
            kls[i] = row;
        }
    }
    let (mut advantages, mut returns, mut actions) = (Vec::new(), Vec::new(), Vec::new());
    let (mut kl_sum, mut tokens) = (0.0, 0.0);
    for (i, a) in arrays.iter().enumerate() {
        let on: Vec<bool> = a.mask.iter().map(|m| *m > 0.0).collect();
        let mut r = vec![0.0; on.len()];
        if p.kl_reward_coef > 0.0 {
            for t in (0..on.len()).filter(|&t| on[t]) {
                r[t] -= p.kl_reward_coef * f64::from(kls[i][t]);
                kl_sum += f64::from(kls[i][t]);
                tokens += 1.0;
            }
        }
        if let Some(last) = on.iter().rposition(|x| *x) {
            r[last] += rows[i].trajectory.reward;
        }
        let values: Vec<f64> = old_values[i].iter().map(|v| f64::from(*v)).collect();
        let (adv, ret) = gae(&r, &values, &on, p.gamma, p.lam);
        advantages.push(adv);
        returns.push(ret);
        actions.push(on);
    }
    if p.whiten {
        whiten(&mut advantages, &actions);
    }
    let to_f32 = |v: Vec<Vec<f64>>| -> Vec<Vec<f32>> {
        v.into_iter()
            .map(|r| r.into_iter().map(|x| x as f32).collect())
            .collect()
    };
    Ok(PpoTargets {
        advantages: to_f32(advantages),
        returns: to_f32(returns),
        old_values,
        kl: kl_sum / f64::max(tokens, 1.0),
    })
}

/// Log-probs of every row (each `tokens − 1` long) under `mode`, without gradients.
fn per_row_logps(
    model: &Model,
    micros: &[&Micro],
    mode: Mode,
    temperature: f64,
    lens: &[usize],
) -> Result<Vec<Vec<f32>>> {
    Ok(per_row_pass(model, micros, mode, temperature, lens, true, None)?.0)
}

/// One `tokens − 1`-long vector per row of the update.
type PerRow = Vec<Vec<f32>>;

/// One pass over every row without gradients: each row's log-probs under `mode` (when
/// `want_logps`) and, given a value head, its values from the same hidden states.
fn per_row_pass(
    model: &Model,
    micros: &[&Micro],
    mode: Mode,
    temperature: f64,
    lens: &[usize],
    want_logps: bool,
    head: Option<&ValueHead>,
) -> Result<(PerRow, PerRow)> {
    let (mut logps, mut values) = (vec![Vec::new(); lens.len()], vec![Vec::new(); lens.len()]);
    let keep = |out: &mut Vec<Vec<f32>>, m: &Micro, t: Tensor| -> Result<()> {
        for (i, row) in m.unpack(&t)? {
            debug_assert_eq!(row.len(), lens[i]);
            out[i] = row;
        }
        Ok(())
    };
    // A critic with its own adapter runs its own pass; the policy's is needed for
    // log-probs or a shared critic only.
    let policy_pass = want_logps || head.is_some_and(|h| !h.separate());
    for m in micros {
        let hidden = if policy_pass {
            Some(model.forward_batch(&m.input, &m.attn, &m.pos, mode)?)
        } else {
            None
        };
        if let Some(hidden) = hidden.as_ref().filter(|_| want_logps) {
            keep(&mut logps, m, score(model, hidden, m, temperature)?.0)?;
        }
        if let Some(head) = head {
            let v = head.values(model, (&m.input, &m.attn, &m.pos), hidden.as_ref(), false)?;
            keep(&mut values, m, v)?;
        }
    }
    Ok((logps, values))
}

fn masked_sum(x: &Tensor, mask: &Tensor) -> Result<f64> {
    Ok((x * mask)?.sum_all()?.to_scalar::<f32>()? as f64)
}

/// Each row's summed KL to the reference over its sampled tokens, estimated from the
/// sampler's log-probs with `reward_kl_estimator` (k1 by default, as RL2, TRL's RLOO and
/// verl put in the reward): Σ_t KL(behavior_logps_t, ref_logps_t). For KL in the reward
/// (the reward of row i becomes r_i − β · KL_i, before advantages).
pub fn sequence_kl(model: &Model, rows: &[Row], cfg: &UpdateConfig) -> Result<Vec<f64>> {
    let arrays: Vec<RowArrays> = rows.iter().map(arrays_of).collect();
    let all: Vec<usize> = (0..rows.len()).collect();
    let device = model.device();
    let behavior: Vec<Vec<f32>> = arrays.iter().map(|a| a.behavior.clone()).collect();
    let mut out = vec![0.0; rows.len()];
    for m in &micro_batches(rows, &arrays, &all, cfg, device)? {
        for (i, kl) in m.unpack(&reward_kl(model, m, &behavior, cfg)?)? {
            out[i] = kl.iter().map(|&k| f64::from(k)).sum();
        }
    }
    Ok(out)
}

/// Each row's log-probs of its targets under `mode` at `temperature`, without gradients,
/// `tokens − 1` long (target k is token k + 1), from a forward of `model` (the run's, or
/// another with the same tokenizer): a distillation teacher's reading of the rows at 1.
pub fn token_logps(
    model: &Model,
    rows: &[Row],
    mode: Mode,
    temperature: f64,
    cfg: &UpdateConfig,
) -> Result<Vec<Vec<f32>>> {
    let arrays: Vec<RowArrays> = rows.iter().map(arrays_of).collect();
    let all: Vec<usize> = (0..rows.len()).collect();
    let lens: Vec<usize> = arrays.iter().map(|a| a.input.len()).collect();
    let micros = micro_batches(rows, &arrays, &all, cfg, model.device())?;
    let refs: Vec<&Micro> = micros.iter().collect();
    per_row_logps(model, &refs, mode, temperature, &lens)
}

/// `[B, T]` per-token KL(behavior_logps, ref_logps) of one micro-batch with
/// `reward_kl_estimator`, 0 off the sampled tokens: KL in the reward, summed per row for
/// GRPO ([`sequence_kl`]), per token for PPO's token rewards.
fn reward_kl(
    model: &Model,
    m: &Micro,
    behavior: &[Vec<f32>],
    cfg: &UpdateConfig,
) -> Result<Tensor> {
    let (ref_logps, _) = logps(model, m, Mode::BASE, cfg.temperature)?;
    let k = kl(
        &m.pad(behavior, model.device())?,
        &ref_logps,
        cfg.reward_kl_estimator,
    )?;
    Ok((k * &m.mask)?)
}

/// The mini-batches of each epoch, in order: `k` nearly equal shares of the shuffled rows
/// (in batch order within a share). One mini-batch is the batch as it is.
fn plan(n: usize, k: usize, epochs: usize, seed: u64) -> Vec<(usize, Vec<usize>)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    for epoch in 0..epochs {
        let mut order: Vec<usize> = (0..n).collect();
        if k > 1 {
            order.shuffle(&mut rng);
        }
        let mut rest = &order[..];
        for j in 0..k {
            let size = n / k + usize::from(j < n % k);
            let (share, tail) = rest.split_at(size);
            let mut share = share.to_vec();
            share.sort_unstable();
            out.push((epoch, share));
            rest = tail;
        }
    }
    out
}

/// Updates the adapter (and with PPO the value head `critic`) from `rows`.
pub fn update(
    model: &Model,
    critic: Option<&ValueHead>,
    opt: &mut AdamW,
    rows: &[Row],
    cfg: &UpdateConfig,
    inputs: &StepInputs,
) -> Result<UpdateStats> {
    // A micro-batch's products decide whether splitting them across threads pays.
    let tokens: usize = rows.iter().map(|r| r.trajectory.tokens.len()).sum();
    model.sized(tokens.min(cfg.micro_batch_tokens), || {
        update_here(model, critic, opt, rows, cfg, inputs)
    })
}

fn update_here(
    model: &Model,
    critic: Option<&ValueHead>,
    opt: &mut AdamW,
    rows: &[Row],
    cfg: &UpdateConfig,
    inputs: &StepInputs,
) -> Result<UpdateStats> {
    let StepInputs { lr, seed, dropout } = *inputs;
    if rows.is_empty() {
        bail!("no trajectories to learn from");
    }
    if let Some(r) = rows.iter().find(|r| r.trajectory.tokens.len() < 2) {
        bail!(
            "trajectory of sample {} has fewer than two tokens",
            r.trajectory.sample_id
        );
    }
    let device = model.device();
    let arrays: Vec<RowArrays> = rows.iter().map(arrays_of).collect();
    let k = cfg.mini_batches.clamp(1, rows.len());
    let epochs = cfg.epochs.max(1);
    let steps: Vec<(usize, Vec<usize>, Vec<Micro>)> = plan(rows.len(), k, epochs, seed)
        .into_iter()
        .map(|(e, share)| {
            let micros = micro_batches(rows, &arrays, &share, cfg, device)?;
            Ok((e, share, micros))
        })
        .collect::<Result<_>>()?;
    let train = Mode {
        adapters: true,
        grad: true,
        dropout_rng: dropout,
        adapter: None,
        segments: None,
    };
    // The first epoch covers every row once: its micro-batches give the passes that need
    // the whole batch (the policy before any step, the reference).
    let first_epoch: Vec<&Micro> = steps
        .iter()
        .take_while(|(e, _, _)| *e == 0)
        .flat_map(|(_, _, m)| m)
        .collect();
    let critic = match (&cfg.ppo, critic) {
        (Some(p), Some(head)) => Some((p, head)),
        (Some(_), None) => bail!("PPO needs a value head and none was given"),
        (None, _) => None,
    };
    let fixed = fixed(model, rows, &arrays, &first_epoch, critic, steps.len(), cfg)?;
    let mut stats = UpdateStats {
        micro_batches: first_epoch.len(),
        ..Default::default()
    };
    let params = opt.params().to_vec();
    if let Some(bar) = &cfg.progress {
        bar.reset();
        bar.set_length(steps.iter().map(|(_, _, m)| m.len() as u64).sum());
    }
    let (mut clipped_tokens, mut kl_old_sum, mut step_tokens_sum) = (0.0, 0.0, 0.0);
    let (mut value_loss_sum, mut value_clipped) = (0.0, 0.0);
    // Σ k3, Σ |old − rollout|, max ratio, tokens: the sampler against the trainer.
    let mut mismatch = (0.0, 0.0, 0.0f64, 0.0);
    for (epoch, share, micros) in &steps {
        let mut acc = Accumulator::new(params.len());
        let mut step = MiniStats {
            epoch: *epoch,
            rows: share.clone(),
            ..Default::default()
        };
        let (mut tokens, mut clipped_sum, mut kl_sum) = (0.0, 0.0, 0.0);
        for m in micros {
            if let Some(bar) = &cfg.progress {
                bar.inc(1);
            }
            let (loss, sums) = micro_loss(model, m, &fixed, cfg, *epoch, train)?;
            let grads = loss.backward()?;
            acc.add(&params, &grads)?;
            step.loss += loss.to_scalar::<f32>()? as f64;
            tokens += sums.tokens;
            clipped_sum += sums.clipped;
            kl_sum += sums.kl_old;
            value_clipped += sums.value_clipped;
            if let Some((k3, diff, max_r, n)) = sums.mismatch {
                mismatch = (
                    mismatch.0 + k3,
                    mismatch.1 + diff,
                    mismatch.2.max(max_r),
                    mismatch.3 + n,
                );
            }
            if *epoch == 0 {
                stats.tokens += sums.tokens as usize;
                stats.policy_loss += sums.surrogate;
                stats.entropy += sums.entropy;
                stats.kl += sums.kl_ref;
                value_loss_sum += sums.value_loss;
            }
        }
        let mut grads = acc.take(&params)?;
        step.grad_norm = clip_grad_norm(&mut grads, cfg.max_grad_norm)?;
        if !step.grad_norm.is_finite() {
            bail!(
                "the gradient norm is {}: skipping would hide a diverging run",
                step.grad_norm
            );
        }
        // A mini-batch whose rows all have advantage 0, with no KL, value or distillation
        // term, has nothing to learn from: its gradient is zero. AdamW would still move
        // the adapter, on its momentum and its weight decay, for many steps after the last
        // signal: a run whose groups had all gone flat drifted (entropy 0.8 -> 2.1 with
        // `grad_norm` 0 in each step, issue 63). So such a step leaves the adapter and the
        // optimizer's moments as they are. (A mini-batch whose tokens are all clipped also
        // has a zero gradient, but there the step is PPO's own, and it is taken.)
        let signal = fixed.refs.is_some()
            || fixed.ppo.is_some()
            || share.iter().any(|&i| {
                rows[i].advantage != 0.0 || rows[i].token_advantages.iter().any(|&a| a != 0.0)
            });
        if signal {
            opt.update(&grads, lr)?;
            stats.optimizer_steps += 1;
        }
        step.clip_fraction = clipped_sum / tokens.max(1.0);
        step.approx_kl = kl_sum / tokens.max(1.0);
        (clipped_tokens, kl_old_sum, step_tokens_sum) = (
            clipped_tokens + clipped_sum,
            kl_old_sum + kl_sum,
            step_tokens_sum + tokens,
        );
        if *epoch == 0 {
            stats.loss += step.loss / k as f64;
        }
        stats.grad_norm += step.grad_norm / steps.len() as f64;
        stats.steps.push(step);
    }
    let n = stats.tokens.max(1) as f64;
    stats.policy_loss /= n;
    stats.entropy /= n;
    stats.kl /= n;
    stats.clip_fraction = clipped_tokens / step_tokens_sum.max(1.0);
    stats.approx_kl = kl_old_sum / step_tokens_sum.max(1.0);
    if cfg.old_logps == OldLogps::Recompute && mismatch.3 > 0.0 {
        stats.rollout_kl = Some(mismatch.0 / mismatch.3);
        stats.rollout_logp_diff = Some(mismatch.1 / mismatch.3);
        stats.rollout_max_ratio = Some(mismatch.2);
    }
    if let Some((p, _, t)) = &fixed.ppo {
        stats.value_loss = Some(value_loss_sum / n);
        stats.value_clip_fraction = Some(value_clipped / step_tokens_sum.max(1.0));
        if p.kl_reward_coef > 0.0 {
            stats.kl = t.kl;
        }
    }
    Ok(stats)
}

/// The passes an update needs before its first step, over the first epoch's micro-batches
/// (which cover every row once): the policy before any step and the critic's values, the
/// reference's log-probs and PPO's targets.
fn fixed<'a, 't>(
    model: &Model,
    rows: &'a [Row<'t>],
    arrays: &[RowArrays],
    first_epoch: &[&Micro],
    critic: Option<(&'a PpoConfig, &'a ValueHead)>,
    planned_steps: usize,
    cfg: &UpdateConfig,
) -> Result<Fixed<'a, 't>> {
    let lens: Vec<usize> = arrays.iter().map(|a| a.input.len()).collect();
    let behavior: Vec<Vec<f32>> = arrays.iter().map(|a| a.behavior.clone()).collect();
    // The policy before any step needs a pass of its own unless one step is all there
    // is (then it is the step's own log-probs, detached) or the sampler's stand in; the
    // critic's values before any step come from the same pass.
    let recompute = cfg.old_logps == OldLogps::Recompute && planned_steps > 1;
    let (recomputed, old_values) = if recompute || critic.is_some() {
        let head = critic.map(|(_, h)| h);
        per_row_pass(
            model,
            first_epoch,
            Mode::INFERENCE,
            cfg.temperature,
            &lens,
            recompute,
            head,
        )?
    } else {
        Default::default()
    };
    // `None`: the step's own log-probs, detached.
    let old: Option<Vec<Vec<f32>>> = match cfg.old_logps {
        OldLogps::Sampler => Some(behavior.clone()),
        OldLogps::Recompute => recompute.then_some(recomputed),
    };
    let refs = if cfg.kl_coef > 0.0 {
        Some(per_row_logps(
            model,
            first_epoch,
            Mode::BASE,
            cfg.temperature,
            &lens,
        )?)
    } else {
        None
    };
    let ppo = match critic {
        Some((p, head)) => {
            let t = ppo_targets(
                model,
                rows,
                arrays,
                &behavior,
                first_epoch,
                old_values,
                p,
                cfg,
            )?;
            Some((p, head, t))
        }
        None => None,
    };
    Ok(Fixed {
        rows,
        behavior,
        old,
        refs,
        ppo,
    })
}

/// What an update holds fixed over its steps: the rows, their sampler log-probs, the policy
/// before any step (`None`: each step's own log-probs, detached), the reference's
/// log-probs (with a KL term) and PPO's targets.
struct Fixed<'a, 't> {
    rows: &'a [Row<'t>],
    behavior: Vec<Vec<f32>>,
    old: Option<Vec<Vec<f32>>>,
    refs: Option<Vec<Vec<f32>>>,
    ppo: Option<(&'a PpoConfig, &'a ValueHead, PpoTargets)>,
}

/// A micro-batch's sums over its trained tokens, for the step's figures.
#[derive(Default)]
struct MicroSums {
    tokens: f64,
    /// Tokens whose ratio was clipped.
    clipped: f64,
    /// k3 of KL(old ‖ current) with samples from the old policy: r − 1 − log r.
    kl_old: f64,
    /// The critic's clipped value terms that were the larger.
    value_clipped: f64,
    /// Σ k3, Σ |old − rollout|, max ratio, tokens: the sampler against the trainer
    /// (measured in the first epoch when the old log-probs are recomputed).
    mismatch: Option<(f64, f64, f64, f64)>,
    // First epoch only (0 otherwise): the surrogate, the entropy, the KL to the reference
    // and the value loss.
    surrogate: f64,
    entropy: f64,
    kl_ref: f64,
    value_loss: f64,
}

/// One micro-batch's loss, Σ over its tokens of weight × (clipped surrogate, importance-
/// weighted where the rollout needs it, + β·KL to the reference + the critic's value
/// loss), and its sums for the figures.
fn micro_loss(
    model: &Model,
    m: &Micro,
    fixed: &Fixed,
    cfg: &UpdateConfig,
    epoch: usize,
    train: Mode,
) -> Result<(Tensor, MicroSums)> {
    let device = model.device();
    let Fixed {
        rows,
        behavior,
        old,
        refs,
        ppo,
    } = fixed;
    let hidden = model.forward_batch(&m.input, &m.attn, &m.pos, train)?;
    let (lp, entropy) = score(model, &hidden, m, cfg.temperature)?;
    let old = match old {
        Some(old) => m.pad(old, device)?,
        None => lp.detach(),
    };
    // PPO: each token's own advantage; otherwise its row's.
    let advantages = match ppo {
        Some((_, _, t)) => m.pad(&t.advantages, device)?,
        None => m.advantages.clone(),
    };
    let (surrogate, clipped) =
        clipped_surrogate(&lp, &old, &advantages, cfg.clip_low, cfg.clip_high)?;
    let mut per_token = surrogate.clone();
    let mut sums = MicroSums::default();
    let measure = cfg.old_logps == OldLogps::Recompute && epoch == 0;
    let rollout = if measure || cfg.rollout_correction != RolloutCorrection::None {
        Some(m.pad(behavior, device)?)
    } else {
        None
    };
    if let Some(rollout) = rollout.as_ref().filter(|_| measure) {
        sums.mismatch = Some(rollout_mismatch(&old, rollout, &m.mask)?);
    }
    if let Some(rollout) = rollout.as_ref()
        && cfg.rollout_correction != RolloutCorrection::None
    {
        let w = rollout_weights(&old, rollout, &m.mask, &m.attn, cfg.rollout_correction)?;
        per_token = (per_token * w)?;
    }
    if cfg.old_logps == OldLogps::Recompute
        && cfg.rollout_correction == RolloutCorrection::None
        && m.layout.slots.iter().any(|s| rows[s.row].stale)
    {
        // w = 1 + stale·(min(e^{old − behavior}, cap) − 1): fresh rows weigh 1.
        let stale = m.spread(|i| f32::from(u8::from(rows[i].stale)), device)?;
        let tis = truncated_is(&old, &m.pad(behavior, device)?, cfg.tis_cap)?;
        let w = ((tis - 1.0)? * stale)? + 1.0;
        per_token = (per_token * w?)?;
    }
    let kl_tok = match refs {
        Some(refs) => Some(kl(&lp, &m.pad(refs, device)?, cfg.kl_estimator)?),
        None => None,
    };
    if let Some(k) = &kl_tok {
        per_token = (per_token + (k * cfg.kl_coef)?)?;
    }
    // The critic's loss, never importance-weighted: it regresses returns.
    if let Some((p, head, t)) = ppo {
        let v = head.values(model, (&m.input, &m.attn, &m.pos), Some(&hidden), true)?;
        let (vl, used) = value_loss(
            &v,
            &m.pad(&t.old_values, device)?,
            &m.pad(&t.returns, device)?,
            p.value_clip,
        )?;
        per_token = (per_token + (&vl * p.vf_coef)?)?;
        sums.value_clipped = masked_sum(&used, &m.mask)?;
        if epoch == 0 {
            sums.value_loss = masked_sum(&vl, &m.mask)?;
        }
    }
    let loss = (&per_token * &m.weight)?.sum_all()?;
    sums.tokens = m.mask.sum_all()?.to_scalar::<f32>()? as f64;
    sums.clipped = masked_sum(&clipped, &m.mask)?;
    sums.kl_old = masked_sum(&kl(&old, &lp.detach(), KlEstimator::K3)?, &m.mask)?;
    if epoch == 0 {
        sums.surrogate = masked_sum(&surrogate, &m.mask)?;
        sums.entropy = masked_sum(&entropy, &m.mask)?;
        if let Some(k) = &kl_tok {
            sums.kl_ref = masked_sum(k, &m.mask)?;
        }
    }
    Ok((loss, sums))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::LoraConfig;
    use crate::model::fixtures;
    use crate::rl::optim::AdamWConfig;
    use crate::rollout::Trajectory;

    fn trajectory(tokens: Vec<u32>, prompt_len: usize, masked: &[usize]) -> Trajectory {
        let logps = (prompt_len..tokens.len())
            .map(|i| {
                if masked.contains(&(i - prompt_len)) {
                    None
                } else {
                    Some(-1.0)
                }
            })
            .collect();
        Trajectory::sampled(tokens, prompt_len, logps)
    }

    pub(crate) fn cfg(micro_batch_tokens: usize) -> UpdateConfig {
        UpdateConfig {
            clip_low: 0.2,
            clip_high: 0.28,
            aggregation: Aggregation::SeqMeanTokenMean,
            norm_constant: 64.0,
            kl_coef: 0.05,
            kl_estimator: KlEstimator::K3,
            reward_kl_estimator: KlEstimator::K1,
            temperature: 1.0,
            tis_cap: 2.0,
            rollout_correction: RolloutCorrection::None,
            max_grad_norm: 0.0,
            micro_batch_tokens,
            pack_sequences: true,
            mini_batches: 1,
            epochs: 1,
            old_logps: OldLogps::Recompute,
            ppo: None,
            progress: None,
        }
    }

    fn model() -> Model {
        let mut m = fixtures::load("qwen2");
        m.attach_lora(&LoraConfig::default(), 3).unwrap();
        // A nonzero B so that adapters-on differs from the reference.
        for (i, (name, v)) in m.lora_vars().into_iter().enumerate() {
            if name.ends_with("lora_B") {
                let u = fixtures::uniform(v.dims(), i as u64);
                v.set(&(u * 0.02).unwrap()).unwrap();
            }
        }
        m
    }

    fn rows_of<'a>(ts: &'a [Trajectory], adv: &[f64]) -> Vec<Row<'a>> {
        ts.iter()
            .zip(adv)
            .map(|(t, a)| Row {
                trajectory: t,
                advantage: *a,
                token_advantages: &[],
                stale: false,
                trained_from: 0,
            })
            .collect()
    }

    /// Every row's log-probs (`tokens − 1` each) under `mode` at `temperature`.
    fn scored(m: &Model, rows: &[Row], mode: Mode, temperature: f64) -> Vec<Vec<f32>> {
        token_logps(m, rows, mode, temperature, &cfg(1000)).unwrap()
    }

    fn at(lr: f64, seed: u64) -> StepInputs<'static> {
        StepInputs {
            lr,
            seed,
            dropout: None,
        }
    }

    fn lora_values(m: &Model) -> Vec<Vec<f32>> {
        m.lora_vars()
            .iter()
            .map(|(_, v)| {
                v.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            })
            .collect()
    }

    /// Micro-batching is exact: one row per forward gives the same update as all at once.
    #[test]
    fn micro_batches_accumulate_to_the_whole_batch() {
        let ts = vec![
            trajectory((1..20).collect(), 5, &[3, 4]),
            trajectory((30..42).collect(), 4, &[]),
            trajectory((50..77).collect(), 9, &[0]),
        ];
        let rows = rows_of(&ts, &[1.0, -0.5, 0.25]);
        let mut after = Vec::new();
        for tokens in [10_000, 1] {
            let m = model();
            let mut opt = AdamW::new(m.lora_vars(), AdamWConfig::default()).unwrap();
            let s = update(&m, None, &mut opt, &rows, &cfg(tokens), &at(1e-3, 0)).unwrap();
            assert_eq!(s.micro_batches, if tokens == 1 { 3 } else { 1 });
            assert_eq!(s.tokens, 12 + 8 + 17);
            assert!(s.kl > 0.0 && s.entropy > 0.0);
            after.push((lora_values(&m), s));
        }
        let (a, sa) = &after[0];
        let (b, sb) = &after[1];
        assert!(
            (sa.loss - sb.loss).abs() < 1e-5,
            "{} vs {}",
            sa.loss,
            sb.loss
        );
        assert!((sa.grad_norm - sb.grad_norm).abs() < 1e-4 * sa.grad_norm);
        let d = a
            .iter()
            .zip(b)
            .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
            .fold(0f32, f32::max);
        assert!(d < 1e-6, "max parameter difference {d}");
    }

    /// Packing is exact: rows packed into lanes give the padded layout's update (loss,
    /// gradient norm, parameters), with a stale row's importance weight and with the
    /// per-sequence rollout correction, over two epochs (recomputed old log-probs); and
    /// the lanes hold the rows first-fit decreasing in the longest row's width.
    #[test]
    fn packed_rows_update_as_padded_rows() {
        let ts = vec![
            trajectory((1..30).collect(), 5, &[3, 4]),
            trajectory((30..42).collect(), 4, &[]),
            trajectory((50..62).collect(), 9, &[0]),
            trajectory((80..86).collect(), 3, &[]),
        ];
        let mut rows = rows_of(&ts, &[1.0, -0.5, 0.25, 0.7]);
        rows[2].stale = true;
        let arrays: Vec<RowArrays> = rows.iter().map(arrays_of).collect();
        let micros =
            micro_batches(&rows, &arrays, &[0, 1, 2, 3], &cfg(10_000), &Device::Cpu).unwrap();
        assert_eq!(micros.len(), 1);
        assert_eq!(micros[0].input.dims(), [2, 28]);
        let placed: Vec<(usize, usize, usize)> = micros[0]
            .layout
            .slots
            .iter()
            .map(|s| (s.row, s.lane, s.start))
            .collect();
        assert_eq!(placed, [(0, 0, 0), (1, 1, 0), (2, 1, 11), (3, 1, 22)]);
        let ids = micros[0].attn.to_vec2::<u32>().unwrap();
        assert_eq!(&ids[1][9..13], [1, 1, 2, 2]);
        assert_eq!(ids[1][27], 0);
        let correction = [
            RolloutCorrection::None,
            RolloutCorrection::SeqMis { min: 0.0, cap: 1e3 },
        ];
        for correction in correction {
            let mut after = Vec::new();
            for pack in [false, true] {
                let m = model();
                let mut opt = AdamW::new(m.lora_vars(), AdamWConfig::default()).unwrap();
                let mut c = cfg(10_000);
                c.pack_sequences = pack;
                c.rollout_correction = correction;
                c.epochs = 2;
                let s = update(&m, None, &mut opt, &rows, &c, &at(1e-3, 0)).unwrap();
                assert_eq!(s.tokens, 22 + 8 + 2 + 3);
                after.push((lora_values(&m), s));
            }
            // Each step's loss, gradient norm and KL to the old policy agree to rounding;
            // the parameters to a tenth of one step's size (lr 1e-3): Adam divides each
            // gradient by its own magnitude, so rounding in a near-zero component moves
            // its step by more than rounding moves the loss.
            let ((a, sa), (b, sb)) = (&after[0], &after[1]);
            assert_eq!(sa.steps.len(), 2);
            for (x, y) in sa.steps.iter().zip(&sb.steps) {
                let near = |p: f64, q: f64| (p - q).abs() <= 1e-5 * p.abs().max(1e-3);
                assert!(
                    near(x.loss, y.loss) && near(x.grad_norm, y.grad_norm),
                    "{correction:?}: padded {x:?}, packed {y:?}"
                );
                assert!((x.approx_kl - y.approx_kl).abs() < 1e-6);
            }
            let d = a
                .iter()
                .zip(b)
                .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
                .fold(0f32, f32::max);
            assert!(d < 1e-4, "{correction:?}: max parameter difference {d}");
        }
    }

    /// KL in the reward: zero when the sampler was the reference itself, and the k1 sum
    /// is Σ (behavior − ref) over sampled tokens.
    #[test]
    fn sequence_kl_sums_over_sampled_tokens() {
        let m = model();
        let mut t = trajectory((1..16).collect(), 5, &[2]);
        let rows = rows_of(std::slice::from_ref(&t), &[0.0]);
        let ref_lp = scored(&m, &rows, Mode::BASE, 1.0).remove(0);
        // The sampler's log-probs = the reference's: no KL.
        for (c, lp) in t.logps.iter_mut().enumerate() {
            if lp.is_some() {
                *lp = Some(ref_lp[t.prompt_len + c - 1]);
            }
        }
        let rows = rows_of(std::slice::from_ref(&t), &[0.0]);
        let mut c = cfg(1000);
        c.reward_kl_estimator = KlEstimator::K3;
        assert!(sequence_kl(&m, &rows, &c).unwrap()[0].abs() < 1e-6);
        // Shift the sampler's log-probs by 0.1: k1 sums 0.1 per sampled token (9 of 10).
        for lp in t.logps.iter_mut().flatten() {
            *lp += 0.1;
        }
        let rows = rows_of(std::slice::from_ref(&t), &[0.0]);
        c.reward_kl_estimator = KlEstimator::K1;
        let k1 = sequence_kl(&m, &rows, &c).unwrap()[0];
        assert!((k1 - 0.9).abs() < 1e-4, "{k1}");
    }

    /// A positive advantage makes its trajectory more likely, a negative one less.
    #[test]
    fn the_update_follows_the_advantages() {
        let ts = vec![
            trajectory((1..16).collect(), 5, &[]),
            trajectory((100..115).collect(), 5, &[]),
        ];
        let rows = rows_of(&ts, &[1.0, -1.0]);
        let m = model();
        let seq_logp = |m: &Model, t: &Trajectory| -> f64 {
            let rows = rows_of(std::slice::from_ref(t), &[0.0]);
            let lp = scored(m, &rows, Mode::INFERENCE, 1.0).remove(0);
            let mask = row_arrays(t).mask;
            lp.iter().zip(mask).map(|(l, m)| f64::from(l * m)).sum()
        };
        let before: Vec<f64> = ts.iter().map(|t| seq_logp(&m, t)).collect();
        let mut opt = AdamW::new(m.lora_vars(), AdamWConfig::default()).unwrap();
        let mut c = cfg(1000);
        c.kl_coef = 0.0;
        c.epochs = 3;
        let s = update(&m, None, &mut opt, &rows, &c, &at(1e-3, 0)).unwrap();
        assert_eq!(s.optimizer_steps, 3);
        assert_eq!(
            s.steps[0].clip_fraction, 0.0,
            "ratio is 1 at the first step"
        );
        let after: Vec<f64> = ts.iter().map(|t| seq_logp(&m, t)).collect();
        assert!(after[0] > before[0], "{before:?} -> {after:?}");
        assert!(after[1] < before[1], "{before:?} -> {after:?}");
    }

    /// A step after signal, then a batch with every advantage 0 and no KL term: the second
    /// update's gradient is zero, so it takes no optimizer step and leaves the adapter and
    /// AdamW's moments exactly as they were (AdamW alone would go on moving the adapter on
    /// its first moment: checked here by stepping it once on the zero gradient).
    #[test]
    fn a_batch_without_signal_leaves_the_adapter_where_it_was() {
        let ts = vec![
            trajectory((1..16).collect(), 5, &[]),
            trajectory((100..115).collect(), 5, &[]),
        ];
        let m = model();
        let mut opt = AdamW::new(m.lora_vars(), AdamWConfig::default()).unwrap();
        let mut c = cfg(1000);
        c.kl_coef = 0.0;
        let s = update(
            &m,
            None,
            &mut opt,
            &rows_of(&ts, &[1.0, -1.0]),
            &c,
            &at(1e-2, 0),
        )
        .unwrap();
        assert_eq!((s.optimizer_steps, s.steps.len()), (1, 1));
        let before = lora_values(&m);
        let moments = opt.state().unwrap();
        let s = update(
            &m,
            None,
            &mut opt,
            &rows_of(&ts, &[0.0, 0.0]),
            &c,
            &at(1e-2, 1),
        )
        .unwrap();
        assert_eq!((s.optimizer_steps, s.steps.len()), (0, 1));
        assert_eq!(s.grad_norm, 0.0);
        assert!(s.entropy > 0.0, "the step's figures are still measured");
        assert_eq!(lora_values(&m), before);
        assert_eq!(opt.step, 1);
        for ((a, x), (b, y)) in moments.iter().zip(opt.state().unwrap()) {
            assert_eq!(a, &b);
            let (x, y) = (x.flatten_all().unwrap(), y.flatten_all().unwrap());
            assert_eq!(
                x.to_vec1::<f32>().unwrap(),
                y.to_vec1::<f32>().unwrap(),
                "{a}"
            );
        }
        // What the skip prevents: AdamW stepped on the zero gradient moves the adapter.
        let zeros: Vec<Tensor> = opt
            .params()
            .iter()
            .map(|(_, v)| v.as_tensor().zeros_like().unwrap())
            .collect();
        opt.update(&zeros, 1e-2).unwrap();
        assert_ne!(lora_values(&m), before);
    }

    /// A row's per-token terms (distillation's) add to its advantage token by token: terms
    /// of 0.7 on every token with a row advantage of 0.3 train exactly as an advantage of
    /// 1.0 does, and a term on one token alone moves that token's log-prob the most.
    #[test]
    fn per_token_terms_add_to_the_row_advantage() {
        let ts = vec![
            trajectory((1..16).collect(), 5, &[]),
            trajectory((100..115).collect(), 5, &[2]),
        ];
        let mut c = cfg(1000);
        c.kl_coef = 0.0;
        let run = |rows: &[Row]| -> Vec<Vec<f32>> {
            let m = model();
            let mut opt = AdamW::new(m.lora_vars(), AdamWConfig::default()).unwrap();
            update(&m, None, &mut opt, rows, &c, &at(1e-2, 0)).unwrap();
            scored(&m, &rows_of(&ts, &[0.0, 0.0]), Mode::INFERENCE, 1.0)
        };
        let whole = run(&rows_of(&ts, &[1.0, -1.0]));
        let terms: Vec<Vec<f32>> = ts
            .iter()
            .zip([0.7f32, -0.7])
            .map(|(t, v)| vec![v; t.tokens.len() - 1])
            .collect();
        let mut split = rows_of(&ts, &[0.3, -0.3]);
        for (r, t) in split.iter_mut().zip(&terms) {
            r.token_advantages = t;
        }
        let split = run(&split);
        for (a, b) in whole.iter().flatten().zip(split.iter().flatten()) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        // One token's term alone: that token's log-prob rises more than any other's.
        let before = scored(&model(), &rows_of(&ts, &[0.0, 0.0]), Mode::INFERENCE, 1.0);
        let mut one = vec![0f32; ts[0].tokens.len() - 1];
        one[7] = 5.0;
        let mut rows = rows_of(&ts[..1], &[0.0]);
        rows[0].token_advantages = &one;
        let after = run(&rows);
        let rise: Vec<f32> = after[0]
            .iter()
            .zip(&before[0])
            .map(|(a, b)| a - b)
            .collect();
        let top = (0..rise.len())
            .max_by(|&i, &j| rise[i].total_cmp(&rise[j]))
            .unwrap();
        assert_eq!(top, 7, "{rise:?}");
    }

    /// Mini-batch epochs: the second epoch's steps see ratios away from 1, clipping acts,
    /// and each later step's loss is the reference formula at those ratios. The reference
    /// replays the first epoch alone on a second model (same seed, same shuffle), so it
    /// holds the adapter the full run had before its third step, and computes
    /// verl's seq-mean-token-sum of −min(ρA, clip(ρ, 0.8, 1.28)A) in f64 from that
    /// model's log-probs and the untouched model's (the old policy).
    #[test]
    fn mini_batch_epochs_clip_and_match_the_reference_loss() {
        let ts = vec![
            trajectory((1..20).collect(), 5, &[3, 4]),
            trajectory((30..42).collect(), 4, &[]),
            trajectory((50..77).collect(), 9, &[0]),
            trajectory((80..95).collect(), 3, &[]),
            trajectory((100..110).collect(), 2, &[1]),
        ];
        let adv = [1.0, -1.0, 0.5, -0.5, 1.5];
        let rows = rows_of(&ts, &adv);
        let mut c = cfg(64);
        c.kl_coef = 0.0;
        c.aggregation = Aggregation::SeqMeanTokenSum;
        c.mini_batches = 2;
        c.epochs = 2;
        let lr = 0.0005;
        let seed = 11;
        let m = model();
        let mut opt = AdamW::new(m.lora_vars(), AdamWConfig::default()).unwrap();
        let s = update(&m, None, &mut opt, &rows, &c, &at(lr, seed)).unwrap();
        assert_eq!(s.optimizer_steps, 4);
        let shares: Vec<usize> = s.steps.iter().map(|st| st.rows.len()).collect();
        assert_eq!(shares, [3, 2, 3, 2], "five rows in two nearly equal shares");
        for e in 0..2 {
            let mut seen: Vec<usize> = s.steps[2 * e..2 * e + 2]
                .iter()
                .flat_map(|st| st.rows.clone())
                .collect();
            seen.sort_unstable();
            assert_eq!(seen, [0, 1, 2, 3, 4], "each epoch covers every row once");
        }
        assert_ne!(
            s.steps[0].rows, s.steps[2].rows,
            "each epoch is shuffled anew"
        );
        assert!(s.steps[0].clip_fraction == 0.0 && s.steps[0].approx_kl < 1e-6);
        // lr 5e-4 moves this tiny model's ratios past 1 ± 0.2 for some tokens, not all
        // (measured: 17% and 53% of the second epoch's tokens clipped).
        assert!(
            s.steps[2..]
                .iter()
                .all(|st| st.clip_fraction > 0.0 && st.clip_fraction < 1.0),
            "clipping acts in the second epoch: {:?}",
            s.steps
        );
        assert!(s.clip_fraction > 0.0 && s.approx_kl > 0.0);

        // The adapter before step 3: the first epoch alone, replayed.
        let replay = model();
        let mut opt2 = AdamW::new(replay.lora_vars(), AdamWConfig::default()).unwrap();
        let mut c1 = c.clone();
        c1.epochs = 1;
        let s1 = update(&replay, None, &mut opt2, &rows, &c1, &at(lr, seed)).unwrap();
        assert_eq!(s1.steps[0].rows, s.steps[0].rows);
        let current = scored(&replay, &rows, Mode::INFERENCE, 1.0);
        let old = scored(&model(), &rows, Mode::INFERENCE, 1.0);
        let step = &s.steps[2];
        let (mut loss, mut clipped, mut tokens) = (0.0f64, 0usize, 0usize);
        for &i in &step.rows {
            let mask = row_arrays(&ts[i]).mask;
            for (k, &on) in mask.iter().enumerate() {
                if on == 0.0 {
                    continue;
                }
                let ratio = (f64::from(current[i][k]) - f64::from(old[i][k])).exp();
                let a = adv[i];
                let unclipped = ratio * a;
                let clip = ratio.clamp(0.8, 1.28) * a;
                loss += -unclipped.min(clip);
                clipped += usize::from(clip < unclipped);
                tokens += 1;
            }
        }
        loss /= step.rows.len() as f64;
        assert!(
            (step.loss - loss).abs() < 1e-4 * (1.0 + loss.abs()),
            "step 3 loss {} vs reference {loss}",
            step.loss
        );
        let reference_clip = clipped as f64 / tokens as f64;
        assert!(
            (step.clip_fraction - reference_clip).abs() <= 1.0 / tokens as f64,
            "clip fraction {} vs reference {reference_clip}",
            step.clip_fraction
        );
    }

    /// Sampled at T = 0.7, a trajectory's recorded log-probs are what the update scores
    /// at T = 0.7: with the sampler's log-probs as the old policy every ratio is 1 and
    /// nothing is clipped. Scored at T = 1 (the former behaviour) the same batch reads as
    /// a different policy.
    #[test]
    fn the_update_scores_at_the_sampling_temperature() {
        use crate::sampler::decode::{Sequence, advance};
        use crate::sampler::draw::SamplingParams;
        let m = model();
        let params = SamplingParams {
            temperature: 0.7,
            max_new_tokens: 16,
            seed: 5,
            ..SamplingParams::default()
        };
        let mut seq = Sequence::new(&m, vec![1, 40, 41, 42, 43], 5);
        for _ in 0..16 {
            advance(&m, &mut [&mut seq], Mode::INFERENCE).unwrap();
            seq.sample_next(&params).unwrap();
        }
        let mut t = trajectory(seq.tokens.clone(), seq.prompt_len, &[]);
        t.logps = seq.logprobs.clone();
        let rows = rows_of(std::slice::from_ref(&t), &[1.0]);
        let at_07 = scored(&m, &rows, Mode::INFERENCE, 0.7).remove(0);
        for (c, lp) in t.logps.iter().enumerate() {
            let lp = lp.unwrap();
            let full = at_07[t.prompt_len + c - 1];
            assert!(
                (lp - full).abs() < 1e-4,
                "token {c}: sampled {lp}, scored {full}"
            );
        }
        let mut c = cfg(1000);
        c.kl_coef = 0.0;
        c.old_logps = OldLogps::Sampler;
        let mut approx = Vec::new();
        for temperature in [0.7, 1.0] {
            c.temperature = temperature;
            let m = model();
            let mut opt = AdamW::new(m.lora_vars(), AdamWConfig::default()).unwrap();
            let s = update(&m, None, &mut opt, &rows, &c, &at(1e-3, 0)).unwrap();
            approx.push((s.approx_kl, s.clip_fraction));
        }
        assert!(approx[0].0 < 1e-8 && approx[0].1 == 0.0, "{approx:?}");
        assert!(approx[1].0 > 1e-3, "scored at T = 1: {approx:?}");
    }

    /// The mini-batch plan: `k` shares of sizes differing by at most one, every row once
    /// per epoch, the same for the same seed.
    #[test]
    fn the_plan_splits_each_epoch_into_near_equal_shares() {
        let p = plan(7, 3, 2, 9);
        assert_eq!(p.len(), 6);
        let sizes: Vec<usize> = p.iter().map(|(_, s)| s.len()).collect();
        assert_eq!(sizes, [3, 2, 2, 3, 2, 2]);
        assert_eq!(p, plan(7, 3, 2, 9));
        assert_ne!(p, plan(7, 3, 2, 10));
        assert_eq!(
            plan(4, 1, 2, 9),
            [(0, vec![0, 1, 2, 3]), (1, vec![0, 1, 2, 3])]
        );
    }

    /// PPO: the critic regresses the returns (its loss falls from one update to the
    /// next on the same batch), the value head moves, and the rewarded trajectory becomes
    /// more likely while the unrewarded one becomes less likely. Tool-output tokens (the
    /// masked span) are not actions: they get no advantage and no value loss.
    #[test]
    fn ppo_trains_the_critic_and_follows_the_rewards() {
        ppo_on_a_fixed_batch(false);
    }

    /// The same with a critic adapter of its own: the policy's adapter then learns from
    /// the advantages alone.
    #[test]
    fn ppo_with_a_separate_critic_adapter_trains_both() {
        ppo_on_a_fixed_batch(true);
    }

    fn ppo_on_a_fixed_batch(separate: bool) {
        let mut ts = vec![
            trajectory((1..16).collect(), 5, &[3, 4]),
            trajectory((100..115).collect(), 5, &[3, 4]),
        ];
        ts[0].reward = 1.0;
        ts[1].reward = 0.0;
        let rows = rows_of(&ts, &[0.0, 0.0]);
        let m = model();
        let head = ValueHead::new(&m, separate, 0).unwrap();
        let mut params = m.lora_vars();
        params.extend(head.vars());
        let mut opt = AdamW::new(params, AdamWConfig::default()).unwrap();
        let mut c = cfg(1000);
        c.kl_coef = 0.0;
        c.epochs = 2;
        c.ppo = Some(PpoConfig {
            gamma: 1.0,
            lam: 0.95,
            vf_coef: 0.5,
            value_clip: 0.2,
            whiten: true,
            kl_reward_coef: 0.0,
        });
        let seq = |m: &Model, t: &Trajectory| -> f64 {
            let lp = scored(
                m,
                &rows_of(std::slice::from_ref(t), &[0.0]),
                Mode::INFERENCE,
                1.0,
            );
            let mask = row_arrays(t).mask;
            lp[0].iter().zip(mask).map(|(l, k)| f64::from(l * k)).sum()
        };
        let before = [seq(&m, &ts[0]), seq(&m, &ts[1])];
        let mut value_losses = Vec::new();
        for step in 0..4 {
            let s = update(&m, Some(&head), &mut opt, &rows, &c, &at(1e-3, step)).unwrap();
            value_losses.push(s.value_loss.unwrap());
        }
        assert!(
            value_losses.windows(2).all(|w| w[1] < w[0]),
            "the critic's loss falls: {value_losses:?}"
        );
        let w = head.weight.as_tensor().abs().unwrap().sum_all().unwrap();
        assert!(w.to_scalar::<f32>().unwrap() > 0.0, "the value head moved");
        let after = [seq(&m, &ts[0]), seq(&m, &ts[1])];
        assert!(
            after[0] > before[0] && after[1] < before[1],
            "{before:?} -> {after:?}"
        );

        // The masked span's positions: zero advantage, return and value loss.
        let arrays: Vec<RowArrays> = rows.iter().map(arrays_of).collect();
        let behavior: Vec<Vec<f32>> = arrays.iter().map(|a| a.behavior.clone()).collect();
        let all: Vec<usize> = (0..rows.len()).collect();
        let micros = micro_batches(&rows, &arrays, &all, &c, m.device()).unwrap();
        let refs: Vec<&Micro> = micros.iter().collect();
        let p = c.ppo.clone().unwrap();
        let lens: Vec<usize> = arrays.iter().map(|a| a.input.len()).collect();
        let (_, values) =
            per_row_pass(&m, &refs, Mode::INFERENCE, 1.0, &lens, false, Some(&head)).unwrap();
        let t = ppo_targets(&m, &rows, &arrays, &behavior, &refs, values.clone(), &p, &c).unwrap();
        for span in [ts[0].prompt_len + 3 - 1, ts[0].prompt_len + 4 - 1] {
            assert_eq!(arrays[0].mask[span], 0.0);
            assert_eq!((t.advantages[0][span], t.returns[0][span]), (0.0, 0.0));
        }
        // KL in the token rewards: the last action's return is its own reward,
        // r − β·k1 with k1 = behavior − ref (the sampler recorded −1 for every token).
        let mut p = p;
        p.kl_reward_coef = 0.1;
        let t = ppo_targets(&m, &rows, &arrays, &behavior, &refs, values, &p, &c).unwrap();
        let reference = scored(&m, &rows, Mode::BASE, 1.0);
        let last = arrays[0].mask.iter().rposition(|x| *x > 0.0).unwrap();
        let want = 1.0 - 0.1 * (-1.0 - f64::from(reference[0][last]));
        assert!(
            (f64::from(t.returns[0][last]) - want).abs() < 1e-5,
            "{} vs {want}",
            t.returns[0][last]
        );
        assert!(t.kl > 0.0);
    }
}
