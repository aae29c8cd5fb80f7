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

use super::weights::Weights;
use anyhow::{Context, Result, bail};

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
        let mut out = vec![0f32; self.absmax_count()];
        self.absmax_range(0, &mut out);
        out
    }

    /// The number of 64-value blocks.
    pub fn absmax_count(&self) -> usize {
        match &self.absmax {
            Absmax::F32(v) => v.len(),
            Absmax::Nested { codes, .. } => codes.len(),
        }
    }

    /// The f32 absmax of blocks `first..first + out.len()` into `out`, decoded from the
    /// 8-bit codes when double-quantized (the kernels decode them as they go rather than
    /// keep an f32 copy, 0.5 bits per weight that bitsandbytes' layout saves).
    pub fn absmax_range(&self, first: usize, out: &mut [f32]) {
        match &self.absmax {
            Absmax::F32(v) => out.copy_from_slice(&v[first..first + out.len()]),
            Absmax::Nested {
                codes,
                scales,
                map,
                offset,
            } => {
                for (i, o) in out.iter_mut().enumerate() {
                    let i = first + i;
                    *o = map[codes[i] as usize] * scales[i / NESTED_BLOCK] + offset;
                }
            }
        }
    }

    /// Dequantizes rows `r0..r1` into `out` (`(r1 − r0) · cols` values), with `absmax`
    /// from [`Nf4::absmax_f32`].
    pub fn dequantize_rows(&self, absmax: &[f32], r0: usize, r1: usize, out: &mut [f32]) {
        let start = r0 * self.cols;
        for (k, o) in out[..(r1 - r0) * self.cols].iter_mut().enumerate() {
            let i = start + k;
            let byte = self.packed[i / 2];
            let code = if i.is_multiple_of(2) {
                byte >> 4
            } else {
                byte & 0x0f
            };
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

/// The NF4 weight `name` (`[out, in]`) of a checkpoint bitsandbytes serialized
/// (transformers' `save_pretrained` of a 4-bit model): `name` holds the packed codes,
/// `name.absmax` the absmax values (u8 codes with `name.nested_absmax`,
/// `name.nested_quant_map` and the offset when double-quantized), `name.quant_map` the 16
/// levels and `name.quant_state.bitsandbytes__nf4` a JSON record of shape, block sizes and
/// offset. `None` when `name` is stored dense (bitsandbytes skips some modules).
pub fn read_bnb(w: &Weights, name: &str, out_f: usize, in_f: usize) -> Result<Option<Nf4>> {
    let state_key = format!("{name}.quant_state.bitsandbytes__nf4");
    if w.contains(&format!("{name}.quant_state.bitsandbytes__fp4")) {
        bail!("{name} is bitsandbytes FP4: rlhost reads NF4 only");
    }
    if !w.contains(&state_key) {
        return Ok(None);
    }
    let where_ = || format!("{name} in {}", w.dir().display());
    let bytes = |k: &str| -> Result<Vec<u8>> {
        Ok(w.raw(k)?
            .flatten_all()?
            .to_dtype(candle_core::DType::U8)?
            .to_vec1::<u8>()?)
    };
    let floats = |k: &str| -> Result<Vec<f32>> {
        Ok(w.raw(k)?
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1::<f32>()?)
    };
    let state: serde_json::Value = serde_json::from_slice(&bytes(&state_key)?)
        .with_context(|| format!("{}: the quant state is not JSON", where_()))?;
    let field = |k: &str| {
        state
            .get(k)
            .with_context(|| format!("{}: quant state has no `{k}`", where_()))
    };
    let shape: Vec<usize> = serde_json::from_value(field("shape")?.clone())
        .with_context(|| format!("{}: quant state `shape`", where_()))?;
    if shape != [out_f, in_f] {
        bail!(
            "{}: quantized shape {shape:?}, config.json implies [{out_f}, {in_f}]",
            where_()
        );
    }
    let block = field("blocksize")?.as_u64().unwrap_or(0) as usize;
    if block != BLOCK {
        bail!(
            "{}: NF4 block size {block}; rlhost reads blocks of {BLOCK} (bitsandbytes' default)",
            where_()
        );
    }
    if floats(&format!("{name}.quant_map"))? != NF4 {
        bail!("{}: its quant_map is not the NF4 levels", where_());
    }
    let packed = bytes(name)?;
    let n = out_f * in_f;
    if packed.len() != n.div_ceil(2) {
        bail!("{}: {} packed bytes for {n} values", where_(), packed.len());
    }
    let blocks = n.div_ceil(BLOCK);
    let absmax_key = format!("{name}.absmax");
    let absmax = match state
        .get("nested_offset")
        .and_then(serde_json::Value::as_f64)
    {
        Some(offset) => {
            let codes = bytes(&absmax_key)?;
            let scales = floats(&format!("{name}.nested_absmax"))?;
            let map = floats(&format!("{name}.nested_quant_map"))?;
            let nested_block = state
                .get("nested_blocksize")
                .and_then(serde_json::Value::as_u64);
            if codes.len() != blocks
                || map.len() != 256
                || scales.len() != blocks.div_ceil(NESTED_BLOCK)
                || nested_block != Some(NESTED_BLOCK as u64)
            {
                bail!(
                    "{}: the double-quantized absmax does not fit the weight ({} codes, {} scales, nested block {nested_block:?})",
                    where_(),
                    codes.len(),
                    scales.len()
                );
            }
            Absmax::Nested {
                codes,
                scales,
                map,
                offset: offset as f32,
            }
        }
        None => {
            let v = floats(&absmax_key)?;
            if v.len() != blocks {
                bail!(
                    "{}: {} absmax values for {blocks} blocks",
                    where_(),
                    v.len()
                );
            }
            Absmax::F32(v)
        }
    };
    Ok(Some(Nf4 {
        rows: out_f,
        cols: in_f,
        packed,
        absmax,
    }))
}

pub mod linear;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::Placement;
    use candle_core::{DType, Device, Tensor};
    use std::collections::HashMap;

    /// `tests/fixtures/nf4_reference.safetensors`, made by `scripts/nf4_reference.py`
    /// with bitsandbytes' own `quantize_4bit` / `dequantize_4bit`.
    pub(crate) fn reference() -> HashMap<String, Tensor> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/nf4_reference.safetensors"
        );
        candle_core::safetensors::load(path, &Device::Cpu).unwrap()
    }

    pub(crate) fn f32s(r: &HashMap<String, Tensor>, k: &str) -> Vec<f32> {
        r[k].flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    pub(crate) fn bytes(r: &HashMap<String, Tensor>, k: &str) -> Vec<u8> {
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

    /// The GPU's dequantization (candle ops over the codes) gives the CPU's values
    /// exactly, on the reference's shapes: a partial last block, an odd number of
    /// values, double-quantized absmax. Run here on the CPU; the ops are the same there.
    #[test]
    fn dequantizing_with_tensor_ops_equals_the_cpu_decoder() {
        let r = reference();
        for name in ["a", "b", "c"] {
            let w = &r[&format!("{name}.weight")];
            let (rows, cols) = w.dims2().unwrap();
            let values = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for nested in [false, true] {
                let q = linear::Nf4Linear::new(Nf4::quantize(&values, rows, cols, nested).unwrap());
                let ops = q.dense_on(&Device::Cpu).unwrap();
                let ops = ops.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(
                    ops,
                    q.q.dequantize(),
                    "{name} ({rows}x{cols}), nested {nested}"
                );
            }
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

    /// The fixture saved 4-bit by transformers (`tests/fixtures/models/qwen2-nf4`) loads
    /// as NF4 and, with the fixture adapter, gives PEFT + bitsandbytes' logits.
    #[test]
    fn a_checkpoint_bitsandbytes_saved_in_4_bits_loads() {
        use crate::model::fixtures::{self, Reference, masked_max_diff};
        use crate::model::frozen::Weight;
        use crate::model::{Mode, Model, peft};
        let r = reference();
        let fixture = Reference::load("qwen2");
        let mut model = Model::load(&fixtures::model_dir("qwen2-nf4"), &Placement::CPU).unwrap();
        assert!(
            model
                .projections()
                .iter()
                .all(|(_, _, l)| matches!(l.weight, Weight::Nf4(_))),
            "every projection stays 4-bit"
        );
        peft::load_adapter(&mut model, &fixtures::model_dir("qwen2").join("adapter")).unwrap();
        let logits = fixture.logits(&model, Mode::INFERENCE);
        let d = masked_max_diff(&logits, &r["qwen2.qlora_logits"], &fixture.attention_mask());
        assert!(d <= 1e-5, "pre-quantized logits differ from PEFT's by {d}");
    }
}
