//! SwiGLU `silu(gate) ⊙ up` on CUDA, forward and backward, the fused form of
//! [`crate::model::compute::swiglu`]: one elementwise pass each way where the composed
//! form makes four tensors forward and keeps them for a backward of six more.

use super::{
    Module, PushKernelArg, alloc, cuda, elementwise, launch, ptx, storage, tensor, view, with_dtype,
};
use candle_core::{CudaStorage, CustomOp2, Layout, Result, Shape, Tensor, bail};

const KERNELS: Module = Module {
    name: "rlhost_swiglu",
    ptx: ptx!("swiglu"),
};

/// `silu(gate) ⊙ up` for two tensors of one shape.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dims() != up.dims() || gate.dtype() != up.dtype() {
        bail!(
            "fused swiglu: gate {:?} {:?}, up {:?} {:?}",
            gate.dims(),
            gate.dtype(),
            up.dims(),
            up.dtype()
        );
    }
    let (gate, up) = (gate.contiguous()?, up.contiguous()?);
    if gate.track_op() || up.track_op() {
        gate.apply_op2(&up, SwiGlu)
    } else {
        gate.apply_op2_no_bwd(&up, &SwiGlu)
    }
}

/// `silu(gate) ⊙ up` of gate and up taken as one product, `gate_up: [rows, 2w]`, gate's
/// `w` columns first: `[rows, w]`, read in place (no copy of either half). No backward:
/// the joined product is the sampling forward's ([`crate::model::joint`]).
pub fn swiglu_joint(gate_up: &Tensor) -> Result<Tensor> {
    let (rows, w2) = gate_up.dims2()?;
    if w2 % 2 != 0 {
        bail!("joint swiglu: {w2} columns are not gate's and up's halves");
    }
    let gate_up = gate_up.contiguous()?;
    gate_up
        .apply_op1_no_bwd(&SwiGluJoint)?
        .reshape((rows, w2 / 2))
}

struct SwiGluJoint;

impl candle_core::CustomOp1 for SwiGluJoint {
    fn name(&self) -> &'static str {
        "fused-swiglu-joint"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        bail!("joint swiglu: CUDA only")
    }

    fn cuda_fwd(&self, gu: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (rows, w2) = l.shape().dims2()?;
        let w = w2 / 2;
        let dev = super::device(gu);
        let dtype = gu.dtype();
        with_dtype!(dtype, T => {
            let v = view::<T>(gu, l, "joint swiglu")?;
            let y = alloc::<T>(dev, rows * w)?;
            let (stream, func) = KERNELS.load(dev, "swiglu_joint_fwd", dtype)?;
            let mut args = stream.launch_builder(&func);
            let (rows64, w64) = (rows as i64, w as i64);
            args.arg(&v).arg(&y).arg(&rows64).arg(&w64);
            launch(&mut args, elementwise(rows * w))?;
            Ok((storage(y, dev), Shape::from((rows, w))))
        })
    }
}

struct SwiGlu;

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "fused-swiglu"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        bail!("fused swiglu: CUDA only")
    }

    fn cuda_fwd(
        &self,
        g: &CudaStorage,
        g_l: &Layout,
        u: &CudaStorage,
        u_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let n = g_l.shape().elem_count();
        let dev = super::device(g);
        let dtype = g.dtype();
        with_dtype!(dtype, T => {
            let gv = view::<T>(g, g_l, "swiglu")?;
            let uv = view::<T>(u, u_l, "swiglu")?;
            let y = alloc::<T>(dev, n)?;
            let (stream, func) = KERNELS.load(dev, "swiglu_fwd", dtype)?;
            let mut args = stream.launch_builder(&func);
            let n64 = n as i64;
            args.arg(&gv).arg(&uv).arg(&y).arg(&n64);
            launch(&mut args, elementwise(n))?;
            Ok((storage(y, dev), g_l.shape().clone()))
        })
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let n = gate.elem_count();
        let grad = grad.contiguous()?;
        let (g_guard, g_l) = gate.storage_and_layout();
        let gs = cuda(&g_guard, "swiglu backward")?;
        let (u_guard, u_l) = up.storage_and_layout();
        let us = cuda(&u_guard, "swiglu backward")?;
        let (d_guard, d_l) = grad.storage_and_layout();
        let ds = cuda(&d_guard, "swiglu backward")?;
        let dev = super::device(gs);
        with_dtype!(gate.dtype(), T => {
            let gv = view::<T>(gs, g_l, "swiglu backward")?;
            let uv = view::<T>(us, u_l, "swiglu backward")?;
            let dv = view::<T>(ds, d_l, "swiglu backward")?;
            let dg = alloc::<T>(dev, n)?;
            let du = alloc::<T>(dev, n)?;
            let (stream, func) = KERNELS.load(dev, "swiglu_bwd", gate.dtype())?;
            let mut args = stream.launch_builder(&func);
            let n64 = n as i64;
            args.arg(&gv).arg(&uv).arg(&dv).arg(&dg).arg(&du).arg(&n64);
            launch(&mut args, elementwise(n))?;
            Ok((
                Some(tensor(dg, dev, gate.shape().clone())),
                Some(tensor(du, dev, up.shape().clone())),
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{compute, fixtures};
    use candle_core::{DType, Var};

    /// The fused SwiGLU against the composed form on the GPU, values and both gradients,
    /// in f32, bf16 and f16. Skipped without `RLHOST_TEST_DEVICE=cuda`.
    #[test]
    fn fused_swiglu_matches_the_composed_form() {
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        let shape = [3, 11, 896];
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2), (DType::F16, 2e-3)] {
            let make = |s: u64| fixtures::uniform_on(&shape, s, 4.0, &dev, dtype);
            let gate = Var::from_tensor(&make(1)).unwrap();
            let up = Var::from_tensor(&make(2)).unwrap();
            let coef = make(3).to_dtype(DType::F32).unwrap();
            let run = |fused: bool| {
                let y = if fused {
                    swiglu(gate.as_tensor(), up.as_tensor())
                } else {
                    crate::model::cpu::composed(|| {
                        compute::swiglu(gate.as_tensor(), up.as_tensor())
                    })
                }
                .unwrap();
                let loss = (y.to_dtype(DType::F32).unwrap() * &coef)
                    .unwrap()
                    .sum_all()
                    .unwrap();
                let grads = loss.backward().unwrap();
                let g = |v: &Var| grads.get(v.as_tensor()).unwrap().clone();
                (y, g(&gate), g(&up))
            };
            let (yf, ggf, guf) = run(true);
            let (yc, ggc, guc) = run(false);
            let e = [
                fixtures::relative_diff(&yf, &yc),
                fixtures::relative_diff(&ggf, &ggc),
                fixtures::relative_diff(&guf, &guc),
            ];
            eprintln!("swiglu {dtype:?}: output, grad gate, grad up {e:?}");
            assert!(
                e[0] <= tol && e[1] <= tol * 2.0 && e[2] <= tol * 2.0,
                "{dtype:?}: {e:?}"
            );
        }
    }

    /// The joint form over `[gate, up]` side by side equals the fused kernel over the two
    /// halves to the bit (the same arithmetic; that kernel is held to the composed form
    /// above), in f32, bf16 and f16. Skipped without `RLHOST_TEST_DEVICE=cuda`.
    #[test]
    fn joint_swiglu_equals_the_fused_kernel_over_its_halves() {
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let gu = fixtures::uniform_on(&[5, 2 * 896], 4, 4.0, &dev, dtype);
            let joint = swiglu_joint(&gu).unwrap();
            let composed = swiglu(
                &gu.narrow(1, 0, 896).unwrap(),
                &gu.narrow(1, 896, 896).unwrap(),
            )
            .unwrap();
            let e = fixtures::max_diff(
                &joint.to_dtype(DType::F32).unwrap(),
                &composed.to_dtype(DType::F32).unwrap(),
            );
            eprintln!("joint swiglu {dtype:?}: max diff {e:e}");
            assert_eq!(e, 0.0, "{dtype:?}");
        }
    }
}
