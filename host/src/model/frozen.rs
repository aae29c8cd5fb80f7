//! A projection's frozen base weight `W: [out, in]`, dense or NF4 (QLoRA), and the fused
//! LoRA ops' products with it, so that a 4-bit base trains through the same kernels as an
//! f32 one.
//!
//! An NF4 weight is dequantized a block of output rows at a time into a scratch buffer of
//! at most [`BLOCK_FLOATS`] values and multiplied from there: the forward writes the
//! block's columns of `x Wᵀ` (with the adapter's low-rank term in the same tiles), the
//! backward adds the block's share of `g W`. The backward dequantizes again rather than
//! keeping anything, so the f32 weight never exists whole; dequantizing costs `out · in`
//! operations against the product's `tokens · out · in`.

use super::nf4::Nf4Linear;
use candle_core::{Device, Result, Tensor};
use std::sync::Arc;
#[cfg(target_arch = "x86_64")]
use {
    super::cpu::alloc::zeroed,
    super::cpu::gemm::{MatRef, gemm_plus, product_plus, product_plus_into},
    super::cpu::storage::with_f32_data,
};

/// A projection's frozen base weight `[out, in]`: a dense tensor, or NF4 (QLoRA), which is
/// dequantized a block at a time and never kept whole.
#[derive(Clone)]
pub enum Weight {
    Dense(Tensor),
    Nf4(Arc<Nf4Linear>),
}

impl Weight {
    /// `(out, in)`.
    pub fn dims2(&self) -> (usize, usize) {
        match self {
            Weight::Dense(w) => {
                let d = w.dims();
                (d[0], d[1])
            }
            Weight::Nf4(q) => q.dims(),
        }
    }

    /// The weight in f32, dequantized when it is NF4 (for a merged export).
    pub fn to_dense(&self, device: &Device) -> Result<Tensor> {
        match self {
            Weight::Dense(w) => Ok(w.clone()),
            Weight::Nf4(q) => q.dense(device),
        }
    }
}

#[cfg(target_arch = "x86_64")]
/// Most values of a dequantized block (8 MB: in L3, and small beside the activations).
/// Tests use small blocks, so that small weights cross several.
const BLOCK_FLOATS: usize = if cfg!(test) { 1 << 13 } else { 2 << 20 };

#[cfg(target_arch = "x86_64")]
/// A frozen weight's values as the fused ops read them.
#[derive(Clone, Copy)]
pub enum Frozen<'a> {
    /// Row-major `[out, in]`.
    Dense(&'a [f32], usize, usize),
    Nf4(&'a Nf4Linear),
}

#[cfg(target_arch = "x86_64")]
/// Runs `f` on `w`'s values (a dense weight made contiguous first, without a copy when it
/// is).
pub fn with_frozen<R>(w: &Weight, f: impl FnOnce(Frozen) -> Result<R>) -> Result<R> {
    match w {
        Weight::Dense(t) => {
            let (n, k) = t.dims2()?;
            with_f32_data(t, |d| f(Frozen::Dense(d, n, k)))
        }
        Weight::Nf4(q) => f(Frozen::Nf4(q)),
    }
}

#[cfg(target_arch = "x86_64")]
/// Runs `f` on three weights' values.
pub fn with_frozen3<R>(w: [&Weight; 3], f: impl FnOnce([Frozen; 3]) -> Result<R>) -> Result<R> {
    with_frozen(w[0], |a| {
        with_frozen(w[1], |b| with_frozen(w[2], |c| f([a, b, c])))
    })
}

#[cfg(target_arch = "x86_64")]
/// Output rows per dequantized block of an `[out, in]` weight: evenly split blocks of at
/// most [`BLOCK_FLOATS`] values, a multiple of 64 rows (whole strips of the gemm).
fn block_rows(out_f: usize, in_f: usize) -> usize {
    let most = (BLOCK_FLOATS / in_f.max(1)).max(64);
    let blocks = out_f.div_ceil(most).max(1);
    out_f.div_ceil(blocks).next_multiple_of(64)
}

#[cfg(target_arch = "x86_64")]
impl Frozen<'_> {
    /// `(out, in)`.
    pub fn dims(&self) -> (usize, usize) {
        match self {
            Frozen::Dense(_, n, k) => (*n, *k),
            Frozen::Nf4(q) => q.dims(),
        }
    }

    /// Runs `f(r0, r1, block)` for consecutive row blocks of the NF4 weight dequantized.
    fn blocks(q: &Nf4Linear, mut f: impl FnMut(usize, usize, MatRef)) {
        let (out_f, in_f) = q.dims();
        let rows = block_rows(out_f, in_f);
        let mut scratch = Vec::new();
        for r0 in (0..out_f).step_by(rows) {
            let r1 = (r0 + rows).min(out_f);
            scratch.resize((r1 - r0) * in_f, 0.0);
            q.dequantize_rows_into(r0, r1, &mut scratch);
            f(r0, r1, MatRef::row_major(&scratch, r1 - r0, in_f));
        }
    }

    /// `x Wᵀ + low · bt` (`[m, out]`, row-major) for `x: [m, in]` and the adapter's
    /// `low = s x Aᵀ: [m, r]`, `bt = Bᵀ: [r, out]`.
    pub fn forward_plus(&self, x: MatRef, low: MatRef, bt: MatRef) -> Vec<f32> {
        match *self {
            Frozen::Dense(w, n, k) => product_plus(x, MatRef::row_major(w, n, k).t(), low, bt),
            Frozen::Nf4(q) => {
                let (m, n) = (x.rows, q.dims().0);
                let mut c = zeroed(m * n);
                Self::blocks(q, |r0, r1, w| {
                    let tail = Some((low, bt.cols_range(r0, r1)));
                    gemm_plus(x, w.t(), tail, &mut c[r0..], n, false);
                });
                c
            }
        }
    }

    /// `c = g W + gl · a` (or `+=` with `accumulate`), `c: [m, in]` row-major, for
    /// `g: [m, out]` and the adapter's `gl = s g B: [m, r]`, `a = A: [r, in]`.
    pub fn backward_plus_into(
        &self,
        g: MatRef,
        gl: MatRef,
        a: MatRef,
        c: &mut [f32],
        accumulate: bool,
    ) {
        match *self {
            Frozen::Dense(w, n, k) => {
                product_plus_into(g, MatRef::row_major(w, n, k), gl, a, c, accumulate)
            }
            Frozen::Nf4(q) => {
                let k = q.dims().1;
                Self::blocks(q, |r0, r1, w| {
                    let first = r0 == 0;
                    let tail = first.then_some((gl, a));
                    gemm_plus(g.cols_range(r0, r1), w, tail, c, k, accumulate || !first);
                });
            }
        }
    }

    /// [`Frozen::backward_plus_into`] into a new buffer.
    pub fn backward_plus(&self, g: MatRef, gl: MatRef, a: MatRef) -> Vec<f32> {
        match *self {
            Frozen::Dense(w, n, k) => product_plus(g, MatRef::row_major(w, n, k), gl, a),
            Frozen::Nf4(q) => {
                let mut c = zeroed(g.rows * q.dims().1);
                self.backward_plus_into(g, gl, a, &mut c, false);
                c
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::model::nf4::Nf4;

    fn spread(n: usize, salt: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ salt) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// The blocked NF4 products equal the dense products of the dequantized weight, over
    /// several blocks and a short last one.
    #[test]
    fn nf4_blocks_give_the_dense_products() {
        if !crate::model::cpu::gemv::available() {
            return;
        }
        let (n, k, m, r) = (200, 128, 37, 4);
        let q = Nf4Linear::new(Nf4::quantize(&spread(n * k, 1), n, k, true).unwrap());
        assert!(block_rows(n, k) < n, "the test must cross blocks");
        let w = q.q.dequantize();
        let dense = Frozen::Dense(&w, n, k);
        let (x, low, b, g, gl, a) = (
            spread(m * k, 2),
            spread(m * r, 3),
            spread(n * r, 4),
            spread(m * n, 5),
            spread(m * r, 6),
            spread(r * k, 7),
        );
        let (xm, lowm, bt) = (
            MatRef::row_major(&x, m, k),
            MatRef::row_major(&low, m, r),
            MatRef::row_major(&b, n, r).t(),
        );
        let close = |a: &[f32], b: &[f32]| {
            let worst = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-3, "differs by {worst}");
        };
        close(
            &Frozen::Nf4(&q).forward_plus(xm, lowm, bt),
            &dense.forward_plus(xm, lowm, bt),
        );
        let (gm, glm, am) = (
            MatRef::row_major(&g, m, n),
            MatRef::row_major(&gl, m, r),
            MatRef::row_major(&a, r, k),
        );
        let want = dense.backward_plus(gm, glm, am);
        close(&Frozen::Nf4(&q).backward_plus(gm, glm, am), &want);
        // Accumulating adds to what is there.
        let mut c = vec![1f32; m * k];
        Frozen::Nf4(&q).backward_plus_into(gm, glm, am, &mut c, true);
        let plus_one: Vec<f32> = want.iter().map(|v| v + 1.0).collect();
        close(&c, &plus_one);
    }
}
