//! Activation recomputation, "gradient checkpointing" (`train.gradient_checkpointing`): a
//! decoder layer's training forward keeps only its input, and its backward runs the layer
//! again, this time with a graph, to take the gradients from.
//!
//! Why: a training forward's graph keeps every layer's activations until the backward.
//! The MLP's gate, up and SwiGLU outputs alone are `3 · tokens · intermediate` floats per
//! layer (60 MB for 1,024 tokens of a 0.5B model, 1.4 GB over its 24 layers), which is
//! most of a LoRA step's memory and all that is left once the base is 4-bit. Recomputed,
//! the step keeps one `[tokens, hidden]` input per layer and one layer's activations at a
//! time, for a second forward of every layer (about a third more compute). The unit is
//! the decoder layer, as in transformers' `gradient_checkpointing_enable()`.
//!
//! The op is `y = block(x; adapters)` for any block of the model (the decoder passes each
//! layer's forward) with the adapters of its projections (the live ones or
//! `mode.adapter`'s) as one flat input, as in [`super::cpu::mlp_op`]. The forward runs the
//! block on detached copies, through the same kernels as training, and builds no graph.
//! The backward makes fresh variables of `x` and the adapters, runs the block on them,
//! backpropagates `Σ y ⊙ g` and returns their gradients. LoRA dropout draws the same masks
//! both times: each layer draws them from its own generator, seeded from the run's (see
//! [`super::Model::forward_batch`]), which is made again from its seed for the second run.

use super::lora::{AdapterSnapshot, Linear, Mode, seeded};
use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp2, Layout, Result, Shape, Storage, Tensor, TensorId, Var, bail,
};
use std::sync::Mutex;

/// A block's forward, `block(x, mode)`, that can run again in the backward.
pub type Block = Box<dyn Fn(&Tensor, Mode<'_>) -> Result<Tensor> + Send + Sync>;

/// `block(x, mode)` with LoRA dropout drawn from a generator seeded with `dropout_seed`
/// (when `mode` has one), recomputed in the backward when the forward builds a graph
/// through the adapters of `projections` (the block's); otherwise the plain forward.
pub fn recomputed(
    block: Block,
    projections: &[&Linear],
    x: &Tensor,
    mode: Mode,
    dropout_seed: Option<u64>,
) -> Result<Tensor> {
    let rng = dropout_seed.map(|s| Mutex::new(seeded(s)));
    let mode = Mode {
        dropout_rng: rng.as_ref(),
        ..mode
    };
    let adapters: Vec<(TensorId, Tensor, Tensor)> = if mode.adapters && mode.grad {
        projections
            .iter()
            .filter_map(|lin| lin.lora.as_ref())
            .map(|l| {
                let (a, b) = l.pair(mode.adapter);
                (l.lora_a.as_tensor().id(), a.clone(), b.clone())
            })
            .collect()
    } else {
        Vec::new()
    };
    if adapters.is_empty() {
        return block(x, mode);
    }
    let detached = AdapterSnapshot::from_pairs(
        0,
        adapters
            .iter()
            .map(|(id, a, b)| (*id, a.detach(), b.detach())),
    )
    .with_scaling(mode.adapter.and_then(|s| s.scaling));
    let y = block(
        &x.detach(),
        Mode {
            adapter: Some(&detached),
            ..mode
        },
    )?;
    let mut parts = Vec::with_capacity(2 * adapters.len());
    for (_, a, b) in &adapters {
        parts.push(a.flatten_all()?);
        parts.push(b.flatten_all()?);
    }
    let params = Tensor::cat(&parts, 0)?;
    x.apply_op2(
        &params,
        Recompute {
            block,
            adapters: adapters
                .iter()
                .map(|(id, a, b)| (*id, a.shape().clone(), b.shape().clone()))
                .collect(),
            dropout_seed,
            y: Mutex::new(Some(y)),
        },
    )
}

struct Recompute {
    block: Block,
    /// Each adapter's live `lora_A` id and the shapes of `A` and `B`, in the order of the
    /// flat input.
    adapters: Vec<(TensorId, Shape, Shape)>,
    /// The seed of the layer's dropout generator.
    dropout_seed: Option<u64>,
    /// The forward's output, computed outside the op (it runs whole blocks) and handed
    /// over once.
    y: Mutex<Option<Tensor>>,
}

impl Recompute {
    /// The forward's output, once, in a storage of its own (the backends' `try_clone`
    /// copies a whole storage, whatever the layout: it must hold exactly `y`).
    fn take_y(&self) -> Result<Tensor> {
        let Some(y) = self.y.lock().map_err(|_| poisoned())?.take() else {
            bail!("checkpoint: the forward ran twice")
        };
        y.force_contiguous()
    }
}

fn poisoned() -> candle_core::Error {
    candle_core::Error::Msg("checkpoint: poisoned".into())
}

impl CustomOp2 for Recompute {
    fn name(&self) -> &'static str {
        "layer-checkpoint"
    }

    fn cpu_fwd(
        &self,
        _x: &CpuStorage,
        _xl: &Layout,
        _p: &CpuStorage,
        _pl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = self.take_y()?;
        let (storage, layout) = y.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((s.try_clone(layout)?, y.shape().clone())),
            _ => bail!("checkpoint: the block's output is not on the CPU"),
        }
    }

    fn cuda_fwd(
        &self,
        _x: &CudaStorage,
        _xl: &Layout,
        _p: &CudaStorage,
        _pl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let y = self.take_y()?;
        let (storage, layout) = y.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => Ok((s.try_clone(layout)?, y.shape().clone())),
            _ => bail!("checkpoint: the block's output is not on the GPU"),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        params: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // Fresh leaves: `x` only where the outer graph wants its gradient (not under frozen
        // embeddings), the adapters always.
        let x_var = x
            .track_op()
            .then(|| Var::from_tensor(&x.detach()))
            .transpose()?;
        let x_in = x_var
            .as_ref()
            .map_or_else(|| x.detach(), |v| v.as_tensor().clone());
        let params = params.detach();
        let (mut vars, mut at) = (Vec::with_capacity(self.adapters.len()), 0);
        for (id, a_shape, b_shape) in &self.adapters {
            let mut take = |shape: &Shape| -> Result<Var> {
                let n = shape.elem_count();
                let v = Var::from_tensor(&params.narrow(0, at, n)?.reshape(shape)?)?;
                at += n;
                Ok(v)
            };
            vars.push((*id, take(a_shape)?, take(b_shape)?));
        }
        let set = AdapterSnapshot::from_pairs(
            0,
            vars.iter()
                .map(|(id, a, b)| (*id, a.as_tensor().clone(), b.as_tensor().clone())),
        );
        let rng = self.dropout_seed.map(|s| Mutex::new(seeded(s)));
        let mode = Mode {
            adapters: true,
            grad: true,
            dropout_rng: rng.as_ref(),
            adapter: Some(&set),
            segments: None,
        };
        let y = (self.block)(&x_in, mode)?;
        let grads = (y * g.detach())?.sum_all()?.backward()?;
        let grad_or_zero = |v: &Var| -> Result<Tensor> {
            match grads.get(v.as_tensor()) {
                Some(d) => d.flatten_all(),
                None => v.as_tensor().zeros_like()?.flatten_all(),
            }
        };
        let dx = match &x_var {
            Some(v) => Some(match grads.get(v.as_tensor()) {
                Some(d) => d.clone(),
                None => x.zeros_like()?,
            }),
            None => None,
        };
        let mut parts = Vec::with_capacity(2 * vars.len());
        for (_, a, b) in &vars {
            parts.push(grad_or_zero(a)?);
            parts.push(grad_or_zero(b)?);
        }
        Ok((dx, Some(Tensor::cat(&parts, 0)?)))
    }
}

#[cfg(test)]
mod tests {
    use crate::model::fixtures::{self, Reference, max_diff};
    use crate::model::lora::{Mode, seeded};
    use crate::model::{Model, peft};
    use candle_core::Var;
    use std::sync::Mutex;

    /// The fixture loss and the gradient of every variable in `vars`, with the model's
    /// layers recomputed in the backward or not.
    fn loss_and_grads(
        model: &mut Model,
        checkpointing: bool,
        mode: Mode,
        vars: &[(String, Var)],
    ) -> (f32, Vec<candle_core::Tensor>) {
        model.gradient_checkpointing = checkpointing;
        let loss = Reference::load("qwen2").lora_loss(model, mode);
        let grads = loss.backward().unwrap();
        let g = vars
            .iter()
            .map(|(path, v)| {
                grads
                    .get(v.as_tensor())
                    .unwrap_or_else(|| panic!("no gradient for {path}"))
                    .clone()
            })
            .collect();
        (loss.to_scalar::<f32>().unwrap(), g)
    }

    fn set_dropout(model: &mut Model, p: f64) {
        let paths: Vec<String> = model.projections().into_iter().map(|(p, _, _)| p).collect();
        for path in paths {
            if let Some(l) = model.projection_mut(&path).and_then(|l| l.lora.as_mut()) {
                l.dropout = p;
            }
        }
    }

    fn assert_same(
        a: &(f32, Vec<candle_core::Tensor>),
        b: &(f32, Vec<candle_core::Tensor>),
        what: &str,
    ) {
        assert!(
            (a.0 - b.0).abs() <= 1e-6 * a.0.abs(),
            "{what}: loss {} vs {}",
            a.0,
            b.0
        );
        let worst =
            a.1.iter()
                .zip(&b.1)
                .map(|(x, y)| max_diff(x, y) / fixtures::max_abs(x).max(1e-12))
                .fold(0f32, f32::max);
        eprintln!("{what}: worst relative gradient difference {worst:.1e}");
        assert!(
            worst <= 1e-5,
            "{what}: worst relative gradient difference {worst}"
        );
    }

    /// Recomputing every layer in the backward gives the loss and adapter gradients of
    /// the kept-activations path: with the live adapter (f32 and NF4 base), with LoRA
    /// dropout (the same masks drawn twice), and with a second trainable adapter set (PPO's
    /// separate critic).
    #[test]
    fn recomputed_layers_give_the_same_loss_and_gradients() {
        let mut model = fixtures::load("qwen2");
        peft::load_adapter(&mut model, &fixtures::model_dir("qwen2").join("adapter")).unwrap();
        let train = Mode::TRAIN;
        let vars = model.lora_vars();
        let kept = loss_and_grads(&mut model, false, train, &vars);
        let recomputed = loss_and_grads(&mut model, true, train, &vars);
        assert_same(&kept, &recomputed, "live adapter");

        set_dropout(&mut model, 0.2);
        let with_dropout = |model: &mut Model, checkpointing: bool| {
            let rng = Mutex::new(seeded(11));
            let mode = Mode {
                dropout_rng: Some(&rng),
                ..train
            };
            loss_and_grads(model, checkpointing, mode, &vars)
        };
        let kept_d = with_dropout(&mut model, false);
        let recomputed_d = with_dropout(&mut model, true);
        assert_same(&kept_d, &recomputed_d, "dropout");
        assert!((kept_d.0 - kept.0).abs() > 1e-4, "dropout changed the loss");
        set_dropout(&mut model, 0.0);

        let (critic, critic_vars) = model.trainable_adapter(5).unwrap();
        // A fresh B is zero; move it so that A's gradient is not zero too.
        for (_, v) in &critic_vars {
            v.set(&(v.as_tensor() + 0.01).unwrap()).unwrap();
        }
        let on_critic = Mode {
            adapter: Some(&critic),
            ..train
        };
        let kept_c = loss_and_grads(&mut model, false, on_critic, &critic_vars);
        let recomputed_c = loss_and_grads(&mut model, true, on_critic, &critic_vars);
        assert_same(&kept_c, &recomputed_c, "a second adapter set");

        model.quantize_nf4(true).unwrap();
        let kept_q = loss_and_grads(&mut model, false, train, &vars);
        let recomputed_q = loss_and_grads(&mut model, true, train, &vars);
        assert_same(&kept_q, &recomputed_q, "NF4 base");
    }

    /// In bf16 too: the op hands its output over in the model's dtype, and the backward
    /// runs the same computation again.
    #[test]
    fn recomputed_layers_in_bf16_give_the_same_gradients() {
        let at = crate::model::Placement {
            device: fixtures::device(),
            dtype: candle_core::DType::BF16,
        };
        let mut model = Model::load(&fixtures::model_dir("qwen2"), &at).unwrap();
        peft::load_adapter(&mut model, &fixtures::model_dir("qwen2").join("adapter")).unwrap();
        let vars = model.lora_vars();
        let kept = loss_and_grads(&mut model, false, Mode::TRAIN, &vars);
        let recomputed = loss_and_grads(&mut model, true, Mode::TRAIN, &vars);
        assert_same(&kept, &recomputed, "bf16");
    }
}
