//! NF4 weights in bitsandbytes' layout (QLoRA's 4-bit NormalFloat), so that a base model
//! quantized here and one quantized by bitsandbytes hold the same bytes.
//!
//! A weight `[out, in]` is flattened row-major and cut into blocks of 64 values (the last
//! may be shorter). Each block keeps its absolute maximum `absmax` in f32; each value is
//! replaced by the index of the nearest of the 16 NF4 levels to `w / absmax` (nearest by
//! the midpoints between levels), two indices per byte, the first in the high nibble.
//! Dequantized, `w ≈ NF4[index] · absmax`.
//!
//! Double quantization (`bnb_4bit_use_double_quant`) stores the absmax values themselves
//! in 8 bits: their mean (`offset`) is subtracted, the rest is quantized in blocks of 256
//! to bitsandbytes' signed dynamic map (`create_dynamic_map`) with one f32 scale per block
//! (`nested_absmax`); absmax ≈ MAP[code] · nested_absmax + offset. bitsandbytes' CPU
//! quantizer rounds to that map through a 65,536-entry lookup table of the value on a
//! uniform grid over [−1, 1], not by exact midpoints; this file builds the same table so
//! that the codes agree byte for byte.

use anyhow::{Result, bail};
use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Tensor};
use std::sync::Arc;

/// The 16 NF4 levels (bitsandbytes `get_4bit_type("nf4")`, as f32).
pub const NF4: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// Values per NF4 block (bitsandbytes' default for 4-bit weights, the only size QLoRA uses).
pub const BLOCK: usize = 64;
/// Absmax values per block of the double quantization.
pub const NESTED_BLOCK: usize = 256;

/// How the per-block absmax values are kept.
#[derive(Debug, Clone, PartialEq)]
pub enum Absmax {
    F32(Vec<f32>),
    /// Double quantization: `value = map[codes[i]] · scales[i / 256] + offset`.
    Nested {
        codes: Vec<u8>,
        scales: Vec<f32>,
        map: Vec<f32>,
        offset: f32,
    },
}

/// A quantized `[rows, cols]` weight.
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4 {
    pub rows: usize,
    pub cols: usize,
    /// `ceil(rows · cols / 2)` bytes.
    pub packed: Vec<u8>,
    pub absmax: Absmax,
}

impl Nf4 {
    /// Quantizes row-major `w: [rows, cols]`, with double quantization when `nested`.
    pub fn quantize(w: &[f32], rows: usize, cols: usize, nested: bool) -> Result<Nf4> {
        if w.len() != rows * cols {
            bail!("nf4: {} values for a {rows}x{cols} weight", w.len());
        }
        if let Some(i) = w.iter().position(|x| !x.is_finite()) {
            bail!("nf4: value {i} of the weight is {} (not finite)", w[i]);
        }
        let mids: Vec<f32> = NF4.windows(2).map(|p| (p[0] + p[1]) / 2.0).collect();
        let mut codes = vec![0u8; w.len()];
        let mut absmax = Vec::with_capacity(w.len().div_ceil(BLOCK));
        for (block, out) in w.chunks(BLOCK).zip(codes.chunks_mut(BLOCK)) {
            let m = block.iter().fold(0f32, |a, x| a.max(x.abs()));
            absmax.push(m);
            if m == 0.0 {
                // Every value is 0: NF4's 0 level.
                out.fill(7);
                continue;
            }
            for (x, c) in block.iter().zip(out.iter_mut()) {
                let v = x / m;
                // The number of midpoints below v is the nearest level's index.
                *c = mids.iter().take_while(|&&mid| mid < v).count() as u8;
            }
        }
        // An odd count pads the last byte with a quantized 0.0 (code 7), as bitsandbytes.
        let packed = codes
            .chunks(2)
            .map(|p| (p[0] << 4) | p.get(1).copied().unwrap_or(7))
            .collect();
        let absmax = if nested {
            nest(&absmax)
        } else {
            Absmax::F32(absmax)
        };
        Ok(Nf4 {
            rows,
            cols,
            packed,
            absmax,
        })
    }

    /// The f32 absmax of every block.
    pub fn absmax_f32(&self) -> Vec<f32> {
        match &self.absmax {
            Absmax::F32(v) => v.clone(),
            Absmax::Nested {
                codes,
                scales,
                map,
                offset,
            } => codes
                .iter()
                .enumerate()
                .map(|(i, &c)| map[c as usize] * scales[i / NESTED_BLOCK] + offset)
                .collect(),
        }
    }

    /// Dequantizes rows `r0..r1` into `out` (`(r1 − r0) · cols` values), with `absmax`
    /// from [`Nf4::absmax_f32`].
    pub fn dequantize_rows(&self, absmax: &[f32], r0: usize, r1: usize, out: &mut [f32]) {
        let start = r0 * self.cols;
        for (k, o) in out[..(r1 - r0) * self.cols].iter_mut().enumerate() {
            let i = start + k;
            let byte = self.packed[i / 2];
            let code = if i.is_multiple_of(2) { byte >> 4 } else { byte & 0x0f };
            *o = NF4[code as usize] * absmax[i / BLOCK];
        }
    }

    /// The whole weight in f32.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        self.dequantize_rows(&self.absmax_f32(), 0, self.rows, &mut out);
        out
    }
}

/// bitsandbytes' signed dynamic 8-bit map (`create_dynamic_map(signed=True,
/// max_exponent_bits=7, total_bits=8)`): for exponents 10⁻⁶ … 10⁰, the midpoints of
/// 2^i + 1 evenly spaced fractions of [0.1, 1] scaled by the exponent, both signs, then 0
/// and 1, padded with zeros to 256 values and sorted.
pub fn dynamic_map() -> Vec<f32> {
    let mut data: Vec<f32> = Vec::with_capacity(256);
    for i in 0..7i32 {
        let items = (1usize << i) + 1;
        // Python's 10 ** (i − 6), cast to the map's f32 before it multiplies.
        let scale = 10f64.powi(i - 6) as f32;
        // torch.linspace(0.1, 1, items) in f32, then the means of neighbours.
        let bounds: Vec<f32> = (0..items)
            .map(|k| linspace_f32(0.1, 1.0, items, k))
            .collect();
        for p in bounds.windows(2) {
            let mean = (p[0] + p[1]) / 2.0;
            data.push(scale * mean);
            data.push(-scale * mean);
        }
    }
    data.push(0.0);
    data.push(1.0);
    data.resize(256, 0.0);
    data.sort_by(f32::total_cmp);
    data
}

/// `torch.linspace(start, end, steps)[k]` in f32: torch steps from the start for the first
/// half and back from the end for the second, each a fused multiply-add (measured against
/// torch 2.15: plain products differ in 12 of 65 values).
fn linspace_f32(start: f32, end: f32, steps: usize, k: usize) -> f32 {
    if steps == 1 {
        return start;
    }
    let step = (end - start) / (steps - 1) as f32;
    if k < steps / 2 {
        step.mul_add(k as f32, start)
    } else {
        (-step).mul_add((steps - 1 - k) as f32, end)
    }
}

/// Double quantization of the absmax values around their mean. bitsandbytes takes torch's
/// f32 mean, whose summation order depends on the machine's vector width; here the sum is
/// in f64, rounded once (within an ulp or two of torch's).
fn nest(absmax: &[f32]) -> Absmax {
    let offset = (absmax.iter().map(|&x| f64::from(x)).sum::<f64>() / absmax.len() as f64) as f32;
    nest_around(absmax, offset)
}

/// Double quantization of `absmax − offset`, as bitsandbytes' CPU `quantize_blockwise`.
fn nest_around(absmax: &[f32], offset: f32) -> Absmax {
    let map = dynamic_map();
    let lut = lookup_table(&map);
    let mut codes = Vec::with_capacity(absmax.len());
    let mut scales = Vec::new();
    for block in absmax.chunks(NESTED_BLOCK) {
        let centred: Vec<f32> = block.iter().map(|x| x - offset).collect();
        let m = centred.iter().fold(0f32, |a, x| a.max(x.abs()));
        scales.push(m);
        if m == 0.0 {
            codes.extend(std::iter::repeat_n(0u8, block.len()));
            continue;
        }
        let inv = 1.0 / m;
        codes.extend(centred.iter().map(|x| lut[lut_index(x * inv)]));
    }
    Absmax::Nested {
        codes,
        scales,
        map,
        offset,
    }
}

const LUT_SIZE: usize = 65_536;

/// For each of 65,536 evenly spaced values over [−1, 1], the index of the nearest map
/// entry by midpoints.
fn lookup_table(map: &[f32]) -> Vec<u8> {
    let mids: Vec<f32> = map.windows(2).map(|p| 0.5 * (p[0] + p[1])).collect();
    let mut lut = vec![0u8; LUT_SIZE];
    let mut idx = 0;
    for (i, slot) in lut.iter_mut().enumerate() {
        let v = -1.0 + (2.0 * i as f32) / (LUT_SIZE - 1) as f32;
        while idx < mids.len() && mids[idx] < v {
            idx += 1;
        }
        *slot = idx as u8;
    }
    lut
}

fn lut_index(v: f32) -> usize {
    let v = v.clamp(-1.0, 1.0);
    ((v + 1.0) * 0.5 * (LUT_SIZE - 1) as f32 + 0.5) as u16 as usize
}

/// Output rows of the weight dequantized at a time: `ROW_BLOCK × in` f32 of scratch (2 MB
/// for a 1,024-wide layer) instead of the whole weight.
const ROW_BLOCK: usize = 512;

/// A frozen NF4 projection `[out, in]`: `y = x · Wᵀ` with W dequantized a block of rows
/// at a time, forward and backward (which recomputes each block rather than keeping the
/// dequantized weight alive), so that the f32 weight never exists whole.
#[derive(Debug)]
pub struct Nf4Linear {
    pub q: Nf4,
    /// The per-block absmax in f32 (1/64 of the weight's values; decoded once).
    absmax: Vec<f32>,
}

impl Nf4Linear {
    pub fn new(q: Nf4) -> Nf4Linear {
        let absmax = q.absmax_f32();
        Nf4Linear { q, absmax }
    }

    /// `(out, in)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.q.rows, self.q.cols)
    }

    /// Rows `r0..r1` of the weight, dequantized.
    pub fn rows(&self, r0: usize, r1: usize, device: &Device) -> candle_core::Result<Tensor> {
        let mut out = vec![0f32; (r1 - r0) * self.q.cols];
        self.q.dequantize_rows(&self.absmax, r0, r1, &mut out);
        Tensor::from_vec(out, (r1 - r0, self.q.cols), device)
    }

    /// The whole weight in f32 (for a merged export).
    pub fn dense(&self, device: &Device) -> candle_core::Result<Tensor> {
        self.rows(0, self.q.rows, device)
    }

    /// `x · Wᵀ` for `x: [..., in]`; differentiable in `x`.
    pub fn forward(self: &Arc<Self>, x: &Tensor) -> candle_core::Result<Tensor> {
        let (out_f, in_f) = self.dims();
        let mut dims = x.dims().to_vec();
        let rows = x.elem_count() / in_f;
        let y = x
            .reshape((rows, in_f))?
            .contiguous()?
            .apply_op1(Nf4Matmul { w: self.clone() })?;
        *dims.last_mut().expect("x has at least one dim") = out_f;
        y.reshape(dims)
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
    use super::*;
    use candle_core::{DType, Device, Tensor};
    use std::collections::HashMap;

    /// `tests/fixtures/nf4_reference.safetensors`, made by `scripts/nf4_reference.py`
    /// with bitsandbytes' own `quantize_4bit` / `dequantize_4bit`.
    fn reference() -> HashMap<String, Tensor> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/nf4_reference.safetensors"
        );
        candle_core::safetensors::load(path, &Device::Cpu).unwrap()
    }

    fn f32s(r: &HashMap<String, Tensor>, k: &str) -> Vec<f32> {
        r[k].flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    fn bytes(r: &HashMap<String, Tensor>, k: &str) -> Vec<u8> {
        r[k].flatten_all().unwrap().to_vec1::<u8>().unwrap()
    }

    #[test]
    fn the_levels_and_the_dynamic_map_are_bitsandbytes() {
        let r = reference();
        assert_eq!(f32s(&r, "nf4.quant_map"), NF4);
        assert_eq!(f32s(&r, "a.dq.nested_quant_map"), dynamic_map());
    }

    /// Codes, absmax values (plain and double-quantized) and dequantized weights equal
    /// bitsandbytes' byte for byte, on shapes with a partial last block, an all-zero
    /// block and an outlier.
    #[test]
    fn quantization_matches_bitsandbytes_exactly() {
        let r = reference();
        for name in ["a", "b", "c"] {
            let w = &r[&format!("{name}.weight")];
            let (rows, cols) = w.dims2().unwrap();
            let w = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let q = Nf4::quantize(&w, rows, cols, false).unwrap();
            assert_eq!(
                q.packed,
                bytes(&r, &format!("{name}.packed")),
                "{name} codes"
            );
            assert_eq!(q.absmax, Absmax::F32(f32s(&r, &format!("{name}.absmax"))));
            assert_eq!(q.dequantize(), f32s(&r, &format!("{name}.dequantized")));
            let q = Nf4::quantize(&w, rows, cols, true).unwrap();
            assert_eq!(q.packed, bytes(&r, &format!("{name}.dq.packed")));
            let Absmax::Nested { offset, .. } = q.absmax else {
                panic!("{name}: not nested");
            };
            // The offset is a mean whose last bit depends on the summation order.
            let theirs = f32s(&r, &format!("{name}.dq.offset"))[0];
            assert!(
                (offset - theirs).abs() <= 2.0 * f32::EPSILON * theirs,
                "{name} offset"
            );
            // Around bitsandbytes' own offset, the codes and scales are its own.
            let absmax = f32s(&r, &format!("{name}.absmax"));
            let nested = nest_around(&absmax, theirs);
            let Absmax::Nested { codes, scales, .. } = &nested else {
                unreachable!()
            };
            assert_eq!(*scales, f32s(&r, &format!("{name}.dq.nested_absmax")));
            assert_eq!(
                *codes,
                bytes(&r, &format!("{name}.dq.absmax")),
                "{name} nested codes"
            );
            let q = Nf4 {
                absmax: nested,
                ..q
            };
            let ours = q.dequantize();
            let theirs = f32s(&r, &format!("{name}.dq.dequantized"));
            let worst = ours
                .iter()
                .zip(&theirs)
                .map(|(a, b)| (a - b).abs() / b.abs().max(1e-6))
                .fold(0f32, f32::max);
            // bitsandbytes adds the offset after a multiply its kernel may fuse.
            assert!(
                worst <= 1e-6,
                "{name}: dequantized differ by {worst} (relative)"
            );
        }
    }

    #[test]
    fn quantization_error_is_bounded_by_the_level_spacing() {
        let w: Vec<f32> = (0..640)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 1000.0)
            .collect();
        let q = Nf4::quantize(&w, 10, 64, false).unwrap();
        let d = q.dequantize();
        let absmax = q.absmax_f32();
        for (i, (a, b)) in w.iter().zip(&d).enumerate() {
            // Half the widest gap between levels (−1 → −0.696) times the block's absmax.
            assert!(
                (a - b).abs() <= 0.153 * absmax[i / BLOCK],
                "{i}: {a} vs {b}"
            );
        }
        let t = Tensor::from_vec(d, (10, 64), &Device::Cpu).unwrap();
        assert_eq!(t.dtype(), DType::F32);
        let e = Nf4::quantize(&[f32::NAN, 0.0], 1, 2, false).unwrap_err();
        assert!(e.to_string().contains("not finite"));
    }

    /// The op equals a matmul with the dequantized weight, forward and backward, across
    /// row blocks (700 output rows: two blocks, the second partial).
    #[test]
    fn the_projection_is_the_dequantized_matmul_both_ways() {
        let dev = Device::Cpu;
        let (out_f, in_f) = (700, 96);
        let w: Vec<f32> = (0..out_f * in_f)
            .map(|i| (((i * 7919) % 1000) as f32 - 500.0) / 20_000.0)
            .collect();
        let lin = Arc::new(Nf4Linear::new(
            Nf4::quantize(&w, out_f, in_f, true).unwrap(),
        ));
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
            // The adapter trains on the 4-bit base: every LoRA tensor gets a gradient.
            let train = Mode {
                adapters: true,
                grad: true,
                dropout_rng: None,
                adapter: None,
            };
            let h = model
                .forward_batch(
                    &fixture.input_ids(),
                    &fixture.attention_mask(),
                    &fixture.position_ids(),
                    train,
                )
                .unwrap();
            let grads = h.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            assert_eq!(model.missing_grads(&grads), Vec::<String>::new());
        }
    }
}
