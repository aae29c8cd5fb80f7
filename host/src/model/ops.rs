//! Tensor ops the training path needs that candle lacks: a matmul against a frozen weight
//! whose backward computes only the input gradient, and target-token log-probs (with
//! entropy) computed chunk by chunk with their own backward, plus the rotary embedding's
//! tables and its `rotate_half` form.
//!
//! Why custom ops: candle's matmul backward always computes the gradient of both operands,
//! so a frozen `[out, in]` weight gets a full-size gradient nobody reads (a probe on a
//! 0.5B-shaped model: peak 23 → 18 GB and backward 19.7 → 11.7 s without it). And the
//! log-probs of targets over a 151,936-token vocabulary would otherwise keep several
//! `[tokens × vocab]` intermediates alive for the backward; here a chunk of logits is
//! recomputed in the backward instead (nothing vocabulary-sized outlives a chunk).
//!
//! Both are `CustomOp1`s whose input is the tensor that may need a gradient; the frozen
//! operands ride along in the op. Their forward runs the same maths with ordinary tensor
//! ops; only the backward is ours.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, D, DType, Device, Layout, Result, Shape, Storage, Tensor, bail,
};
use std::sync::Mutex;

/// `x @ w^T` for a frozen weight `w: [out, in]` and `x: [..., in]`. When `x` carries a
/// gradient graph, the backward returns `grad_y @ w` for `x` and nothing for `w`.
pub fn frozen_linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (out_f, in_f) = w.dims2()?;
    let dims = x.dims().to_vec();
    let rows = x.elem_count() / in_f;
    let x2 = x.reshape((rows, in_f))?;
    let y = if x.track_op() {
        x2.contiguous()?.apply_op1(FrozenMatmul { w: w.clone() })?
    } else if let Some(y) = small_rows_matmul(&x2, w)? {
        y
    } else {
        x2.matmul(&w.t()?)?
    };
    let mut out_dims = dims;
    *out_dims.last_mut().expect("x has at least one dim") = out_f;
    y.reshape(out_dims)
}

/// Rows of `x` handled by [`super::cpu::gemv`] rather than candle's gemm (decoding batches);
/// beyond this, gemm's blocking wins. Measured with `examples/gemv_probe.rs`.
const SMALL_ROWS: usize = 16;

/// `x @ w^T` through the streaming kernel when it applies (CPU, f32, few rows, AVX2+FMA).
fn small_rows_matmul(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    let (m, k) = x.dims2()?;
    let n = w.dim(0)?;
    if m > SMALL_ROWS
        || !super::cpu::gemv::available()
        || x.dtype() != DType::F32
        || !x.device().is_cpu()
    {
        return Ok(None);
    }
    let (guard, layout) = w.storage_and_layout();
    let (Storage::Cpu(CpuStorage::F32(data)), Some((start, end))) =
        (&*guard, layout.contiguous_offsets())
    else {
        return Ok(None);
    };
    let w_data = &data[start..end];
    let xs = x.flatten_all()?.to_vec1::<f32>()?;
    let mut out = Vec::with_capacity(m * n);
    for rows in xs.chunks(super::cpu::gemv::MAX_ROWS * k) {
        out.extend(super::cpu::gemv::matmul_wt(
            rows,
            rows.len() / k,
            w_data,
            n,
            k,
        ));
    }
    Ok(Some(Tensor::from_vec(out, (m, n), x.device())?))
}

struct FrozenMatmul {
    w: Tensor,
}

impl CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(&self, x: &CpuStorage, x_l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (m, k) = x_l.shape().dims2()?;
        let n = self.w.dim(0)?;
        let (w_storage, w_l) = self.w.storage_and_layout();
        let Storage::Cpu(w) = &*w_storage else {
            bail!("frozen-matmul: weight is not on the CPU")
        };
        // `w^T` is a strided view of `w`: gemm reads it in place, no copy.
        let y = x.matmul(w, (1, m, n, k), x_l, &w_l.transpose(0, 1)?)?;
        Ok((y, Shape::from((m, n))))
    }

    /// The same product through cuBLAS: on a GPU the op is what saves the weight's
    /// gradient (measured on an H200, issue 39).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        x_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (m, k) = x_l.shape().dims2()?;
        let n = self.w.dim(0)?;
        let (w_storage, w_l) = self.w.storage_and_layout();
        let Storage::Cuda(w) = &*w_storage else {
            bail!("frozen-matmul: weight is not on the GPU")
        };
        let y = x.matmul(w, (1, m, n, k), x_l, &w_l.transpose(0, 1)?)?;
        Ok((y, Shape::from((m, n))))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad_y: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad_y.matmul(&self.w)?))
    }
}

/// Log-probs of `targets` and the entropy of the distribution at each row:
/// `logits = hidden @ lm_head^T`, `logp_i = logits_i[t_i] - logsumexp(logits_i)`,
/// `H_i = logsumexp(logits_i) - Σ_v p_iv · logits_iv`.
///
/// `hidden: [N, H]`, `lm_head: [V, H]` (frozen), `targets: [N]` u32. Returns `[N]` log-probs
/// and `[N]` entropies; both have a backward to `hidden` when it tracks gradients. At most
/// `chunk_rows × V` logits exist at any time, forward or backward, except that the CPU
/// kernel keeps the logits for the backward with `keep_logits` ([`super::cpu::head`]).
pub fn target_logprobs(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
    keep_logits: bool,
) -> Result<(Tensor, Tensor)> {
    let chunk_rows = chunk_rows.max(1);
    let (n, _h) = hidden.dims2()?;
    if targets.dims() != [n] {
        bail!("target_logprobs: {n} rows but targets {:?}", targets.dims());
    }
    let targets = targets.to_dtype(DType::U32)?;
    #[cfg(target_arch = "x86_64")]
    if super::cpu::gemm::applies(hidden, lm_head) {
        let out = super::cpu::head::target_logprobs(
            hidden,
            lm_head,
            &targets.to_vec1::<u32>()?,
            keep_logits,
        )?;
        return Ok((
            out.narrow(1, 0, 1)?.squeeze(1)?,
            out.narrow(1, 1, 1)?.squeeze(1)?,
        ));
    }
    composed_target_logprobs(hidden, lm_head, &targets, chunk_rows)
}

/// [`target_logprobs`] from candle ops (any device; the CPU fast path is [`super::cpu::head`]).
fn composed_target_logprobs(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
) -> Result<(Tensor, Tensor)> {
    let n = hidden.dim(0)?;
    let detached = hidden.detach();
    let mut parts = Vec::new();
    for start in (0..n).step_by(chunk_rows) {
        let len = chunk_rows.min(n - start);
        let h = detached.narrow(0, start, len)?;
        let t = targets.narrow(0, start, len)?;
        let logits = h.matmul(&lm_head.t()?)?;
        let lse = logsumexp(&logits)?;
        let picked = logits.gather(&t.unsqueeze(1)?, 1)?.squeeze(1)?;
        let logp = (picked - &lse)?;
        let p = logits.broadcast_sub(&lse.unsqueeze(1)?)?.exp()?;
        let entropy = (&lse - (p * &logits)?.sum(1)?)?;
        parts.push(Tensor::stack(&[logp, entropy], 1)?);
    }
    let value = if parts.is_empty() {
        Tensor::zeros((0, 2), DType::F32, hidden.device())?
    } else {
        Tensor::cat(&parts, 0)?
    };
    let out = if hidden.track_op() {
        hidden.apply_op1(TargetLogprobs {
            value: Mutex::new(Some(value)),
            lm_head: lm_head.clone(),
            targets: targets.clone(),
            chunk_rows,
        })?
    } else {
        value
    };
    Ok((
        out.narrow(1, 0, 1)?.squeeze(1)?,
        out.narrow(1, 1, 1)?.squeeze(1)?,
    ))
}

/// Row-wise `log Σ exp` over the last dim, shifted by the max for stability.
fn logsumexp(logits: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?;
    let sum = logits.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?;
    (sum.log()? + max)?.squeeze(D::Minus1)
}

struct TargetLogprobs {
    /// The forward's result, computed before the op is applied and handed over once.
    value: Mutex<Option<Tensor>>,
    lm_head: Tensor,
    targets: Tensor,
    chunk_rows: usize,
}

impl CustomOp1 for TargetLogprobs {
    fn name(&self) -> &'static str {
        "target-logprobs"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        super::cpu::storage::precomputed(&self.value, self.name())
    }

    // With z the logits of a row, p = softmax(z), t the target and (g_l, g_h) the incoming
    // gradients of (logp, entropy):
    //   d logp / dz = onehot(t) - p
    //   d H / dz    = -p ⊙ (log p + H)      (H = -Σ p log p)
    //   d hidden    = (g_l (onehot(t) - p) - g_h p ⊙ (log p + H)) @ lm_head
    fn bwd(&self, hidden: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let n = hidden.dim(0)?;
        let hidden = hidden.detach();
        let mut parts = Vec::new();
        for start in (0..n).step_by(self.chunk_rows) {
            let len = self.chunk_rows.min(n - start);
            let h = hidden.narrow(0, start, len)?;
            let t = self.targets.narrow(0, start, len)?.unsqueeze(1)?;
            let g = grad.narrow(0, start, len)?;
            let g_logp = g.narrow(1, 0, 1)?.contiguous()?;
            let g_ent = g.narrow(1, 1, 1)?.contiguous()?;
            let logits = h.matmul(&self.lm_head.t()?)?;
            let lse = logsumexp(&logits)?.unsqueeze(1)?;
            let logp_all = logits.broadcast_sub(&lse)?;
            let p = logp_all.exp()?;
            let entropy = (p.clone() * &logp_all)?.sum_keepdim(1)?.neg()?;
            let d_ent = (p.clone() * logp_all.broadcast_add(&entropy)?)?
                .neg()?
                .broadcast_mul(&g_ent)?;
            let d_logp = p.broadcast_mul(&g_logp)?.neg()?;
            let d_logp = d_logp.scatter_add(&t, &g_logp, 1)?;
            let dz = (d_logp + d_ent)?;
            parts.push(dz.matmul(&self.lm_head)?);
        }
        if parts.is_empty() {
            return Ok(Some(hidden.zeros_like()?));
        }
        Ok(Some(Tensor::cat(&parts, 0)?))
    }
}

/// Rotary inverse frequencies `[head_dim / 2]`, computed in f32 as transformers does.
pub fn rope_inv_freq(
    head_dim: usize,
    theta: f64,
    scaling: &super::config::RopeScaling,
    device: &Device,
) -> Result<Tensor> {
    use super::config::RopeScaling;
    let half = head_dim / 2;
    let base = theta as f32;
    let mut inv: Vec<f32> = (0..half)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    match *scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => inv.iter_mut().for_each(|f| *f /= factor as f32),
        // transformers `_compute_llama3_parameters`: wavelengths longer than the original
        // context / low_freq_factor are slowed by `factor`, shorter than
        // context / high_freq_factor kept, and those between blended smoothly.
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let (factor, low, high, old) = (
                factor as f32,
                low_freq_factor as f32,
                high_freq_factor as f32,
                original_max_position_embeddings as f32,
            );
            let low_wavelen = old / low;
            let high_wavelen = old / high;
            for f in inv.iter_mut() {
                let wavelen = 2.0 * std::f32::consts::PI / *f;
                let scaled = if wavelen > low_wavelen {
                    *f / factor
                } else {
                    *f
                };
                // transformers: `~(wavelen < high) & ~(wavelen > low)`; no NaN can occur here.
                let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                *f = if medium {
                    let smooth = (old / wavelen - low) / (high - low);
                    (1.0 - smooth) * scaled / factor + smooth * scaled
                } else {
                    scaled
                };
            }
        }
    }
    Tensor::from_vec(inv, half, device)
}

/// `cos` and `sin` `[positions.., head_dim / 2]` for f32 or u32 positions of any shape.
pub fn rope_cos_sin(inv_freq: &Tensor, positions: &Tensor) -> Result<(Tensor, Tensor)> {
    let pos = positions.to_dtype(DType::F32)?.unsqueeze(D::Minus1)?;
    let freqs = pos.broadcast_mul(
        &inv_freq.reshape(
            std::iter::repeat_n(1, positions.rank())
                .chain([inv_freq.elem_count()])
                .collect::<Vec<_>>(),
        )?,
    )?;
    Ok((freqs.cos()?, freqs.sin()?))
}

/// The rotary embedding from differentiable ops for `x: [B, heads, T, d]` with per-row
/// `cos`, `sin: [B, T, d/2]`: `x ⊙ cos + rotate_half(x) ⊙ sin`.
pub fn rotate_half(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let cos = Tensor::cat(&[cos, cos], D::Minus1)?.unsqueeze(1)?;
    let sin = Tensor::cat(&[sin, sin], D::Minus1)?.unsqueeze(1)?;
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
}

/// Softmax over the last dim; fused only where no gradient is needed.
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    if x.track_op() {
        candle_nn::ops::softmax(x, D::Minus1)
    } else {
        candle_nn::ops::softmax_last_dim(&x.contiguous()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    use crate::model::fixtures::{max_diff, uniform};

    #[test]
    fn frozen_linear_matches_matmul_and_leaves_the_weight_alone() {
        let x = Var::from_tensor(&uniform(&[2, 3, 8], 1)).unwrap();
        let w = uniform(&[5, 8], 2);
        let w_var = Var::from_tensor(&w).unwrap();
        let ours = frozen_linear(x.as_tensor(), &w).unwrap();
        let stock = x
            .as_tensor()
            .broadcast_matmul(&w_var.as_tensor().t().unwrap())
            .unwrap();
        assert!(max_diff(&ours, &stock) < 1e-6);
        let g_ours = (ours.sqr().unwrap().sum_all().unwrap()).backward().unwrap();
        let g_stock = (stock.sqr().unwrap().sum_all().unwrap())
            .backward()
            .unwrap();
        let gx = g_ours.get(x.as_tensor()).unwrap();
        assert!(max_diff(gx, g_stock.get(x.as_tensor()).unwrap()) < 1e-5);
        // The stock matmul computes the weight's gradient; ours never does.
        assert!(g_stock.get(w_var.as_tensor()).is_some());
        assert!(g_ours.get(&w).is_none());
    }

    #[test]
    fn target_logprobs_match_log_softmax_with_gradients() {
        let h = Var::from_tensor(&uniform(&[7, 6], 3)).unwrap();
        let lm = (uniform(&[11, 6], 4) * 3.0).unwrap();
        let targets = Tensor::new(&[0u32, 3, 10, 5, 5, 1, 9], &Device::Cpu).unwrap();
        let coef = uniform(&[7], 5);
        // Reference: plain candle ops on full logits.
        let logits = h.as_tensor().matmul(&lm.t().unwrap()).unwrap();
        let logp_all = candle_nn::ops::log_softmax(&logits, 1).unwrap();
        let ref_logp = logp_all
            .gather(&targets.unsqueeze(1).unwrap(), 1)
            .unwrap()
            .squeeze(1)
            .unwrap();
        let ref_ent = (logp_all.exp().unwrap() * &logp_all)
            .unwrap()
            .sum(1)
            .unwrap()
            .neg()
            .unwrap();
        let ref_loss = ((&ref_logp * &coef).unwrap() + (&ref_ent * 0.3).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let ref_grad = ref_loss.backward().unwrap();
        // The composed form chunk by chunk, and the public entry (the fused head on AVX2).
        for chunk in [1, 3, 7, 100, 0] {
            let (logp, ent) = if chunk == 0 {
                target_logprobs(h.as_tensor(), &lm, &targets, 3, true).unwrap()
            } else {
                composed_target_logprobs(h.as_tensor(), &lm, &targets, chunk).unwrap()
            };
            assert!(max_diff(&logp, &ref_logp) < 1e-5);
            assert!(max_diff(&ent, &ref_ent) < 1e-5);
            let loss = ((&logp * &coef).unwrap() + (&ent * 0.3).unwrap())
                .unwrap()
                .sum_all()
                .unwrap();
            let grads = loss.backward().unwrap();
            let ours = grads.get(h.as_tensor()).unwrap();
            let want = ref_grad.get(h.as_tensor()).unwrap();
            assert!(max_diff(ours, want) < 1e-5, "chunk {chunk}");
        }
    }

    #[test]
    fn rotate_half_agrees_with_candles_fused_rope() {
        let x = uniform(&[2, 4, 3, 8], 6);
        let positions = Tensor::new(&[[0u32, 1, 2], [5, 6, 7]], &Device::Cpu).unwrap();
        let inv = rope_inv_freq(
            8,
            10000.0,
            &super::super::config::RopeScaling::None,
            &Device::Cpu,
        )
        .unwrap();
        let (cos, sin) = rope_cos_sin(&inv, &positions).unwrap();
        let ours = rotate_half(&x, &cos, &sin).unwrap();
        let fused = candle_nn::rotary_emb::rope(&x, &cos, &sin).unwrap();
        assert!(max_diff(&ours, &fused) < 1e-6);
    }
}
