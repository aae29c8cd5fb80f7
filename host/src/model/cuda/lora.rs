//! A projection with its LoRA adapter on CUDA in half precision, `y = x Wᵀ (+ bias) +
//! s · (x Aᵀ) Bᵀ`, as one graph node: the adapter's products in the compute dtype (cuBLAS,
//! f32 accumulation) from f32 master weights cast per call (r · (in + out) elements), and
//! its own backward, so that a projection keeps only its input and its output for the
//! backward where the composed form keeps the base product, the delta and their sum
//! (3 × 147 MB for each MLP projection of the 1.5B shape at 8 × 1024 tokens). Unsloth's
//! `fast_lora.py` derivation, with `dy` the incoming gradient `[N, out]`:
//!   dlow = s · dy B          [N, r]
//!   dx   = dy W + dlow A     [N, in]   (W frozen: no gradient of its own)
//!   dA   = dlowᵀ x           [r, in]
//!   dB   = s · dyᵀ (x Aᵀ)    [out, r]  (x Aᵀ recomputed: N · r elements)
//! The gradients of A and B come back in their own dtype (f32), rounded once from the
//! compute dtype's products, as PEFT's mixed precision has them.

use candle_core::{CustomOp3, Layout, Result, Shape, Tensor, bail};
use std::sync::Mutex;

/// `base + s · (x Aᵀ) Bᵀ` where `base = x Wᵀ (+ bias)` was computed by the caller without a
/// gradient graph; `x: [.., in]` in half precision, `w: [out, in]` frozen, `a: [r, in]`,
/// `b: [out, r]` (f32). The result tracks gradients to x, A and B where they do.
pub fn lora_linear(
    x: &Tensor,
    base: &Tensor,
    w: &Tensor,
    a: &Tensor,
    b: &Tensor,
    scaling: f64,
) -> Result<Tensor> {
    let dt = x.dtype();
    let (r, in_f) = a.dims2()?;
    let (out_f, r_b) = b.dims2()?;
    if r_b != r || w.dims() != [out_f, in_f] || x.dim(candle_core::D::Minus1)? != in_f {
        bail!(
            "fused lora: x {:?}, W {:?}, A {:?}, B {:?} do not chain",
            x.dims(),
            w.dims(),
            a.dims(),
            b.dims()
        );
    }
    let rows = x.elem_count() / in_f;
    let x2 = x.reshape((rows, in_f))?;
    let low = x2.detach().matmul(&a.to_dtype(dt)?.t()?)?;
    let delta = (low * scaling)?.matmul(&b.to_dtype(dt)?.t()?)?;
    let out = (base.detach().reshape((rows, out_f))? + delta)?;
    let out = if x.track_op() || a.track_op() || b.track_op() {
        x2.apply_op3(
            a,
            b,
            LoraLinear {
                value: Mutex::new(Some(out)),
                w: w.clone(),
                scaling,
            },
        )?
    } else {
        out
    };
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("x has at least one dim") = out_f;
    out.reshape(dims)
}

struct LoraLinear {
    /// The forward's result, computed before the op is applied and handed over once.
    value: Mutex<Option<Tensor>>,
    w: Tensor,
    scaling: f64,
}

impl CustomOp3 for LoraLinear {
    fn name(&self) -> &'static str {
        "fused-lora-linear"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        bail!("fused lora: CUDA only (the CPU has model/cpu/lora_op.rs)")
    }

    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let value = self
            .value
            .lock()
            .map_err(|_| candle_core::Error::Msg("fused lora: poisoned".into()))?
            .take();
        let Some(value) = value else {
            bail!("fused lora: forward ran twice")
        };
        let (guard, layout) = value.storage_and_layout();
        // candle wants the op's storage by value: one copy of the output, the cost of the
        // add the composed form makes anyway.
        let copy = super::cuda(&guard, "fused lora")?.try_clone(layout)?;
        Ok((copy, value.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _out: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dt = x.dtype();
        let need_dx = x.track_op();
        let x = x.detach();
        let dy = dy.contiguous()?;
        let a_h = a.detach().to_dtype(dt)?;
        let b_h = b.detach().to_dtype(dt)?;
        let dlow = (dy.matmul(&b_h)? * self.scaling)?;
        let dx = if need_dx {
            Some((dy.matmul(&self.w)? + dlow.matmul(&a_h)?)?)
        } else {
            None
        };
        let (da, db) = if a.track_op() || b.track_op() {
            let low = x.matmul(&a_h.t()?)?;
            let db = (dy.t()?.matmul(&low)? * self.scaling)?.to_dtype(b.dtype())?;
            let da = dlow.t()?.matmul(&x)?.to_dtype(a.dtype())?;
            (Some(da), Some(db))
        } else {
            (None, None)
        };
        Ok((dx, da, db))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures;
    use candle_core::{DType, Var};

    /// The fused projection against the same sum from candle's differentiable ops in the
    /// same dtype on the GPU: values and the gradients of x, A and B, in bf16 and f16.
    /// Skipped without `RLHOST_TEST_DEVICE=cuda`.
    #[test]
    fn fused_lora_linear_matches_the_composed_sum() {
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        let (rows, in_f, out_f, r, s) = (37, 96, 160, 8, 2.0);
        for (dtype, tol) in [(DType::BF16, 1.5e-2), (DType::F16, 3e-3)] {
            let make = |shape: &[usize], seed: u64| fixtures::uniform(shape, seed).to_device(&dev).unwrap();
            let x = Var::from_tensor(&make(&[rows, in_f], 1).to_dtype(dtype).unwrap()).unwrap();
            let w = (make(&[out_f, in_f], 2) * 0.1).unwrap().to_dtype(dtype).unwrap();
            let a = Var::from_tensor(&make(&[r, in_f], 3)).unwrap();
            let b = Var::from_tensor(&(make(&[out_f, r], 4) * 0.5).unwrap()).unwrap();
            let coef = make(&[rows, out_f], 5);
            let run = |fused: bool| {
                let xt = x.as_tensor();
                let base = xt.detach().matmul(&w.t().unwrap()).unwrap();
                let y = if fused {
                    lora_linear(xt, &base, &w, a.as_tensor(), b.as_tensor(), s).unwrap()
                } else {
                    let low = xt.matmul(&a.as_tensor().to_dtype(dtype).unwrap().t().unwrap()).unwrap();
                    let delta = (low * s)
                        .unwrap()
                        .matmul(&b.as_tensor().to_dtype(dtype).unwrap().t().unwrap())
                        .unwrap();
                    (crate::model::ops::frozen_linear(xt, &w).unwrap() + delta).unwrap()
                };
                let loss = (y.to_dtype(DType::F32).unwrap() * &coef).unwrap().sum_all().unwrap();
                let grads = loss.backward().unwrap();
                let g = |t: &Tensor| grads.get(t).unwrap().clone();
                (y, [g(xt), g(a.as_tensor()), g(b.as_tensor())])
            };
            let (yf, gf) = run(true);
            let (yc, gc) = run(false);
            let e = fixtures::relative_diff(&yf, &yc);
            eprintln!("lora linear {dtype:?}: output {e:.2e}");
            assert!(e <= tol, "{dtype:?}: output {e}");
            for (name, (f, c)) in ["x", "A", "B"].iter().zip(gf.iter().zip(&gc)) {
                assert_eq!(f.dtype(), c.dtype(), "{name}");
                let e = fixtures::relative_diff(f, c);
                eprintln!("lora linear {dtype:?}: grad {name} {e:.2e}");
                assert!(e <= tol * 2.0, "{dtype:?}: grad {name} {e}");
            }
        }
    }
}
