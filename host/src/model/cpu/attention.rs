//! Causal attention with grouped kv heads on the CPU, forward and backward, for the
//! batch (training) path: `P = softmax(s Q Kᵀ + M)`, `O = P V` (formulas in
//! [`super::fused`]).
//!
//! candle's batched matmul ran the six products of a layer at a fraction of the FMA peak
//! and computed all of `Q Kᵀ` although a causal mask hides half of it. Here each product
//! is the packed gemm ([`super::gemm::gemm_packed`]) on one thread per block of query
//! rows, many blocks in parallel, and the hidden upper triangle is skipped a register tile
//! at a time: the columns of `Q Kᵀ` and `dO Vᵀ` after a tile's last position are not
//! computed, and the depth of `P V`, `dS K`, `dSᵀ Q` and `Pᵀ dO` stops (or starts) at the
//! diagonal. The mask still applies (padding) on the part that is computed.
//!
//! Layouts (contiguous f32): `q` `[B, kv, R·T, d]` with the `R` query heads of a kv head
//! stacked as rows (row `r` is position `r mod T`), `k`, `v` `[B, kv, T, d]`, the additive
//! mask `[B, T, T]`. A query row whose every visible key is masked (a padding position)
//! gets zero weights, so a zero output and no gradient.

use super::alloc::zeroed;
use super::gemm::{Band, MatRef, PackedB, gemm_packed};
use rayon::prelude::*;

/// A key is hidden from a query when the mask adds at most this (the masks use -1e30).
const HIDDEN: f32 = -1e29;

/// Query (or key) rows per parallel task, a multiple of the register tile's 6 rows.
const ROWS: usize = 48;

/// Sizes of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub batch: usize,
    pub kv_heads: usize,
    /// Query heads per kv head.
    pub rep: usize,
    pub t: usize,
    pub d: usize,
}

impl Dims {
    fn pairs(&self) -> usize {
        self.batch * self.kv_heads
    }

    fn rows(&self) -> usize {
        self.rep * self.t
    }

    /// The last position among query rows `row..row + mr` (rows wrap every `t`).
    fn last_pos(&self, row: usize, mr: usize) -> usize {
        let first = row % self.t;
        if first + mr <= self.t {
            first + mr - 1
        } else {
            self.t - 1
        }
    }
}

/// `(O, P)` for the layouts above, `O` `[B, kv, R·T, d]`, `P` `[B, kv, R·T, T]` (zero
/// above the diagonal).
pub fn forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: &[f32],
    dims: Dims,
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let Dims { kv_heads, t, d, .. } = dims;
    let rows = dims.rows();
    check(q, k, v, mask, dims);
    let (kt, vb) = (pack_heads(k, dims, true), pack_heads(v, dims, false));
    let mut out = zeroed(dims.pairs() * rows * d);
    let mut p = zeroed(dims.pairs() * rows * t);
    for_row_blocks(&mut out, d, &mut p, t, rows, |pair, r0, o, pb| {
        let (kt, vb) = (&kt[pair], &vb[pair]);
        let n = o.len() / d;
        let qm = MatRef::row_major(&q[(pair * rows + r0) * d..][..n * d], n, d);
        causal_scores(dims, r0, qm, kt, pb);
        let batch = pair / kv_heads;
        for (r, pr) in pb.chunks_exact_mut(t).enumerate() {
            let i = (r0 + r) % t;
            softmax_row(&mut pr[..=i], &mask[(batch * t + i) * t..][..=i], scale);
            pr[i + 1..].fill(0.0);
        }
        causal_weighted(dims, r0, pb, vb, o);
    });
    (out, p)
}

/// `(dQ, dK, dV)` from the forward's inputs, `O`, `P` and `dO` (`dO` and `O` laid out
/// like `q`).
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    p: &[f32],
    d_out: &[f32],
    dims: Dims,
    scale: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let Dims { rep, t, d, .. } = dims;
    let rows = dims.rows();
    assert!(out.len() == q.len() && d_out.len() == q.len() && p.len() == dims.pairs() * rows * t);
    // dS = s P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)) and dQ = dS K, by blocks of query rows.
    let (vt, kb) = (pack_heads(v, dims, true), pack_heads(k, dims, false));
    let mut dq = zeroed(q.len());
    let mut ds = zeroed(p.len());
    for_row_blocks(&mut dq, d, &mut ds, t, rows, |pair, r0, dqb, dsb| {
        let (vt, kb) = (&vt[pair], &kb[pair]);
        let n = dqb.len() / d;
        let at = (pair * rows + r0) * d;
        let (go, o) = (&d_out[at..][..n * d], &out[at..][..n * d]);
        causal_scores(dims, r0, MatRef::row_major(go, n, d), vt, dsb);
        let pb = &p[(pair * rows + r0) * t..][..n * t];
        for (r, (dsr, pr)) in dsb.chunks_exact_mut(t).zip(pb.chunks_exact(t)).enumerate() {
            let i = (r0 + r) % t;
            let (gr, or) = (&go[r * d..][..d], &o[r * d..][..d]);
            let dot: f32 = gr.iter().zip(or).map(|(g, o)| g * o).sum();
            for (s, &pv) in dsr[..=i].iter_mut().zip(&pr[..=i]) {
                *s = scale * pv * (*s - dot);
            }
            dsr[i + 1..].fill(0.0);
        }
        causal_weighted(dims, r0, dsb, kb, dqb);
    });
    // dK = Σ_g dS_gᵀ Q_g and dV = Σ_g P_gᵀ dO_g over the R query heads, by blocks of keys;
    // query i reaches key j only for i ≥ j.
    let packed: Vec<Vec<(PackedB, PackedB)>> = (0..dims.pairs())
        .into_par_iter()
        .map(|pair| {
            (0..rep)
                .map(|g| {
                    let at = (pair * rows + g * t) * d;
                    (
                        PackedB::new(MatRef::row_major(&q[at..][..t * d], t, d)),
                        PackedB::new(MatRef::row_major(&d_out[at..][..t * d], t, d)),
                    )
                })
                .collect()
        })
        .collect();
    let mut dk = zeroed(k.len());
    let mut dv = zeroed(v.len());
    for_row_blocks(&mut dk, d, &mut dv, d, t, |pair, j0, dkb, dvb| {
        let n = dkb.len() / d;
        let depth = |row: usize, _: usize| j0 + row..t;
        for (g, (qg, gg)) in packed[pair].iter().enumerate() {
            let at = (pair * rows + g * t) * t + j0;
            // Rows j0.. of dS_gᵀ and P_gᵀ: column j of the group's [T, T] block.
            let end = (pair * rows + (g + 1) * t) * t;
            let view = |data| MatRef {
                data,
                rows: n,
                cols: t,
                rs: 1,
                cs: t,
            };
            gemm_packed(view(&ds[at..end]), qg, dkb, d, g > 0, Band::Depth(&depth));
            gemm_packed(view(&p[at..end]), gg, dvb, d, g > 0, Band::Depth(&depth));
        }
    });
    (dq, dk, dv)
}

/// Scores `c = a · b` (`Q Kᵀ`, `dO Vᵀ`) for a block of query rows from `r0`: each tile's
/// columns up to its last position only, the rest left unwritten.
fn causal_scores(dims: Dims, r0: usize, a: MatRef, b: &PackedB, c: &mut [f32]) {
    let cols = |row: usize, mr: usize| dims.last_pos(r0 + row, mr) + 1;
    gemm_packed(a, b, c, dims.t, false, Band::Cols(&cols));
}

/// `c = s · b` (`P V`, `dS K`) for the score rows `s` of a block of query rows from `r0`,
/// summed over the keys up to each tile's last position only (the rest of `s` is zero).
fn causal_weighted(dims: Dims, r0: usize, s: &[f32], b: &PackedB, c: &mut [f32]) {
    let depth = |row: usize, mr: usize| 0..dims.last_pos(r0 + row, mr) + 1;
    let n = c.len() / dims.d;
    let a = MatRef::row_major(s, n, dims.t);
    gemm_packed(a, b, c, dims.d, false, Band::Depth(&depth));
}

/// Each (batch, kv head)'s `[T, d]` keys or values packed as a product's B: transposed
/// (for `Q Kᵀ`, `dO Vᵀ`) or as they are (for `P V`, `dS K`).
fn pack_heads(x: &[f32], dims: Dims, transposed: bool) -> Vec<PackedB> {
    let Dims { t, d, .. } = dims;
    (0..dims.pairs())
        .into_par_iter()
        .map(|pair| {
            let m = MatRef::row_major(&x[pair * t * d..][..t * d], t, d);
            PackedB::new(if transposed { m.t() } else { m })
        })
        .collect()
}

/// Runs `f(pair, first_row, a_block, b_block)` in parallel over blocks of [`ROWS`] rows
/// of two outputs with `rows` rows per (batch, kv head) pair, `a_width` and `b_width`
/// floats per row.
fn for_row_blocks(
    a: &mut [f32],
    a_width: usize,
    b: &mut [f32],
    b_width: usize,
    rows: usize,
    f: impl Fn(usize, usize, &mut [f32], &mut [f32]) + Sync,
) {
    a.par_chunks_mut(rows * a_width)
        .zip(b.par_chunks_mut(rows * b_width))
        .enumerate()
        .for_each(|(pair, (ap, bp))| {
            ap.par_chunks_mut(ROWS * a_width)
                .zip(bp.par_chunks_mut(ROWS * b_width))
                .enumerate()
                .for_each(|(blk, (ab, bb))| f(pair, blk * ROWS, ab, bb));
        });
}

/// `z ← softmax(s z + m)` over a row's visible keys; all zero when the mask hides them all.
fn softmax_row(z: &mut [f32], m: &[f32], scale: f32) {
    let mut max = f32::NEG_INFINITY;
    let mut visible = false;
    for (z, &m) in z.iter_mut().zip(m) {
        visible |= m > HIDDEN;
        *z = *z * scale + m;
        max = max.max(*z);
    }
    if !visible {
        z.fill(0.0);
        return;
    }
    let (done, mut sum) = super::simd::simd_exp(z, max);
    for z in &mut z[done..] {
        *z = (*z - max).exp();
        sum += *z;
    }
    let inv = 1.0 / sum;
    z.iter_mut().for_each(|z| *z *= inv);
}

fn check(q: &[f32], k: &[f32], v: &[f32], mask: &[f32], dims: Dims) {
    let Dims { batch, t, d, .. } = dims;
    assert!(
        q.len() == dims.pairs() * dims.rows() * d
            && k.len() == dims.pairs() * t * d
            && v.len() == k.len()
            && mask.len() == batch * t * t,
        "attention: sizes do not fit {dims:?}"
    );
}
