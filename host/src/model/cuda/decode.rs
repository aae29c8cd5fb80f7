//! The attention of a decode step for the whole batch in two launches a layer
//! (`decode.cu`), the fused form of [`crate::model::compute::decode_attention`]: one new
//! query token per row of the KV pool, which attends to its row's first `lens[row]`
//! positions. The composed form is a product over every row's whole capacity, the mask,
//! a softmax of several kernels and a second product; this reads each row's keys and
//! values up to its length once for all the query heads of a kv head.
//!
//! Flash-decoding: a batch of single-token queries is too few blocks to fill the GPU, so
//! the cached length is split into chunks, a block a (row, kv head, chunk), each leaving
//! its online softmax's max, sum and weighted values; a second launch merges the chunks
//! (`decode.cu` has the equations). Inference only: no backward.

use super::{Module, PushKernelArg, alloc, cuda, launch, ptx, tensor, view, with_dtype};
use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::{DType, Result, Tensor, bail};
use std::sync::OnceLock;

const KERNELS: Module = Module {
    name: "rlhost_decode",
    ptx: ptx!("decode"),
};

/// Query heads a kv head may have and the head sizes the kernel takes (`MAX_REPS`,
/// `MAX_LANE · 32` in decode.cu).
const MAX_REPS: usize = 8;
const HEAD_DIMS: [usize; 2] = [64, 128];
/// Threads of a split block: four warps (`WARPS`).
const THREADS: u32 = 128;
/// Blocks that keep an H100/H200 busy (132 streaming multiprocessors, two blocks each):
/// the chunks are as many as bring the grid there, each at least [`MIN_CHUNK`] keys.
const BUSY_BLOCKS: usize = 264;
const MIN_CHUNK: usize = 64;

/// Whether the kernel takes a decode step with queries `q: [P, g, R, d]`, unless
/// `RLHOST_DECODE_ATTENTION=composed` asks for the composed form (the benchmark runs
/// both).
pub fn applies(q: &Tensor) -> bool {
    static COMPOSED: OnceLock<bool> = OnceLock::new();
    let forced = *COMPOSED.get_or_init(|| {
        std::env::var("RLHOST_DECODE_ATTENTION").is_ok_and(|v| v.eq_ignore_ascii_case("composed"))
    });
    let dims = q.dims();
    !forced
        && super::applies(q)
        && dims.len() == 4
        && dims[2] <= MAX_REPS
        && HEAD_DIMS.contains(&dims[3])
        // A block a (row, kv head) along the grid's second dimension.
        && dims[0] * dims[1] <= MAX_GRID_Y
}

/// The most blocks a grid's second dimension holds.
const MAX_GRID_Y: usize = 65_535;

/// The chunks a row's cached length is split into for `rows` (rows × kv heads) blocks,
/// and the keys a chunk takes, for keys up to `longest`.
pub fn splits(rows: usize, longest: usize) -> (usize, usize) {
    let most = longest.div_ceil(MIN_CHUNK).max(1);
    let splits = BUSY_BLOCKS.div_ceil(rows.max(1)).clamp(1, most);
    (splits, longest.div_ceil(splits).max(1))
}

/// `softmax(scale · q kᵀ) v` for `q: [P, g, R, d]` against `k`, `v: [P, g, cap, d]`,
/// row `p` seeing its first `lens[p]` positions (`lens`: u32 `[P]`, each at least 1 and
/// at most `longest`); returns `[P, g, R, d]` in `q`'s dtype.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lens: &Tensor,
    longest: usize,
    scale: f64,
) -> Result<Tensor> {
    let (p, g, reps, d) = q.dims4()?;
    let cap = k.dim(2)?;
    if k.dims() != [p, g, cap, d] || v.dims() != k.dims() || lens.dims() != [p] {
        bail!(
            "decode attention: q {:?}, k {:?}, v {:?}, lens {:?} are not [P, g, R, d], [P, g, cap, d] twice and [P]",
            q.dims(),
            k.dims(),
            v.dims(),
            lens.dims()
        );
    }
    if reps > MAX_REPS
        || !HEAD_DIMS.contains(&d)
        || p * g > MAX_GRID_Y
        || longest == 0
        || longest > cap
    {
        bail!(
            "decode attention: {reps} query heads a kv head, head size {d}, {longest} of {cap} positions"
        );
    }
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let lens = lens.to_dtype(DType::U32)?.contiguous()?;
    let (splits, chunk) = splits(p * g, longest);
    let (q_guard, q_l) = q.storage_and_layout();
    let (k_guard, k_l) = k.storage_and_layout();
    let (v_guard, v_l) = v.storage_and_layout();
    let (n_guard, n_l) = lens.storage_and_layout();
    let qs = cuda(&q_guard, "decode attention")?;
    let dev = super::device(qs);
    let blocks = p * g;
    with_dtype!(q.dtype(), T => {
        let qv = view::<T>(qs, q_l, "decode attention")?;
        let kv = view::<T>(cuda(&k_guard, "decode attention")?, k_l, "decode attention")?;
        let vv = view::<T>(cuda(&v_guard, "decode attention")?, v_l, "decode attention")?;
        let nv = view::<u32>(cuda(&n_guard, "decode attention")?, n_l, "decode attention")?;
        let part_acc = alloc::<f32>(dev, blocks * splits * reps * d)?;
        let part_ml = alloc::<f32>(dev, blocks * splits * reps * 2)?;
        let (g32, cap32, d32, r32, s32, c32) =
            (g as i32, cap as i32, d as i32, reps as i32, splits as i32, chunk as i32);
        let scale = scale as f32;
        {
            let (stream, func) = KERNELS.load(dev, "decode_attn_split", q.dtype())?;
            let mut args = stream.launch_builder(&func);
            args.arg(&qv).arg(&kv).arg(&vv).arg(&nv).arg(&part_acc).arg(&part_ml);
            args.arg(&g32).arg(&cap32).arg(&d32).arg(&r32).arg(&s32).arg(&c32).arg(&scale);
            let cfg = LaunchConfig {
                grid_dim: (splits as u32, blocks as u32, 1),
                block_dim: (THREADS, 1, 1),
                // Each warp's weighted values for the block's merge.
                shared_mem_bytes: (4 * reps * d * 4) as u32,
            };
            launch(&mut args, cfg)?;
        }
        let out = alloc::<T>(dev, blocks * reps * d)?;
        {
            let (stream, func) = KERNELS.load(dev, "decode_attn_combine", q.dtype())?;
            let mut args = stream.launch_builder(&func);
            args.arg(&part_acc).arg(&part_ml).arg(&out).arg(&d32).arg(&r32).arg(&s32);
            let threads = (reps * d).next_multiple_of(32).min(1024) as u32;
            let cfg = LaunchConfig {
                grid_dim: (blocks as u32, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            launch(&mut args, cfg)?;
        }
        Ok(tensor(out, dev, (p, g, reps, d)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{compute, fixtures};

    /// The splits fill the GPU without chunks under 64 keys, and cover every key.
    #[test]
    fn splits_fill_the_gpu_and_cover_the_keys() {
        assert_eq!(splits(128, 400), (3, 134));
        assert_eq!(splits(128, 40), (1, 40));
        assert_eq!(splits(2, 4096), (64, 64));
        assert_eq!(splits(512, 4096), (1, 4096));
        for (rows, longest) in [(1, 1), (7, 999), (128, 385), (64, 64)] {
            let (s, c) = splits(rows, longest);
            assert!(
                s * c >= longest && (s - 1) * c < longest,
                "{rows} {longest}"
            );
        }
    }

    /// The kernel against the composed form on the GPU: batches of rows of different
    /// lengths (one of a single position), 1.5B-, 0.5B- and Qwen3-shaped heads, lengths
    /// that split into several chunks and into one, in f32, bf16 and f16. Skipped without
    /// `RLHOST_TEST_DEVICE=cuda`.
    #[test]
    fn decode_attention_matches_the_composed_form() {
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        // (rows, kv heads, query heads a kv head, head size, capacity)
        for (p, g, reps, d, cap) in [
            (64, 2, 6, 128, 448),
            (5, 2, 7, 64, 1024),
            (3, 8, 2, 128, 64),
        ] {
            let make =
                |shape: &[usize], s: u64| fixtures::uniform_on(shape, s, 2.0, &dev, DType::F32);
            let q = make(&[p, g, reps, d], 1);
            let k = make(&[p, g, cap, d], 2);
            let v = make(&[p, g, cap, d], 3);
            let lens: Vec<u32> = (0..p)
                .map(|i| {
                    if i == 1 {
                        1
                    } else {
                        cap.saturating_sub(7 * i).max(1) as u32
                    }
                })
                .collect();
            let longest = *lens.iter().max().unwrap() as usize;
            let mask = compute::decode_mask(&lens, cap, &dev).unwrap();
            let lens = Tensor::new(lens.as_slice(), &dev).unwrap();
            let scale = 1.0 / (d as f64).sqrt();
            let composed = |q: &Tensor, k: &Tensor, v: &Tensor| {
                crate::model::cpu::composed(|| {
                    compute::decode_attention(q, k, v, || Ok(mask.clone()), &lens, longest, scale)
                })
                .unwrap()
            };
            let reference = composed(&q, &k, &v);
            // In f32 the kernel is the composed form up to the order of summation; in half
            // precision it may be no further from the f32 form than the composed one is.
            let fused = attention(&q, &k, &v, &lens, longest, scale).unwrap();
            let e = fixtures::relative_diff(&fused, &reference);
            eprintln!("decode attention {p}x{g}x{reps}x{d}, cap {cap}, F32: {e:.2e}");
            assert!(e <= 1e-4, "{p}x{g}x{reps}x{d} f32: {e}");
            for dtype in [DType::BF16, DType::F16] {
                let half = |t: &Tensor| t.to_dtype(dtype).unwrap();
                let (qh, kh, vh) = (half(&q), half(&k), half(&v));
                let fused = attention(&qh, &kh, &vh, &lens, longest, scale).unwrap();
                let ef = fixtures::relative_diff(&fused, &reference);
                let eh = fixtures::relative_diff(&composed(&qh, &kh, &vh), &reference);
                eprintln!(
                    "decode attention {p}x{g}x{reps}x{d}, cap {cap}, {dtype:?}: kernel {ef:.2e}, composed {eh:.2e} from f32"
                );
                assert!(
                    ef.is_finite() && ef <= 1.5 * eh + 1e-3,
                    "{dtype:?}: {ef} vs {eh}"
                );
            }
        }
    }
}
