//! Grouped-query attention `softmax(scale · Q Kᵀ + M) V` on CUDA, forward and backward,
//! the fused form of [`crate::model::compute::attention`] (same layout: `q: [B, g, R·T, d]`
//! with the R query heads of each of g kv groups stacked as rows, `k`, `v: [B, g, T, d]`,
//! the additive f32 mask `[B, 1, 1, T, T]`).
//!
//! The products are cuBLAS's, in the compute dtype with f32 accumulation; the softmax of
//! each score row (scale, mask, max, exponentials, normalisation) is one kernel pass in
//! f32 (`attention.cu`) that writes the probabilities in the compute dtype and keeps two
//! numbers a row (its max and the reciprocal of its sum). Nothing `T × T` outlives the
//! call: the backward recomputes the scores from Q and K (one more product) and the
//! probabilities from the two numbers, as FlashAttention does, instead of keeping a
//! layer's `[B, g, R·T, T]` probabilities (28 × 201 MB for the 1.5B shape at 8 × 1024).
//!
//! With `P = softmax(S)`, `O = P V` and the incoming `dO`:
//!   dV = Pᵀ dO,  dP = dO Vᵀ,  dS = scale · P ⊙ (dP − rowsum(P ⊙ dP)),
//!   dQ = dS K,   dK = dSᵀ Q
//! (the R query heads of a group share its K and V, so `Pᵀ dO` and `dSᵀ Q` sum over them
//! by the layout alone).

use super::{
    Module, PushKernelArg, alloc, cuda, launch, per_row, ptx, row_threads, tensor, view, with_dtype,
};
use candle_core::{DType, Result, Tensor, bail};

const KERNELS: Module = Module {
    name: "rlhost_attention",
    ptx: ptx!("attention"),
};

/// The fused attention; the result tracks gradients to `q`, `k` and `v` when any does.
/// Half precision with head size 64 or 128 takes the flash kernels ([`super::flash`]),
/// anything else (f32 among them) the cuBLAS products around one softmax pass. The
/// flash kernels read the sequence ids `ids` (f32 `[B, T]`) the mask was made from and
/// apply its rule themselves ([`crate::model::decoder::batch_mask`]); the softmax pass
/// reads the mask.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    ids: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    check(q, k, v, mask)?;
    if super::flash::applies(q) {
        return super::flash::attention(q, k, v, ids, scale);
    }
    cublas_attention(q, k, v, mask, scale)
}

/// The shapes of [`attention`]'s arguments checked.
fn check(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<()> {
    let (b, g, rt, d) = q.dims4()?;
    let t = k.dim(2)?;
    if k.dims() != [b, g, t, d] || v.dims() != [b, g, t, d] || !rt.is_multiple_of(t) {
        bail!(
            "fused attention: q {:?}, k {:?}, v {:?} are not [B, g, R·T, d], [B, g, T, d] twice",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    if mask.elem_count() != b * t * t {
        bail!(
            "fused attention: mask {:?} is not [B, 1, 1, T, T]",
            mask.dims()
        );
    }
    Ok(())
}

/// The attention as cuBLAS's products around [`softmax_fwd`]'s one pass a row (what
/// `RLHOST_ATTENTION=cublas` keeps; the benchmark times it beside the flash kernels).
pub fn cublas_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let (_, g, rt, _) = q.dims4()?;
    let t = k.dim(2)?;
    let mask = mask.to_dtype(DType::F32)?.contiguous()?;
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let scores = q.detach().matmul(&k.detach().t()?)?;
    let (p, stats) = softmax_fwd(&scores, &mask, scale as f32, g * rt, t)?;
    drop(scores);
    let out = p.matmul(&v.detach())?;
    drop(p);
    if !(q.track_op() || k.track_op() || v.track_op()) {
        return Ok(out);
    }
    super::apply_precomputed3(
        &q,
        &k,
        &v,
        out,
        FusedAttention {
            stats,
            mask,
            scale: scale as f32,
        },
    )
}

/// `(P, stats)` for scores `[.., T]`: P in the scores' dtype, stats `[rows, 2]` f32.
fn softmax_fwd(
    scores: &Tensor,
    mask: &Tensor,
    scale: f32,
    rows_per_batch: usize,
    t: usize,
) -> Result<(Tensor, Tensor)> {
    let rows = scores.elem_count() / t;
    let (s_guard, s_l) = scores.storage_and_layout();
    let s = cuda(&s_guard, "attention")?;
    let (m_guard, m_l) = mask.storage_and_layout();
    let m = cuda(&m_guard, "attention")?;
    let dev = super::device(s);
    with_dtype!(scores.dtype(), T => {
        let sv = view::<T>(s, s_l, "attention")?;
        let mv = view::<f32>(m, m_l, "attention")?;
        let p = alloc::<T>(dev, rows * t)?;
        let stats = alloc::<f32>(dev, rows * 2)?;
        let (kernel, threads) = row_kernel("attn_softmax_fwd", t);
        let (stream, func) = KERNELS.load(dev, kernel, scores.dtype())?;
        let mut args = stream.launch_builder(&func);
        let (t32, rpb) = (t as i32, rows_per_batch as i64);
        args.arg(&sv).arg(&mv).arg(&p).arg(&stats).arg(&t32).arg(&rpb).arg(&scale);
        launch(&mut args, per_row(rows, threads))?;
        Ok((tensor(p, dev, scores.shape().clone()), tensor(stats, dev, (rows, 2))))
    })
}

/// Elements a thread holds in the register form of a row kernel (`REG` in attention.cu).
const REG: usize = 8;

/// The register form of a row kernel (`<name>_reg`, the row read once) and its threads
/// where a row fits (`REG` elements a thread, at most 1024 threads), else the three-pass
/// form.
fn row_kernel(name: &'static str, t: usize) -> (&'static str, u32) {
    if t <= REG * 1024 {
        let reg = match name {
            "attn_softmax_fwd" => "attn_softmax_fwd_reg",
            _ => "attn_softmax_bwd_reg",
        };
        (
            reg,
            (t.div_ceil(REG).div_ceil(32) * 32).clamp(32, 1024) as u32,
        )
    } else {
        (name, row_threads(t))
    }
}

/// P again from the same scores and the forward's stats.
fn softmax_recompute(
    scores: &Tensor,
    mask: &Tensor,
    stats: &Tensor,
    scale: f32,
    rows_per_batch: usize,
    t: usize,
) -> Result<Tensor> {
    let rows = scores.elem_count() / t;
    let (s_guard, s_l) = scores.storage_and_layout();
    let s = cuda(&s_guard, "attention backward")?;
    let (m_guard, m_l) = mask.storage_and_layout();
    let m = cuda(&m_guard, "attention backward")?;
    let (st_guard, st_l) = stats.storage_and_layout();
    let st = cuda(&st_guard, "attention backward")?;
    let dev = super::device(s);
    with_dtype!(scores.dtype(), T => {
        let sv = view::<T>(s, s_l, "attention backward")?;
        let mv = view::<f32>(m, m_l, "attention backward")?;
        let stv = view::<f32>(st, st_l, "attention backward")?;
        let p = alloc::<T>(dev, rows * t)?;
        let (stream, func) = KERNELS.load(dev, "attn_softmax_recompute", scores.dtype())?;
        let mut args = stream.launch_builder(&func);
        let (t32, rpb) = (t as i32, rows_per_batch as i64);
        args.arg(&sv).arg(&mv).arg(&stv).arg(&p).arg(&t32).arg(&rpb).arg(&scale);
        launch(&mut args, per_row(rows, row_threads(t)))?;
        Ok(tensor(p, dev, scores.shape().clone()))
    })
}

/// `dS = scale · P ⊙ (dP − rowsum(P ⊙ dP))`.
fn softmax_bwd(p: &Tensor, dp: &Tensor, scale: f32, t: usize) -> Result<Tensor> {
    let rows = p.elem_count() / t;
    let (p_guard, p_l) = p.storage_and_layout();
    let ps = cuda(&p_guard, "attention backward")?;
    let (d_guard, d_l) = dp.storage_and_layout();
    let ds = cuda(&d_guard, "attention backward")?;
    let dev = super::device(ps);
    with_dtype!(p.dtype(), T => {
        let pv = view::<T>(ps, p_l, "attention backward")?;
        let dv = view::<T>(ds, d_l, "attention backward")?;
        let out = alloc::<T>(dev, rows * t)?;
        let (kernel, threads) = row_kernel("attn_softmax_bwd", t);
        let (stream, func) = KERNELS.load(dev, kernel, p.dtype())?;
        let mut args = stream.launch_builder(&func);
        let t32 = t as i32;
        args.arg(&pv).arg(&dv).arg(&out).arg(&t32).arg(&scale);
        launch(&mut args, per_row(rows, threads))?;
        Ok(tensor(out, dev, p.shape().clone()))
    })
}

struct FusedAttention {
    stats: Tensor,
    mask: Tensor,
    scale: f32,
}

impl super::Backward3 for FusedAttention {
    const NAME: &'static str = "fused attention";

    fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (_, g, rt, _) = q.dims4()?;
        let t = k.dim(2)?;
        let (q, k, v) = (q.detach(), k.detach(), v.detach());
        let grad = grad.contiguous()?;
        let scores = q.matmul(&k.t()?)?;
        let p = softmax_recompute(&scores, &self.mask, &self.stats, self.scale, g * rt, t)?;
        drop(scores);
        let dv = p.t()?.matmul(&grad)?;
        let dp = grad.matmul(&v.t()?)?;
        let ds = softmax_bwd(&p, &dp, self.scale, t)?;
        drop((p, dp));
        let dq = ds.matmul(&k)?;
        let dk = ds.t()?.matmul(&q)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::compute;
    use crate::model::fixtures;
    use candle_core::{Device, Var};

    /// The cuBLAS form against the composed form on the GPU: values and the
    /// gradients of q, k and v, causal with left padding, grouped queries (R = 3), head
    /// sizes 64 and 128, in f32, bf16 and f16. Skipped without `RLHOST_TEST_DEVICE=cuda`.
    #[test]
    fn fused_attention_matches_the_composed_form() {
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        let (b, g, r, t) = (2, 2, 3, 37);
        for d in [64, 128] {
            for (dtype, tol) in [(DType::F32, 2e-5), (DType::BF16, 2e-2), (DType::F16, 4e-3)] {
                let seed = d as u64;
                let make =
                    |shape: &[usize], s: u64| fixtures::uniform_on(shape, s, 1.0, &dev, dtype);
                let q = Var::from_tensor(&make(&[b, g, r * t, d], seed)).unwrap();
                let k = Var::from_tensor(&make(&[b, g, t, d], seed + 1)).unwrap();
                let v = Var::from_tensor(&make(&[b, g, t, d], seed + 2)).unwrap();
                // Row 0 unpadded, row 1 with five pads on the left.
                let am: Vec<u32> = (0..b * t).map(|i| u32::from(i < t || i % t >= 5)).collect();
                let am = Tensor::from_vec(am, (b, t), &Device::Cpu)
                    .unwrap()
                    .to_device(&dev)
                    .unwrap();
                let mask = crate::model::decoder::batch_mask(&am).unwrap();
                let ids = crate::model::decoder::sequence_ids(&am).unwrap();
                let coef = make(&[b, g, r * t, d], seed + 3);
                let run = |fused: bool| {
                    let scale = 1.0 / (d as f64).sqrt();
                    let out = if fused {
                        cublas_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &mask, scale)
                    } else {
                        crate::model::cpu::composed(|| {
                            compute::attention(
                                q.as_tensor(),
                                k.as_tensor(),
                                v.as_tensor(),
                                &mask,
                                &ids,
                                scale,
                            )
                        })
                    }
                    .unwrap();
                    let loss = (out.to_dtype(DType::F32).unwrap()
                        * coef.to_dtype(DType::F32).unwrap())
                    .unwrap()
                    .sum_all()
                    .unwrap();
                    let grads = loss.backward().unwrap();
                    let gs: Vec<Tensor> = [&q, &k, &v]
                        .iter()
                        .map(|x| grads.get(x.as_tensor()).unwrap().clone())
                        .collect();
                    (out, gs)
                };
                let (out_f, grads_f) = run(true);
                let (out_c, grads_c) = run(false);
                let rel = |a: &Tensor, b: &Tensor| fixtures::relative_diff(a, b);
                let e = rel(&out_f, &out_c);
                eprintln!("attention d={d} {dtype:?}: output {e:.2e}");
                assert!(e <= tol, "d={d} {dtype:?}: output {e}");
                for (name, (a, c)) in ["q", "k", "v"].iter().zip(grads_f.iter().zip(&grads_c)) {
                    let e = rel(a, c);
                    eprintln!("attention d={d} {dtype:?}: grad {name} {e:.2e}");
                    assert!(e <= tol * 2.0, "d={d} {dtype:?}: grad {name} {e}");
                }
            }
        }
    }
}
