//! Projections that read one input (q/k/v; gate/up) taken as one product when sampling:
//! their frozen weights stored as row ranges of one `[Σ outᵢ, in]` buffer (each part's
//! `weight` a view of its rows, so no memory is added and the training path reads the
//! parts as before), their biases likewise, and their adapters as one `A = [A₁; A₂; …]`
//! and a block-diagonal `B` ([`AdapterSnapshot::joint`]). A decode step then makes one
//! base product, one `x Aᵀ` and one `(x Aᵀ) Bᵀ` for the group instead of three of each
//! per part (issue 64: at batch 64 of the 1.5B shape, each is a launch-bound product).
//!
//! Only where nothing is trained and a frozen adapter set is read: the sampling forward
//! ([`super::decoder::Model::forward_cached`]). Everything else, and any part whose
//! weight or bias was replaced after joining (NF4 quantization, a loaded weight), takes
//! the parts one by one.

use super::compute;
use super::frozen::Weight;
use super::lora::{Linear, Mode};
use candle_core::{DType, Result, Tensor, TensorId};

/// The joined storage of a group of projections.
#[derive(Clone)]
pub struct Joint {
    /// `[W₁; W₂; …]`, `[Σ outᵢ, in]`.
    weight: Tensor,
    /// `[b₁; b₂; …]`, when every part has a bias.
    bias: Option<Tensor>,
    /// The ids of the views the parts were given (weight, bias): a part that no longer
    /// holds them reads another buffer, and the group is taken part by part.
    views: Vec<(TensorId, Option<TensorId>)>,
    outs: Vec<usize>,
}

impl Joint {
    /// Joins `parts` (dense weights of one dtype and input width; a bias on all or none):
    /// the weights and biases are copied into one buffer each and every part given a
    /// view of its rows. `None`, the parts untouched, where they cannot be joined.
    pub fn join(parts: &mut [&mut Linear]) -> Result<Option<Joint>> {
        if parts.len() < 2 {
            return Ok(None);
        }
        let mut weights = Vec::with_capacity(parts.len());
        for p in parts.iter() {
            match &p.weight {
                Weight::Dense(w) => weights.push(w.clone()),
                Weight::Nf4(_) => return Ok(None),
            }
        }
        let in_f = weights[0].dim(1)?;
        if weights
            .iter()
            .any(|w| w.dim(1).ok() != Some(in_f) || w.dtype() != weights[0].dtype())
        {
            return Ok(None);
        }
        let biases: Option<Vec<Tensor>> = parts.iter().map(|p| p.bias.clone()).collect();
        if biases.is_none() && parts.iter().any(|p| p.bias.is_some()) {
            return Ok(None);
        }
        let outs: Vec<usize> = weights.iter().map(|w| w.dim(0)).collect::<Result<_>>()?;
        let weight = Tensor::cat(&weights, 0)?;
        let bias = biases.map(|b| Tensor::cat(&b, 0)).transpose()?;
        let mut views = Vec::with_capacity(parts.len());
        let mut at = 0;
        for (p, &out) in parts.iter_mut().zip(&outs) {
            let w = weight.narrow(0, at, out)?;
            let b = bias.as_ref().map(|b| b.narrow(0, at, out)).transpose()?;
            views.push((w.id(), b.as_ref().map(Tensor::id)));
            p.weight = Weight::Dense(w);
            p.bias = b;
            at += out;
        }
        Ok(Some(Joint {
            weight,
            bias,
            views,
            outs,
        }))
    }

    /// Whether every part still reads this group's buffers.
    fn holds(&self, parts: &[&Linear]) -> bool {
        parts.len() == self.views.len()
            && parts.iter().zip(&self.views).all(|(p, (w, b))| {
                matches!(&p.weight, Weight::Dense(t) if t.id() == *w)
                    && p.bias.as_ref().map(Tensor::id) == *b
            })
    }

    /// The parts' outputs side by side, `[.., Σ outᵢ]`, each as
    /// [`compute::lora_linear`] gives it (up to the order of summation), or `None` where
    /// the group is taken part by part: a gradient or dropout wanted, adapters per
    /// segment, the live adapter read (its tensors change under a cache), a part's
    /// weight replaced, or parts of unequal scaling.
    pub fn forward(&self, parts: &[&Linear], x: &Tensor, mode: Mode) -> Result<Option<Tensor>> {
        if mode.grad || mode.dropout_rng.is_some() || mode.segments.is_some() || !self.holds(parts)
        {
            return Ok(None);
        }
        let adapted = mode.adapters && parts.iter().any(|p| p.lora.is_some());
        if !adapted {
            return compute::joint_linear(x, &self.weight, self.bias.as_ref(), None).map(Some);
        }
        let Some(set) = mode.adapter else {
            return Ok(None);
        };
        // Every adapter of the group must be the set's (a part whose adapter the set does
        // not hold reads the live one, part by part), all of one scaling.
        let mut scaling = None;
        for p in parts {
            if let Some(l) = &p.lora {
                if set.get(l).is_none() {
                    return Ok(None);
                }
                let s = l.scaling_in(Some(set));
                if scaling.is_some_and(|t| t != s) {
                    return Ok(None);
                }
                scaling = Some(s);
            }
        }
        let scaling = scaling.expect("some part is adapted");
        let shapes: Vec<_> = parts
            .iter()
            .zip(&self.outs)
            .map(|(p, &out)| (p.lora.as_ref(), out))
            .collect();
        // In the compute dtype where the fused projection runs (a GPU in half precision,
        // as it computes an adapter), in the set's dtype elsewhere (as the composed form
        // does).
        let dtype =
            if x.dtype() != DType::F32 && x.device().is_cuda() && !compute::composed_forced() {
                x.dtype()
            } else {
                DType::F32
            };
        let Some(pair) = set.joint(&shapes, dtype)? else {
            return Ok(None);
        };
        compute::joint_linear(
            x,
            &self.weight,
            self.bias.as_ref(),
            Some((&pair.0, &pair.1, scaling)),
        )
        .map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::decoder::Attention;
    use crate::model::fixtures;
    use crate::model::lora::{LoraConfig, Mode};
    use crate::model::{Model, Placement};

    /// A joined group gives what its parts give one by one, with a frozen set's adapters
    /// (of unequal ranks once one part has none) and without adapters; and a part
    /// replaced after joining sends the group back to the parts. In f32 on the test
    /// device, and with `RLHOST_TEST_DEVICE=cuda` in bf16 and f16 too, where the group
    /// and its parts run the fused projection with the set's pairs cast once.
    #[test]
    fn a_joined_group_equals_its_parts() {
        case(DType::F32, 1e-5);
        if fixtures::device().is_cuda() {
            case(DType::BF16, 1e-2);
            case(DType::F16, 2e-3);
        }
    }

    /// `max |a − b| / max |b|`.
    fn rel(a: &Tensor, b: &Tensor) -> f32 {
        let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        fixtures::max_diff(&f(a), &f(b)) / fixtures::max_abs(&f(b)).max(f32::MIN_POSITIVE)
    }

    fn case(dtype: DType, tol: f32) {
        let at = Placement {
            device: fixtures::device(),
            dtype,
        };
        let mut model = Model::load(&fixtures::model_dir("qwen2"), &at).unwrap();
        let dev = model.device().clone();
        model.attach_lora(&LoraConfig::default(), 5).unwrap();
        // Nonzero B everywhere, so that every delta counts.
        for (_, var) in model.lora_vars() {
            let t = var.as_tensor();
            var.set(&(t + fixtures::uniform(t.dims(), 9).to_device(&dev).unwrap()).unwrap())
                .unwrap();
        }
        // The v projection without an adapter: a zero block.
        model.layers[0].self_attn.v_proj.lora = None;
        let set = model.adapter_snapshot(1).unwrap();
        let x = fixtures::uniform_on(&[5, model.cfg.hidden_size], 11, 1.0, &dev, dtype);
        let layer = &mut model.layers[0];
        let separate = |attn: &Attention, mode: Mode| {
            let parts = [&attn.q_proj, &attn.k_proj, &attn.v_proj];
            let ys: Vec<Tensor> = parts
                .iter()
                .map(|p| compute::lora_linear(p, &x, mode).unwrap())
                .collect();
            Tensor::cat(&ys, 1).unwrap()
        };
        let sampling = Mode {
            adapter: Some(&set),
            ..Mode::INFERENCE
        };
        let before = separate(&layer.self_attn, sampling);
        // The set's pairs cast once compute what the live ones cast per call compute.
        let live = separate(&layer.self_attn, Mode::INFERENCE);
        assert_eq!(fixtures::max_diff(&live, &before), 0.0, "{dtype:?}");
        let attn = &mut layer.self_attn;
        let joint = Joint::join(&mut [&mut attn.q_proj, &mut attn.k_proj, &mut attn.v_proj])
            .unwrap()
            .expect("dense parts of one width join");
        let parts = [&attn.q_proj, &attn.k_proj, &attn.v_proj];
        let joined = joint
            .forward(&parts, &x, sampling)
            .unwrap()
            .expect("applies");
        assert_eq!(joined.dims(), before.dims());
        let e = rel(&joined, &before);
        eprintln!("joined q/k/v {dtype:?}: {e:.2e} from the parts");
        assert!(e <= tol, "{dtype:?}: {e}");
        // The parts still read their own rows after joining.
        assert_eq!(fixtures::max_diff(&separate(attn, sampling), &before), 0.0);
        let base = joint.forward(&parts, &x, Mode::BASE).unwrap().unwrap();
        assert!(
            rel(&base, &separate(attn, Mode::BASE)) <= tol,
            "{dtype:?} base"
        );
        // Not while training, nor with the live adapter (no frozen set to cache from).
        assert!(joint.forward(&parts, &x, Mode::TRAIN).unwrap().is_none());
        assert!(
            joint
                .forward(&parts, &x, Mode::INFERENCE)
                .unwrap()
                .is_none()
        );
        // A part given a weight of its own no longer reads the group's buffer.
        let own = match &attn.k_proj.weight {
            Weight::Dense(w) => w.copy().unwrap(),
            Weight::Nf4(_) => unreachable!("joined parts are dense"),
        };
        attn.k_proj.weight = Weight::Dense(own);
        let parts = [&attn.q_proj, &attn.k_proj, &attn.v_proj];
        assert!(joint.forward(&parts, &x, sampling).unwrap().is_none());
    }
}
