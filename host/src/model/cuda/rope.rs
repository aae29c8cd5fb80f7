//! Projected heads placed for attention and rotated, on CUDA, forward and backward: the
//! fused form of [`crate::model::compute::rope_heads`] with a rotation. `[B, T, n·d]` in,
//! `[B, g, (n/g)·T, d]` out (the same memory as `[B, n, T, d]`), rotated by `cos`,
//! `sin: [B, T, d/2]` in transformers' `rotate_half` form: one pass where the composed
//! form transposes into a copy and then makes seven tensors (two halves, a negation, a
//! concatenation, two products, a sum); its backward rotates back and lays the gradient
//! out as the input lay, in one pass too.

use super::{
    Module, PushKernelArg, alloc, cuda, elementwise, launch, ptx, storage, view, with_dtype,
};
use candle_core::{CudaStorage, CustomOp1, Layout, Result, Shape, Tensor, bail};

const KERNELS: Module = Module {
    name: "rlhost_rope",
    ptx: ptx!("rope"),
};

/// `y: [B, T, n·d]` (or `[B, T, n, d]`) → rotated heads `[B, groups, (n/groups)·T, d]`.
pub fn rope_heads(
    y: &Tensor,
    n: usize,
    groups: usize,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let (b, t) = (y.dim(0)?, y.dim(1)?);
    let d = y.elem_count() / (b * t * n);
    if !d.is_multiple_of(2)
        || b * t * n * d != y.elem_count()
        || cos.elem_count() != b * t * d / 2
        || !n.is_multiple_of(groups)
    {
        bail!(
            "fused rope: heads {:?} as {n} heads of {d}, tables {:?}, {groups} groups",
            y.dims(),
            cos.dims()
        );
    }
    let op = Rope::new(y, cos, sin, [b, t, n, d])?;
    let y = y.contiguous()?;
    let out = if y.track_op() {
        y.apply_op1(op)?
    } else {
        y.apply_op1_no_bwd(&op)?
    };
    out.reshape((b, groups, n / groups * t, d))
}

/// Rotated heads `[rows, n, 1, d]` of `y: [rows, n·d]`, one position a row, whose rows
/// may be wider apart than `n · d` (q or k as columns of q/k/v taken as one product):
/// read in place, no copy first. Sampling only (no backward).
pub fn rope_rows_strided(y: &Tensor, n: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (rows, width) = y.dims2()?;
    let d = width / n;
    let stride = y.stride();
    if n * d != width || !d.is_multiple_of(2) || stride[1] != 1 || cos.elem_count() != rows * d / 2
    {
        bail!(
            "strided rope: rows {:?} (strides {stride:?}) as {n} heads, tables {:?}",
            y.dims(),
            cos.dims()
        );
    }
    let op = Rope::new(y, cos, sin, [rows, 1, n, d])?;
    y.apply_op1_no_bwd(&op)?.reshape((rows, n, 1, d))
}

struct Rope {
    cos: Tensor,
    sin: Tensor,
    /// `[B, T, n, d]`.
    dims: [usize; 4],
}

impl Rope {
    /// The op over `y`'s heads `dims` (`[B, T, n, d]`), its tables in `y`'s dtype.
    fn new(y: &Tensor, cos: &Tensor, sin: &Tensor, dims: [usize; 4]) -> Result<Rope> {
        Ok(Rope {
            cos: cos.to_dtype(y.dtype())?.contiguous()?,
            sin: sin.to_dtype(y.dtype())?.contiguous()?,
            dims,
        })
    }

    /// Runs `kernel` from `src` (forward: `[B, T, n, d]`, its `B · T` rows of `n · d`
    /// elements possibly further apart; backward: `[B, n, T, d]`, contiguous).
    fn run(&self, kernel: &str, src: &CudaStorage, src_l: &Layout) -> Result<CudaStorage> {
        use candle_core::backend::BackendStorage;
        let [b, t, n, d] = self.dims;
        let (c_guard, c_l) = self.cos.storage_and_layout();
        let c = cuda(&c_guard, "rope")?;
        let (s_guard, s_l) = self.sin.storage_and_layout();
        let s = cuda(&s_guard, "rope")?;
        let dev = super::device(src);
        let dtype = src.dtype();
        let total = b * t * n * d;
        // The rows' spacing: a contiguous source's `n · d`, or a wider one whose rows are
        // the leading columns of a larger product ([`rope_rows_strided`]).
        let (first, stride) = match src_l.contiguous_offsets() {
            Some((first, _)) => (first, n * d),
            None => {
                let st = src_l.stride();
                if src_l.dims().len() != 2 || st[1] != 1 || t != 1 {
                    bail!(
                        "rope: rows {:?} of strides {st:?} are not one position each",
                        src_l.dims()
                    );
                }
                (src_l.start_offset(), st[0])
            }
        };
        let span = match b * t {
            0 => 0,
            rows => (rows - 1) * stride + n * d,
        };
        with_dtype!(dtype, T => {
            let xv = src.as_cuda_slice::<T>()?.slice(first..first + span);
            let cv = view::<T>(c, c_l, "rope")?;
            let sv = view::<T>(s, s_l, "rope")?;
            let out = alloc::<T>(dev, total)?;
            let (stream, func) = KERNELS.load(dev, kernel, dtype)?;
            let mut args = stream.launch_builder(&func);
            let [b32, t32, n32, d32] = [b as i32, t as i32, n as i32, d as i32];
            let stride64 = stride as i64;
            args.arg(&xv).arg(&cv).arg(&sv).arg(&out).arg(&b32).arg(&t32).arg(&n32).arg(&d32);
            // The backward's entry takes no stride: its gradient is contiguous.
            if kernel.ends_with("_fwd") {
                args.arg(&stride64);
            }
            launch(&mut args, elementwise(total / 2))?;
            Ok(storage(out, dev))
        })
    }
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "fused-rope-heads"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        bail!("fused rope: CUDA only")
    }

    fn cuda_fwd(&self, y: &CudaStorage, y_l: &Layout) -> Result<(CudaStorage, Shape)> {
        let [b, t, n, d] = self.dims;
        Ok((
            self.run("rope_heads_fwd", y, y_l)?,
            Shape::from((b, n, t, d)),
        ))
    }

    fn bwd(&self, y: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let (g_guard, g_l) = grad.storage_and_layout();
        let g = cuda(&g_guard, "rope backward")?;
        let dx = self.run("rope_heads_bwd", g, g_l)?;
        Ok(Some(Tensor::from_storage(
            candle_core::Storage::Cuda(dx),
            y.shape().clone(),
            candle_core::op::BackpropOp::none(),
            false,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{compute, fixtures, ops};
    use candle_core::{DType, Var};

    /// The fused placement and rotation against the composed form on the GPU, values and
    /// input gradients, for 12 query heads in 2 groups of head size 128 and 4 of 64, in
    /// f32, bf16 and f16. Skipped without `RLHOST_TEST_DEVICE=cuda`.
    #[test]
    fn fused_rope_heads_match_the_composed_form() {
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        let (b, t) = (2, 9);
        for (n, groups, d) in [(12, 2, 128), (4, 4, 64)] {
            for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 1e-2), (DType::F16, 2e-3)] {
                let y = Var::from_tensor(
                    &fixtures::uniform(&[b, t, n * d], 1)
                        .to_device(&dev)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap(),
                )
                .unwrap();
                let positions = candle_core::Tensor::arange(0u32, (b * t) as u32, &dev)
                    .unwrap()
                    .reshape((b, t))
                    .unwrap();
                let inv =
                    ops::rope_inv_freq(d, 10000.0, &crate::model::config::RopeScaling::None, &dev)
                        .unwrap();
                let (cos, sin) = ops::rope_cos_sin(&inv, &positions).unwrap();
                let (cos, sin) = (cos.to_dtype(dtype).unwrap(), sin.to_dtype(dtype).unwrap());
                let coef = fixtures::uniform(&[b, groups, n / groups * t, d], 2)
                    .to_device(&dev)
                    .unwrap();
                let run = |fused: bool| {
                    let out = if fused {
                        rope_heads(y.as_tensor(), n, groups, &cos, &sin)
                    } else {
                        crate::model::cpu::composed(|| {
                            compute::rope_heads(y.as_tensor(), n, groups, Some((&cos, &sin)))
                        })
                    }
                    .unwrap();
                    let loss = (out.to_dtype(DType::F32).unwrap() * &coef)
                        .unwrap()
                        .sum_all()
                        .unwrap();
                    let g = loss.backward().unwrap().get(y.as_tensor()).unwrap().clone();
                    (out, g)
                };
                let (of, gf) = run(true);
                let (oc, gc) = run(false);
                let (eo, eg) = (
                    fixtures::relative_diff(&of, &oc),
                    fixtures::relative_diff(&gf, &gc),
                );
                eprintln!("rope n={n} d={d} {dtype:?}: output {eo:.2e}, grad {eg:.2e}");
                assert!(
                    eo <= tol && eg <= tol * 2.0,
                    "n={n} d={d} {dtype:?}: {eo} {eg}"
                );
            }
        }
    }

    /// Heads read in place from columns of a wider product (q and k of q/k/v taken as
    /// one) are rotated to the bit as the same heads copied out first, in f32, bf16 and
    /// f16, at an offset and with a row stride. Skipped without `RLHOST_TEST_DEVICE=cuda`.
    #[test]
    fn strided_rows_rotate_as_their_contiguous_copy() {
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        let (rows, n, d) = (7, 4, 64);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            // q of 2 heads, then these 4, then 3 more: the rows are 9 heads wide.
            let wide = fixtures::uniform_on(&[rows, 9 * d], 3, 1.0, &dev, dtype);
            let part = wide.narrow(1, 2 * d, n * d).unwrap();
            let positions = candle_core::Tensor::arange(3u32, 3 + rows as u32, &dev)
                .unwrap()
                .reshape((rows, 1))
                .unwrap();
            let inv =
                ops::rope_inv_freq(d, 10000.0, &crate::model::config::RopeScaling::None, &dev)
                    .unwrap();
            let (cos, sin) = ops::rope_cos_sin(&inv, &positions).unwrap();
            let (cos, sin) = (cos.to_dtype(dtype).unwrap(), sin.to_dtype(dtype).unwrap());
            let strided = rope_rows_strided(&part, n, &cos, &sin).unwrap();
            let copied = rope_heads(
                &part
                    .contiguous()
                    .unwrap()
                    .reshape((rows, 1, n * d))
                    .unwrap(),
                n,
                n,
                &cos,
                &sin,
            )
            .unwrap();
            assert_eq!(strided.dims(), [rows, n, 1, d]);
            let e = fixtures::max_diff(
                &strided.to_dtype(DType::F32).unwrap(),
                &copied.to_dtype(DType::F32).unwrap(),
            );
            assert_eq!(e, 0.0, "{dtype:?}");
        }
    }
}
