//! The register tile of [`super::gemm`]: one `MR × NR` block of C from a packed B strip and
//! an A strip (packed, or in place), on AVX-512 (the whole 12×32 tile in 24 zmm
//! accumulators) or AVX2 (four 6×16 quarters in 12 ymm each), with the steps of an
//! optional second product (a [`Tail`]) run into the same accumulators. The blocking, the
//! packing and the threads around it are in the parent module; this file holds only the
//! FMAs and the loads and stores of C at a tile's edges.

use super::{MR, MR2, NR};

/// The instruction set of the tile kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Isa {
    /// A tile's four 6×16 quarters, one after the other, each in 12 ymm accumulators.
    Avx2,
    /// The whole 12×32 tile in 24 zmm accumulators: twice the FMA width, and fewer loads
    /// per FMA.
    Avx512,
}

/// The kernel this machine runs: AVX-512 where present (a 2-core Xeon here ran the step's
/// products at up to ~2x the AVX2 kernel's rate), else AVX2 (callers check
/// [`super::gemv::available`]).
pub(super) fn isa() -> Isa {
    #[cfg(test)]
    if let Some(isa) = super::tests::FORCE_ISA.get() {
        return isa;
    }
    if std::is_x86_feature_detected!("avx512f") {
        Isa::Avx512
    } else {
        Isa::Avx2
    }
}

/// One tile's operands: `kc` steps of A at `a` (row stride `lda` in place) against the B
/// strip `b`, into the `mr × nr` tile of C at `c` (row stride `ldc`), added to it with
/// `add`, with the `tail`'s steps after.
#[derive(Clone, Copy)]
pub(super) struct Tile<'b> {
    pub kc: usize,
    pub a: *const f32,
    pub lda: usize,
    pub b: &'b [f32],
    pub c: *mut f32,
    pub ldc: usize,
    pub mr: usize,
    pub nr: usize,
    pub add: bool,
    pub tail: Option<Tail>,
}

/// One `mr × nr` tile of C (`mr ≤ MR`, `nr ≤ NR`) from a B strip and either a packed A
/// strip (`DIRECT` false: element `(i, p)` at `a[p * MR + i]`) or A in place (`DIRECT`:
/// at `a[i * lda + p]`), on `isa`'s kernel.
///
/// # Safety
/// `isa`'s features (AVX2 and FMA, or AVX-512F) must be available; `c` must be valid for
/// `mr` rows of `nr` floats at stride `ldc`; `a` must hold `kc` steps of `mr` rows; `b`
/// holds `kc` packed steps, and the tail's steps after them.
#[inline(always)]
pub(super) unsafe fn tile<const DIRECT: bool>(isa: Isa, t: Tile) {
    let Tile {
        kc,
        a,
        lda,
        b,
        c,
        ldc,
        mr,
        nr,
        tail,
        ..
    } = t;
    debug_assert!(b.len() >= (kc + tail.map_or(0, |t| t.steps)) * NR);
    // SAFETY: per the contract above; each quarter of an AVX2 tile is inside the tile.
    unsafe {
        match isa {
            Isa::Avx512 => tile512::<DIRECT>(t),
            Isa::Avx2 => {
                // Quarters: columns by halves of 16, rows by halves of MR2. A half's B lines
                // (one of each step's two) are used twice in a row, so the strip's two
                // halves are not both needed in L1 (32 KB on many AVX2 machines) at once.
                for col in (0..nr).step_by(16) {
                    for r0 in (0..mr).step_by(MR2) {
                        let a = if DIRECT { a.add(r0 * lda) } else { a.add(r0) };
                        let tail = tail.map(|t| Tail {
                            a: t.a.add(r0 * t.lda),
                            ..t
                        });
                        let (mr, nr) = (MR2.min(mr - r0), 16.min(nr - col));
                        let c = c.add(r0 * ldc + col);
                        let quarter = Tile {
                            a,
                            c,
                            mr,
                            nr,
                            tail,
                            ..t
                        };
                        tile256::<DIRECT>(quarter, col);
                    }
                }
            }
        }
    }
}

/// Element `(i, p)` of A for each of the tile's rows: in place at `rows[i] + p`, packed at
/// `rows[i] + p·MR`. Rows past `mr` of an in-place A repeat row 0 (their results are
/// dropped), so no read leaves A.
///
/// # Safety
/// `a` must hold the tile's rows as in [`tile`].
#[inline(always)]
unsafe fn a_rows<const DIRECT: bool, const R: usize>(
    a: *const f32,
    lda: usize,
    mr: usize,
) -> [*const f32; R] {
    std::array::from_fn(|i| {
        if !DIRECT {
            a.wrapping_add(i)
        } else if i < mr {
            a.wrapping_add(i * lda)
        } else {
            a
        }
    })
}

/// Extra steps for a tile: row-major A rows from `a` (stride `lda`), against the B strip's
/// `steps` steps after the tile's own.
#[derive(Clone, Copy)]
pub(super) struct Tail {
    pub a: *const f32,
    pub lda: usize,
    pub steps: usize,
}

/// Runs a tile's steps through `step(rows, b, p, a_step)`: `kc` steps of A's `rows` (in
/// place or packed, per `DIRECT`) against the strip at `bp`, then the tail's (rows in
/// place, their own steps of B).
#[inline(always)]
fn run_steps<const DIRECT: bool, const R: usize>(
    kc: usize,
    rows: &[*const f32; R],
    bp: *const f32,
    tail: Option<([*const f32; R], *const f32, usize)>,
    mut step: impl FnMut(&[*const f32; R], *const f32, usize, usize),
) {
    let a_step = if DIRECT { 1 } else { MR };
    // Four steps per iteration: less loop overhead between the FMAs.
    let mut p = 0;
    while p + 4 <= kc {
        step(rows, bp, p, a_step);
        step(rows, bp, p + 1, a_step);
        step(rows, bp, p + 2, a_step);
        step(rows, bp, p + 3, a_step);
        p += 4;
    }
    while p < kc {
        step(rows, bp, p, a_step);
        p += 1;
    }
    if let Some((rows, bp, steps)) = tail {
        for p in 0..steps {
            step(&rows, bp, p, 1);
        }
    }
}

/// Starts fetching the `mr × nr` tile of C at `c` (row stride `ldc`) into L1: its rows are
/// far apart, and the product runs meanwhile. A prefetch has no effect but on the cache.
#[inline(always)]
fn prefetch_c(c: *mut f32, ldc: usize, mr: usize, nr: usize) {
    use std::arch::x86_64::*;
    for i in 0..mr {
        let row = c.wrapping_add(i * ldc);
        // SAFETY: prefetching never faults and reads nothing into the program.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(row as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(nr - 1) as *const i8);
            if nr > 16 {
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(16) as *const i8);
            }
        }
    }
}

/// [`tile`] on AVX-512: 12 rows × 32 columns in 24 zmm accumulators, each step two B
/// loads, twelve broadcasts of A and 24 FMAs (BLIS's Skylake-X sgemm shape, transposed);
/// edge tiles through masked loads and stores.
///
/// # Safety
/// AVX-512F must be available; otherwise as [`tile`].
#[target_feature(enable = "avx512f")]
unsafe fn tile512<const DIRECT: bool>(t: Tile) {
    use std::arch::x86_64::*;
    let Tile {
        kc,
        a,
        lda,
        b,
        c,
        ldc,
        mr,
        nr,
        add,
        tail,
    } = t;
    const R: usize = MR;
    let bp = b.as_ptr();
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    // SAFETY: per the contract above.
    unsafe {
        prefetch_c(c, ldc, mr, nr);
        let step = |acc: &mut [[__m512; 2]; R], rows: &[*const f32; R], bp: *const f32, p, s| {
            let b0 = _mm512_loadu_ps(bp.add(p * NR));
            let b1 = _mm512_loadu_ps(bp.add(p * NR + 16));
            for (row, &ar) in acc.iter_mut().zip(rows) {
                let av = _mm512_set1_ps(*ar.add(p * s));
                row[0] = _mm512_fmadd_ps(av, b0, row[0]);
                row[1] = _mm512_fmadd_ps(av, b1, row[1]);
            }
        };
        let rows = a_rows::<DIRECT, R>(a, lda, mr);
        let tail = tail.map(|t| (a_rows::<true, R>(t.a, t.lda, mr), bp.add(kc * NR), t.steps));
        run_steps::<DIRECT, R>(kc, &rows, bp, tail, |rows, bp, p, s| {
            step(&mut acc, rows, bp, p, s)
        });
        let mask = |n: usize| -> __mmask16 { ((1u32 << n.min(16)) - 1) as __mmask16 };
        let (m0, m1) = (mask(nr), mask(nr.saturating_sub(16)));
        for (i, row) in acc.iter().enumerate().take(mr) {
            let (p0, p1) = (c.add(i * ldc), c.wrapping_add(i * ldc + 16));
            let (mut v0, mut v1) = (row[0], row[1]);
            if add {
                v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, p0));
                v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, p1));
            }
            // Masked-off lanes are neither read nor written (no fault past the tile).
            _mm512_mask_storeu_ps(p0, m0, v0);
            _mm512_mask_storeu_ps(p1, m1, v1);
        }
    }
}

/// [`tile`] on AVX2 for up to [`MR2`] rows and the 16 columns of the B strip from `col0`
/// (0 or 16), `nr ≤ 16`: 6 × 16 in 12 ymm accumulators; full tiles go straight to C, edge
/// tiles through a scratch tile.
///
/// # Safety
/// AVX2 and FMA must be available; otherwise as [`tile`], with `c` at the half's first
/// column.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile256<const DIRECT: bool>(t: Tile, col0: usize) {
    use std::arch::x86_64::*;
    let Tile {
        kc,
        a,
        lda,
        b,
        c,
        ldc,
        mr,
        nr,
        add,
        tail,
    } = t;
    const H: usize = 16;
    const R: usize = MR2;
    let bp = b.as_ptr().wrapping_add(col0);
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    // SAFETY: per the contract above.
    unsafe {
        prefetch_c(c, ldc, mr, nr);
        let step = |acc: &mut [[__m256; 2]; R], rows: &[*const f32; R], bp: *const f32, p, s| {
            let b0 = _mm256_loadu_ps(bp.add(p * NR));
            let b1 = _mm256_loadu_ps(bp.add(p * NR + 8));
            for (row, &ar) in acc.iter_mut().zip(rows) {
                let av = _mm256_broadcast_ss(&*ar.add(p * s));
                row[0] = _mm256_fmadd_ps(av, b0, row[0]);
                row[1] = _mm256_fmadd_ps(av, b1, row[1]);
            }
        };
        let rows = a_rows::<DIRECT, R>(a, lda, mr);
        let tail = tail.map(|t| (a_rows::<true, R>(t.a, t.lda, mr), bp.add(kc * NR), t.steps));
        run_steps::<DIRECT, R>(kc, &rows, bp, tail, |rows, bp, p, s| {
            step(&mut acc, rows, bp, p, s)
        });
        if mr == R && nr == H {
            for (i, row) in acc.iter().enumerate() {
                let p = c.add(i * ldc);
                let (mut v0, mut v1) = (row[0], row[1]);
                if add {
                    v0 = _mm256_add_ps(v0, _mm256_loadu_ps(p));
                    v1 = _mm256_add_ps(v1, _mm256_loadu_ps(p.add(8)));
                }
                _mm256_storeu_ps(p, v0);
                _mm256_storeu_ps(p.add(8), v1);
            }
        } else {
            let mut scratch = [0f32; R * H];
            for (i, row) in acc.iter().enumerate() {
                _mm256_storeu_ps(scratch.as_mut_ptr().add(i * H), row[0]);
                _mm256_storeu_ps(scratch.as_mut_ptr().add(i * H + 8), row[1]);
            }
            for i in 0..mr {
                for j in 0..nr {
                    let p = c.add(i * ldc + j);
                    let v = scratch[i * H + j];
                    *p = if add { *p + v } else { v };
                }
            }
        }
    }
}
