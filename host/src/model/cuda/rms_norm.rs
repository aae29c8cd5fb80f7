//! RMSNorm over the last dim with a frozen weight on CUDA, forward and backward, the
//! fused form of [`crate::model::compute::rms_norm`] (and, for sampling, the residual add
//! before it in the same pass, [`add_rms_norm`]): one pass over each row where the
//! composed form makes seven tensors (an f32 copy, its square, the mean, the root, the
//! reciprocal, the product, the cast) and keeps most of them for the backward. It rounds
//! where transformers rounds (`rms_norm.cu` has the equations); the weight gets no
//! gradient (norm weights are frozen under LoRA).

use super::{
    Module, PushKernelArg, alloc, cuda, launch, per_row, ptx, row_threads, storage, tensor, view,
    with_dtype,
};
use candle_core::{CudaStorage, CustomOp1, Layout, Result, Shape, Tensor, bail};

const KERNELS: Module = Module {
    name: "rlhost_rms_norm",
    ptx: ptx!("rms_norm"),
};

/// `w ⊙ x / √(mean(x²) + eps)` over the last dim of `x`; `w` has that many elements.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let n = x.dim(candle_core::D::Minus1)?;
    if w.elem_count() != n {
        bail!("fused rms_norm: weight {:?} for rows of {n}", w.dims());
    }
    let op = RmsNorm {
        w: w.to_dtype(x.dtype())?.contiguous()?,
        eps: eps as f32,
    };
    let x = x.contiguous()?;
    if x.track_op() {
        x.apply_op1(op)
    } else {
        x.apply_op1_no_bwd(&op)
    }
}

/// `(s, rms_norm(s))` for `s = x + a` in one pass, where no gradient is wanted (the
/// decoder's residual add and the next norm, in sampling): the sum rounded to the
/// compute dtype as the composed add rounds it, then the norm as [`rms_norm`] computes it.
pub fn add_rms_norm(x: &Tensor, a: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let n = x.dim(candle_core::D::Minus1)?;
    if a.shape() != x.shape() || a.dtype() != x.dtype() || w.elem_count() != n {
        bail!(
            "fused add_rms_norm: {:?} + {:?}, weight {:?}",
            x.dims(),
            a.dims(),
            w.dims()
        );
    }
    let rows = x.elem_count() / n.max(1);
    let (x, a) = (x.contiguous()?, a.contiguous()?);
    let w = w.to_dtype(x.dtype())?.contiguous()?;
    let (x_guard, x_l) = x.storage_and_layout();
    let (a_guard, a_l) = a.storage_and_layout();
    let (w_guard, w_l) = w.storage_and_layout();
    let xs = cuda(&x_guard, "add_rms_norm")?;
    let dev = super::device(xs);
    with_dtype!(x.dtype(), T => {
        let xv = view::<T>(xs, x_l, "add_rms_norm")?;
        let av = view::<T>(cuda(&a_guard, "add_rms_norm")?, a_l, "add_rms_norm")?;
        let wv = view::<T>(cuda(&w_guard, "add_rms_norm")?, w_l, "add_rms_norm")?;
        let sum = alloc::<T>(dev, rows * n)?;
        let y = alloc::<T>(dev, rows * n)?;
        let (stream, func) = KERNELS.load(dev, "add_rms_norm_fwd", x.dtype())?;
        let mut args = stream.launch_builder(&func);
        let n32 = n as i32;
        let eps = eps as f32;
        args.arg(&xv).arg(&av).arg(&wv).arg(&sum).arg(&y).arg(&n32).arg(&eps);
        launch(&mut args, per_row(rows, row_threads(n)))?;
        Ok((tensor(sum, dev, x.shape().clone()), tensor(y, dev, x.shape().clone())))
    })
}

struct RmsNorm {
    w: Tensor,
    eps: f32,
}

impl CustomOp1 for RmsNorm {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        bail!("fused rms_norm: CUDA only")
    }

    fn cuda_fwd(&self, x: &CudaStorage, x_l: &Layout) -> Result<(CudaStorage, Shape)> {
        let n = x_l.dims().last().copied().unwrap_or(1);
        let rows = x_l.shape().elem_count() / n.max(1);
        let (w_guard, w_l) = self.w.storage_and_layout();
        let w = cuda(&w_guard, "rms_norm")?;
        let dev = super::device(x);
        let dtype = self.w.dtype();
        with_dtype!(dtype, T => {
            let xv = view::<T>(x, x_l, "rms_norm")?;
            let wv = view::<T>(w, w_l, "rms_norm")?;
            let y = alloc::<T>(dev, rows * n)?;
            let (stream, func) = KERNELS.load(dev, "rms_norm_fwd", dtype)?;
            let mut args = stream.launch_builder(&func);
            let n32 = n as i32;
            args.arg(&xv).arg(&wv).arg(&y).arg(&n32).arg(&self.eps);
            launch(&mut args, per_row(rows, row_threads(n)))?;
            Ok((storage(y, dev), x_l.shape().clone()))
        })
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let n = x.dim(candle_core::D::Minus1)?;
        let rows = x.elem_count() / n.max(1);
        let grad = grad.contiguous()?;
        let (x_guard, x_l) = x.storage_and_layout();
        let xs = cuda(&x_guard, "rms_norm backward")?;
        let (w_guard, w_l) = self.w.storage_and_layout();
        let w = cuda(&w_guard, "rms_norm backward")?;
        let (g_guard, g_l) = grad.storage_and_layout();
        let g = cuda(&g_guard, "rms_norm backward")?;
        let dev = super::device(xs);
        with_dtype!(x.dtype(), T => {
            let xv = view::<T>(xs, x_l, "rms_norm backward")?;
            let wv = view::<T>(w, w_l, "rms_norm backward")?;
            let gv = view::<T>(g, g_l, "rms_norm backward")?;
            let dx = alloc::<T>(dev, rows * n)?;
            let (stream, func) = KERNELS.load(dev, "rms_norm_bwd", x.dtype())?;
            let mut args = stream.launch_builder(&func);
            let n32 = n as i32;
            args.arg(&xv).arg(&wv).arg(&gv).arg(&dx).arg(&n32).arg(&self.eps);
            launch(&mut args, per_row(rows, row_threads(n)))?;
            Ok(Some(tensor(dx, dev, x.shape().clone())))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{compute, fixtures};
    use candle_core::{DType, Var};

    /// The residual add and norm in one pass against the composed add then norm on the
    /// GPU, in f32, bf16 and f16. Skipped without `RLHOST_TEST_DEVICE=cuda`.
    #[test]
    fn fused_add_rms_norm_matches_the_composed_form() {
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let make = |shape: &[usize], s: u64| fixtures::uniform_on(shape, s, 1.0, &dev, dtype);
            let (x, a) = ((make(&[64, 1536], 1) * 3.0).unwrap(), make(&[64, 1536], 2));
            let w = (make(&[1536], 3) + 1.0).unwrap();
            let (sum, y) = add_rms_norm(&x, &a, &w, 1e-6).unwrap();
            let (want_sum, want_y) = crate::model::cpu::composed(|| {
                let s = (&x + &a)?;
                let y = compute::rms_norm(&s, &w, 1e-6)?;
                Ok::<_, candle_core::Error>((s, y))
            })
            .unwrap();
            let (es, ey) = (
                fixtures::relative_diff(&sum, &want_sum),
                fixtures::relative_diff(&y, &want_y),
            );
            eprintln!("add_rms_norm {dtype:?}: sum {es:.2e}, norm {ey:.2e}");
            assert!(es == 0.0 && ey <= 1e-2, "{dtype:?}: {es} {ey}");
        }
    }

    /// The fused RMSNorm against the composed form on the GPU, values and input
    /// gradients, rows of 1536 and 128 (a hidden state and a Qwen3 head), in f32, bf16 and
    /// f16. Skipped without `RLHOST_TEST_DEVICE=cuda`.
    #[test]
    fn fused_rms_norm_matches_the_composed_form() {
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        for (shape, n) in [(vec![3, 7, 1536], 1536), (vec![2, 5, 4, 128], 128)] {
            for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2), (DType::F16, 2e-3)] {
                let make =
                    |shape: &[usize], s: u64| fixtures::uniform_on(shape, s, 1.0, &dev, dtype);
                let x = Var::from_tensor(&(make(&shape, 1) * 3.0).unwrap()).unwrap();
                let w = (make(&[n], 2) + 1.0).unwrap();
                let coef = make(&shape, 3).to_dtype(DType::F32).unwrap();
                let run = |fused: bool| {
                    let y = if fused {
                        rms_norm(x.as_tensor(), &w, 1e-6)
                    } else {
                        crate::model::cpu::composed(|| compute::rms_norm(x.as_tensor(), &w, 1e-6))
                    }
                    .unwrap();
                    let loss = (y.to_dtype(DType::F32).unwrap() * &coef)
                        .unwrap()
                        .sum_all()
                        .unwrap();
                    let g = loss.backward().unwrap().get(x.as_tensor()).unwrap().clone();
                    (y, g)
                };
                let (yf, gf) = run(true);
                let (yc, gc) = run(false);
                let (ey, eg) = (
                    fixtures::relative_diff(&yf, &yc),
                    fixtures::relative_diff(&gf, &gc),
                );
                eprintln!("rms_norm {shape:?} {dtype:?}: output {ey:.2e}, grad {eg:.2e}");
                assert!(
                    ey <= tol && eg <= tol * 2.0,
                    "{shape:?} {dtype:?}: {ey} {eg}"
                );
            }
        }
    }
}
