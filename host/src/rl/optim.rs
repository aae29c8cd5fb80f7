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
///
/// An f32 parameter on a CUDA device takes the fused in-place update
/// ([`crate::model::compute::adamw`]: two launches, no buffers) with its moments kept
/// interleaved; checkpoints see the same `exp_avg`/`exp_avg_sq` tensors either way.
pub struct AdamW {
    params: Vec<(String, Var)>,
    moments: Vec<Moments>,
    pub step: u64,
    pub cfg: AdamWConfig,
}

/// One parameter's first and second moments.
enum Moments {
    /// Two tensors of the parameter's shape, for the composed update.
    Split { m: Tensor, v: Tensor },
    /// `[n, 2]` f32, `m` then `v` per element, for the fused CUDA update.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Interleaved(Tensor),
}

impl Moments {
    /// Zeros for `p`, in the form its device's update takes.
    fn zeros(p: &Tensor) -> Result<Moments> {
        Moments::from_split(p.zeros_like()?, p.zeros_like()?, p)
    }

    fn from_split(m: Tensor, v: Tensor, p: &Tensor) -> Result<Moments> {
        #[cfg(feature = "cuda")]
        if fused(p) {
            let mv = Tensor::stack(&[m.flatten_all()?, v.flatten_all()?], 1)?.contiguous()?;
            return Ok(Moments::Interleaved(mv));
        }
        let _ = p;
        Ok(Moments::Split { m, v })
    }

    /// `(m, v)` in the parameter's shape.
    fn split(&self, p: &Tensor) -> Result<(Tensor, Tensor)> {
        match self {
            Moments::Split { m, v } => Ok((m.clone(), v.clone())),
            Moments::Interleaved(mv) => Ok((
                mv.narrow(1, 0, 1)?.contiguous()?.reshape(p.shape())?,
                mv.narrow(1, 1, 1)?.contiguous()?.reshape(p.shape())?,
            )),
        }
    }
}

/// Whether `p` takes the fused CUDA update.
#[cfg(feature = "cuda")]
fn fused(p: &Tensor) -> bool {
    p.device().is_cuda()
        && p.dtype() == candle_core::DType::F32
        && p.is_contiguous()
        && !crate::model::compute::composed_forced()
}

impl AdamW {
    pub fn new(params: Vec<(String, Var)>, cfg: AdamWConfig) -> Result<AdamW> {
        Ok(AdamW {
            moments: params
                .iter()
                .map(|(_, p)| Moments::zeros(p.as_tensor()))
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
        for ((_, p), (g, moments)) in self.params.iter().zip(grads.iter().zip(&mut self.moments)) {
            match moments {
                Moments::Split { m, v } => {
                    *m = ((&*m * c.beta1)? + (g * (1.0 - c.beta1))?)?;
                    *v = ((&*v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
                    let step = ((&*m / bc1)? / ((&*v / bc2)?.sqrt()? + c.eps)?)?;
                    let decayed = (p.as_tensor() * (1.0 - lr * c.weight_decay))?;
                    p.set(&(decayed - (step * lr)?)?)?;
                }
                #[cfg(feature = "cuda")]
                Moments::Interleaved(mv) => crate::model::compute::adamw::update(
                    p.as_tensor(),
                    mv,
                    g,
                    crate::model::compute::adamw::Step {
                        lr: lr as f32,
                        decay: (1.0 - lr * c.weight_decay) as f32,
                        beta1: c.beta1 as f32,
                        rest1: (1.0 - c.beta1) as f32,
                        beta2: c.beta2 as f32,
                        rest2: (1.0 - c.beta2) as f32,
                        inv_bc1: (1.0 / bc1) as f32,
                        inv_bc2: (1.0 / bc2) as f32,
                        eps: c.eps as f32,
                    },
                )?,
                #[cfg(not(feature = "cuda"))]
                Moments::Interleaved(_) => {
                    candle_core::bail!("interleaved moments without the cuda feature")
                }
            }
        }
        Ok(())
    }

    /// The moments by name (`exp_avg.NAME`, `exp_avg_sq.NAME`), for a checkpoint.
    pub fn state(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for ((name, p), moments) in self.params.iter().zip(&self.moments) {
            let (m, v) = moments.split(p.as_tensor())?;
            out.push((format!("exp_avg.{name}"), m));
            out.push((format!("exp_avg_sq.{name}"), v));
        }
        Ok(out)
    }

    /// Restores moments written by [`AdamW::state`] and the step count.
    pub fn load_state(
        &mut self,
        tensors: &HashMap<String, Tensor>,
        step: u64,
    ) -> anyhow::Result<()> {
        for ((name, p), slot) in self.params.iter().zip(&mut self.moments) {
            let mut pair = Vec::with_capacity(2);
            for key in [format!("exp_avg.{name}"), format!("exp_avg_sq.{name}")] {
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
                pair.push(t.to_device(p.device())?.to_dtype(p.dtype())?);
            }
            let v = pair.pop().expect("two moments");
            let m = pair.pop().expect("two moments");
            *slot = Moments::from_split(m, v, p.as_tensor())?;
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
    // Each tensor's sum of squares stays on its device until one read of them all (a read
    // per tensor waited on the device hundreds of times a step); summed in f64 as before.
    let sums = grads
        .iter()
        .map(|g| {
            g.to_dtype(candle_core::DType::F32)?
                .sqr()?
                .sum_all()?
                .reshape(1)
        })
        .collect::<Result<Vec<_>>>()?;
    let sq: f64 = if sums.is_empty() {
        0.0
    } else {
        Tensor::cat(&sums, 0)?
            .to_vec1::<f32>()?
            .iter()
            .map(|&s| s as f64)
            .sum()
    };
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
