//! The optimizer side of a training step: gradient accumulation over micro-batches,
//! gradient-norm clipping, AdamW (PyTorch's decoupled form) with state that checkpoints
//! save and restore, and the warm-up + cosine learning-rate schedule.
//!
//! candle-nn's `AdamW` keeps its moments private, so a resumed run could not continue
//! from the same optimizer state; this one exposes them by parameter name.

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        // PyTorch's defaults, except weight decay (0.01 in torch; LoRA recipes use 0).
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// AdamW over named parameters:
/// p ← p·(1 − lr·wd); m ← β1·m + (1 − β1)·g; v ← β2·v + (1 − β2)·g²;
/// p ← p − lr · (m / (1 − β1^t)) / (√(v / (1 − β2^t)) + ε).
pub struct AdamW {
    params: Vec<(String, Var)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    pub step: u64,
    pub cfg: AdamWConfig,
}

impl AdamW {
    pub fn new(params: Vec<(String, Var)>, cfg: AdamWConfig) -> Result<AdamW> {
        let zeros = |p: &Var| p.as_tensor().zeros_like();
        Ok(AdamW {
            m: params
                .iter()
                .map(|(_, p)| zeros(p))
                .collect::<Result<_>>()?,
            v: params
                .iter()
                .map(|(_, p)| zeros(p))
                .collect::<Result<_>>()?,
            params,
            step: 0,
            cfg,
        })
    }

    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// One update with `grads` (one per parameter, in order) at learning rate `lr`.
    pub fn update(&mut self, grads: &[Tensor], lr: f64) -> Result<()> {
        self.step += 1;
        let c = self.cfg;
        let bc1 = 1.0 - c.beta1.powi(self.step as i32);
        let bc2 = 1.0 - c.beta2.powi(self.step as i32);
        for (i, ((_, p), g)) in self.params.iter().zip(grads).enumerate() {
            let m = ((&self.m[i] * c.beta1)? + (g * (1.0 - c.beta1))?)?;
            let v = ((&self.v[i] * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
            let step = ((&m / bc1)? / ((&v / bc2)?.sqrt()? + c.eps)?)?;
            let decayed = (p.as_tensor() * (1.0 - lr * c.weight_decay))?;
            p.set(&(decayed - (step * lr)?)?)?;
            self.m[i] = m;
            self.v[i] = v;
        }
        Ok(())
    }

    /// The moments by name (`exp_avg.NAME`, `exp_avg_sq.NAME`), for a checkpoint.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (i, (name, _)) in self.params.iter().enumerate() {
            out.push((format!("exp_avg.{name}"), self.m[i].clone()));
            out.push((format!("exp_avg_sq.{name}"), self.v[i].clone()));
        }
        out
    }

    /// Restores moments written by [`AdamW::state`] and the step count.
    pub fn load_state(
        &mut self,
        tensors: &HashMap<String, Tensor>,
        step: u64,
    ) -> anyhow::Result<()> {
        for (i, (name, p)) in self.params.iter().enumerate() {
            for (key, slot) in [
                (format!("exp_avg.{name}"), &mut self.m[i]),
                (format!("exp_avg_sq.{name}"), &mut self.v[i]),
            ] {
                let t = tensors
                    .get(&key)
                    .ok_or_else(|| anyhow::anyhow!("optimizer state has no `{key}`"))?;
                if t.dims() != p.dims() {
                    anyhow::bail!(
                        "optimizer state `{key}` has shape {:?}, the parameter {:?}: the checkpoint belongs to another adapter shape",
                        t.dims(),
                        p.dims()
                    );
                }
                *slot = t.to_device(p.device())?;
            }
        }
        self.step = step;
        Ok(())
    }
}

/// Sums gradients over micro-batches, one slot per parameter.
pub struct Accumulator {
    sums: Vec<Option<Tensor>>,
}

impl Accumulator {
    pub fn new(n: usize) -> Accumulator {
        Accumulator {
            sums: vec![None; n],
        }
    }

    /// Adds one backward pass's gradients of `params`. A parameter without a gradient is
    /// an error: it would be silently skipped by the update.
    pub fn add(&mut self, params: &[(String, Var)], grads: &GradStore) -> anyhow::Result<()> {
        for ((name, p), sum) in params.iter().zip(&mut self.sums) {
            let g = grads.get(p.as_tensor()).ok_or_else(|| {
                anyhow::anyhow!(
                    "`{name}` got no gradient: an op in the training path has no backward"
                )
            })?;
            *sum = Some(match sum.take() {
                Some(s) => (s + g)?,
                None => g.clone(),
            });
        }
        Ok(())
    }

    /// The summed gradients (zeros where no micro-batch contributed).
    pub fn take(self, params: &[(String, Var)]) -> Result<Vec<Tensor>> {
        self.sums
            .into_iter()
            .zip(params)
            .map(|(s, (_, p))| match s {
                Some(s) => Ok(s),
                None => p.as_tensor().zeros_like(),
            })
            .collect()
    }
}

/// Scales `grads` so that their global L2 norm is at most `max_norm` (if > 0); returns the
/// norm before clipping (`torch.nn.utils.clip_grad_norm_`).
pub fn clip_grad_norm(grads: &mut [Tensor], max_norm: f64) -> Result<f64> {
    let mut sq = 0.0f64;
    for g in grads.iter() {
        sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    }
    let norm = sq.sqrt();
    if max_norm > 0.0 && norm > max_norm {
        let scale = max_norm / (norm + 1e-6);
        for g in grads.iter_mut() {
            *g = (&*g * scale)?;
        }
    }
    Ok(norm)
}

/// Learning rate at `step` (0-based): linear warm-up over `warmup` steps, then cosine
/// decay to `min_ratio · base` at `total` (transformers' `get_cosine_schedule_with_warmup`
/// when `min_ratio` = 0).
pub fn lr_at(step: u64, total: u64, warmup: u64, base: f64, min_ratio: f64) -> f64 {
    if step < warmup {
        return base * step as f64 / warmup.max(1) as f64;
    }
    let progress = (step - warmup) as f64 / total.saturating_sub(warmup).max(1) as f64;
    let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos());
    base * (min_ratio + (1.0 - min_ratio) * cosine)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use candle_nn::Optimizer;

    /// Same trajectory as candle-nn's AdamW (which follows torch.optim.AdamW) over a few
    /// steps with changing gradients and weight decay.
    #[test]
    fn adamw_matches_the_reference_implementation() {
        let dev = Device::Cpu;
        let init = Tensor::new(&[[0.5f32, -1.0], [2.0, 0.1]], &dev).unwrap();
        let ours = Var::from_tensor(&init).unwrap();
        let theirs = Var::from_tensor(&init).unwrap();
        let cfg = AdamWConfig {
            weight_decay: 0.1,
            ..AdamWConfig::default()
        };
        let mut a = AdamW::new(vec![("w".into(), ours.clone())], cfg).unwrap();
        let mut b = candle_nn::AdamW::new(
            vec![theirs.clone()],
            candle_nn::ParamsAdamW {
                lr: 0.05,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.1,
            },
        )
        .unwrap();
        for k in 0..5 {
            // loss = Σ w² · (k + 1): gradient 2 w (k + 1).
            let loss_a =
                (ours.as_tensor().sqr().unwrap().sum_all().unwrap() * (k + 1) as f64).unwrap();
            let g = loss_a.backward().unwrap();
            let mut acc = Accumulator::new(1);
            acc.add(a.params(), &g).unwrap();
            a.update(&acc.take(a.params()).unwrap(), 0.05).unwrap();
            let loss_b =
                (theirs.as_tensor().sqr().unwrap().sum_all().unwrap() * (k + 1) as f64).unwrap();
            b.backward_step(&loss_b).unwrap();
        }
        let d = (ours.as_tensor() - theirs.as_tensor())
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d < 1e-6, "max diff {d}");
    }

    /// transformers: lr_lambda = step / warmup, then 0.5 · (1 + cos(π · progress)).
    #[test]
    fn schedule_matches_cosine_with_warmup() {
        assert_eq!(lr_at(0, 100, 10, 1.0, 0.0), 0.0);
        assert_eq!(lr_at(5, 100, 10, 1.0, 0.0), 0.5);
        assert_eq!(lr_at(10, 100, 10, 1.0, 0.0), 1.0);
        // progress 0.5 → 0.5.
        assert!((lr_at(55, 100, 10, 1.0, 0.0) - 0.5).abs() < 1e-12);
        assert!(lr_at(100, 100, 10, 1.0, 0.0).abs() < 1e-12);
        assert!((lr_at(100, 100, 10, 1.0, 0.1) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn clipping_scales_to_the_max_norm() {
        let dev = Device::Cpu;
        let mut g = vec![
            Tensor::new(&[3f32], &dev).unwrap(),
            Tensor::new(&[4f32], &dev).unwrap(),
        ];
        assert_eq!(clip_grad_norm(&mut g, 10.0).unwrap(), 5.0);
        assert_eq!(g[0].to_vec1::<f32>().unwrap(), [3.0]);
        clip_grad_norm(&mut g, 1.0).unwrap();
        let n: f32 = g
            .iter()
            .map(|t| {
                t.sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
            })
            .sum();
        assert!((n.sqrt() - 1.0).abs() < 1e-5);
    }
}
