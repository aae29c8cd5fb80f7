//! AdamW's update of one f32 parameter on CUDA, in place (`adamw.cu`): the fused form of
//! the composed update in [`crate::rl::optim::AdamW`], which it must equal. Two launches a
//! parameter where the composed form runs about a dozen kernels and allocates as many
//! buffers: with a LoRA model's hundreds of adapter tensors, the optimizer's step was
//! mostly launch and allocation overhead.
//!
//! The moments live interleaved in one `[n, 2]` f32 tensor (`m` then `v` per element), so
//! that each pass writes one tensor in place through candle's in-place ops.

use super::{Module, PushKernelArg, elementwise, launch, ptx, view};
use candle_core::{CudaStorage, InplaceOp2, Layout, Result, Tensor, bail};

const KERNELS: Module = Module {
    name: "rlhost_adamw",
    ptx: ptx!("adamw"),
};

/// One AdamW step's numbers: `decay` = 1 − lr·wd, `rest1` = 1 − β1, `rest2` = 1 − β2,
/// `inv_bc1` = 1 / (1 − β1ᵗ), `inv_bc2` = 1 / (1 − β2ᵗ) (each computed in f64, then
/// rounded, as the composed form's constants are).
#[derive(Debug, Clone, Copy)]
pub struct Step {
    pub lr: f32,
    pub decay: f32,
    pub beta1: f32,
    pub rest1: f32,
    pub beta2: f32,
    pub rest2: f32,
    pub inv_bc1: f32,
    pub inv_bc2: f32,
    pub eps: f32,
}

/// Updates `mv` (`[n, 2]`, the moments) with the gradient `g`, then the parameter `p`
/// (`n` f32 elements, contiguous) from them.
pub fn update(p: &Tensor, mv: &Tensor, g: &Tensor, step: Step) -> Result<()> {
    let n = p.elem_count();
    if g.elem_count() != n || mv.elem_count() != 2 * n || !p.is_contiguous() {
        bail!(
            "fused adamw: parameter {:?}, moments {:?}, gradient {:?}",
            p.dims(),
            mv.dims(),
            g.dims()
        );
    }
    let g = g.to_dtype(candle_core::DType::F32)?.contiguous()?;
    mv.inplace_op2(&g, &Pass::Moments(step))?;
    p.inplace_op2(mv, &Pass::Apply(step))
}

/// One of the two passes: the moments from the gradient (written: the moments, read: the
/// gradient), or the parameter from the moments (written: the parameter, read: the
/// moments).
enum Pass {
    Moments(Step),
    Apply(Step),
}

impl InplaceOp2 for Pass {
    fn name(&self) -> &'static str {
        match self {
            Pass::Moments(_) => "fused-adamw-moments",
            Pass::Apply(_) => "fused-adamw-apply",
        }
    }

    fn cpu_fwd(
        &self,
        _: &mut candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<()> {
        bail!("fused adamw: CUDA only")
    }

    fn cuda_fwd(
        &self,
        written: &mut CudaStorage,
        written_l: &Layout,
        read: &CudaStorage,
        read_l: &Layout,
    ) -> Result<()> {
        let dev = super::device(read).clone();
        let rv = view::<f32>(read, read_l, "adamw")?;
        let Some((a, b)) = written_l.contiguous_offsets() else {
            bail!(
                "fused adamw: {} must write a contiguous tensor",
                self.name()
            )
        };
        let mut wv = written.as_cuda_slice_mut::<f32>()?.slice_mut(a..b);
        let (kernel, n) = match self {
            Pass::Moments(_) => ("adamw_moments", read_l.shape().elem_count()),
            Pass::Apply(_) => ("adamw_apply", written_l.shape().elem_count()),
        };
        let (stream, func) = KERNELS.load(&dev, kernel, candle_core::DType::F32)?;
        let mut args = stream.launch_builder(&func);
        let n64 = n as i64;
        args.arg(&mut wv).arg(&rv).arg(&n64);
        match self {
            Pass::Moments(s) => {
                args.arg(&s.beta1).arg(&s.rest1).arg(&s.beta2).arg(&s.rest2);
            }
            Pass::Apply(s) => {
                args.arg(&s.lr)
                    .arg(&s.decay)
                    .arg(&s.inv_bc1)
                    .arg(&s.inv_bc2)
                    .arg(&s.eps);
            }
        }
        launch(&mut args, elementwise(n))
    }
}

#[cfg(test)]
mod tests {
    use crate::model::fixtures;
    use crate::rl::optim::{AdamW, AdamWConfig};
    use candle_core::{Tensor, Var};

    /// Five steps of the fused update against the composed one on the GPU, with weight
    /// decay and gradients that change each step: the parameters and the checkpointed
    /// moments agree, and moments restored into a fused optimizer continue the same way.
    /// Skipped without `RLHOST_TEST_DEVICE=cuda`.
    #[test]
    fn fused_adamw_matches_the_composed_update() {
        let dev = fixtures::device();
        if !dev.is_cuda() {
            return;
        }
        let shapes: [&[usize]; 3] = [&[16, 64], &[7], &[3, 1000]];
        let make = |composed: bool| {
            let params: Vec<(String, Var)> = shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let t = fixtures::uniform(s, i as u64).to_device(&dev).unwrap();
                    (format!("p{i}"), Var::from_tensor(&t).unwrap())
                })
                .collect();
            let cfg = AdamWConfig {
                weight_decay: 0.1,
                ..AdamWConfig::default()
            };
            if composed {
                crate::model::cpu::composed(|| AdamW::new(params, cfg)).unwrap()
            } else {
                AdamW::new(params, cfg).unwrap()
            }
        };
        let (mut fused, mut composed) = (make(false), make(true));
        let grads = |k: u64| -> Vec<Tensor> {
            shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    fixtures::uniform(s, 100 + 10 * k + i as u64)
                        .to_device(&dev)
                        .unwrap()
                })
                .collect()
        };
        for k in 0..5 {
            fused.update(&grads(k), 0.01).unwrap();
            composed.update(&grads(k), 0.01).unwrap();
        }
        let worst = |a: &AdamW, b: &AdamW| -> f32 {
            let mut worst = 0f32;
            for ((_, x), (_, y)) in a.params().iter().zip(b.params()) {
                worst = worst.max(fixtures::relative_diff(x.as_tensor(), y.as_tensor()));
            }
            for ((_, x), (_, y)) in a.state().unwrap().iter().zip(&b.state().unwrap()) {
                worst = worst.max(fixtures::relative_diff(x, y));
            }
            worst
        };
        let e = worst(&fused, &composed);
        eprintln!("fused adamw vs composed after 5 steps: {e:.2e}");
        assert!(e <= 1e-6, "{e}");
        // The composed optimizer's moments restored into a fresh fused one.
        let state: std::collections::HashMap<String, Tensor> =
            composed.state().unwrap().into_iter().collect();
        let mut restored = make(false);
        for ((_, p), (_, q)) in restored.params().iter().zip(composed.params()) {
            p.set(q.as_tensor()).unwrap();
        }
        restored.load_state(&state, composed.step).unwrap();
        restored.update(&grads(9), 0.01).unwrap();
        composed.update(&grads(9), 0.01).unwrap();
        let e = worst(&restored, &composed);
        eprintln!("fused adamw restored from a checkpoint, one more step: {e:.2e}");
        assert!(e <= 1e-6, "{e}");
    }
}
