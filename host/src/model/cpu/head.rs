//! Target-token log-probs and entropy through the output head on the CPU, fused: the
//! logits are produced a vocabulary block at a time by [`super::gemm`] for all rows at
//! once and reduced on the spot (an online log-sum-exp), so none of the composed form's
//! several `[rows × vocab]` intermediates exist (the logits themselves only when kept).
//!
//! Why: composed from candle ops, the head ran in 52-row chunks (to keep each chunk's
//! logits under the heap-block limit, [`super::alloc`]) at ~90 GFLOPS, and each chunk made
//! five passes over its logits with scalar `exp` (forward) and eight (backward). Here the
//! product runs over every row (2,048 at a time) and one pass reduces each block.
//!
//! Per row with logits `z`, target `t`, `m = max z`, `s = Σ e^{z−m}`, `lse = m + ln s`:
//! `logp = z_t − lse`, `H = lse − Σ_v p_v z_v` (`p = e^{z−lse}`). Backward, with incoming
//! `(g_l, g_h)`: `dz_v = g_l (δ_vt − p_v) − g_h p_v (z_v − lse + H)`, `dhidden = dz · W`;
//! the forward keeps the logits for this when they fit in [`KEEP_LOGITS_BYTES`] (PyTorch
//! keeps them, and their log-softmax, always); otherwise the backward recomputes each block
//! (a second product over the head).

use super::gemm::{MatRef, gemm};
use super::simd;
use super::storage::with_f32_data;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;
use std::sync::Mutex;

/// Vocabulary columns per block.
const VOCAB_BLOCK: usize = 2048;
/// Rows per pass: a block of logits is `ROWS × VOCAB_BLOCK × 4` = 16 MiB, under the heap
/// limit so that it is reused rather than page-faulted in each time.
const ROWS: usize = 2048;

/// The most logits memory kept from the forward so that the backward needs one product
/// over the head instead of two (1,024 tokens of a 151,936-id vocabulary: 622 MB). Larger
/// batches recompute each block in the backward instead.
const KEEP_LOGITS_BYTES: usize = 768 << 20;

/// The kept-logits buffer between steps. A fresh 622 MB allocation is a fresh `mmap` whose
/// every page faults in and is zeroed by the kernel: 7% of a step's profile on this VM.
static KEPT_POOL: Mutex<Vec<f32>> = Mutex::new(Vec::new());

/// `[N, 2]`: log-prob of `targets[i]` and entropy for each row of `hidden: [N, H]` under
/// `softmax(hidden · lm_headᵀ)`, `lm_head: [V, H]` frozen; differentiable in `hidden`.
/// With `keep_logits` the forward keeps the logits for the backward (up to
/// [`KEEP_LOGITS_BYTES`]); without, the backward recomputes them (gradient checkpointing
/// trades that product for the memory). Callers check [`super::gemm::applies`].
pub fn target_logprobs(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &[u32],
    keep_logits: bool,
) -> Result<Tensor> {
    let (n, h) = hidden.dims2()?;
    let (v, h2) = lm_head.dims2()?;
    if h != h2 || targets.len() != n {
        bail!(
            "head: hidden {n}x{h}, lm_head {v}x{h2}, {} targets",
            targets.len()
        );
    }
    if let Some(&bad) = targets.iter().find(|&&t| t as usize >= v) {
        bail!("head: target id {bad} is outside the vocabulary of {v}");
    }
    with_blocks(
        hidden,
        lm_head,
        targets,
        ROWS,
        VOCAB_BLOCK,
        if keep_logits { KEEP_LOGITS_BYTES } else { 0 },
    )
}

/// [`target_logprobs`] with the row and vocabulary blocking given (tests use small ones).
fn with_blocks(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &[u32],
    rows: usize,
    vocab_block: usize,
    keep_bytes: usize,
) -> Result<Tensor> {
    hidden.contiguous()?.apply_op1(HeadLogprobs {
        lm_head: lm_head.clone(),
        targets: targets.to_vec(),
        saved: Mutex::new((Vec::new(), None)),
        keep_bytes: if hidden.track_op() { keep_bytes } else { 0 },
        rows,
        vocab_block,
    })
}

struct HeadLogprobs {
    lm_head: Tensor,
    rows: usize,
    vocab_block: usize,
    targets: Vec<u32>,
    /// From the forward for the backward: each row's log-sum-exp, and all logits when kept.
    saved: Mutex<(Vec<f32>, Option<Vec<f32>>)>,
    /// Logits memory that may be kept for the backward (0 when none will follow).
    keep_bytes: usize,
}

/// Each block of rows × vocabulary: the logits of `hidden[r0..r0+rows]` for vocabulary ids
/// `v0..v0+len`, handed to `f(v0, len, z, ldz)` as `rows` rows of `len` at stride `ldz`.
/// With `kept` (all `[N, V]` logits) they are read from there (`compute`: first written
/// there by the product); otherwise computed into `scratch`.
#[allow(clippy::too_many_arguments)]
fn for_each_block(
    vocab_block: usize,
    hidden: &[f32],
    w: &[f32],
    h: usize,
    r0: usize,
    rows: usize,
    scratch: &mut Vec<f32>,
    mut kept: Option<(&mut [f32], bool)>,
    mut f: impl FnMut(usize, usize, &mut [f32], usize) -> Result<()>,
) -> Result<()> {
    let v = w.len() / h;
    let x = MatRef::row_major(&hidden[r0 * h..(r0 + rows) * h], rows, h);
    for v0 in (0..v).step_by(vocab_block) {
        let len = vocab_block.min(v - v0);
        let wb = MatRef::row_major(&w[v0 * h..(v0 + len) * h], len, h).t();
        match kept.as_mut() {
            Some((all, compute)) => {
                let z = &mut all[r0 * v + v0..(r0 + rows - 1) * v + v0 + len];
                if *compute {
                    gemm(x, wb, z, v, false);
                }
                f(v0, len, z, v)?;
            }
            None => {
                scratch.resize(rows * len, 0.0);
                gemm(x, wb, scratch, len, false);
                f(v0, len, &mut scratch[..], len)?;
            }
        }
    }
    Ok(())
}

impl CustomOp1 for HeadLogprobs {
    fn name(&self) -> &'static str {
        "head-logprobs"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, h) = l.shape().dims2()?;
        let hidden = super::storage::f32_slice(s, l, self.name())?;
        let mut out = vec![0f32; n * 2];
        let mut lse_all = vec![0f32; n];
        let mut kept = None;
        with_f32_data(&self.lm_head, |w| {
            let v = w.len() / h;
            // Keep every logit for the backward when that is allowed and small enough.
            if n * v * 4 <= self.keep_bytes {
                let mut buf = KEPT_POOL
                    .lock()
                    .map(|mut p| std::mem::take(&mut *p))
                    .unwrap_or_default();
                buf.clear();
                buf.resize(n * v, 0.0);
                kept = Some(buf);
            }
            let mut scratch = Vec::new();
            for r0 in (0..n).step_by(self.rows) {
                let rows = self.rows.min(n - r0);
                // Per row: running max, Σ e^{z−m}, Σ e^{z−m} z, the target's logit.
                let mut stats = vec![(f32::NEG_INFINITY, 0f64, 0f64, 0f32); rows];
                let targets = &self.targets[r0..r0 + rows];
                for_each_block(
                    self.vocab_block,
                    hidden,
                    w,
                    h,
                    r0,
                    rows,
                    &mut scratch,
                    kept.as_deref_mut().map(|k| (k, true)),
                    |v0, len, z, ldz| {
                        stats
                            .par_iter_mut()
                            .zip(z.par_chunks(ldz))
                            .zip(targets.par_iter())
                            .for_each(|((st, zr), &t)| {
                                let zr = &zr[..len];
                                // SAFETY: `gemm::applies` (checked by the caller) means AVX2+FMA.
                                let bm = unsafe { simd::max(zr) };
                                if bm > st.0 {
                                    let c = ((st.0 - bm) as f64).exp();
                                    st.1 *= c;
                                    st.2 *= c;
                                    st.0 = bm;
                                }
                                // SAFETY: as above.
                                let (se, sez) = unsafe { simd::exp_sums(zr, st.0) };
                                st.1 += se as f64;
                                st.2 += sez as f64;
                                let t = t as usize;
                                if (v0..v0 + len).contains(&t) {
                                    st.3 = zr[t - v0];
                                }
                            });
                        Ok(())
                    },
                )?;
                for (i, &(m, s, sz, zt)) in stats.iter().enumerate() {
                    let lse = m as f64 + s.ln();
                    lse_all[r0 + i] = lse as f32;
                    out[(r0 + i) * 2] = (zt as f64 - lse) as f32;
                    out[(r0 + i) * 2 + 1] = (lse - sz / s) as f32;
                }
            }
            Ok(())
        })?;
        *self
            .saved
            .lock()
            .map_err(|_| candle_core::Error::Msg("head: poisoned".into()))? = (lse_all, kept);
        Ok((CpuStorage::F32(out), Shape::from((n, 2))))
    }

    fn bwd(&self, hidden: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (n, h) = hidden.dims2()?;
        let hidden_v = hidden.detach().flatten_all()?.to_vec1::<f32>()?;
        let res = res.detach().flatten_all()?.to_vec1::<f32>()?;
        let grad = grad.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let (lse, mut kept) = {
            let mut saved = self
                .saved
                .lock()
                .map_err(|_| candle_core::Error::Msg("head: poisoned".into()))?;
            // The kept logits become the gradients in place: a second backward recomputes.
            (saved.0.clone(), saved.1.take())
        };
        if lse.len() != n {
            bail!("head: backward before forward");
        }
        let mut dh = vec![0f32; n * h];
        with_f32_data(&self.lm_head, |w| {
            let mut scratch = Vec::new();
            for r0 in (0..n).step_by(self.rows) {
                let rows = self.rows.min(n - r0);
                let targets = &self.targets[r0..r0 + rows];
                let dh_rows = &mut dh[r0 * h..(r0 + rows) * h];
                for_each_block(
                    self.vocab_block,
                    &hidden_v,
                    w,
                    h,
                    r0,
                    rows,
                    &mut scratch,
                    kept.as_deref_mut().map(|k| (k, false)),
                    |v0, len, z, ldz| {
                        z.par_chunks_mut(ldz)
                            .zip(targets.par_iter())
                            .enumerate()
                            .for_each(|(i, (zr, &t))| {
                                let zr = &mut zr[..len];
                                let r = r0 + i;
                                let (gl, gh) = (grad[r * 2], grad[r * 2 + 1]);
                                let (lse, ent) = (lse[r], res[r * 2 + 1]);
                                // SAFETY: `gemm::applies` (checked by the caller) means AVX2+FMA.
                                unsafe { simd::logit_grads(zr, lse, ent, gl, gh) };
                                let t = t as usize;
                                if (v0..v0 + len).contains(&t) {
                                    zr[t - v0] += gl;
                                }
                            });
                        let wb = MatRef::row_major(&w[v0 * h..(v0 + len) * h], len, h);
                        let dz = MatRef {
                            data: z,
                            rows,
                            cols: len,
                            rs: ldz,
                            cs: 1,
                        };
                        gemm(dz, wb, dh_rows, h, true);
                        Ok(())
                    },
                )?;
            }
            Ok(())
        })?;
        if let (Some(buf), Ok(mut pool)) = (kept, KEPT_POOL.lock()) {
            *pool = buf;
        }
        Ok(Some(Tensor::from_vec(dh, (n, h), hidden.device())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures::{max_diff, uniform};
    use candle_core::{D, Device, Var};

    /// Several row passes and vocabulary blocks, both with a partial last one, against
    /// log-softmax on the full logits: values, and gradients of a mix of both outputs.
    #[test]
    fn blocked_head_matches_log_softmax_with_gradients() {
        if !crate::model::cpu::gemv::available() {
            return;
        }
        let (n, h, v) = (23, 20, 300);
        let hv = Var::from_tensor(&(uniform(&[n, h], 11) * 2.0).unwrap()).unwrap();
        let lm = (uniform(&[v, h], 12) * 3.0).unwrap();
        let targets: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 5) % v as u32).collect();
        let t = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
        let coef = uniform(&[n], 13);
        let logp_all = candle_nn::ops::log_softmax(
            &hv.as_tensor().matmul(&lm.t().unwrap()).unwrap(),
            D::Minus1,
        )
        .unwrap();
        let want_logp = logp_all
            .gather(&t.unsqueeze(1).unwrap(), 1)
            .unwrap()
            .squeeze(1)
            .unwrap();
        let want_ent = (logp_all.exp().unwrap() * &logp_all)
            .unwrap()
            .sum(1)
            .unwrap()
            .neg()
            .unwrap();
        let mix = |lp: &Tensor, en: &Tensor| {
            ((lp * &coef).unwrap() - (en * 0.7).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
        };
        let want_grad = mix(&want_logp, &want_ent).backward().unwrap();
        let want_grad = want_grad.get(hv.as_tensor()).unwrap();
        // Logits kept for the backward (the first two) or recomputed there.
        for (rows, block, keep) in [
            (5, 64, 1 << 20),
            (8, 17, 1 << 20),
            (23, 300, 0),
            (1, 1000, 0),
        ] {
            let out = with_blocks(hv.as_tensor(), &lm, &targets, rows, block, keep).unwrap();
            let (lp, en) = (
                out.narrow(1, 0, 1).unwrap().squeeze(1).unwrap(),
                out.narrow(1, 1, 1).unwrap().squeeze(1).unwrap(),
            );
            assert!(max_diff(&lp, &want_logp) < 2e-5, "logp {rows}x{block}");
            assert!(max_diff(&en, &want_ent) < 2e-5, "entropy {rows}x{block}");
            let g = mix(&lp, &en).backward().unwrap();
            let d = max_diff(g.get(hv.as_tensor()).unwrap(), want_grad);
            assert!(d < 2e-5, "grad {rows}x{block}: {d}");
        }
        assert!(
            target_logprobs(hv.as_tensor(), &lm, &[v as u32; 23], true)
                .unwrap_err()
                .to_string()
                .contains("outside the vocabulary")
        );
    }
}
