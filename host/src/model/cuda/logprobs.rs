//! Log-probs of target tokens and the entropy of each row on CUDA, without the full
//! logits: the fused form of [`crate::model::compute::target_logprobs`]. The frozen head's
//! product runs `chunk_rows` rows at a time in the compute dtype (cuBLAS), and one kernel
//! pass over each chunk's logits leaves two numbers a row (and its log-sum-exp for the
//! backward), so that nothing vocabulary-sized outlives a chunk; the backward recomputes
//! a chunk's logits, turns them into their gradient in one pass (`logprobs.cu` has the
//! equations) and multiplies by the head. The composed form keeps every chunk's f32 logits
//! and log-softmax for the backward: about 5 GB each for 8,192 × 151,936.

use super::{Module, PushKernelArg, alloc, cuda, launch, per_row, ptx, tensor, view, with_dtype};
use candle_core::{CustomOp1, DType, Layout, Result, Shape, Tensor, bail};
use std::sync::Mutex;

const KERNELS: Module = Module {
    name: "rlhost_logprobs",
    ptx: ptx!("logprobs"),
};

/// Threads per row of logits: a vocabulary is long.
const THREADS: u32 = 512;

/// `(logp, entropy)`, each `[N]` f32, for `hidden: [N, H]`, the frozen `lm_head: [V, H]`
/// and `targets: [N]` (u32); both track a gradient to `hidden` where it does.
pub fn target_logprobs(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
) -> Result<(Tensor, Tensor)> {
    let (n, h) = hidden.dims2()?;
    let (v, h_head) = lm_head.dims2()?;
    if h != h_head || targets.dims() != [n] {
        bail!(
            "fused log-probs: hidden {:?}, head {:?}, targets {:?}",
            hidden.dims(),
            lm_head.dims(),
            targets.dims()
        );
    }
    let chunk_rows = chunk_rows.max(1);
    let head = lm_head.detach().to_dtype(hidden.dtype())?;
    let targets = targets.to_dtype(DType::U32)?.contiguous()?;
    // A target outside the vocabulary would read past a row of logits in the kernel:
    // refused here (one small read back per batch).
    if n > 0 {
        let top = targets.max(0)?.to_scalar::<u32>()?;
        if top as usize >= v {
            bail!("fused log-probs: target token {top} is outside the vocabulary of {v}");
        }
    }
    let detached = hidden.detach();
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for start in (0..n).step_by(chunk_rows) {
        let len = chunk_rows.min(n - start);
        let logits = detached.narrow(0, start, len)?.matmul(&head.t()?)?;
        let (out, lse) = forward_chunk(&logits, &targets.narrow(0, start, len)?, v)?;
        outs.push(out);
        lses.push(lse);
    }
    if outs.is_empty() {
        let empty = Tensor::zeros(0, DType::F32, hidden.device())?;
        return Ok((empty.clone(), empty));
    }
    let value = Tensor::cat(&outs, 0)?;
    let out = if hidden.track_op() {
        hidden.apply_op1(FusedHead {
            value: Mutex::new(Some(value)),
            lse: Tensor::cat(&lses, 0)?,
            head,
            targets,
            chunk_rows,
        })?
    } else {
        value
    };
    Ok((
        out.narrow(1, 0, 1)?.squeeze(1)?,
        out.narrow(1, 1, 1)?.squeeze(1)?,
    ))
}

/// `([rows, 2] (logp, entropy), [rows] lse)` of one chunk of logits `[rows, v]`.
fn forward_chunk(logits: &Tensor, targets: &Tensor, v: usize) -> Result<(Tensor, Tensor)> {
    let rows = logits.dim(0)?;
    let logits = logits.contiguous()?;
    let targets = targets.contiguous()?;
    let (z_guard, z_l) = logits.storage_and_layout();
    let z = cuda(&z_guard, "log-probs")?;
    let (t_guard, t_l) = targets.storage_and_layout();
    let t = cuda(&t_guard, "log-probs")?;
    let dev = super::device(z);
    with_dtype!(logits.dtype(), T => {
        let zv = view::<T>(z, z_l, "log-probs")?;
        let tv = view::<u32>(t, t_l, "log-probs")?;
        let out = alloc::<f32>(dev, rows * 2)?;
        let lse = alloc::<f32>(dev, rows)?;
        let (stream, func) = KERNELS.load(dev, "logprobs_fwd", logits.dtype())?;
        let mut args = stream.launch_builder(&func);
        let v32 = v as i32;
        args.arg(&zv).arg(&tv).arg(&out).arg(&lse).arg(&v32);
        launch(&mut args, per_row(rows, THREADS))?;
        Ok((tensor(out, dev, (rows, 2)), tensor(lse, dev, rows)))
    })
}

/// The gradient of one chunk's logits `[rows, v]` from its forward and the incoming
/// gradients `[rows, 2]`.
fn backward_chunk(
    logits: &Tensor,
    targets: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    grad: &Tensor,
    v: usize,
) -> Result<Tensor> {
    let rows = logits.dim(0)?;
    let [logits, targets, out, lse, grad] =
        [logits, targets, out, lse, grad].map(|t| t.contiguous());
    let (logits, targets, out, lse, grad) =
        (logits?, targets?, out?, lse?, grad?.to_dtype(DType::F32)?);
    let (z_guard, z_l) = logits.storage_and_layout();
    let z = cuda(&z_guard, "log-probs backward")?;
    let (t_guard, t_l) = targets.storage_and_layout();
    let t = cuda(&t_guard, "log-probs backward")?;
    let (o_guard, o_l) = out.storage_and_layout();
    let o = cuda(&o_guard, "log-probs backward")?;
    let (l_guard, l_l) = lse.storage_and_layout();
    let l = cuda(&l_guard, "log-probs backward")?;
    let (g_guard, g_l) = grad.storage_and_layout();
    let g = cuda(&g_guard, "log-probs backward")?;
    let dev = super::device(z);
    with_dtype!(logits.dtype(), T => {
        let zv = view::<T>(z, z_l, "log-probs backward")?;
        let tv = view::<u32>(t, t_l, "log-probs backward")?;
        let ov = view::<f32>(o, o_l, "log-probs backward")?;
        let lv = view::<f32>(l, l_l, "log-probs backward")?;
        let gv = view::<f32>(g, g_l, "log-probs backward")?;
        let dz = alloc::<T>(dev, rows * v)?;
        let (stream, func) = KERNELS.load(dev, "logprobs_bwd", logits.dtype())?;
        let mut args = stream.launch_builder(&func);
        let v32 = v as i32;
        args.arg(&zv).arg(&tv).arg(&ov).arg(&lv).arg(&gv).arg(&dz).arg(&v32);
        launch(&mut args, per_row(rows, THREADS))?;
        Ok(tensor(dz, dev, (rows, v)))
    })
}

struct FusedHead {
    /// The forward's result `[N, 2]`, computed before the op is applied and handed over once.
    value: Mutex<Option<Tensor>>,
    lse: Tensor,
    /// The head in the compute dtype.
    head: Tensor,
    targets: Tensor,
    chunk_rows: usize,
}

impl CustomOp1 for FusedHead {
    fn name(&self) -> &'static str {
        "fused-target-logprobs"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        bail!("fused log-probs: CUDA only")
    }

    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::precomputed(&self.value, "fused log-probs")
    }

    fn bwd(&self, hidden: &Tensor, out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let n = hidden.dim(0)?;
        let v = self.head.dim(0)?;
        let hidden = hidden.detach();
        let out = out.detach();
        let mut parts = Vec::new();
        for start in (0..n).step_by(self.chunk_rows) {
            let len = self.chunk_rows.min(n - start);
            let logits = hidden.narrow(0, start, len)?.matmul(&self.head.t()?)?;
            let dz = backward_chunk(
                &logits,
                &self.targets.narrow(0, start, len)?,
                &out.narrow(0, start, len)?,
                &self.lse.narrow(0, start, len)?,
                &grad.narrow(0, start, len)?,
                v,
            )?;
            drop(logits);
            parts.push(dz.matmul(&self.head)?);
        }
        if parts.is_empty() {
            return Ok(Some(hidden.zeros_like()?));
        }
        Ok(Some(Tensor::cat(&parts, 0)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{compute, fixtures};
    use candle_core::Var;

    /// The fused head against the composed form on the GPU: log-probs, entropies and the
    /// gradient of the hidden states under a loss weighing both, chunked unevenly, in f32,
    /// bf16 and f16. Skipped without `RLHOST_TEST_DEVICE=cuda`.
    #[test]
    fn fused_logprobs_match_the_composed_form() {
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        let (n, h, v) = (45, 64, 3001);
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2), (DType::F16, 3e-3)] {
            let make =
                |shape: &[usize], s: u64| fixtures::uniform(shape, s).to_device(&dev).unwrap();
            let hidden = Var::from_tensor(&make(&[n, h], 1).to_dtype(dtype).unwrap()).unwrap();
            let head = (make(&[v, h], 2) * 0.5).unwrap().to_dtype(dtype).unwrap();
            let targets: Vec<u32> = (0..n as u32).map(|i| (i * 617) % v as u32).collect();
            let targets = Tensor::new(targets, &dev).unwrap();
            let coef = make(&[n], 3);
            let run = |fused: bool| {
                let (logp, ent) = if fused {
                    target_logprobs(hidden.as_tensor(), &head, &targets, 16)
                } else {
                    crate::model::cpu::composed(|| {
                        compute::target_logprobs(hidden.as_tensor(), &head, &targets, 16, true)
                    })
                }
                .unwrap();
                let loss = ((&logp * &coef).unwrap() + (&ent * 0.3).unwrap())
                    .unwrap()
                    .sum_all()
                    .unwrap();
                let g = loss
                    .backward()
                    .unwrap()
                    .get(hidden.as_tensor())
                    .unwrap()
                    .clone();
                (logp, ent, g)
            };
            let (lf, ef, gf) = run(true);
            let (lc, ec, gc) = run(false);
            let e = [
                fixtures::relative_diff(&lf, &lc),
                fixtures::relative_diff(&ef, &ec),
                fixtures::relative_diff(&gf, &gc),
            ];
            eprintln!("log-probs {dtype:?}: logp, entropy, grad {e:?}");
            assert!(
                e[0] <= tol && e[1] <= tol && e[2] <= tol * 2.0,
                "{dtype:?}: {e:?}"
            );
        }
    }
}
