//! `y = x W^T` for a few rows of `x` (decoding), streaming the weight once.
//!
//! Decoding multiplies 1–16 activation rows by every weight matrix: the work is bound by
//! reading the weights, not by arithmetic. candle's gemm backend packs and blocks for large
//! products and reached 16–21 GB/s here at one row and 5–9 GB/s at eight (measured with
//! `examples/gemv_probe.rs` on this 2-core machine, whose 2-thread read bandwidth is
//! ~26 GB/s). This kernel reads each weight row once, multiplies it with all rows of `x`
//! (which stay in cache) using AVX2 FMA, and splits the weight rows across rayon's threads.
//! Used only when the CPU has AVX2 and FMA; everything else goes through candle.

use rayon::prelude::*;

/// Most activation rows handled in one pass over the weights.
pub const MAX_ROWS: usize = 8;

/// Whether this machine can run the kernel.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| {
            std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[i][j] = Σ_k x[i][k] · w[j][k]` for `x: [m, k]`, `w: [n, k]` (row-major,
/// contiguous), `out: [m, n]`. Panics if called when [`available`] is false or with
/// `m > MAX_ROWS`; callers check both.
pub fn matmul_wt(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    let avx512 = std::is_x86_feature_detected!("avx512f");
    #[cfg(not(target_arch = "x86_64"))]
    let avx512 = false;
    matmul_wt_on(avx512, x, m, w, n, k)
}

/// [`matmul_wt`] on the AVX-512 kernel or the AVX2 one.
fn matmul_wt_on(avx512: bool, x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
    assert!(available() && (1..=MAX_ROWS).contains(&m));
    assert!(x.len() == m * k && w.len() >= n * k);
    // Output transposed ([n, m]) so that each task writes one contiguous block.
    let mut out_t = vec![0f32; n * m];
    let threads = rayon::current_num_threads().max(1);
    // Enough blocks to balance the threads; each block a few hundred KB of weights.
    let rows_per_block = (n / (threads * 8)).clamp(4, 1024);
    out_t
        .par_chunks_mut(rows_per_block * m)
        .enumerate()
        .for_each(|(b, chunk)| {
            let j0 = b * rows_per_block;
            let rows = chunk.len() / m;
            let w_block = &w[j0 * k..(j0 + rows) * k];
            // SAFETY: `available()` checked AVX2 and FMA at the top of the function, and the
            // caller AVX-512F where `avx512`.
            unsafe {
                if avx512 {
                    block512(x, m, w_block, rows, k, chunk)
                } else {
                    block(x, m, w_block, rows, k, chunk)
                }
            }
        });
    let mut out = vec![0f32; m * n];
    for j in 0..n {
        for i in 0..m {
            out[i * n + j] = out_t[j * m + i];
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
unsafe fn block(x: &[f32], m: usize, w: &[f32], rows: usize, k: usize, out_t: &mut [f32]) {
    // R weight rows per step against all M activation rows: R·M accumulators stay in
    // registers (at most 12 of the 16 ymm), and R independent FMA chains and memory
    // streams are in flight even for one activation row (FMA latency is 4 cycles).
    // SAFETY (all arms): the caller checked AVX2 and FMA.
    unsafe {
        match m {
            1 => tile::<1, 4, false>(x, w, rows, k, out_t),
            2 => tile::<2, 4, false>(x, w, rows, k, out_t),
            3 => tile::<3, 3, false>(x, w, rows, k, out_t),
            4 => tile::<4, 2, false>(x, w, rows, k, out_t),
            5 => tile::<5, 2, false>(x, w, rows, k, out_t),
            6 => tile::<6, 2, false>(x, w, rows, k, out_t),
            7 => tile::<7, 1, false>(x, w, rows, k, out_t),
            _ => tile::<8, 1, false>(x, w, rows, k, out_t),
        }
    }
}

/// [`block`] with AVX-512: twice the FMA width, 32 registers for more weight rows per pass,
/// and the weight rows prefetched [`PREFETCH`] floats ahead (from [`PREFETCH_FROM_ROWS`]
/// activation rows). With eight activation rows the AVX2 kernel read the weights at 11–15
/// GB/s against 25–27 at one row, waiting on the weight loads (perf: the FMAs after them);
/// this one reads them at 17–21 GB/s, the same at one row (`examples/gemv_probe.rs`-style shapes, 2 threads, a 2-core AVX-512 Xeon).
/// Taking `x` a few hundred columns at a time to keep it in L1 was slower: it cut the
/// weight stream into short runs the hardware prefetcher lost.
///
/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn block512(x: &[f32], m: usize, w: &[f32], rows: usize, k: usize, out_t: &mut [f32]) {
    // R·M accumulators, M x vectors and R weight vectors within the 32 zmm registers.
    // SAFETY (all arms): the caller checked AVX-512F.
    unsafe {
        match m {
            1 => tile::<1, 8, true>(x, w, rows, k, out_t),
            2 => tile::<2, 6, true>(x, w, rows, k, out_t),
            3 => tile::<3, 5, true>(x, w, rows, k, out_t),
            4 => tile::<4, 4, true>(x, w, rows, k, out_t),
            5 => tile::<5, 3, true>(x, w, rows, k, out_t),
            6 => tile::<6, 3, true>(x, w, rows, k, out_t),
            7 => tile::<7, 2, true>(x, w, rows, k, out_t),
            _ => tile::<8, 2, true>(x, w, rows, k, out_t),
        }
    }
}

/// How far ahead of the product the weight rows are fetched: 8 KB (best of 512, 1024 and
/// 2048 floats at eight activation rows on the Xeon).
const PREFETCH: usize = 2048;

/// Fewest activation rows for which the weight rows are prefetched. With fewer the FMAs
/// keep far ahead of memory and the hardware prefetcher alone streams faster: on a 2-core
/// AMD EPYC (Zen 4) the `[151936, 896]` head read at 24–25 GB/s without the prefetches and
/// 21–23 with them at one and two rows, alike at four, and at 16–17 GB/s with them against
/// 12–15 without at six and eight rows (two alternating sweeps, 2 threads).
const PREFETCH_FROM_ROWS: usize = 4;

/// `out[r·M + i] = Σ_q x[i][q] · w[r][q]` for `R` weight rows (row stride `k`); the last
/// partial 16 columns through masked loads (masked-off lanes read nothing and add zero).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_rows512<const M: usize, const R: usize>(
    x: &[f32],
    w: &[f32],
    k: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    debug_assert!(x.len() == M * k && w.len() == R * k && out.len() == R * M);
    let mut acc = [[_mm512_setzero_ps(); M]; R];
    let mut kk = 0;
    while kk < k {
        let mask: __mmask16 = if k - kk >= 16 {
            0xFFFF
        } else {
            ((1u32 << (k - kk)) - 1) as __mmask16
        };
        // SAFETY: the mask keeps every read below k, within each row of x and w; a prefetch
        // past the end has no effect.
        unsafe {
            let xs: [__m512; M] =
                std::array::from_fn(|i| _mm512_maskz_loadu_ps(mask, x.as_ptr().add(i * k + kk)));
            for (r, acc) in acc.iter_mut().enumerate() {
                if M >= PREFETCH_FROM_ROWS {
                    _mm_prefetch::<_MM_HINT_T0>(
                        w.as_ptr().wrapping_add(r * k + kk + PREFETCH) as *const i8
                    );
                }
                let a = _mm512_maskz_loadu_ps(mask, w.as_ptr().add(r * k + kk));
                for i in 0..M {
                    acc[i] = _mm512_fmadd_ps(a, xs[i], acc[i]);
                }
            }
        }
        kk += 16;
    }
    for (r, acc) in acc.iter().enumerate() {
        for i in 0..M {
            out[r * M + i] = _mm512_reduce_add_ps(acc[i]);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn block(_: &[f32], _: usize, _: &[f32], _: usize, _: usize, _: &mut [f32]) {
    unreachable!("available() is false off x86_64")
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let hi = _mm256_extractf128_ps(v, 1);
    let lo = _mm256_castps256_ps128(v);
    let s = _mm_add_ps(hi, lo);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// All `rows` weight rows of the block, `R` at a time (then one at a time for the rest),
/// against the `M` rows of `x`, on the AVX-512 kernel (`WIDE`) or the AVX2 one.
///
/// # Safety
/// The kernel's features (AVX-512F, or AVX2 and FMA) must be available.
#[cfg(target_arch = "x86_64")]
unsafe fn tile<const M: usize, const R: usize, const WIDE: bool>(
    x: &[f32],
    w: &[f32],
    rows: usize,
    k: usize,
    out_t: &mut [f32],
) {
    let mut j = 0;
    while j < rows {
        let r = if j + R <= rows { R } else { 1 };
        let (w, out) = (&w[j * k..(j + r) * k], &mut out_t[j * M..(j + r) * M]);
        // SAFETY: per the contract above.
        unsafe {
            match (WIDE, r == R) {
                (true, true) => tile_rows512::<M, R>(x, w, k, out),
                (true, false) => tile_rows512::<M, 1>(x, w, k, out),
                (false, true) => tile_rows::<M, R>(x, w, k, out),
                (false, false) => tile_rows::<M, 1>(x, w, k, out),
            }
        }
        j += r;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_rows<const M: usize, const R: usize>(
    x: &[f32],
    w: &[f32],
    k: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    debug_assert!(x.len() == M * k && w.len() == R * k && out.len() == R * M);
    let mut acc = [[_mm256_setzero_ps(); M]; R];
    let k8 = k / 8 * 8;
    let mut kk = 0;
    while kk < k8 {
        // SAFETY: kk + 8 <= k8 <= k, the length of each weight row and each row of x.
        unsafe {
            let mut xs = [_mm256_setzero_ps(); M];
            for (i, xv) in xs.iter_mut().enumerate() {
                *xv = _mm256_loadu_ps(x.as_ptr().add(i * k + kk));
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let a = _mm256_loadu_ps(w.as_ptr().add(r * k + kk));
                for i in 0..M {
                    acc[i] = _mm256_fmadd_ps(a, xs[i], acc[i]);
                }
            }
        }
        kk += 8;
    }
    for (r, acc) in acc.iter().enumerate() {
        let wr = &w[r * k..(r + 1) * k];
        for i in 0..M {
            let xi = &x[i * k..(i + 1) * k];
            let mut t = unsafe { hsum(acc[i]) };
            for q in k8..k {
                t += wr[q] * xi[q];
            }
            out[r * M + i] = t;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_plain_product_for_every_row_count_and_ragged_sizes() {
        if !available() {
            eprintln!("no AVX2/FMA here: kernel not used, nothing to test");
            return;
        }
        // k off and on the 16-wide AVX-512 steps and the 8-wide AVX2 ones.
        for (n, k) in [(1, 1), (5, 7), (37, 19), (130, 64), (333, 100), (20, 48)] {
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                .collect();
            for m in 1..=MAX_ROWS {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0)
                    .collect();
                let avx512 = std::is_x86_feature_detected!("avx512f");
                for got in [Some(false), Some(true).filter(|_| avx512)]
                    .into_iter()
                    .flatten()
                    .map(|on| matmul_wt_on(on, &x, m, &w, n, k))
                {
                    for i in 0..m {
                        for j in 0..n {
                            let want: f32 = (0..k).map(|q| x[i * k + q] * w[j * k + q]).sum();
                            let g = got[i * n + j];
                            assert!(
                                (g - want).abs() <= 1e-4 * (1.0 + want.abs()),
                                "m={m} n={n} k={k}: {g} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
