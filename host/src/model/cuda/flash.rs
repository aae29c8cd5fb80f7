//! FlashAttention-2 on the tensor cores, forward and backward (`flash.cu`): the fused
//! attention [`super::attention::attention`] takes for half-precision tensors with head
//! size 64 or 128, the form of [`crate::model::compute::attention`] it must equal.
//!
//! The mask is the decoder's batch mask ([`crate::model::decoder::batch_mask`]), read not
//! as `B·T²` values but as the sequence ids it is made from (`[B, T]`, 0 for padding,
//! several ids in a row that packs sequences): the kernels apply its rule (causal, a real
//! key, the query's own sequence unless the query is padding) a score at a time, and
//! skip every tile above the diagonal. A query with no visible key (left padding) gets 0
//! where the composed form averages the masked keys uniformly; nothing reads those rows
//! (their positions are masked out of every loss and every later query's attention).
//!
//! Forward: per query row, the running max and sum of the online softmax, leaving the
//! row's log-sum-exp (`[B, g, R·T]` f32). Backward: `delta = rowsum(dO ⊙ O)`, then per
//! block of 64 keys the tiles' probabilities again from the log-sum-exp, with
//!   dV = Pᵀ dO,  dS = scale · P ⊙ (dO Vᵀ − delta),  dK = dSᵀ Q,  dQ = dS K
//! accumulated in f32 and cast to the compute dtype once.

use super::{Module, PushKernelArg, cuda, launch, ptx, tensor, view, with_dtype};
use candle_core::cuda_backend::WrapErr;
use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::{DType, Result, Tensor, bail};
use std::sync::OnceLock;

const KERNELS: Module = Module {
    name: "rlhost_flash",
    ptx: ptx!("flash"),
};

/// Query rows of a forward block and keys of a backward block (`BM`, `BN` in flash.cu).
const TILE: usize = 64;
/// Threads of a block: four warps.
const THREADS: u32 = 128;
/// Halves added to each shared-memory row (`PAD` in flash.cu).
const PAD: usize = 8;
/// Query rows a backward step takes by default (16 or 32; [`attention_tuned`] picks).
pub const BACKWARD_QUERIES: usize = 32;

/// Whether the flash kernels take attention of `q` (its dtype and head size), unless
/// `RLHOST_ATTENTION=cublas` asks for the cuBLAS-and-softmax form (the benchmark runs
/// both).
pub fn applies(q: &Tensor) -> bool {
    static CUBLAS: OnceLock<bool> = OnceLock::new();
    let forced = *CUBLAS.get_or_init(|| {
        std::env::var("RLHOST_ATTENTION").is_ok_and(|v| v.eq_ignore_ascii_case("cublas"))
    });
    !forced
        && matches!(q.dtype(), DType::BF16 | DType::F16)
        && matches!(q.dims().last(), Some(64 | 128))
}

/// The flash attention of `q: [B, g, R·T, d]`, `k`, `v: [B, g, T, d]` under the batch
/// mask of the sequence ids `ids` (`[B, T]`, any dtype holding whole numbers below
/// 2^24); tracks gradients to q, k and v when any does.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, ids: &Tensor, scale: f64) -> Result<Tensor> {
    attention_tuned(q, k, v, ids, scale, BACKWARD_QUERIES)
}

/// [`attention`] with the backward taking `backward_queries` query rows a step (16 or
/// 32: more work between two barriers, more registers and shared memory).
pub fn attention_tuned(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ids: &Tensor,
    scale: f64,
    backward_queries: usize,
) -> Result<Tensor> {
    if !matches!(backward_queries, 16 | 32) {
        bail!("flash attention: {backward_queries} query rows a backward step (16 or 32)");
    }
    let (b, g, rt, d) = q.dims4()?;
    let t = k.dim(2)?;
    let reps = rt / t;
    if ids.elem_count() != b * t {
        bail!(
            "flash attention: sequence ids {:?} are not [B, T] = [{b}, {t}]",
            ids.dims()
        );
    }
    let ids = ids.to_dtype(DType::F32)?.contiguous()?;
    let (q, k, v) = (aligned(q)?, aligned(k)?, aligned(v)?);
    let geometry = Geometry {
        b,
        g,
        reps,
        t,
        d,
        scale: scale as f32,
        backward_queries,
    };
    let (out, lse) = forward(&q, &k, &v, &ids, &geometry)?;
    if !(q.track_op() || k.track_op() || v.track_op()) {
        return Ok(out);
    }
    super::apply_precomputed3(&q, &k, &v, out, FlashAttention { lse, ids, geometry })
}

/// `x` contiguous with its first element 16-byte aligned (the kernels load 16 bytes at
/// a time); a view that starts elsewhere is copied.
fn aligned(x: &Tensor) -> Result<Tensor> {
    let x = x.contiguous()?;
    if x.layout().start_offset() % 8 == 0 {
        Ok(x)
    } else {
        x.copy()
    }
}

#[derive(Clone, Copy)]
struct Geometry {
    b: usize,
    g: usize,
    reps: usize,
    t: usize,
    d: usize,
    scale: f32,
    backward_queries: usize,
}

impl Geometry {
    /// One block a tile of 64 (queries forward, keys backward) of one query head.
    fn grid(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (
                self.t.div_ceil(TILE) as u32,
                (self.b * self.g * self.reps) as u32,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn kernel(&self, op: &str) -> String {
        format!("{op}_d{}", self.d)
    }

    /// The backward's entry and its shared memory in bytes (the layout in flash.cu).
    fn backward_kernel(&self, elem: usize) -> (String, u32) {
        let (bq, row) = (self.backward_queries, self.d + PAD);
        let bytes = elem * ((2 * TILE + 2 * bq) * row + TILE * (bq + PAD)) + 4 * (3 * bq + TILE);
        (format!("flash_bwd_d{}_q{bq}", self.d), bytes as u32)
    }
}

/// `(out, lse)`: the attention in q's dtype and each query row's log-sum-exp (log2 units).
fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ids: &Tensor,
    geo: &Geometry,
) -> Result<(Tensor, Tensor)> {
    let rows = geo.b * geo.g * geo.reps * geo.t;
    let (q_guard, q_l) = q.storage_and_layout();
    let (k_guard, k_l) = k.storage_and_layout();
    let (v_guard, v_l) = v.storage_and_layout();
    let (m_guard, m_l) = ids.storage_and_layout();
    let qs = cuda(&q_guard, "flash attention")?;
    let dev = super::device(qs);
    with_dtype!(q.dtype(), T => {
        let qv = view::<T>(qs, q_l, "flash attention")?;
        let kv = view::<T>(cuda(&k_guard, "flash attention")?, k_l, "flash attention")?;
        let vv = view::<T>(cuda(&v_guard, "flash attention")?, v_l, "flash attention")?;
        let mv = view::<f32>(cuda(&m_guard, "flash attention")?, m_l, "flash attention")?;
        let out = super::alloc::<T>(dev, rows * geo.d)?;
        let lse = super::alloc::<f32>(dev, rows)?;
        let (stream, func) = KERNELS.load(dev, &geo.kernel("flash_fwd"), q.dtype())?;
        let mut args = stream.launch_builder(&func);
        let (t, groups, reps) = (geo.t as i32, geo.g as i32, geo.reps as i32);
        let scale_log2 = geo.scale * std::f32::consts::LOG2_E;
        args.arg(&qv).arg(&kv).arg(&vv).arg(&mv).arg(&out).arg(&lse);
        args.arg(&t).arg(&groups).arg(&reps).arg(&scale_log2);
        launch(&mut args, geo.grid())?;
        Ok((
            tensor(out, dev, q.shape().clone()),
            tensor(lse, dev, rows),
        ))
    })
}

struct FlashAttention {
    lse: Tensor,
    /// The sequence ids, f32 `[B, T]`.
    ids: Tensor,
    geometry: Geometry,
}

impl FlashAttention {
    /// `(dq, dk, dv)` in q's dtype.
    fn gradients(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let geo = &self.geometry;
        let rows = geo.b * geo.g * geo.reps * geo.t;
        let kv_len = geo.b * geo.g * geo.t * geo.d;
        let (out, grad) = (aligned(out)?, aligned(&grad.to_dtype(q.dtype())?)?);
        let (q_guard, q_l) = q.storage_and_layout();
        let (k_guard, k_l) = k.storage_and_layout();
        let (v_guard, v_l) = v.storage_and_layout();
        let (o_guard, o_l) = out.storage_and_layout();
        let (g_guard, g_l) = grad.storage_and_layout();
        let (m_guard, m_l) = self.ids.storage_and_layout();
        let (l_guard, l_l) = self.lse.storage_and_layout();
        let op = "flash attention backward";
        let qs = cuda(&q_guard, op)?;
        let dev = super::device(qs);
        let (dq, dk, dv) = with_dtype!(q.dtype(), T => {
            let qv = view::<T>(qs, q_l, op)?;
            let kv = view::<T>(cuda(&k_guard, op)?, k_l, op)?;
            let vv = view::<T>(cuda(&v_guard, op)?, v_l, op)?;
            let ov = view::<T>(cuda(&o_guard, op)?, o_l, op)?;
            let gv = view::<T>(cuda(&g_guard, op)?, g_l, op)?;
            let mv = view::<f32>(cuda(&m_guard, op)?, m_l, op)?;
            let lv = view::<f32>(cuda(&l_guard, op)?, l_l, op)?;
            let delta = super::alloc::<f32>(dev, rows)?;
            let (stream, func) = KERNELS.load(dev, &geo.kernel("flash_delta"), q.dtype())?;
            let mut args = stream.launch_builder(&func);
            let rows64 = rows as i64;
            args.arg(&ov).arg(&gv).arg(&delta).arg(&rows64);
            let warps = (THREADS / 32) as usize;
            launch(
                &mut args,
                LaunchConfig {
                    grid_dim: (rows.div_ceil(warps) as u32, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                },
            )?;
            let dq = dev.alloc_zeros::<f32>(rows * geo.d)?;
            let dk = dev.alloc_zeros::<f32>(kv_len)?;
            let dv = dev.alloc_zeros::<f32>(kv_len)?;
            let (name, smem) = geo.backward_kernel(q.dtype().size_in_bytes());
            let (stream, func) = KERNELS.load(dev, &name, q.dtype())?;
            // Past the 48 KB a launch may take without asking (d = 128 with 32 queries).
            func.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .w()?;
            let mut args = stream.launch_builder(&func);
            let (t, groups, reps) = (geo.t as i32, geo.g as i32, geo.reps as i32);
            let scale_log2 = geo.scale * std::f32::consts::LOG2_E;
            args.arg(&qv).arg(&kv).arg(&vv).arg(&mv).arg(&gv).arg(&lv).arg(&delta);
            args.arg(&dq).arg(&dk).arg(&dv);
            args.arg(&t).arg(&groups).arg(&reps).arg(&geo.scale).arg(&scale_log2);
            launch(
                &mut args,
                LaunchConfig {
                    shared_mem_bytes: smem,
                    ..geo.grid()
                },
            )?;
            (
                tensor(dq, dev, q.shape().clone()),
                tensor(dk, dev, k.shape().clone()),
                tensor(dv, dev, v.shape().clone()),
            )
        });
        let dtype = q.dtype();
        Ok((
            dq.to_dtype(dtype)?,
            dk.to_dtype(dtype)?,
            dv.to_dtype(dtype)?,
        ))
    }
}

impl super::Backward3 for FlashAttention {
    const NAME: &'static str = "flash attention";

    fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (q, k, v) = (
            aligned(&q.detach())?,
            aligned(&k.detach())?,
            aligned(&v.detach())?,
        );
        let (dq, dk, dv) = self.gradients(&q, &k, &v, &out.detach(), grad)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{compute, fixtures};
    use candle_core::{Device, Var};

    /// The flash kernels against the composed form on the GPU, at every real query row:
    /// values and the gradients of q, k and v, in bf16 and f16, head sizes 64 and 128,
    /// both backward step sizes, grouped (R = 3) and not, lengths that end inside a tile
    /// and span several, with left padding, and rows that pack several sequences (their
    /// boundaries inside tiles, right padding after them). The yardstick is the composed
    /// form's own
    /// rounding: each is compared with the composed form in f32 on the same inputs, and
    /// the flash error may be at most 1.5× the composed half-precision error (plus
    /// 1e-3). Padded query rows carry no gradient (as in training) and are left out of
    /// the comparison. Skipped without `RLHOST_TEST_DEVICE=cuda`.
    #[test]
    fn flash_attention_matches_the_composed_form() {
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        // Sequence ids a row: `pad` pads on the left of the last row; or packed rows, each
        // run (id, length) in turn.
        let left = |b: usize, t: usize, pad: usize| -> Vec<u32> {
            (0..b * t)
                .map(|i| u32::from(i / t + 1 < b || i % t >= pad))
                .collect()
        };
        let packed = |rows: &[&[(u32, usize)]]| -> Vec<u32> {
            rows.iter()
                .flat_map(|runs| runs.iter().flat_map(|&(id, n)| std::iter::repeat_n(id, n)))
                .collect()
        };
        let cases = [
            (2, 2, 3, 37, left(2, 37, 5)),
            (2, 1, 1, 130, left(2, 130, 70)),
            (1, 2, 2, 200, left(1, 200, 0)),
            (
                2,
                2,
                3,
                150,
                packed(&[&[(1, 40), (2, 70), (3, 30), (0, 10)], &[(1, 3), (2, 147)]]),
            ),
        ];
        for (b, g, r, t, real) in cases {
            let pad = real.iter().filter(|&&i| i == 0).count();
            assert_eq!(real.len(), b * t);
            for (d, bq) in [(64, 16), (64, 32), (128, 16), (128, 32)] {
                for dtype in [DType::BF16, DType::F16] {
                    let seed = (d + t) as u64;
                    let make = |shape: &[usize], s: u64, gain: f64| {
                        fixtures::uniform_on(shape, s, gain, &dev, DType::F32)
                    };
                    let q32 = make(&[b, g, r * t, d], seed, 3.0);
                    let k32 = make(&[b, g, t, d], seed + 1, 1.0);
                    let v32 = make(&[b, g, t, d], seed + 2, 1.0);
                    let am = Tensor::from_vec(real.clone(), (b, t), &Device::Cpu)
                        .unwrap()
                        .to_device(&dev)
                        .unwrap();
                    let mask = crate::model::decoder::batch_mask(&am).unwrap();
                    let ids = crate::model::decoder::sequence_ids(&am).unwrap();
                    // 1 at real query rows of [B, g, R·T, 1], else 0.
                    let rows: Vec<f32> = (0..b * g * r * t)
                        .map(|i| f32::from(u8::from(real[(i / (g * r * t)) * t + i % t] != 0)))
                        .collect();
                    let rows = Tensor::from_vec(rows, (b, g, r * t, 1), &Device::Cpu)
                        .unwrap()
                        .to_device(&dev)
                        .unwrap();
                    let coef = make(&[b, g, r * t, d], seed + 3, 1.0)
                        .broadcast_mul(&rows)
                        .unwrap();
                    let scale = 1.0 / (d as f64).sqrt();
                    let run = |dt: DType, flash: bool| {
                        let vars = [&q32, &k32, &v32]
                            .map(|x| Var::from_tensor(&x.to_dtype(dt).unwrap()).unwrap());
                        let [q, k, v] = [0, 1, 2].map(|i| vars[i].as_tensor().clone());
                        let out = if flash {
                            attention_tuned(&q, &k, &v, &ids, scale, bq)
                        } else {
                            crate::model::cpu::composed(|| {
                                compute::attention(&q, &k, &v, &mask, &ids, scale)
                            })
                        }
                        .unwrap()
                        .to_dtype(DType::F32)
                        .unwrap();
                        let loss = (&out * &coef).unwrap().sum_all().unwrap();
                        let grads = loss.backward().unwrap();
                        let gs: Vec<Tensor> = vars
                            .iter()
                            .map(|x| grads.get(x.as_tensor()).unwrap().clone())
                            .collect();
                        (out.broadcast_mul(&rows).unwrap(), gs)
                    };
                    let (out_ref, grads_ref) = run(DType::F32, false);
                    let (out_half, grads_half) = run(dtype, false);
                    let (out_flash, grads_flash) = run(dtype, true);
                    let rel = fixtures::relative_diff;
                    let check = |what: &str, flash: &Tensor, half: &Tensor, reference: &Tensor| {
                        let (ef, eh) = (rel(flash, reference), rel(half, reference));
                        eprintln!(
                            "flash B={b} g={g} R={r} T={t} pad={pad} d={d} bq={bq} {dtype:?} {what}: \
                             flash {ef:.2e}, composed {eh:.2e} from f32"
                        );
                        assert!(
                            ef.is_finite() && ef <= 1.5 * eh + 1e-3,
                            "{what}: {ef} vs {eh}"
                        );
                    };
                    check("output", &out_flash, &out_half, &out_ref);
                    for (i, name) in ["q", "k", "v"].iter().enumerate() {
                        check(name, &grads_flash[i], &grads_half[i], &grads_ref[i]);
                    }
                }
            }
        }
    }
}
