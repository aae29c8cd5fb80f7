//! A projection's frozen base weight as the fused LoRA kernels read it ([`Frozen`]):
//! dense f32, or kept quantized (NF4, QLoRA) and dequantized a block of output rows at a
//! time into a scratch buffer of at most [`BLOCK_FLOATS`] values, multiplied from there.
//! The forward writes the block's columns of `x Wᵀ` (with the adapter's low-rank term in
//! the same tiles), the backward adds the block's share of `g W`; the backward dequantizes
//! again rather than keeping anything, so the f32 weight never exists whole.
//!
//! The model's weight types reach the kernels through two traits, so that nothing here
//! names them: [`RowBlocks`] (a quantized weight's rows, `model/nf4/`) and
//! [`FrozenWeight`] (what a fused op keeps for its backward, `model/frozen.rs`).

use super::alloc::zeroed;
use super::gemm::{MatRef, gemm_plus, product_plus, product_plus_into};
use candle_core::{Result, Tensor};

/// A weight `[out, in]` kept quantized, read a block of output rows at a time.
pub trait RowBlocks: Sync {
    /// `(out, in)`.
    fn dims(&self) -> (usize, usize);
    /// Rows `r0..r1` in f32, row-major, into `out` (`(r1 - r0) · in` values).
    fn dequantize_rows_into(&self, r0: usize, r1: usize, out: &mut [f32]);
}

/// A frozen weight as a fused op keeps it for its backward, and lends its values to the
/// kernels.
pub trait FrozenWeight: Clone + Send + Sync + 'static {
    /// `(out, in)`.
    fn dims2(&self) -> (usize, usize);
    /// Whether the kernels can take it beside `x` (a dense weight: f32, as the gemm
    /// reads it).
    fn applies(&self, x: &Tensor) -> bool;
    /// Runs `f` on its values (a dense weight made contiguous first, without a copy when
    /// it is).
    fn with_frozen<R>(&self, f: impl FnOnce(Frozen) -> Result<R>) -> Result<R>;
}

/// Runs `f` on three weights' values.
pub fn with_frozen3<W: FrozenWeight, R>(
    w: [&W; 3],
    f: impl FnOnce([Frozen; 3]) -> Result<R>,
) -> Result<R> {
    w[0].with_frozen(|a| w[1].with_frozen(|b| w[2].with_frozen(|c| f([a, b, c]))))
}

/// Most values of a dequantized block (8 MB: in L3, and small beside the activations).
/// Tests use small blocks, so that small weights cross several.
const BLOCK_FLOATS: usize = if cfg!(test) { 1 << 13 } else { 2 << 20 };

/// A frozen weight's values as the fused ops read them.
#[derive(Clone, Copy)]
pub enum Frozen<'a> {
    /// Row-major `[out, in]`.
    Dense(&'a [f32], usize, usize),
    /// A weight kept quantized: dequantized a block of rows at a time.
    Blocks(&'a dyn RowBlocks),
}

/// Output rows per dequantized block of an `[out, in]` weight: evenly split blocks of at
/// most [`BLOCK_FLOATS`] values, a multiple of 64 rows (whole strips of the gemm).
pub fn block_rows(out_f: usize, in_f: usize) -> usize {
    let most = (BLOCK_FLOATS / in_f.max(1)).max(64);
    let blocks = out_f.div_ceil(most).max(1);
    out_f.div_ceil(blocks).next_multiple_of(64)
}

impl Frozen<'_> {
    /// `(out, in)`.
    pub fn dims(&self) -> (usize, usize) {
        match self {
            Frozen::Dense(_, n, k) => (*n, *k),
            Frozen::Blocks(q) => q.dims(),
        }
    }

    /// Runs `f(r0, r1, block)` for consecutive row blocks of the quantized weight dequantized.
    fn blocks(q: &dyn RowBlocks, mut f: impl FnMut(usize, usize, MatRef)) {
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
            Frozen::Blocks(q) => {
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
            Frozen::Blocks(q) => {
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
            Frozen::Blocks(q) => {
                let mut c = zeroed(g.rows * q.dims().1);
                self.backward_plus_into(g, gl, a, &mut c, false);
                c
            }
        }
    }
}
