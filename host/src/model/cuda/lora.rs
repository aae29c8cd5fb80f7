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
//! The gradients of A and B are written in f32 straight from cuBLAS's f32 accumulators.
//! Forward and backward are cuBLAS products into buffers of their own ([`super::gemm`]):
//! the base product, the bias and the adapter's share accumulate in the output, `dy W`
//! and `dlow A` in `dx`, so no `[N, out]` or `[N, in]` temporary is made.

use super::gemm::{Op, Operand, gemm};
use super::{cuda, with_dtype};
use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, bail};

/// `x Wᵀ + bias + s · (x Aᵀ) Bᵀ` for `x: [.., in]` in half precision, the frozen `w: [out,
/// in]` and `bias: [out]` in its dtype, `a: [r, in]` and `b: [out, r]` (f32). The result
/// tracks gradients to x, A and B where they do.
pub fn lora_linear(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scaling: f64,
) -> Result<Tensor> {
    let (r, in_f) = a.dims2()?;
    let (out_f, r_b) = b.dims2()?;
    if r_b != r
        || w.dims() != [out_f, in_f]
        || x.dim(candle_core::D::Minus1)? != in_f
        || bias.is_some_and(|b| b.elem_count() != out_f)
        || w.dtype() != x.dtype()
    {
        bail!(
            "fused lora: x {:?} {:?}, W {:?} {:?}, A {:?}, B {:?} do not chain",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype(),
            a.dims(),
            b.dims()
        );
    }
    let op = LoraLinear {
        w: w.contiguous()?,
        bias: bias
            .map(|b| b.to_dtype(x.dtype())?.contiguous())
            .transpose()?,
        scaling,
    };
    let (a, b) = (a.contiguous()?, b.contiguous()?);
    super::over_rows(x, in_f, out_f, |x2| {
        if x.track_op() || a.track_op() || b.track_op() {
            x2.apply_op3(&a, &b, op)
        } else {
            x2.apply_op3_no_bwd(&a, &b, &op)
        }
    })
}

struct LoraLinear {
    w: Tensor,
    bias: Option<Tensor>,
    scaling: f64,
}

/// `x Wᵀ + bias` for `x: [.., in]` in half precision with no gradient, as the fused
/// projection makes its base product: the bias's rows, then `+= x Wᵀ` by cuBLAS into the
/// same buffer, rounded once as PyTorch's `addmm` rounds. The composed form appends a
/// column of ones to x and the bias to W, a copy of the weight each call (a sampling
/// forward of the base model, the reference policy's forward).
pub fn biased_linear(x: &Tensor, w: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let (out_f, in_f) = w.dims2()?;
    if x.dim(candle_core::D::Minus1)? != in_f
        || bias.elem_count() != out_f
        || w.dtype() != x.dtype()
    {
        bail!(
            "biased linear: x {:?} {:?}, W {:?} {:?}, bias {:?} do not chain",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype(),
            bias.dims()
        );
    }
    let op = BiasedLinear {
        w: w.contiguous()?,
        bias: bias.to_dtype(x.dtype())?.contiguous()?,
    };
    super::over_rows(x, in_f, out_f, |x2| x2.apply_op1_no_bwd(&op))
}

struct BiasedLinear {
    w: Tensor,
    bias: Tensor,
}

impl candle_core::CustomOp1 for BiasedLinear {
    fn name(&self) -> &'static str {
        "biased-linear"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        bail!("biased linear: CUDA only")
    }

    fn cuda_fwd(&self, x: &CudaStorage, x_l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (rows, _) = x_l.shape().dims2()?;
        let out_f = self.w.dim(0)?;
        let c = base_product(x, x_l, &self.w, Some(&self.bias))?;
        Ok((c, Shape::from((rows, out_f))))
    }
}

/// `x Wᵀ (+ bias)` for `x: [rows, in]` into a fresh buffer: the bias's rows first, then the
/// product accumulated onto them (`beta = 1`), so that the sum is rounded once.
fn base_product(
    x: &CudaStorage,
    x_l: &Layout,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<CudaStorage> {
    let dev = super::device(x);
    let (rows, in_f) = x_l.shape().dims2()?;
    let out_f = w.dim(0)?;
    let mut c = buffer(dev, rows * out_f, x.dtype())?;
    let mut beta = 0.0;
    if let Some(bias) = bias {
        let (g, l) = bias.storage_and_layout();
        cuda(&g, "base product")?.copy_strided_src(&mut c, 0, &l.broadcast_as((rows, out_f))?)?;
        beta = 1.0;
    }
    let (w_guard, w_l) = w.storage_and_layout();
    let ws = cuda(&w_guard, "base product")?;
    gemm(
        dev,
        Operand {
            s: x,
            l: x_l,
            op: Op::N,
        },
        Operand {
            s: ws,
            l: w_l,
            op: Op::T,
        },
        &mut c,
        (rows, out_f, in_f),
        1.0,
        beta,
    )?;
    Ok(c)
}

/// An uninitialised contiguous buffer of `n` elements of `dtype`.
fn buffer(dev: &candle_core::CudaDevice, n: usize, dtype: DType) -> Result<CudaStorage> {
    with_dtype!(dtype, T => Ok(super::storage(super::alloc::<T>(dev, n)?, dev)))
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

    /// Into one buffer: the bias's rows, then `+= x Wᵀ`, then `+= s · (x Aᵀ) Bᵀ`, each
    /// product accumulated by cuBLAS with one rounding (the bias and the base product as
    /// PyTorch's `addmm` sums them).
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        x_l: &Layout,
        a: &CudaStorage,
        a_l: &Layout,
        b: &CudaStorage,
        b_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = super::device(x);
        let dt = x.dtype();
        let (rows, in_f) = x_l.shape().dims2()?;
        let (r, _) = a_l.shape().dims2()?;
        let (out_f, _) = b_l.shape().dims2()?;
        let mut c = base_product(x, x_l, &self.w, self.bias.as_ref())?;
        let xo = |op| Operand { s: x, l: x_l, op };
        // The adapter in the compute dtype: r · (in + out) elements cast per call, unless
        // it comes in that dtype already (a sampling set's pair cast once,
        // `AdapterSnapshot::cast`).
        let (a_cast, b_cast);
        let (a_h, a_hl) = if a.dtype() == dt {
            (a, a_l.clone())
        } else {
            a_cast = a.to_dtype(a_l, dt)?;
            (&a_cast, Layout::contiguous((r, in_f)))
        };
        let (b_h, b_hl) = if b.dtype() == dt {
            (b, b_l.clone())
        } else {
            b_cast = b.to_dtype(b_l, dt)?;
            (&b_cast, Layout::contiguous((out_f, r)))
        };
        let mut low = buffer(dev, rows * r, dt)?;
        gemm(
            dev,
            xo(Op::N),
            Operand {
                s: a_h,
                l: &a_hl,
                op: Op::T,
            },
            &mut low,
            (rows, r, in_f),
            1.0,
            0.0,
        )?;
        let low_l = Layout::contiguous((rows, r));
        gemm(
            dev,
            Operand {
                s: &low,
                l: &low_l,
                op: Op::N,
            },
            Operand {
                s: b_h,
                l: &b_hl,
                op: Op::T,
            },
            &mut c,
            (rows, out_f, r),
            self.scaling as f32,
            1.0,
        )?;
        Ok((c, Shape::from((rows, out_f))))
    }

    /// Unsloth's derivation (the module header), each product through cuBLAS: `dx` in one
    /// buffer (`dy W`, then `+= dlow A`), `dA` and `dB` written in f32 from f32
    /// accumulators.
    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _out: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dt = x.dtype();
        let (rows, in_f) = x.dims2()?;
        let (r, _) = a.dims2()?;
        let (out_f, _) = b.dims2()?;
        let dy = dy.contiguous()?;
        let a_h = a.detach().to_dtype(dt)?.contiguous()?;
        let b_h = b.detach().to_dtype(dt)?.contiguous()?;
        let (dy_g, dy_l) = dy.storage_and_layout();
        let dys = cuda(&dy_g, "fused lora backward")?;
        let (a_g, a_l) = a_h.storage_and_layout();
        let ah = cuda(&a_g, "fused lora backward")?;
        let (b_g, b_l) = b_h.storage_and_layout();
        let bh = cuda(&b_g, "fused lora backward")?;
        let (x_g, x_l) = x.storage_and_layout();
        let xs = cuda(&x_g, "fused lora backward")?;
        let dev = super::device(xs);
        let s = self.scaling as f32;
        // dlow = s · dy B  [rows, r]
        let mut dlow = buffer(dev, rows * r, dt)?;
        let dlow_l = Layout::contiguous((rows, r));
        gemm(
            dev,
            Operand {
                s: dys,
                l: dy_l,
                op: Op::N,
            },
            Operand {
                s: bh,
                l: b_l,
                op: Op::N,
            },
            &mut dlow,
            (rows, r, out_f),
            s,
            0.0,
        )?;
        let dx = if x.track_op() {
            // dx = dy W + dlow A  [rows, in]
            let (w_g, w_l) = self.w.storage_and_layout();
            let w = cuda(&w_g, "fused lora backward")?;
            let mut dx = buffer(dev, rows * in_f, dt)?;
            gemm(
                dev,
                Operand {
                    s: dys,
                    l: dy_l,
                    op: Op::N,
                },
                Operand {
                    s: w,
                    l: w_l,
                    op: Op::N,
                },
                &mut dx,
                (rows, in_f, out_f),
                1.0,
                0.0,
            )?;
            gemm(
                dev,
                Operand {
                    s: &dlow,
                    l: &dlow_l,
                    op: Op::N,
                },
                Operand {
                    s: ah,
                    l: a_l,
                    op: Op::N,
                },
                &mut dx,
                (rows, in_f, r),
                1.0,
                1.0,
            )?;
            Some(wrap(dx, (rows, in_f)))
        } else {
            None
        };
        let (da, db) = if a.track_op() || b.track_op() {
            // low = x Aᵀ  [rows, r], recomputed
            let mut low = buffer(dev, rows * r, dt)?;
            let low_l = Layout::contiguous((rows, r));
            gemm(
                dev,
                Operand {
                    s: xs,
                    l: x_l,
                    op: Op::N,
                },
                Operand {
                    s: ah,
                    l: a_l,
                    op: Op::T,
                },
                &mut low,
                (rows, r, in_f),
                1.0,
                0.0,
            )?;
            // dA = dlowᵀ x  [r, in], dB = s · dyᵀ low  [out, r], in f32
            let mut da = buffer(dev, r * in_f, DType::F32)?;
            gemm(
                dev,
                Operand {
                    s: &dlow,
                    l: &dlow_l,
                    op: Op::T,
                },
                Operand {
                    s: xs,
                    l: x_l,
                    op: Op::N,
                },
                &mut da,
                (r, in_f, rows),
                1.0,
                0.0,
            )?;
            let mut db = buffer(dev, out_f * r, DType::F32)?;
            gemm(
                dev,
                Operand {
                    s: dys,
                    l: dy_l,
                    op: Op::T,
                },
                Operand {
                    s: &low,
                    l: &low_l,
                    op: Op::N,
                },
                &mut db,
                (out_f, r, rows),
                s,
                0.0,
            )?;
            (
                Some(wrap(da, (r, in_f)).to_dtype(a.dtype())?),
                Some(wrap(db, (out_f, r)).to_dtype(b.dtype())?),
            )
        } else {
            (None, None)
        };
        Ok((dx, da, db))
    }
}

/// A storage as a tensor with no gradient graph.
fn wrap(s: CudaStorage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(
        candle_core::Storage::Cuda(s),
        shape,
        candle_core::op::BackpropOp::none(),
        false,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures;
    use candle_core::Var;

    /// The biased product without a gradient against the composed form (a column of ones
    /// on x, the bias on W: one rounding either way), in bf16 and f16, over `[2, 37, ·]`
    /// rows. Skipped without `RLHOST_TEST_DEVICE=cuda`.
    #[test]
    fn biased_linear_matches_the_composed_form() {
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        let (rows, in_f, out_f) = (37, 96, 160);
        for (dtype, tol) in [(DType::BF16, 1e-2), (DType::F16, 2e-3)] {
            let x = fixtures::uniform_on(&[2, rows, in_f], 1, 1.0, &dev, dtype);
            let w = fixtures::uniform_on(&[out_f, in_f], 2, 0.1, &dev, dtype);
            let bias = fixtures::uniform_on(&[out_f], 3, 1.0, &dev, dtype);
            let fused = biased_linear(&x, &w, &bias).unwrap();
            let ones = Tensor::ones((2, rows, 1), dtype, &dev).unwrap();
            let composed = Tensor::cat(&[&x, &ones], 2)
                .unwrap()
                .broadcast_matmul(
                    &Tensor::cat(&[&w, &bias.unsqueeze(1).unwrap()], 1)
                        .unwrap()
                        .t()
                        .unwrap(),
                )
                .unwrap();
            assert_eq!(fused.dims(), [2, rows, out_f]);
            let e = fixtures::relative_diff(&fused, &composed);
            eprintln!("biased linear {dtype:?}: {e:.2e} from the composed form");
            assert!(e <= tol, "{dtype:?}: {e}");
        }
    }

    /// The fused projection against the same sum from candle's differentiable ops in the
    /// same dtype on the GPU, with and without a bias: values and the gradients of x, A and
    /// B, in bf16 and f16. Skipped without `RLHOST_TEST_DEVICE=cuda`.
    #[test]
    fn fused_lora_linear_matches_the_composed_sum() {
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        let (rows, in_f, out_f, r, s) = (37, 96, 160, 8, 2.0);
        for (dtype, tol) in [(DType::BF16, 1.5e-2), (DType::F16, 3e-3)] {
            for with_bias in [false, true] {
                let make = |shape: &[usize], seed: u64| {
                    fixtures::uniform(shape, seed).to_device(&dev).unwrap()
                };
                let x =
                    Var::from_tensor(&make(&[2, rows, in_f], 1).to_dtype(dtype).unwrap()).unwrap();
                let w = (make(&[out_f, in_f], 2) * 0.1)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let bias = with_bias.then(|| make(&[out_f], 6).to_dtype(dtype).unwrap());
                let a = Var::from_tensor(&make(&[r, in_f], 3)).unwrap();
                let b = Var::from_tensor(&(make(&[out_f, r], 4) * 0.5).unwrap()).unwrap();
                let coef = make(&[2, rows, out_f], 5);
                let run = |fused: bool| {
                    let xt = x.as_tensor();
                    let y = if fused {
                        lora_linear(xt, &w, bias.as_ref(), a.as_tensor(), b.as_tensor(), s).unwrap()
                    } else {
                        let low = xt
                            .broadcast_matmul(&a.as_tensor().to_dtype(dtype).unwrap().t().unwrap())
                            .unwrap();
                        let delta = (low * s)
                            .unwrap()
                            .broadcast_matmul(&b.as_tensor().to_dtype(dtype).unwrap().t().unwrap())
                            .unwrap();
                        let base = crate::model::ops::frozen_linear(xt, &w).unwrap();
                        let base = match &bias {
                            Some(bias) => base.broadcast_add(bias).unwrap(),
                            None => base,
                        };
                        (base + delta).unwrap()
                    };
                    let loss = (y.to_dtype(DType::F32).unwrap() * &coef)
                        .unwrap()
                        .sum_all()
                        .unwrap();
                    let grads = loss.backward().unwrap();
                    let g = |t: &Tensor| grads.get(t).unwrap().clone();
                    (y, [g(xt), g(a.as_tensor()), g(b.as_tensor())])
                };
                let (yf, gf) = run(true);
                let (yc, gc) = run(false);
                let e = fixtures::relative_diff(&yf, &yc);
                eprintln!("lora linear {dtype:?} bias {with_bias}: output {e:.2e}");
                assert!(e <= tol, "{dtype:?}: output {e}");
                for (name, (f, c)) in ["x", "A", "B"].iter().zip(gf.iter().zip(&gc)) {
                    assert_eq!(f.dtype(), c.dtype(), "{name}");
                    let e = fixtures::relative_diff(f, c);
                    eprintln!("lora linear {dtype:?} bias {with_bias}: grad {name} {e:.2e}");
                    assert!(e <= tol * 2.0, "{dtype:?}: grad {name} {e}");
                }
            }
        }
    }

    /// An NF4 projection in half precision on the GPU (`compute::lora_linear`: the weight
    /// dequantized to the compute dtype, the fused op) against the composed NF4 path, which
    /// computes the base product in f32 and the adapter in f32: values and the gradients
    /// of x, A and B, bf16 and f16, held to the dense projection's tolerances. Without a
    /// GPU (as on the CPU) the two are the same path. Skipped without
    /// `RLHOST_TEST_DEVICE=cuda`.
    #[test]
    fn an_nf4_projection_takes_the_fused_op_in_half_precision() {
        use crate::model::lora::{Linear, Lora, LoraConfig, Mode, seeded};
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        let (rows, in_f, out_f) = (37, 128, 192);
        for (dtype, tol) in [(DType::BF16, 1.5e-2), (DType::F16, 3e-3)] {
            let w = (fixtures::uniform(&[out_f, in_f], 2) * 0.1).unwrap();
            let mut lin = Linear::new(w.to_device(&dev).unwrap(), None);
            lin.quantize_nf4(true).unwrap();
            let cfg = LoraConfig {
                r: 8,
                ..LoraConfig::default()
            };
            let mut lora = Lora::init(in_f, out_f, &cfg, &mut seeded(3), &dev).unwrap();
            // B away from zero, so that its gradient and the adapter's share are not trivial.
            lora.lora_b = Var::from_tensor(
                &(fixtures::uniform(&[out_f, 8], 4) * 0.5)
                    .unwrap()
                    .to_device(&dev)
                    .unwrap(),
            )
            .unwrap();
            lin.lora = Some(lora);
            let x = Var::from_tensor(
                &fixtures::uniform(&[2, rows, in_f], 1)
                    .to_device(&dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
            )
            .unwrap();
            let coef = fixtures::uniform(&[2, rows, out_f], 5)
                .to_device(&dev)
                .unwrap();
            let l = lin.lora.as_ref().unwrap();
            let run = |fused: bool| {
                let forward =
                    || crate::model::compute::lora_linear(&lin, x.as_tensor(), Mode::TRAIN);
                let y = if fused {
                    forward()
                } else {
                    crate::model::cpu::composed(forward)
                }
                .unwrap();
                let loss = (y.to_dtype(DType::F32).unwrap() * &coef)
                    .unwrap()
                    .sum_all()
                    .unwrap();
                let grads = loss.backward().unwrap();
                let g = |t: &Tensor| grads.get(t).unwrap().clone();
                (
                    y,
                    [
                        g(x.as_tensor()),
                        g(l.lora_a.as_tensor()),
                        g(l.lora_b.as_tensor()),
                    ],
                )
            };
            let (yf, gf) = run(true);
            let (yc, gc) = run(false);
            let e = fixtures::relative_diff(&yf, &yc);
            eprintln!("nf4 lora linear {dtype:?}: output {e:.2e}");
            assert!(e <= tol, "{dtype:?}: output {e}");
            for (name, (f, c)) in ["x", "A", "B"].iter().zip(gf.iter().zip(&gc)) {
                let e = fixtures::relative_diff(f, c);
                eprintln!("nf4 lora linear {dtype:?}: grad {name} {e:.2e}");
                assert!(e <= tol * 2.0, "{dtype:?}: grad {name} {e}");
            }
        }
    }
}
