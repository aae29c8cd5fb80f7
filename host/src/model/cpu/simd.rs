//! The CPU's elementwise row kernels, 8 lanes at a time with AVX2 and FMA (the softmax
//! and log-softmax passes of the log-prob head and of attention, SwiGLU and its
//! gradients), and the safe entry points that use them where the instruction set is
//! present (they return how much they did; the caller finishes the rest in scalar code).
//!
//! `exp` is a polynomial (Cephes' `expf`: range
//! reduction by ln 2, degree-6 polynomial, exponent by integer add; within 2 ulp of libm
//! for the arguments here, all ≤ 0). libm's scalar `expf` was 4% of a step's profile.

/// The vectorised SwiGLU forward where AVX2/FMA exist; returns the elements it did.
pub(crate) fn simd_swiglu(a: &[f32], b: &[f32], y: &mut [f32]) -> usize {
    #[cfg(target_arch = "x86_64")]
    if super::gemv::available() {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { avx2::swiglu(a, b, y) };
    }
    let _ = (a, b, y);
    0
}

/// `z ← e^{z−m}` vectorised where AVX2/FMA exist: `(elements done, their sum)`.
pub(crate) fn simd_exp(z: &mut [f32], m: f32) -> (usize, f32) {
    #[cfg(target_arch = "x86_64")]
    if super::gemv::available() {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { avx2::exp_in_place(z, m) };
    }
    let _ = (z, m);
    (0, 0.0)
}

/// The vectorised SwiGLU backward, as [`simd_swiglu`].
pub(crate) fn simd_swiglu_grads(
    a: &[f32],
    b: &[f32],
    g: &[f32],
    da: &mut [f32],
    db: &mut [f32],
) -> usize {
    #[cfg(target_arch = "x86_64")]
    if super::gemv::available() {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { avx2::swiglu_grads(a, b, g, da, db) };
    }
    let _ = (a, b, g, da, db);
    0
}

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::{exp_sums, logit_grads, max};

/// The kernels; each needs AVX2 and FMA (`gemv::available`).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// `e^x` lane-wise for `x ≤ 88`; underflows to 0 below −87.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp(x: __m256) -> __m256 {
        let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        // r = x − n ln2 in two parts, so that r stays exact.
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            0.5,
        ] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        // e^r = 1 + r + r² p
        let er = _mm256_add_ps(
            _mm256_fmadd_ps(_mm256_mul_ps(r, r), p, r),
            _mm256_set1_ps(1.0),
        );
        let pow2n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        )));
        _mm256_mul_ps(er, pow2n)
    }

    fn hsum(v: __m256) -> f32 {
        let mut a = [0f32; 8];
        // SAFETY: `a` holds 8 floats.
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
        a.iter().sum()
    }

    /// The largest element (−∞ for an empty row).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn max(z: &[f32]) -> f32 {
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        let chunks = z.chunks_exact(8);
        let tail = chunks.remainder();
        for c in chunks {
            // SAFETY: `c` holds 8 floats.
            m = _mm256_max_ps(m, unsafe { _mm256_loadu_ps(c.as_ptr()) });
        }
        let mut a = [0f32; 8];
        // SAFETY: `a` holds 8 floats.
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), m) };
        a.iter()
            .chain(tail)
            .copied()
            .fold(f32::NEG_INFINITY, f32::max)
    }

    /// `z ← e^{z−m}` over the 8-lane part of `z`; returns `(elements done, their sum)`.
    /// Below −87 the result is e^−87 (≈ 1.6e−38), not 0: masked scores stay negligible.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_in_place(z: &mut [f32], m: f32) -> (usize, f32) {
        let mv = _mm256_set1_ps(m);
        let mut s = _mm256_setzero_ps();
        let done = z.len() - z.len() % 8;
        for c in z[..done].chunks_exact_mut(8) {
            // SAFETY: `c` holds 8 floats; AVX2+FMA per this function's contract.
            unsafe {
                let e = exp(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv));
                _mm256_storeu_ps(c.as_mut_ptr(), e);
                s = _mm256_add_ps(s, e);
            }
        }
        (done, hsum(s))
    }

    /// `(Σ e^{z−m}, Σ e^{z−m} z)`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_sums(z: &[f32], m: f32) -> (f32, f32) {
        let mv = _mm256_set1_ps(m);
        let (mut s, mut sz) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let chunks = z.chunks_exact(8);
        let tail = chunks.remainder();
        for c in chunks {
            // SAFETY: `c` holds 8 floats; AVX2+FMA per this function's contract.
            unsafe {
                let zv = _mm256_loadu_ps(c.as_ptr());
                let e = exp(_mm256_sub_ps(zv, mv));
                s = _mm256_add_ps(s, e);
                sz = _mm256_fmadd_ps(e, zv, sz);
            }
        }
        let (mut s, mut sz) = (hsum(s), hsum(sz));
        for &zv in tail {
            let e = (zv - m).exp();
            s += e;
            sz += e * zv;
        }
        (s, sz)
    }

    /// `σ(a) = 1 / (1 + e^{−a})` lane-wise (saturating to 0 for `a < −87`).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sigmoid(a: __m256) -> __m256 {
        let one = _mm256_set1_ps(1.0);
        // SAFETY: AVX2+FMA per this function's contract.
        let e = unsafe {
            exp(_mm256_sub_ps(
                _mm256_setzero_ps(),
                _mm256_min_ps(a, _mm256_set1_ps(87.0)),
            ))
        };
        _mm256_div_ps(one, _mm256_add_ps(one, e))
    }

    /// SwiGLU forward `y = a σ(a) b` over whole 8-lane groups; returns how many elements it
    /// did (the caller finishes the tail).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn swiglu(a: &[f32], b: &[f32], y: &mut [f32]) -> usize {
        let n = a.len().min(b.len()).min(y.len()) / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n, within all three slices.
            unsafe {
                let av = _mm256_loadu_ps(a.as_ptr().add(i));
                let bv = _mm256_loadu_ps(b.as_ptr().add(i));
                let v = _mm256_mul_ps(_mm256_mul_ps(av, sigmoid(av)), bv);
                _mm256_storeu_ps(y.as_mut_ptr().add(i), v);
            }
        }
        n
    }

    /// SwiGLU backward: `da = g b σ (1 + a (1 − σ))`, `db = g a σ`, as [`swiglu`].
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn swiglu_grads(
        a: &[f32],
        b: &[f32],
        g: &[f32],
        da: &mut [f32],
        db: &mut [f32],
    ) -> usize {
        let n = [a.len(), b.len(), g.len(), da.len(), db.len()]
            .into_iter()
            .min()
            .unwrap_or(0)
            / 8
            * 8;
        let one = _mm256_set1_ps(1.0);
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n, within all five slices.
            unsafe {
                let av = _mm256_loadu_ps(a.as_ptr().add(i));
                let bv = _mm256_loadu_ps(b.as_ptr().add(i));
                let gv = _mm256_loadu_ps(g.as_ptr().add(i));
                let s = sigmoid(av);
                let gs = _mm256_mul_ps(gv, s);
                let k = _mm256_fmadd_ps(av, _mm256_sub_ps(one, s), one);
                _mm256_storeu_ps(
                    da.as_mut_ptr().add(i),
                    _mm256_mul_ps(_mm256_mul_ps(gs, bv), k),
                );
                _mm256_storeu_ps(db.as_mut_ptr().add(i), _mm256_mul_ps(gs, av));
            }
        }
        n
    }

    /// In place: `z ← −p (g_l + g_h (log p + H))` with `log p = z − lse`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn logit_grads(z: &mut [f32], lse: f32, ent: f32, gl: f32, gh: f32) {
        let (lv, ev, glv, ghv) = (
            _mm256_set1_ps(lse),
            _mm256_set1_ps(ent),
            _mm256_set1_ps(gl),
            _mm256_set1_ps(gh),
        );
        let mut chunks = z.chunks_exact_mut(8);
        for c in &mut chunks {
            // SAFETY: `c` holds 8 floats; AVX2+FMA per this function's contract.
            unsafe {
                let logp = _mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), lv);
                let p = exp(logp);
                let k = _mm256_fmadd_ps(ghv, _mm256_add_ps(logp, ev), glv);
                _mm256_storeu_ps(
                    c.as_mut_ptr(),
                    _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(p, k)),
                );
            }
        }
        for zv in chunks.into_remainder() {
            let logp = *zv - lse;
            let p = logp.exp();
            *zv = -p * (gl + gh * (logp + ent));
        }
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn vector_exp_matches_libm() {
            if !crate::model::cpu::gemv::available() {
                return;
            }
            let z: Vec<f32> = (0..1000).map(|i| -90.0 + i as f32 * 0.0917).collect();
            let mut worst = 0f32;
            for &m in &[0.0f32, 3.5] {
                // SAFETY: AVX2+FMA checked above.
                let (s, sz) = unsafe { super::exp_sums(&z, m) };
                let (ws, wsz) = z.iter().fold((0f64, 0f64), |(a, b), &x| {
                    let e = ((x - m) as f64).exp();
                    (a + e, b + e * x as f64)
                });
                worst = worst.max(((s as f64 - ws) / ws).abs() as f32);
                worst = worst.max(((sz as f64 - wsz) / wsz).abs() as f32);
            }
            assert!(worst < 1e-5, "{worst}");
            for (i, &x) in z.iter().enumerate().filter(|(_, x)| **x > -80.0) {
                let mut one = [x; 8];
                // SAFETY: AVX2+FMA checked above.
                unsafe { super::logit_grads(&mut one, 0.0, 0.0, 1.0, 0.0) };
                let want = -(x as f64).exp();
                let rel = ((one[0] as f64 - want) / want).abs();
                assert!(rel < 3e-7, "exp({x}) at {i}: {} vs {want}", one[0]);
            }
            // In place, with a tail it leaves to the caller.
            let mut e = z[..995].to_vec();
            // SAFETY: AVX2+FMA checked above.
            let (done, sum) = unsafe { super::exp_in_place(&mut e, 3.5) };
            assert_eq!(done, 992);
            let mut want_sum = 0f64;
            for (i, (&got, &x)) in e.iter().zip(&z).take(done).enumerate() {
                let want = ((x - 3.5) as f64).exp();
                want_sum += want;
                if x > -80.0 {
                    let rel = ((got as f64 - want) / want).abs();
                    assert!(rel < 3e-7, "exp_in_place at {i}: {got} vs {want}");
                }
            }
            assert!(((sum as f64 - want_sum) / want_sum).abs() < 1e-5);
            assert_eq!(e[done..], z[done..995]);
        }
    }
}
