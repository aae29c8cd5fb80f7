//! Training-path ops with a hand-written backward: RMSNorm, SwiGLU and the attention core.
//!
//! Composed from candle's differentiable primitives each of these is 5–12 graph nodes, and
//! candle's backward gives every node its own gradient tensor (a zero tensor plus an add
//! when it is first reached) and computes gradients for frozen operands too (norm weights,
//! the attention mask, rope tables). On a 0.5B-shaped LoRA step the backward took 2.5× the
//! forward. Here each is one node whose backward computes exactly the gradients needed.
//!
//! Formulas (g = incoming gradient):
//! - RMSNorm `y = w ⊙ x r`, `r = (mean(x²) + eps)^-½`:
//!   `dx = r (g ⊙ w) − x r³ mean((g ⊙ w) ⊙ x)`; `w` is frozen.
//! - SwiGLU `y = silu(a) ⊙ b`, `σ = sigmoid(a)`:
//!   `da = g ⊙ b ⊙ σ (1 + a (1 − σ))`, `db = g ⊙ a σ`.
//! - Attention `P = softmax(s Q Kᵀ + M)`, `O = P V`:
//!   `dV = Pᵀ dO`, `dP = dO Vᵀ`, `dS = P ⊙ (dP − rowsum(dO ⊙ O))`,
//!   `dQ = s dS K`, `dK = s dSᵀ Q` (FlashAttention's form of the softmax backward).

use super::alloc::zeroed;
use super::simd::{simd_exp, simd_swiglu, simd_swiglu_grads};
use super::storage::{f32_slice, precomputed, with_f32_data};
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, D, Layout, Result, Shape, Tensor, bail,
};
use rayon::prelude::*;
use std::sync::Mutex;

fn to_vec(t: &Tensor) -> Result<Vec<f32>> {
    t.contiguous()?.flatten_all()?.to_vec1::<f32>()
}

// ------------------------------------------------------------------ RMSNorm

/// RMSNorm over the last dim with a frozen weight; differentiable in `x`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let op = RmsNorm {
        w: to_vec(w)?,
        eps: eps as f32,
    };
    x.contiguous()?.apply_op1(op)
}

struct RmsNorm {
    w: Vec<f32>,
    eps: f32,
}

impl CustomOp1 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s, l, self.name())?;
        let h = self.w.len();
        let mut out = zeroed(x.len());
        out.par_chunks_mut(h)
            .zip(x.par_chunks(h))
            .for_each(|(o, xr)| {
                let r = 1.0 / (xr.iter().map(|v| v * v).sum::<f32>() / h as f32 + self.eps).sqrt();
                for ((o, &xv), &wv) in o.iter_mut().zip(xr).zip(&self.w) {
                    *o = wv * (xv * r);
                }
            });
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let h = self.w.len();
        let mut dx = zeroed(x.elem_count());
        with_f32_data(x, |xs| {
            with_f32_data(g, |gs| {
                dx.par_chunks_mut(h)
                    .zip(xs.par_chunks(h).zip(gs.par_chunks(h)))
                    .for_each(|(d, (xr, gr))| {
                        let r = 1.0
                            / (xr.iter().map(|v| v * v).sum::<f32>() / h as f32 + self.eps).sqrt();
                        let dot: f32 = gr
                            .iter()
                            .zip(&self.w)
                            .zip(xr)
                            .map(|((g, w), x)| g * w * x)
                            .sum();
                        let c = r * r * r * dot / h as f32;
                        for i in 0..h {
                            d[i] = r * gr[i] * self.w[i] - xr[i] * c;
                        }
                    });
                Ok(())
            })
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

// ------------------------------------------------------------------ SwiGLU

/// `silu(gate) ⊙ up`, differentiable in both.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
}

struct SwiGlu;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Elements per parallel task of the elementwise kernels.
const CHUNK: usize = 1 << 14;

/// `y = silu(a) ⊙ b`, in parallel (all slices the same length).
pub(crate) fn swiglu_into(a: &[f32], b: &[f32], y: &mut [f32]) {
    y.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(y, (a, b))| {
            let done = simd_swiglu(a, b, y);
            for ((y, &a), &b) in y.iter_mut().zip(a).zip(b).skip(done) {
                *y = a * sigmoid(a) * b;
            }
        });
}

/// SwiGLU's backward: `da = g ⊙ b ⊙ σ(a)(1 + a(1 − σ(a)))`, `db = g ⊙ silu(a)`, in parallel.
pub(crate) fn swiglu_grads_into(a: &[f32], b: &[f32], g: &[f32], da: &mut [f32], db: &mut [f32]) {
    da.par_chunks_mut(CHUNK)
        .zip(db.par_chunks_mut(CHUNK))
        .zip(
            a.par_chunks(CHUNK)
                .zip(b.par_chunks(CHUNK))
                .zip(g.par_chunks(CHUNK)),
        )
        .for_each(|((da, db), ((a, b), g))| {
            let done = simd_swiglu_grads(a, b, g, da, db);
            for i in done..a.len() {
                let s = sigmoid(a[i]);
                da[i] = g[i] * b[i] * s * (1.0 + a[i] * (1.0 - s));
                db[i] = g[i] * a[i] * s;
            }
        });
}

/// [`swiglu_grads_into`] in place: `a` becomes `da` and `b` becomes `db`, so that a
/// backward that owns its saved inputs needs no two more buffers of their size. Each
/// 256-value piece is copied aside (L1) and its gradients written over it.
pub(crate) fn swiglu_grads_in_place(a: &mut [f32], b: &mut [f32], g: &[f32]) {
    const PIECE: usize = 256;
    a.par_chunks_mut(CHUNK)
        .zip(b.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK))
        .for_each(|((a, b), g)| {
            let (mut ta, mut tb) = ([0f32; PIECE], [0f32; PIECE]);
            for ((a, b), g) in a
                .chunks_mut(PIECE)
                .zip(b.chunks_mut(PIECE))
                .zip(g.chunks(PIECE))
            {
                let n = a.len();
                ta[..n].copy_from_slice(a);
                tb[..n].copy_from_slice(b);
                let done = simd_swiglu_grads(&ta[..n], &tb[..n], g, a, b);
                for i in done..n {
                    let s = sigmoid(ta[i]);
                    a[i] = g[i] * tb[i] * s * (1.0 + ta[i] * (1.0 - s));
                    b[i] = g[i] * ta[i] * s;
                }
            }
        });
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (a, b) = (
            f32_slice(s1, l1, self.name())?,
            f32_slice(s2, l2, self.name())?,
        );
        if l1.shape() != l2.shape() {
            bail!("swiglu: shapes {:?} and {:?}", l1.shape(), l2.shape());
        }
        let mut out = zeroed(a.len());
        swiglu_into(a, b, &mut out);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (mut da, mut db) = (zeroed(a.elem_count()), zeroed(a.elem_count()));
        with_f32_data(a, |av| {
            with_f32_data(b, |bv| {
                with_f32_data(g, |gv| {
                    swiglu_grads_into(av, bv, gv, &mut da, &mut db);
                    Ok(())
                })
            })
        })?;
        Ok((
            Some(Tensor::from_vec(da, a.shape(), a.device())?),
            Some(Tensor::from_vec(db, b.shape(), b.device())?),
        ))
    }
}

// ------------------------------------------------------------------ heads and rope

/// `y: [B, T, n, d]` (or `[B, T, n·d]`) → `[B, g, (n/g)·T, d]` (contiguous; with `g = n`
/// that is `[B, n, T, d]`, with `g` kv heads the layout [`attention`] takes for queries),
/// each head vector rotated by rope in transformers' `rotate_half` form when `rope` gives
/// `cos`, `sin: [B, T, d/2]`: `o₁ = x₁ cos − x₂ sin`, `o₂ = x₂ cos + x₁ sin` (x₁, x₂ the
/// halves), whose backward is the opposite rotation of the gradient,
/// `dx₁ = g₁ cos + g₂ sin`, `dx₂ = g₂ cos − g₁ sin`. One node instead of the reshapes,
/// transpose, copy and eight-op rope of the composed form.
pub fn heads_rope(
    y: &Tensor,
    n: usize,
    groups: usize,
    rope: Option<(&Tensor, &Tensor)>,
) -> Result<Tensor> {
    let dims = y.dims();
    if dims.len() < 3 || n == 0 || groups == 0 || !n.is_multiple_of(groups) {
        bail!("heads_rope: {dims:?} with {n} heads in {groups} groups");
    }
    let (b, t) = (dims[0], dims[1]);
    let d = y.elem_count() / (b * t * n).max(1);
    if b * t * n * d != y.elem_count() {
        bail!("heads_rope: {dims:?} is not [B, T, {n} heads of d]");
    }
    let rope = match rope {
        Some((cos, sin)) => {
            if cos.dims() != [b, t, d / 2] || sin.dims() != cos.dims() || !d.is_multiple_of(2) {
                bail!(
                    "heads_rope: cos {:?} / sin {:?} do not fit [{b}, {t}, {}]",
                    cos.dims(),
                    sin.dims(),
                    d / 2
                );
            }
            Some((to_vec(cos)?, to_vec(sin)?))
        }
        None => None,
    };
    y.contiguous()?.apply_op1(HeadsRope {
        rope,
        dims: (b, t, n, d),
        groups,
    })
}

struct HeadsRope {
    /// cos and sin, `[B, T, d/2]`; `None`: transpose only.
    rope: Option<(Vec<f32>, Vec<f32>)>,
    /// `(B, T, n, d)`.
    dims: (usize, usize, usize, usize),
    /// Head groups of the output.
    groups: usize,
}

impl HeadsRope {
    /// Rotates `x` (one head vector) into `o` by the angles at row `bt` of the tables,
    /// `sign` 1 forward and −1 for the backward's inverse rotation.
    fn rotate(&self, bt: usize, x: &[f32], o: &mut [f32], sign: f32) {
        let Some((cos, sin)) = &self.rope else {
            o.copy_from_slice(x);
            return;
        };
        let half = x.len() / 2;
        let (c, s) = (&cos[bt * half..][..half], &sin[bt * half..][..half]);
        let (x1, x2) = x.split_at(half);
        let (o1, o2) = o.split_at_mut(half);
        for i in 0..half {
            let si = sign * s[i];
            o1[i] = x1[i] * c[i] - x2[i] * si;
            o2[i] = x2[i] * c[i] + x1[i] * si;
        }
    }
}

impl CustomOp1 for HeadsRope {
    fn name(&self) -> &'static str {
        "heads-rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s, l, self.name())?;
        let (b, t, n, d) = self.dims;
        let mut out = zeroed(x.len());
        // One task per output plane `[b, h]`: T head vectors gathered from stride n·d.
        out.par_chunks_mut(t * d)
            .enumerate()
            .for_each(|(bh, plane)| {
                let (bi, h) = (bh / n, bh % n);
                for (ti, o) in plane.chunks_exact_mut(d).enumerate() {
                    let src = ((bi * t + ti) * n + h) * d;
                    self.rotate(bi * t + ti, &x[src..src + d], o, 1.0);
                }
            });
        let g = self.groups;
        Ok((CpuStorage::F32(out), Shape::from((b, g, n / g * t, d))))
    }

    fn bwd(&self, y: &Tensor, _out: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let (_, t, n, d) = self.dims;
        let mut dy = zeroed(y.elem_count());
        with_f32_data(g, |gv| {
            // One task per input row `[b, t]`: n head vectors from n planes.
            dy.par_chunks_mut(n * d).enumerate().for_each(|(bt, row)| {
                let (bi, ti) = (bt / t, bt % t);
                for (h, o) in row.chunks_exact_mut(d).enumerate() {
                    let src = ((bi * n + h) * t + ti) * d;
                    self.rotate(bt, &gv[src..src + d], o, -1.0);
                }
            });
            Ok(())
        })?;
        Ok(Some(Tensor::from_vec(dy, y.shape(), y.device())?))
    }
}

// ------------------------------------------------------------------ attention

/// `softmax(scale · q kᵀ + mask) v` with grouped-query layout: `q: [B, kv, R·T, d]` (the R
/// query heads of a kv head stacked as rows), `k`, `v: [B, kv, T, d]`, additive
/// `mask: [B, 1, 1, T, T]`, which must hide every key after the query (causal). Returns
/// `[B, kv, R·T, d]`. On AVX2/FMA CPUs the [`super::attention`] kernels run it, skipping
/// the causally hidden blocks; a query that sees no key at all (padding) gets zero
/// weights. Elsewhere candle's matmuls do, and such a query spreads its weight evenly.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    let (b, _, rt, _) = q.dims4()?;
    let t = k.dim(2)?;
    let n_rep = rt / t;
    if rt != n_rep * t || mask.dims() != [b, 1, 1, t, t] {
        bail!(
            "attention: q {:?}, k {:?} and mask {:?} do not fit",
            q.dims(),
            k.dims(),
            mask.dims()
        );
    }
    let track = q.track_op() || k.track_op() || v.track_op();
    #[cfg(target_arch = "x86_64")]
    if super::gemv::available()
        && [q, k, v, mask]
            .iter()
            .all(|x| x.device().is_cpu() && x.dtype() == candle_core::DType::F32)
    {
        let d = k.dim(3)?;
        let (nkv, dev) = (k.dim(1)?, q.device());
        let dims = super::attention::Dims {
            batch: b,
            kv_heads: nkv,
            rep: n_rep,
            t,
            d,
        };
        let (out, p) = with_f32_data(q, |qv| {
            with_f32_data(k, |kv| {
                with_f32_data(v, |vv| {
                    with_f32_data(mask, |mv| {
                        Ok(super::attention::forward(
                            qv,
                            kv,
                            vv,
                            mv,
                            dims,
                            scale as f32,
                        ))
                    })
                })
            })
        })?;
        let out = Tensor::from_vec(out, q.shape(), dev)?;
        if !track {
            return Ok(out);
        }
        let p = Tensor::from_vec(p, (b, nkv, rt, t), dev)?;
        return q.apply_op3(
            k,
            v,
            Attention {
                out: Mutex::new(Some(out)),
                p,
                scale,
                causal: Some(dims),
            },
        );
    }
    let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
    let p = masked_softmax(&qd.matmul(&kd.t()?)?, mask, scale as f32, t)?;
    let out = p.matmul(&vd)?;
    if !track {
        return Ok(out);
    }
    q.apply_op3(
        k,
        v,
        Attention {
            out: Mutex::new(Some(out)),
            p,
            scale,
            causal: None,
        },
    )
}

/// Score rows per parallel task in the attention's elementwise passes.
const SCORE_ROWS: usize = 64;

/// `softmax(scale · s + mask)` over the last dim of the scores `s: [B, kv, R·T, T]` (row
/// `r` of a kv head is query position `r mod T`; `mask: [B, 1, 1, T, T]` additive), in one
/// parallel pass where the composed form made three, two of them on one thread.
fn masked_softmax(s: &Tensor, mask: &Tensor, scale: f32, t: usize) -> Result<Tensor> {
    let (b, nkv, rt, tk) = s.dims4()?;
    let mut p = zeroed(s.elem_count());
    with_f32_data(s, |sv| {
        with_f32_data(mask, |mv| {
            p.par_chunks_mut(tk * SCORE_ROWS)
                .zip(sv.par_chunks(tk * SCORE_ROWS))
                .enumerate()
                .for_each(|(task, (pb, sb))| {
                    for (r, (pr, sr)) in
                        pb.chunks_exact_mut(tk).zip(sb.chunks_exact(tk)).enumerate()
                    {
                        let row = task * SCORE_ROWS + r;
                        let (bi, i) = (row / (nkv * rt), row % rt % t);
                        let mr = &mv[(bi * t + i) * tk..][..tk];
                        let mut max = f32::NEG_INFINITY;
                        for ((p, &s), &m) in pr.iter_mut().zip(sr).zip(mr) {
                            *p = s * scale + m;
                            max = max.max(*p);
                        }
                        let (done, mut sum) = simd_exp(pr, max);
                        for p in &mut pr[done..] {
                            *p = (*p - max).exp();
                            sum += *p;
                        }
                        for p in pr.iter_mut() {
                            *p /= sum;
                        }
                    }
                });
            Ok(())
        })
    })?;
    Tensor::from_vec(p, (b, nkv, rt, tk), s.device())
}

/// The softmax backward scaled for the scores, `dS = s · P ⊙ (dP − rowsum(dO ⊙ O))`, one
/// parallel pass over `P` and `dP` `[.., rows, T]` with `dO`, `O` `[.., rows, d]`.
fn softmax_grad(
    p: &Tensor,
    dp: &Tensor,
    d_out: &Tensor,
    out: &Tensor,
    scale: f32,
) -> Result<Tensor> {
    let tk = p.dim(D::Minus1)?;
    let d = out.dim(D::Minus1)?;
    let mut ds = zeroed(p.elem_count());
    with_f32_data(p, |pv| {
        with_f32_data(dp, |dpv| {
            with_f32_data(d_out, |gv| {
                with_f32_data(out, |ov| {
                    ds.par_chunks_mut(tk * SCORE_ROWS)
                        .enumerate()
                        .for_each(|(task, block)| {
                            for (r, dsr) in block.chunks_exact_mut(tk).enumerate() {
                                let row = task * SCORE_ROWS + r;
                                let (g, o) = (&gv[row * d..][..d], &ov[row * d..][..d]);
                                let dot: f32 = g.iter().zip(o).map(|(g, o)| g * o).sum();
                                let (pr, dpr) = (&pv[row * tk..][..tk], &dpv[row * tk..][..tk]);
                                for ((s, &p), &dp) in dsr.iter_mut().zip(pr).zip(dpr) {
                                    *s = scale * p * (dp - dot);
                                }
                            }
                        });
                    Ok(())
                })
            })
        })
    })?;
    Tensor::from_vec(ds, p.shape(), p.device())
}

struct Attention {
    out: Mutex<Option<Tensor>>,
    /// The attention weights, kept for the backward.
    p: Tensor,
    scale: f64,
    /// Set when the forward ran [`super::attention`]'s causal kernels (as does the
    /// backward then); otherwise candle's matmuls.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    causal: Option<AttentionDims>,
}

#[cfg(target_arch = "x86_64")]
type AttentionDims = super::attention::Dims;
#[cfg(not(target_arch = "x86_64"))]
type AttentionDims = ();

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        precomputed(&self.out, self.name())
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        d_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        #[cfg(target_arch = "x86_64")]
        if let Some(dims) = self.causal {
            let (dq, dk, dv) = with_f32_data(q, |qv| {
                with_f32_data(k, |kv| {
                    with_f32_data(v, |vv| {
                        with_f32_data(out, |ov| {
                            with_f32_data(&self.p, |pv| {
                                with_f32_data(d_out, |gv| {
                                    Ok(super::attention::backward(
                                        qv,
                                        kv,
                                        vv,
                                        ov,
                                        pv,
                                        gv,
                                        dims,
                                        self.scale as f32,
                                    ))
                                })
                            })
                        })
                    })
                })
            })?;
            let dev = q.device();
            return Ok((
                Some(Tensor::from_vec(dq, q.shape(), dev)?),
                Some(Tensor::from_vec(dk, k.shape(), dev)?),
                Some(Tensor::from_vec(dv, v.shape(), dev)?),
            ));
        }
        let (q, k, v, out) = (q.detach(), k.detach(), v.detach(), out.detach());
        let d_out = d_out.contiguous()?;
        let dv = self.p.t()?.matmul(&d_out)?;
        let dp = d_out.matmul(&v.t()?)?;
        let ds = softmax_grad(&self.p, &dp, &d_out, &out, self.scale as f32)?;
        let dq = ds.matmul(&k)?;
        let dk = ds.t()?.matmul(&q)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    use crate::model::fixtures::{max_diff, uniform};

    /// Each fused op against the same maths composed from candle's differentiable ops:
    /// values and gradients (through a random linear functional of the output).
    /// Gradients of `Σ y ⊙ c`: a random linear functional of an op's output.
    fn grads(y: &Tensor, c: &Tensor) -> candle_core::backprop::GradStore {
        (y * c).unwrap().sum_all().unwrap().backward().unwrap()
    }

    /// The in-place SwiGLU backward writes what the out-of-place one does, over a length
    /// that crosses parallel chunks and copied pieces and leaves short tails of both.
    #[test]
    fn swiglu_grads_in_place_equal_the_out_of_place_ones() {
        let n = CHUNK + 256 * 3 + 13;
        let spread = |salt: u32| -> Vec<f32> {
            (0..n as u32)
                .map(|i| ((i.wrapping_mul(2654435761) ^ salt) % 2000) as f32 / 250.0 - 4.0)
                .collect()
        };
        let (a, b, g) = (spread(1), spread(2), spread(3));
        let (mut da, mut db) = (vec![0f32; n], vec![0f32; n]);
        swiglu_grads_into(&a, &b, &g, &mut da, &mut db);
        let (mut a2, mut b2) = (a.clone(), b.clone());
        swiglu_grads_in_place(&mut a2, &mut b2, &g);
        assert_eq!(a2, da);
        assert_eq!(b2, db);
    }

    #[test]
    fn fused_ops_match_composed_ops() {
        let x = Var::from_tensor(&uniform(&[3, 5, 16], 1)).unwrap();
        let w = (uniform(&[16], 2) + 1.0).unwrap();
        let c = uniform(&[3, 5, 16], 3);
        let ours = rms_norm(x.as_tensor(), &w, 1e-6).unwrap();
        let theirs = candle_nn::ops::rms_norm_slow(x.as_tensor(), &w, 1e-6).unwrap();
        assert!(max_diff(&ours, &theirs) < 1e-5);
        let g1 = grads(&ours, &c);
        let g2 = grads(&theirs, &c);
        assert!(
            max_diff(
                g1.get(x.as_tensor()).unwrap(),
                g2.get(x.as_tensor()).unwrap()
            ) < 1e-4
        );

        let a = Var::from_tensor(&(uniform(&[4, 32], 4) * 4.0).unwrap()).unwrap();
        let b = Var::from_tensor(&uniform(&[4, 32], 5)).unwrap();
        let c = uniform(&[4, 32], 6);
        let ours = swiglu(a.as_tensor(), b.as_tensor()).unwrap();
        let theirs = (a.as_tensor().silu().unwrap() * b.as_tensor()).unwrap();
        assert!(max_diff(&ours, &theirs) < 1e-5);
        let g1 = grads(&ours, &c);
        let g2 = grads(&theirs, &c);
        for v in [&a, &b] {
            assert!(
                max_diff(
                    g1.get(v.as_tensor()).unwrap(),
                    g2.get(v.as_tensor()).unwrap()
                ) < 1e-4
            );
        }

        // Heads and rope: [B, T, n, d] → [B, n, T, d] against transpose + composed rope,
        // and transpose alone.
        let y = Var::from_tensor(&uniform(&[2, 3, 4, 8], 11)).unwrap();
        let positions = Tensor::new(&[[0u32, 1, 2], [5, 6, 7]], &Device::Cpu).unwrap();
        let inv = crate::model::ops::rope_inv_freq(
            8,
            10000.0,
            &crate::model::config::RopeScaling::None,
            &Device::Cpu,
        )
        .unwrap();
        let (cos, sin) = crate::model::ops::rope_cos_sin(&inv, &positions).unwrap();
        let c = uniform(&[2, 4, 3, 8], 12);
        for rotate in [true, false] {
            let ours = heads_rope(y.as_tensor(), 4, 4, rotate.then_some((&cos, &sin))).unwrap();
            let moved = y.as_tensor().transpose(1, 2).unwrap();
            let theirs = if rotate {
                crate::model::ops::rotate_half(&moved, &cos, &sin).unwrap()
            } else {
                moved
            };
            assert_eq!(ours.dims(), theirs.dims());
            assert!(max_diff(&ours, &theirs) < 1e-6);
            // Flat heads in, two groups of two heads out: the same values, regrouped.
            let flat = y.as_tensor().reshape((2, 3, 32)).unwrap();
            let grouped = heads_rope(&flat, 4, 2, rotate.then_some((&cos, &sin))).unwrap();
            assert_eq!(grouped.dims(), [2, 2, 6, 8]);
            let regrouped = theirs.reshape((2, 2, 6, 8)).unwrap();
            assert!(max_diff(&grouped, &regrouped) < 1e-6);
            let g1 = grads(&ours, &c);
            let g2 = grads(&theirs, &c);
            let d = max_diff(
                g1.get(y.as_tensor()).unwrap(),
                g2.get(y.as_tensor()).unwrap(),
            );
            assert!(d < 1e-5, "rotate {rotate}: {d}");
        }

        // Attention: B 2, 2 kv heads, 3 query heads each, left padding in row 1 (its first
        // two queries see no key: zero weights). T 5, d 8, T 37, d 24 (several row
        // blocks and register tiles, blocks that wrap from one query head to the next), and
        // T 300 (the depth of P V past one packed block).
        for (t, d, pad) in [(5, 8, 2), (37, 24, 9), (300, 16, 40)] {
            let (bsz, nkv, rep) = (2, 2, 3);
            let q = Var::from_tensor(&uniform(&[bsz, nkv, rep * t, d], 7)).unwrap();
            let k = Var::from_tensor(&uniform(&[bsz, nkv, t, d], 8)).unwrap();
            let v = Var::from_tensor(&uniform(&[bsz, nkv, t, d], 9)).unwrap();
            let (mut m, mut seen) = (Vec::new(), Vec::new());
            for row in 0..bsz {
                for i in 0..t {
                    let hidden = |j: usize| row == 1 && j < pad;
                    seen.push(if (0..=i).all(hidden) { 0f32 } else { 1.0 });
                    for j in 0..t {
                        m.push(if j <= i && !hidden(j) { 0f32 } else { -1e30 });
                    }
                }
            }
            let mask = Tensor::from_vec(m, (bsz, 1, 1, t, t), &Device::Cpu).unwrap();
            let seen = Tensor::from_vec(seen, (bsz, 1, 1, t, 1), &Device::Cpu).unwrap();
            let scale = 1.0 / (d as f64).sqrt();
            let c = uniform(&[bsz, nkv, rep * t, d], 10);
            let ours =
                attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &mask, scale).unwrap();
            let s = (q.as_tensor().matmul(&k.as_tensor().t().unwrap()).unwrap() * scale)
                .unwrap()
                .reshape((bsz, nkv, rep, t, t))
                .unwrap()
                .broadcast_add(&mask)
                .unwrap();
            let p = candle_nn::ops::softmax(&s, D::Minus1)
                .unwrap()
                .broadcast_mul(&seen)
                .unwrap()
                .reshape((bsz, nkv, rep * t, t))
                .unwrap();
            let theirs = p.matmul(v.as_tensor()).unwrap();
            let diff = max_diff(&ours, &theirs);
            assert!(diff < 1e-5, "T {t}: {diff}");
            let g1 = grads(&ours, &c);
            let g2 = grads(&theirs, &c);
            for var in [&q, &k, &v] {
                let d = max_diff(
                    g1.get(var.as_tensor()).unwrap(),
                    g2.get(var.as_tensor()).unwrap(),
                );
                assert!(d < 1e-4, "T {t}: {d}");
            }
        }
    }
}
