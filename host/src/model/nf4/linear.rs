//! A frozen NF4 projection ([`Nf4Linear`]): the product with the 4-bit weight dequantized a
//! block of rows at a time on the CPU (a gemv that reads the codes directly when decoding
//! one token), on a GPU from codes kept 4-bit on the device, forward and backward.

use super::{BLOCK, NF4, Nf4};
use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Tensor};
use std::sync::Arc;

/// Output rows of the weight dequantized at a time: `ROW_BLOCK × in` f32 of scratch (2 MB
/// for a 1,024-wide layer) instead of the whole weight.
const ROW_BLOCK: usize = 512;

/// A frozen NF4 projection `[out, in]`: `y = x · Wᵀ` with W dequantized a block of rows
/// at a time, forward and backward (which recomputes each block rather than keeping the
/// dequantized weight alive), so that the f32 weight never exists whole.
#[derive(Debug)]
pub struct Nf4Linear {
    pub q: Nf4,
    /// The codes (`u8`, two per byte) and the f32 absmax per block on a GPU, copied there
    /// at the first product on it: the weight stays 4-bit on the device.
    on_device: std::sync::Mutex<Option<(Tensor, Tensor)>>,
}

#[cfg(target_arch = "x86_64")]
impl crate::model::cpu::frozen::RowBlocks for Nf4Linear {
    fn dims(&self) -> (usize, usize) {
        Nf4Linear::dims(self)
    }

    fn dequantize_rows_into(&self, r0: usize, r1: usize, out: &mut [f32]) {
        Nf4Linear::dequantize_rows_into(self, r0, r1, out)
    }
}

impl Nf4Linear {
    pub fn new(q: Nf4) -> Nf4Linear {
        Nf4Linear {
            q,
            on_device: std::sync::Mutex::new(None),
        }
    }

    /// The whole weight in `dtype` on `device`, dequantized there ([`Self::dense_on`]) and
    /// rounded once, as bitsandbytes dequantizes to its compute dtype: what the fused
    /// half-precision LoRA op on a GPU takes for an NF4 base.
    pub fn dense_in(
        &self,
        device: &Device,
        dtype: candle_core::DType,
    ) -> candle_core::Result<Tensor> {
        self.dense_on(device)?.to_dtype(dtype)
    }

    /// The whole weight in f32 on `device` (a GPU's path; the tests run it on the CPU),
    /// dequantized there with candle's ops from the codes kept on it: `NF4[code] · absmax[block]`, the high nibble of each
    /// byte first, as [`code_pairs`] decodes them on the CPU.
    pub(super) fn dense_on(&self, device: &Device) -> candle_core::Result<Tensor> {
        use candle_core::DType;
        let (codes, absmax) = {
            let mut held = self.on_device.lock().unwrap_or_else(|e| e.into_inner());
            match held.as_ref() {
                Some((c, a)) if c.device().same_device(device) => (c.clone(), a.clone()),
                _ => {
                    let c = Tensor::from_slice(&self.q.packed, self.q.packed.len(), device)?;
                    let a = Tensor::from_vec(self.q.absmax_f32(), self.q.absmax_count(), device)?;
                    *held = Some((c.clone(), a.clone()));
                    (c, a)
                }
            }
        };
        let n = self.q.rows * self.q.cols;
        let blocks = self.q.absmax_count();
        let bytes = codes.to_dtype(DType::F32)?;
        let hi = (&bytes / 16.0)?.floor()?;
        let lo = (&bytes - (&hi * 16.0)?)?;
        let idx = Tensor::stack(&[&hi, &lo], 1)?
            .flatten_all()?
            .to_dtype(DType::U32)?;
        let levels = Tensor::new(&NF4, device)?.index_select(&idx, 0)?;
        // Pad to whole blocks (a partial last block, or the spare nibble of an odd count).
        let have = levels.dim(0)?;
        let levels = if have < blocks * BLOCK {
            Tensor::cat(
                &[
                    &levels,
                    &Tensor::zeros(blocks * BLOCK - have, DType::F32, device)?,
                ],
                0,
            )?
        } else {
            levels.narrow(0, 0, blocks * BLOCK)?
        };
        levels
            .reshape((blocks, BLOCK))?
            .broadcast_mul(&absmax.unsqueeze(1)?)?
            .flatten_all()?
            .narrow(0, 0, n)?
            .reshape((self.q.rows, self.q.cols))
    }

    /// `(out, in)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.q.rows, self.q.cols)
    }

    /// Rows `r0..r1` of the weight, dequantized.
    pub fn rows(&self, r0: usize, r1: usize, device: &Device) -> candle_core::Result<Tensor> {
        let mut out = vec![0f32; (r1 - r0) * self.q.cols];
        self.dequantize_rows_into(r0, r1, &mut out);
        Tensor::from_vec(out, (r1 - r0, self.q.cols), device)
    }

    /// Rows `r0..r1` dequantized into `out` (`(r1 − r0) · in` values), by all threads.
    /// Rows a multiple of 64 wide (every model's) go a byte at a time through a table of
    /// the 256 code pairs, one absmax per 32 bytes; others value by value.
    pub fn dequantize_rows_into(&self, r0: usize, r1: usize, out: &mut [f32]) {
        use rayon::prelude::*;
        let cols = self.q.cols;
        let out = &mut out[..(r1 - r0) * cols];
        if !cols.is_multiple_of(BLOCK) {
            return self.q.dequantize_rows(&self.q.absmax_f32(), r0, r1, out);
        }
        let pairs = code_pairs();
        out.par_chunks_mut(BLOCK * 64)
            .enumerate()
            .for_each(|(c, chunk)| {
                let first = r0 * cols / BLOCK + c * 64;
                let mut absmax = [0f32; 64];
                let absmax = &mut absmax[..chunk.len() / BLOCK];
                self.q.absmax_range(first, absmax);
                for (b, (vals, &a)) in chunk.chunks_mut(BLOCK).zip(absmax.iter()).enumerate() {
                    let codes =
                        &self.q.packed[(first + b) * BLOCK / 2..(first + b + 1) * BLOCK / 2];
                    for (v, &byte) in vals.chunks_exact_mut(2).zip(codes) {
                        let [hi, lo] = pairs[byte as usize];
                        v[0] = hi * a;
                        v[1] = lo * a;
                    }
                }
            });
    }

    /// The whole weight in f32 (for a merged export).
    pub fn dense(&self, device: &Device) -> candle_core::Result<Tensor> {
        self.rows(0, self.q.rows, device)
    }

    /// `x · Wᵀ` for `x: [..., in]`; differentiable in `x`. Decoding (a few rows, no
    /// gradient) reads the packed codes directly; everything else goes a block at a time.
    pub fn forward(self: &Arc<Self>, x: &Tensor) -> candle_core::Result<Tensor> {
        let (out_f, in_f) = self.dims();
        let mut dims = x.dims().to_vec();
        let rows = x.elem_count() / in_f;
        let x2 = x.reshape((rows, in_f))?.contiguous()?;
        let y = if !x.device().is_cpu() {
            // A GPU: the weight dequantized there for this product (the codes stay
            // on it), then cuBLAS. Its transient f32 copy is what a fused kernel would
            // save; the backward keeps it for `grad_x`.
            x2.to_dtype(candle_core::DType::F32)?
                .matmul(&self.dense_on(x.device())?.t()?)?
        } else if !x.track_op()
            && rows <= GEMV_ROWS
            && in_f.is_multiple_of(BLOCK)
            && x.dtype() == candle_core::DType::F32
            && x.device().is_cpu()
        {
            let xs = x2.flatten_all()?.to_vec1::<f32>()?;
            Tensor::from_vec(self.gemv(&xs, rows), (rows, out_f), x.device())?
        } else {
            x2.apply_op1(Nf4Matmul { w: self.clone() })?
        };
        *dims.last_mut().expect("x has at least one dim") = out_f;
        y.reshape(dims)
    }

    /// `x · Wᵀ` for `rows` rows of `x` (row-major `[rows, in]`, `in` a multiple of 64):
    /// each weight row's codes are decoded once and used for every row of `x`, so the
    /// weight is read once per call at half a byte per value.
    fn gemv(&self, x: &[f32], rows: usize) -> Vec<f32> {
        #[cfg(target_arch = "x86_64")]
        let avx512 = std::is_x86_feature_detected!("avx512f");
        #[cfg(not(target_arch = "x86_64"))]
        let avx512 = false;
        self.gemv_on(x, rows, avx512)
    }

    /// [`Nf4Linear::gemv`] with the AVX-512 kernels or not (tests run both).
    fn gemv_on(&self, x: &[f32], rows: usize, avx512: bool) -> Vec<f32> {
        use rayon::prelude::*;
        let (out_f, in_f) = self.dims();
        // [out, rows], transposed at the end: each task owns whole weight rows.
        let mut t = vec![0f32; out_f * rows];
        t.par_chunks_mut(rows * 64)
            .enumerate()
            // One absmax buffer per worker, not per chunk of rows.
            .for_each_init(
                || vec![0f32; in_f / BLOCK],
                |absmax, (c, chunk)| {
                    for (jj, out) in chunk.chunks_mut(rows).enumerate() {
                        let j = c * 64 + jj;
                        let codes = &self.q.packed[j * in_f / 2..(j + 1) * in_f / 2];
                        self.q.absmax_range(j * in_f / BLOCK, absmax);
                        row_dots(codes, absmax, x, in_f, out, avx512);
                    }
                },
            );
        let mut y = vec![0f32; rows * out_f];
        for j in 0..out_f {
            for r in 0..rows {
                y[r * out_f + j] = t[j * rows + r];
            }
        }
        y
    }

    /// `x · Wᵀ`, block by block, for `x: [n, in]`.
    fn matmul_t(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let out_f = self.q.rows;
        let mut parts = Vec::with_capacity(out_f.div_ceil(ROW_BLOCK));
        for r0 in (0..out_f).step_by(ROW_BLOCK) {
            let r1 = (r0 + ROW_BLOCK).min(out_f);
            parts.push(x.matmul(&self.rows(r0, r1, x.device())?.t()?)?);
        }
        Tensor::cat(&parts, 1)
    }

    /// `g · W` for `g: [n, out]`, block by block.
    fn matmul(&self, g: &Tensor) -> candle_core::Result<Tensor> {
        let out_f = self.q.rows;
        let mut acc: Option<Tensor> = None;
        for r0 in (0..out_f).step_by(ROW_BLOCK) {
            let r1 = (r0 + ROW_BLOCK).min(out_f);
            let part = g
                .narrow(1, r0, r1 - r0)?
                .matmul(&self.rows(r0, r1, g.device())?)?;
            acc = Some(match acc {
                Some(a) => (a + part)?,
                None => part,
            });
        }
        acc.ok_or_else(|| candle_core::Error::Msg("nf4: a weight with no rows".into()))
    }
}

/// The two levels of every byte of codes (high nibble first).
fn code_pairs() -> &'static [[f32; 2]; 256] {
    static PAIRS: std::sync::OnceLock<[[f32; 2]; 256]> = std::sync::OnceLock::new();
    PAIRS.get_or_init(|| std::array::from_fn(|b| [NF4[b >> 4], NF4[b & 0x0f]]))
}

/// Rows of `x` that decoding sends through [`Nf4Linear::gemv`] (the batched path's
/// block-at-a-time products win beyond this, as for the dense weights).
const GEMV_ROWS: usize = 16;

/// `out[r] = Σ_k x[r·in + k] · NF4[code_k] · absmax[k / 64]` for one weight row.
/// `avx512`: AVX-512F is present (callers detect it once per call, not per row).
fn row_dots(codes: &[u8], absmax: &[f32], x: &[f32], in_f: usize, out: &mut [f32], avx512: bool) {
    #[cfg(target_arch = "x86_64")]
    if avx512 {
        // Groups of 8, 4 and 1 rows of `x`.
        let mut r0 = 0;
        while r0 < out.len() {
            let g = match out.len() - r0 {
                n if n >= 8 => 8,
                n if n >= 4 => 4,
                _ => 1,
            };
            let (xs, os) = (&x[r0 * in_f..(r0 + g) * in_f], &mut out[r0..r0 + g]);
            // SAFETY: AVX-512F is present (the caller detected it); `xs` holds `g` rows.
            unsafe {
                match g {
                    8 => row_dots_avx512::<8>(codes, absmax, xs, in_f, os),
                    4 => row_dots_avx512::<4>(codes, absmax, xs, in_f, os),
                    _ => row_dots_avx512::<1>(codes, absmax, xs, in_f, os),
                }
            }
            r0 += g;
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::model::cpu::gemv::available() {
        // Groups of 8, 4, 2 and 1 rows of `x`, each with its accumulators in registers.
        let mut r0 = 0;
        while r0 < out.len() {
            let g = match out.len() - r0 {
                n if n >= 8 => 8,
                n if n >= 4 => 4,
                n if n >= 2 => 2,
                _ => 1,
            };
            let (xs, os) = (&x[r0 * in_f..(r0 + g) * in_f], &mut out[r0..r0 + g]);
            // SAFETY: AVX2 and FMA are present (checked above); `xs` holds `g` rows.
            unsafe {
                match g {
                    8 => row_dots_avx2::<8, 1>(codes, absmax, xs, in_f, os),
                    4 => row_dots_avx2::<4, 2>(codes, absmax, xs, in_f, os),
                    2 => row_dots_avx2::<2, 2>(codes, absmax, xs, in_f, os),
                    _ => row_dots_avx2::<1, 2>(codes, absmax, xs, in_f, os),
                }
            }
            r0 += g;
        }
        return;
    }
    let mut vals = [0f32; BLOCK];
    for (b, &a) in absmax.iter().enumerate() {
        for (k, v) in vals.iter_mut().enumerate() {
            let byte = codes[b * BLOCK / 2 + k / 2];
            let code = if k.is_multiple_of(2) {
                byte >> 4
            } else {
                byte & 0x0f
            };
            *v = NF4[code as usize] * a;
        }
        for (r, o) in out.iter_mut().enumerate() {
            let xs = &x[r * in_f + b * BLOCK..r * in_f + (b + 1) * BLOCK];
            *o += vals.iter().zip(xs).map(|(v, x)| v * x).sum::<f32>();
        }
    }
}

/// [`row_dots`] for `R` rows of `x` with AVX-512: 16 codes at a time are split into
/// nibbles in order and looked up in the 16 levels with one permute, scaled by the
/// block's absmax, and multiplied into two accumulators per row (alternating, so that
/// consecutive FMAs of one row do not wait on each other; 16 for 8 rows, of 32 registers).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn row_dots_avx512<const R: usize>(
    codes: &[u8],
    absmax: &[f32],
    x: &[f32],
    in_f: usize,
    out: &mut [f32],
) {
    // SAFETY: the caller guarantees AVX-512F; every load reads inside `codes` (`in / 2`
    // bytes, 8 at a time at offsets below that), `NF4` (16 values) and the `R` rows of `x`
    // (`in` values each, 16 at a time).
    unsafe {
        use std::arch::x86_64::*;
        debug_assert!(out.len() == R && codes.len() * 2 == in_f && x.len() >= R * in_f);
        let table = _mm512_loadu_ps(NF4.as_ptr());
        let nibble = _mm_set1_epi8(0x0f);
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        let xp = x.as_ptr();
        for (b, &a) in absmax.iter().enumerate() {
            let scale = _mm512_set1_ps(a);
            for q in 0..BLOCK / 16 {
                let bytes = _mm_loadl_epi64(codes.as_ptr().add(b * 32 + q * 8) as *const __m128i);
                let high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
                let low = _mm_and_si128(bytes, nibble);
                let idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(high, low));
                let w = _mm512_mul_ps(_mm512_permutexvar_ps(idx, table), scale);
                let k = b * BLOCK + q * 16;
                for (r, acc) in acc.iter_mut().enumerate() {
                    let xv = _mm512_loadu_ps(xp.add(r * in_f + k));
                    acc[q % 2] = _mm512_fmadd_ps(w, xv, acc[q % 2]);
                }
            }
        }
        for (o, acc) in out.iter_mut().zip(&acc) {
            *o = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
        }
    }
}

/// [`row_dots`] for `R` rows of `x` with AVX2: 16 codes at a time are split into nibbles
/// in order, looked up in the 16 levels with two 8-lane permutes and a blend, scaled by
/// the block's absmax, and multiplied into `A` accumulators per row, all in registers.
/// With `A = 2` (up to 4 rows) each 8-lane half has its own, so that consecutive FMAs do
/// not wait on each other; 8 rows take `A = 1` (8 independent chains hide the latency,
/// and 16 accumulators would not fit), so that each code is decoded once for all 8 rows
/// (decoding per group of four rows ran batch-8 decoding at 0.84× f32).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_dots_avx2<const R: usize, const A: usize>(
    codes: &[u8],
    absmax: &[f32],
    x: &[f32],
    in_f: usize,
    out: &mut [f32],
) {
    // SAFETY: the caller guarantees AVX2 and FMA; every load reads inside `codes`
    // (`in / 2` bytes, 8 at a time at offsets below that), `NF4` (16 values) and the `R`
    // rows of `x` (`in` values each, 8 at a time).
    unsafe {
        use std::arch::x86_64::*;
        debug_assert!(out.len() == R && codes.len() * 2 == in_f && x.len() >= R * in_f);
        let lo = _mm256_loadu_ps(NF4.as_ptr());
        let hi = _mm256_loadu_ps(NF4.as_ptr().add(8));
        let seven = _mm256_set1_epi32(7);
        let nibble = _mm_set1_epi8(0x0f);
        let mut acc = [[_mm256_setzero_ps(); A]; R];
        let xp = x.as_ptr();
        for (b, &a) in absmax.iter().enumerate() {
            let scale = _mm256_set1_ps(a);
            for q in 0..BLOCK / 16 {
                // 8 bytes = 16 codes, the first in each byte's high nibble.
                let bytes = _mm_loadl_epi64(codes.as_ptr().add(b * 32 + q * 8) as *const __m128i);
                let high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
                let low = _mm_and_si128(bytes, nibble);
                let ordered = _mm_unpacklo_epi8(high, low);
                let decode = |idx: __m256i| {
                    let from_lo = _mm256_permutevar8x32_ps(lo, idx);
                    let from_hi = _mm256_permutevar8x32_ps(hi, idx);
                    let upper = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, seven));
                    _mm256_mul_ps(_mm256_blendv_ps(from_lo, from_hi, upper), scale)
                };
                let w = [
                    decode(_mm256_cvtepu8_epi32(ordered)),
                    decode(_mm256_cvtepu8_epi32(_mm_srli_si128(ordered, 8))),
                ];
                let k = b * BLOCK + q * 16;
                for (r, acc) in acc.iter_mut().enumerate() {
                    let row = xp.add(r * in_f + k);
                    for (half, w) in w.iter().enumerate() {
                        let xv = _mm256_loadu_ps(row.add(half * 8));
                        acc[half % A] = _mm256_fmadd_ps(*w, xv, acc[half % A]);
                    }
                }
            }
        }
        for (o, acc) in out.iter_mut().zip(&acc) {
            let sum = acc
                .iter()
                .fold(_mm256_setzero_ps(), |s, a| _mm256_add_ps(s, *a));
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
            *o = lanes.iter().sum();
        }
    }
}

struct Nf4Matmul {
    w: Arc<Nf4Linear>,
}

impl CustomOp1 for Nf4Matmul {
    fn name(&self) -> &'static str {
        "nf4-matmul"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, k) = l.shape().dims2()?;
        let CpuStorage::F32(data) = x else {
            candle_core::bail!("nf4-matmul: the input is not f32");
        };
        let (start, end) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("nf4-matmul: input not contiguous".into()))?;
        let x = Tensor::from_slice(&data[start..end], (n, k), &Device::Cpu)?;
        let y = self.w.matmul_t(&x)?.contiguous()?;
        let out = y.flatten_all()?.to_vec1::<f32>()?;
        Ok((CpuStorage::F32(out), Shape::from((n, self.w.q.rows))))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _y: &Tensor,
        grad_y: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(self.w.matmul(&grad_y.contiguous()?)?))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::reference;
    use super::*;
    use crate::model::Placement;
    use candle_core::DType;

    /// A double-quantized NF4 weight of values spread evenly over ±0.025.
    fn spread_weight(out_f: usize, in_f: usize) -> Arc<Nf4Linear> {
        let w: Vec<f32> = (0..out_f * in_f)
            .map(|i| (((i * 7919) % 1000) as f32 - 500.0) / 20_000.0)
            .collect();
        Arc::new(Nf4Linear::new(
            Nf4::quantize(&w, out_f, in_f, true).unwrap(),
        ))
    }

    /// The op equals a matmul with the dequantized weight, forward and backward, across
    /// row blocks (700 output rows: two blocks, the second partial).
    #[test]
    fn the_projection_is_the_dequantized_matmul_both_ways() {
        let dev = Device::Cpu;
        let (out_f, in_f) = (700, 96);
        let lin = spread_weight(out_f, in_f);
        let dense = lin.dense(&dev).unwrap();
        let x =
            candle_core::Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, 3, in_f), &dev).unwrap())
                .unwrap();
        let y = lin.forward(x.as_tensor()).unwrap();
        let want = x.as_tensor().broadcast_matmul(&dense.t().unwrap()).unwrap();
        let diff = |a: &Tensor, b: &Tensor| {
            (a - b)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        assert_eq!(y.dims(), [2, 3, out_f]);
        assert!(diff(&y, &want) < 1e-5);
        let g = Tensor::randn(0f32, 1.0, (2, 3, out_f), &dev).unwrap();
        let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let dx = grads.get(x.as_tensor()).unwrap();
        let want_dx = g.broadcast_matmul(&dense).unwrap();
        assert!(diff(dx, &want_dx) < 1e-4, "{}", diff(dx, &want_dx));
    }

    /// The fixture model with every projection quantized here and the fixture's PEFT
    /// adapter gives the logits that transformers + bitsandbytes + PEFT give for the same
    /// model loaded in 4 bits (with and without double quantization), and the adapter
    /// still trains: its gradients exist and the loss moves.
    #[test]
    fn qlora_logits_match_peft_with_bitsandbytes() {
        use crate::model::fixtures::{self, Reference, masked_max_diff};
        use crate::model::{Mode, peft};
        let r = reference();
        let fixture = Reference::load("qwen2");
        for (key, nested) in [
            ("qwen2.qlora_logits", true),
            ("qwen2.qlora_logits_nodq", false),
        ] {
            let mut model = fixtures::load("qwen2");
            peft::load_adapter(&mut model, &fixtures::model_dir("qwen2").join("adapter")).unwrap();
            model.quantize_nf4(nested).unwrap();
            let logits = fixture.logits(&model, Mode::INFERENCE);
            let d = masked_max_diff(&logits, &r[key], &fixture.attention_mask());
            let dense = fixture.get("lora_logits");
            let moved = masked_max_diff(dense, &r[key], &fixture.attention_mask());
            eprintln!(
                "{key}: ours vs PEFT+bitsandbytes {d:.2e} (4-bit vs f32 logits: {moved:.2e})"
            );
            assert!(d <= 1e-4, "{key}: {d}");
            assert!(moved > 100.0 * d, "the check can tell 4-bit from f32");
        }
    }

    /// The adapter trains on the 4-bit base as PEFT does on bitsandbytes': the fixtures'
    /// LoRA loss and the gradient of every LoRA tensor through the NF4 projections (the
    /// fused kernels reading dequantized blocks, where they apply).
    #[test]
    fn qlora_gradients_match_peft_with_bitsandbytes() {
        use crate::model::fixtures::{self, Reference};
        use crate::model::{Mode, peft};
        let r = reference();
        let fixture = Reference::load("qwen2");
        let mut model = fixtures::load("qwen2");
        peft::load_adapter(&mut model, &fixtures::model_dir("qwen2").join("adapter")).unwrap();
        model.quantize_nf4(true).unwrap();
        let train = Mode::TRAIN;
        let loss = fixture.lora_loss(&model, train);
        let (got, want) = (
            loss.to_scalar::<f32>().unwrap(),
            r["qwen2.qlora_loss"].to_scalar::<f32>().unwrap(),
        );
        let grads = loss.backward().unwrap();
        assert_eq!(model.missing_grads(&grads), Vec::<String>::new());
        let worst = fixtures::worst_lora_grad_diff(&model, &grads, |k| {
            &r[&format!("qwen2.qlora_grad.{k}")]
        });
        // How far the f32 base's gradients are from these: what the check can tell apart.
        let dense = fixture.get("lora_loss").to_scalar::<f32>().unwrap();
        eprintln!(
            "QLoRA vs PEFT+bitsandbytes: loss {got} vs {want} (f32 base: {dense}), worst relative gradient diff {worst:.2e}"
        );
        assert!(
            (got - want).abs() <= 1e-5 * want.abs(),
            "loss {got} vs {want}"
        );
        assert!((dense - want).abs() > 100.0 * (got - want).abs());
        assert!(worst <= 1e-4, "worst relative gradient diff {worst}");
    }

    /// A 4-bit base in a bf16 model: the projections stay NF4 (computed in f32, cast
    /// back) with their quantization constants as stored, the rest is bf16; logits stay
    /// within twice what bf16 costs the dense model against f32 (another model: its
    /// roundings land elsewhere; a garbled weight or adapter moves them by whole units),
    /// and a training step reaches every adapter tensor.
    #[test]
    fn a_4_bit_base_runs_in_bf16() {
        use crate::model::fixtures::{self, Reference, masked_max_diff};
        use crate::model::{Mode, Model, peft};
        let r = reference();
        let fixture = Reference::load("qwen2");
        let half = Reference::load_half("qwen2");
        let at = Placement {
            device: Device::Cpu,
            dtype: DType::BF16,
        };
        let mut model = Model::load(&fixtures::model_dir("qwen2-nf4"), &at).unwrap();
        assert_eq!(model.dtype(), DType::BF16);
        peft::load_adapter(&mut model, &fixtures::model_dir("qwen2").join("adapter")).unwrap();
        let mask = fixture.attention_mask();
        let logits = fixture.logits(&model, Mode::INFERENCE);
        let d = masked_max_diff(&logits, &r["qwen2.qlora_logits"], &mask);
        let bf16 = half.get("bf16.lora_logits").to_dtype(DType::F32).unwrap();
        let own = masked_max_diff(&bf16, fixture.get("lora_logits"), &mask);
        eprintln!(
            "bf16 NF4 logits vs f32 QLoRA {d:.2e}; bf16 vs f32 (dense, transformers) {own:.2e}"
        );
        assert!(d <= 2.0 * own, "{d} vs {own}");
        let loss = fixture.lora_loss(&model, Mode::TRAIN);
        let grads = loss.backward().unwrap();
        assert!(model.missing_grads(&grads).is_empty());
    }

    /// Decoding's direct read of the codes equals the product with the dequantized weight
    /// for 1 to 16 rows (the AVX2 kernel where present).
    #[test]
    fn decoding_reads_the_codes_directly_and_exactly() {
        let dev = Device::Cpu;
        for in_f in [192, 320] {
            let out_f = 130;
            let lin = spread_weight(out_f, in_f);
            let dense = lin.dense(&dev).unwrap();
            for rows in [1, 3, 4, 7, 8, 13, 16] {
                let x = Tensor::randn(0f32, 1.0, (rows, in_f), &dev).unwrap();
                let want = x.matmul(&dense.t().unwrap()).unwrap();
                let close = |y: Tensor, what: &str| {
                    let d = (y - &want).unwrap().abs().unwrap().max_all().unwrap();
                    assert!(
                        d.to_scalar::<f32>().unwrap() < 1e-5,
                        "{what}: {rows} rows of {in_f}"
                    );
                };
                close(lin.forward(&x).unwrap(), "forward");
                // Both instruction sets' kernels, whichever this machine would pick.
                let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                #[cfg(target_arch = "x86_64")]
                for avx512 in [false, std::is_x86_feature_detected!("avx512f")] {
                    let y = lin.gemv_on(&xs, rows, avx512);
                    close(Tensor::from_vec(y, (rows, out_f), &dev).unwrap(), "gemv");
                }
            }
        }
    }
}
