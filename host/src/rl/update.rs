//! One policy update from a batch of scored trajectories: the rows become padded
//! micro-batches sized by tokens, each micro-batch's loss is weighted so that the
//! accumulated gradient equals the whole batch's aggregated loss exactly, then gradients
//! are clipped and AdamW steps once per pass over the batch (`updates_per_batch` passes).
//!
//! Per token t of trajectory i (only tokens the model sampled, `loss_mask` 1):
//! loss_it = −min(ρ·A_i, clip(ρ, 1 − ε_low, 1 + ε_high)·A_i) · w_it + β · KL_it,
//! ρ = exp(logps − old_logps), w_it = min(exp(old_logps − behavior_logps), cap) for
//! trajectories sampled by an older adapter (1 otherwise). `old_logps` is the policy
//! before this batch's first update: with one pass it is `logps` itself (detached), so
//! ρ = 1 and the update is the plain policy gradient.

use super::algorithms::{Aggregation, KlEstimator, clipped_surrogate, kl, truncated_is};
use super::optim::{Accumulator, AdamW, clip_grad_norm};
use crate::model::{Mode, Model};
use crate::rollout::Trajectory;
use anyhow::{Result, bail};
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};
use std::sync::Mutex;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UpdateConfig {
    pub clip_low: f64,
    pub clip_high: f64,
    pub aggregation: Aggregation,
    /// Dr. GRPO's constant C for `seq-mean-token-sum-norm`.
    pub norm_constant: f64,
    /// KL coefficient in the loss (0: no reference forward at all).
    pub kl_coef: f64,
    pub kl_estimator: KlEstimator,
    pub tis_cap: f64,
    pub max_grad_norm: f64,
    /// Most padded tokens (rows × longest row) per forward/backward.
    pub micro_batch_tokens: usize,
    pub updates_per_batch: usize,
    /// Counts forward/backward passes over micro-batches (a terminal's progress bar).
    #[serde(skip)]
    pub progress: Option<indicatif::ProgressBar>,
}

/// One trajectory to learn from.
pub struct Row<'t> {
    pub trajectory: &'t Trajectory,
    pub advantage: f64,
    /// Sampled by an older adapter version: importance-corrected.
    pub stale: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct UpdateStats {
    /// The aggregated loss of the first pass (what the first step descended).
    pub loss: f64,
    /// Mean over trained tokens of the surrogate alone.
    pub policy_loss: f64,
    pub kl: f64,
    pub entropy: f64,
    pub clip_fraction: f64,
    /// Gradient norm before clipping, last pass.
    pub grad_norm: f64,
    pub tokens: usize,
    pub micro_batches: usize,
    pub optimizer_steps: usize,
}

/// A padded micro-batch, `[B, T]`.
struct Micro {
    input: Tensor,
    target: Tensor,
    attn: Tensor,
    pos: Tensor,
    mask: Tensor,
    /// Per-token weight making Σ over micro-batches the batch aggregate.
    weight: Tensor,
    advantages: Tensor,
    behavior: Vec<Vec<f32>>,
    stale: Vec<bool>,
}

/// Inputs, targets and masks of one row: target k is token k + 1; it is trained on when
/// the model sampled it.
fn row_arrays(t: &Trajectory) -> (Vec<u32>, Vec<u32>, Vec<f32>, Vec<f32>) {
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
    (
        t.tokens[..n - 1].to_vec(),
        t.tokens[1..].to_vec(),
        mask,
        behavior,
    )
}

fn micro_batches(rows: &[Row], cfg: &UpdateConfig, device: &Device) -> Result<Vec<Micro>> {
    let arrays: Vec<_> = rows.iter().map(|r| row_arrays(r.trajectory)).collect();
    let total_tokens: f32 = arrays.iter().map(|a| a.2.iter().sum::<f32>()).sum();
    let b_total = rows.len() as f64;
    let weight_of = |mask: &[f32]| -> Vec<f32> {
        let len: f32 = mask.iter().sum();
        let w = match cfg.aggregation {
            Aggregation::TokenMean => 1.0 / total_tokens.max(1.0) as f64,
            Aggregation::SeqMeanTokenMean => 1.0 / (len.max(1.0) as f64 * b_total),
            Aggregation::SeqMeanTokenSumNorm => 1.0 / (b_total * cfg.norm_constant),
        } as f32;
        mask.iter().map(|m| m * w).collect()
    };
    let mut out = Vec::new();
    let mut start = 0;
    while start < rows.len() {
        let mut end = start + 1;
        let mut longest = arrays[start].0.len();
        while end < rows.len() {
            let l = longest.max(arrays[end].0.len());
            if l * (end + 1 - start) > cfg.micro_batch_tokens {
                break;
            }
            longest = l;
            end += 1;
        }
        let b = end - start;
        let (mut input, mut target, mut attn, mut pos, mut mask, mut weight) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        let mut behavior = vec![];
        for (inp, tgt, m, beh) in &arrays[start..end] {
            let w = weight_of(m);
            let pad = longest - inp.len();
            input.extend(inp.iter().copied().chain(std::iter::repeat_n(0, pad)));
            target.extend(tgt.iter().copied().chain(std::iter::repeat_n(0, pad)));
            attn.extend((0..longest).map(|i| u32::from(i < inp.len())));
            pos.extend(0..longest as u32);
            let m_row: Vec<f32> = m
                .iter()
                .copied()
                .chain(std::iter::repeat_n(0.0, pad))
                .collect();
            mask.extend(m_row);
            weight.extend(w.into_iter().chain(std::iter::repeat_n(0.0, pad)));
            behavior.push(
                beh.iter()
                    .copied()
                    .chain(std::iter::repeat_n(0.0, pad))
                    .collect(),
            );
        }
        let adv: Vec<f32> = rows[start..end]
            .iter()
            .map(|r| r.advantage as f32)
            .collect();
        out.push(Micro {
            input: Tensor::from_vec(input, (b, longest), device)?,
            target: Tensor::from_vec(target, (b, longest), device)?,
            attn: Tensor::from_vec(attn, (b, longest), device)?,
            pos: Tensor::from_vec(pos, (b, longest), device)?,
            mask: Tensor::from_vec(mask, (b, longest), device)?,
            weight: Tensor::from_vec(weight, (b, longest), device)?,
            advantages: Tensor::from_vec(adv, (b, 1), device)?,
            behavior,
            stale: rows[start..end].iter().map(|r| r.stale).collect(),
        });
        start = end;
    }
    Ok(out)
}

fn logps(model: &Model, m: &Micro, mode: Mode) -> Result<(Tensor, Tensor)> {
    let hidden = model.forward_batch(&m.input, &m.attn, &m.pos, mode)?;
    Ok(model.logprobs(&hidden, &m.target)?)
}

fn masked_sum(x: &Tensor, mask: &Tensor) -> Result<f64> {
    Ok((x * mask)?.sum_all()?.to_scalar::<f32>()? as f64)
}

/// Each row's summed KL to the reference over its sampled tokens, estimated from the
/// sampler's log-probs: Σ_t KL(behavior_logps_t, ref_logps_t). For KL in the reward
/// (the reward of row i becomes r_i − β · KL_i, before advantages).
pub fn sequence_kl(model: &Model, rows: &[Row], cfg: &UpdateConfig) -> Result<Vec<f64>> {
    let micros = micro_batches(rows, cfg, model.device())?;
    let mut out = Vec::with_capacity(rows.len());
    for m in &micros {
        let (ref_logps, _) = logps(model, m, Mode::BASE)?;
        let behavior: Vec<f32> = m.behavior.iter().flatten().copied().collect();
        let behavior = Tensor::from_vec(behavior, ref_logps.shape(), model.device())?;
        let k = kl(&behavior, &ref_logps, cfg.kl_estimator)?;
        let per_row = (k * &m.mask)?.sum(1)?.to_vec1::<f32>()?;
        out.extend(per_row.into_iter().map(f64::from));
    }
    Ok(out)
}

/// Updates the adapter from `rows`; `lr` is this step's learning rate.
pub fn update(
    model: &Model,
    opt: &mut AdamW,
    rows: &[Row],
    cfg: &UpdateConfig,
    lr: f64,
    dropout: Option<&Mutex<StdRng>>,
) -> Result<UpdateStats> {
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
    let micros = micro_batches(rows, cfg, device)?;
    let passes = cfg.updates_per_batch.max(1);
    let train = Mode {
        adapters: true,
        grad: true,
        dropout_rng: dropout,
        adapter: None,
    };
    // The policy before any update, when more than one pass needs it fixed.
    let fixed_old: Option<Vec<Tensor>> = if passes > 1 {
        Some(
            micros
                .iter()
                .map(|m| Ok(logps(model, m, Mode::INFERENCE)?.0))
                .collect::<Result<_>>()?,
        )
    } else {
        None
    };
    let refs: Option<Vec<Tensor>> = if cfg.kl_coef > 0.0 {
        Some(
            micros
                .iter()
                .map(|m| Ok(logps(model, m, Mode::BASE)?.0))
                .collect::<Result<_>>()?,
        )
    } else {
        None
    };
    let mut stats = UpdateStats {
        micro_batches: micros.len(),
        ..Default::default()
    };
    let params = opt.params().to_vec();
    if let Some(bar) = &cfg.progress {
        bar.reset();
        bar.set_length((passes * micros.len()) as u64);
    }
    for pass in 0..passes {
        let mut acc = Accumulator::new(params.len());
        for (i, m) in micros.iter().enumerate() {
            if let Some(bar) = &cfg.progress {
                bar.inc(1);
            }
            let (lp, entropy) = logps(model, m, train)?;
            let old = match &fixed_old {
                Some(old) => old[i].clone(),
                None => lp.detach(),
            };
            let (surrogate, clipped) =
                clipped_surrogate(&lp, &old, &m.advantages, cfg.clip_low, cfg.clip_high)?;
            let mut per_token = surrogate.clone();
            if m.stale.iter().any(|s| *s) {
                // Fresh rows get their own old log-probs as behavior: weight 1.
                let old_rows = old.to_vec2::<f32>()?;
                let behavior: Vec<f32> = m
                    .behavior
                    .iter()
                    .zip(&old_rows)
                    .zip(&m.stale)
                    .flat_map(|((b, o), stale)| if *stale { b.clone() } else { o.clone() })
                    .collect();
                let behavior = Tensor::from_vec(behavior, old.shape(), device)?;
                per_token = (per_token * truncated_is(&old, &behavior, cfg.tis_cap)?)?;
            }
            let kl_tok = match &refs {
                Some(refs) => Some(kl(&lp, &refs[i], cfg.kl_estimator)?),
                None => None,
            };
            if let Some(k) = &kl_tok {
                per_token = (per_token + (k * cfg.kl_coef)?)?;
            }
            let loss = (&per_token * &m.weight)?.sum_all()?;
            let grads = loss.backward()?;
            acc.add(&params, &grads)?;
            if pass == 0 {
                stats.loss += loss.to_scalar::<f32>()? as f64;
                stats.tokens += m.mask.sum_all()?.to_scalar::<f32>()? as usize;
                stats.policy_loss += masked_sum(&surrogate, &m.mask)?;
                stats.entropy += masked_sum(&entropy, &m.mask)?;
                stats.clip_fraction += masked_sum(&clipped, &m.mask)?;
                if let Some(k) = &kl_tok {
                    stats.kl += masked_sum(k, &m.mask)?;
                }
            }
        }
        let mut grads = acc.take(&params)?;
        stats.grad_norm = clip_grad_norm(&mut grads, cfg.max_grad_norm)?;
        if !stats.grad_norm.is_finite() {
            bail!(
                "the gradient norm is {}: skipping would hide a diverging run",
                stats.grad_norm
            );
        }
        opt.update(&grads, lr)?;
        stats.optimizer_steps += 1;
    }
    let n = stats.tokens.max(1) as f64;
    stats.policy_loss /= n;
    stats.entropy /= n;
    stats.clip_fraction /= n;
    stats.kl /= n;
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LoraConfig;
    use crate::model::fixtures;
    use crate::rl::optim::AdamWConfig;
    use crate::rollout::{StopReason, Trajectory};

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
        Trajectory {
            sample_id: 0,
            index: 0,
            version: 0,
            prompt_len,
            logps,
            tokens,
            spans: vec![],
            messages: vec![],
            completion: String::new(),
            metadata: serde_json::json!({}),
            turns: 1,
            tool_calls: 0,
            tool_truncations: 0,
            stop: StopReason::EndOfTurn,
            truncated: false,
            faults: vec![],
            rewards: Default::default(),
            reward: 0.0,
        }
    }

    fn cfg(micro_batch_tokens: usize) -> UpdateConfig {
        UpdateConfig {
            clip_low: 0.2,
            clip_high: 0.28,
            aggregation: Aggregation::SeqMeanTokenMean,
            norm_constant: 64.0,
            kl_coef: 0.05,
            kl_estimator: KlEstimator::K3,
            tis_cap: 2.0,
            max_grad_norm: 0.0,
            micro_batch_tokens,
            updates_per_batch: 1,
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
                stale: false,
            })
            .collect()
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
            let s = update(&m, &mut opt, &rows, &cfg(tokens), 1e-3, None).unwrap();
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

    /// KL in the reward: zero when the sampler was the reference itself, and the k1 sum
    /// is Σ (behavior − ref) over sampled tokens.
    #[test]
    fn sequence_kl_sums_over_sampled_tokens() {
        let m = model();
        let mut t = trajectory((1..16).collect(), 5, &[2]);
        let rows = rows_of(std::slice::from_ref(&t), &[0.0]);
        let micro = micro_batches(&rows, &cfg(1000), m.device()).unwrap();
        let (ref_lp, _) = logps(&m, &micro[0], Mode::BASE).unwrap();
        let ref_lp = ref_lp.to_vec2::<f32>().unwrap()[0].clone();
        // The sampler's log-probs = the reference's: no KL.
        for (c, lp) in t.logps.iter_mut().enumerate() {
            if lp.is_some() {
                *lp = Some(ref_lp[t.prompt_len + c - 1]);
            }
        }
        let rows = rows_of(std::slice::from_ref(&t), &[0.0]);
        let mut c = cfg(1000);
        c.kl_estimator = KlEstimator::K3;
        assert!(sequence_kl(&m, &rows, &c).unwrap()[0].abs() < 1e-6);
        // Shift the sampler's log-probs by 0.1: k1 sums 0.1 per sampled token (9 of 10).
        for lp in t.logps.iter_mut().flatten() {
            *lp += 0.1;
        }
        let rows = rows_of(std::slice::from_ref(&t), &[0.0]);
        c.kl_estimator = KlEstimator::K1;
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
            let micro = micro_batches(
                &rows_of(std::slice::from_ref(t), &[0.0]),
                &cfg(1000),
                m.device(),
            )
            .unwrap();
            let (lp, _) = logps(m, &micro[0], Mode::INFERENCE).unwrap();
            masked_sum(&lp, &micro[0].mask).unwrap()
        };
        let before: Vec<f64> = ts.iter().map(|t| seq_logp(&m, t)).collect();
        let mut opt = AdamW::new(m.lora_vars(), AdamWConfig::default()).unwrap();
        let mut c = cfg(1000);
        c.kl_coef = 0.0;
        c.updates_per_batch = 3;
        let s = update(&m, &mut opt, &rows, &c, 1e-3, None).unwrap();
        assert_eq!(s.optimizer_steps, 3);
        assert_eq!(s.clip_fraction, 0.0, "ratio is 1 on the first pass");
        let after: Vec<f64> = ts.iter().map(|t| seq_logp(&m, t)).collect();
        assert!(after[0] > before[0], "{before:?} -> {after:?}");
        assert!(after[1] < before[1], "{before:?} -> {after:?}");
    }
}
