//! PPO's critic: a linear value head on the last hidden state (after the final norm),
//! trained through the policy's LoRA adapter (`train.critic = "shared"`) or through an
//! adapter of its own on the same projections (`"separate"`: a second forward pass per
//! micro-batch, and the policy's adapter never sees the value loss). V(s_t) is read at
//! the position whose next token is the action, the same position the action's
//! log-prob is read at.
//!
//! Saved beside the PEFT adapter as `value_head.safetensors`, with TRL's names for its
//! `AutoModelForCausalLMWithValueHead`: `v_head.summary.weight` `[1, hidden]` and
//! `v_head.summary.bias` `[1]`, f32; a separate adapter adds its tensors under PEFT's
//! names with a `critic.` prefix (`critic.base_model.model.<module>.lora_A.weight`).

use crate::model::lora::AdapterSnapshot;
use crate::model::{Mode, Model};
use anyhow::{Context, Result, bail};
use candle_core::{DType, Tensor, Var};
use std::collections::HashMap;
use std::path::Path;

pub const FILE: &str = "value_head.safetensors";
const WEIGHT: &str = "v_head.summary.weight";
const BIAS: &str = "v_head.summary.bias";

pub struct ValueHead {
    pub weight: Var,
    pub bias: Var,
    /// The critic's own adapter and its variables (`"separate"`), else `None`.
    adapter: Option<(AdapterSnapshot, Vec<(String, Var)>)>,
}

impl ValueHead {
    /// A head that predicts 0 everywhere: the first advantages are the discounted rewards
    /// themselves, and the head learns from there (a random head would add noise of its
    /// own to every advantage of the first steps). With `own_adapter`, an adapter of the
    /// policy's shape, initialised from `seed` as PEFT does.
    pub fn new(model: &Model, own_adapter: bool, seed: u64) -> Result<ValueHead> {
        let device = model.device();
        Ok(ValueHead {
            weight: Var::zeros((1, model.cfg.hidden_size), DType::F32, device)?,
            bias: Var::zeros(1, DType::F32, device)?,
            adapter: if own_adapter {
                Some(model.trainable_adapter(seed)?)
            } else {
                None
            },
        })
    }

    /// `[B, T]` values of `hidden: [B, T, H]`, in f32 (the head's dtype) whatever the
    /// model's compute dtype.
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        let (b, t, h) = hidden.dims3()?;
        let v = hidden
            .to_dtype(DType::F32)?
            .reshape((b * t, h))?
            .matmul(&self.weight.as_tensor().t()?)?
            .broadcast_add(self.bias.as_tensor())?;
        Ok(v.reshape((b, t))?)
    }

    /// `[B, T]` values of a padded batch: from `shared` (the policy's last hidden states
    /// of this very batch, which a shared critic needs) or, with an adapter of its own,
    /// from a forward pass through it.
    pub fn values(
        &self,
        model: &Model,
        (input, attn, pos): (&Tensor, &Tensor, &Tensor),
        shared: Option<&Tensor>,
        grad: bool,
    ) -> Result<Tensor> {
        match &self.adapter {
            None => {
                self.forward(shared.context("a shared critic reads the policy's hidden states")?)
            }
            Some((set, _)) => {
                let mode = Mode {
                    adapters: true,
                    grad,
                    dropout_rng: None,
                    adapter: Some(set),
                    segments: None,
                };
                self.forward(&model.forward_batch(input, attn, pos, mode)?)
            }
        }
    }

    /// Whether values need a forward pass of their own.
    pub fn separate(&self) -> bool {
        self.adapter.is_some()
    }

    /// The trainable tensors under their saved names (the optimizer's keys too).
    pub fn vars(&self) -> Vec<(String, Var)> {
        let mut out = vec![
            (WEIGHT.to_string(), self.weight.clone()),
            (BIAS.to_string(), self.bias.clone()),
        ];
        if let Some((_, vars)) = &self.adapter {
            out.extend(vars.iter().map(|(path, v)| {
                let (module, kind) = path.rsplit_once('.').unwrap_or((path, ""));
                (
                    format!("critic.base_model.model.{module}.{kind}.weight"),
                    v.clone(),
                )
            }));
        }
        out
    }

    pub fn save(&self, dir: &Path) -> Result<()> {
        let tensors: HashMap<String, Tensor> = self
            .vars()
            .into_iter()
            .map(|(k, v)| (k, v.as_tensor().clone()))
            .collect();
        let path = dir.join(FILE);
        candle_core::safetensors::save(&tensors, &path)
            .map_err(|e| crate::model::peft::innermost(&e))
            .with_context(|| format!("writing {}", path.display()))
    }

    /// Reads `dir/value_head.safetensors` into this head (and its adapter), checking
    /// names and shapes.
    pub fn load(&self, dir: &Path) -> Result<()> {
        let path = dir.join(FILE);
        if !path.is_file() {
            bail!(
                "{} is missing: the checkpoint has no value head (was it written by a run with train.algorithm other than \"ppo\"?)",
                path.display()
            );
        }
        let tensors = candle_core::safetensors::load(&path, self.weight.device())
            .with_context(|| format!("reading {}", path.display()))?;
        let has_adapter = tensors.keys().any(|k| k.starts_with("critic."));
        if has_adapter != self.separate() {
            let (was, is) = if has_adapter {
                ("separate", "shared")
            } else {
                ("shared", "separate")
            };
            bail!(
                "{}: the run was started with train.critic = \"{was}\" and is resumed with \"{is}\"; resume with the setting it started with",
                path.display()
            );
        }
        for (name, var) in self.vars() {
            let t = tensors
                .get(&name)
                .with_context(|| format!("{}: no tensor {name}", path.display()))?;
            if t.dims() != var.dims() {
                bail!(
                    "{}: {name} has shape {:?}, the model needs {:?} (a value head of another model?)",
                    path.display(),
                    t.dims(),
                    var.dims()
                );
            }
            var.set(&t.to_dtype(DType::F32)?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LoraConfig;
    use crate::model::fixtures;
    use candle_core::Device;

    /// A head of hidden size 3 with no adapter.
    fn small(hidden: usize) -> ValueHead {
        let dev = Device::Cpu;
        ValueHead {
            weight: Var::zeros((1, hidden), DType::F32, &dev).unwrap(),
            bias: Var::zeros(1, DType::F32, &dev).unwrap(),
            adapter: None,
        }
    }

    #[test]
    fn values_are_a_linear_read_of_the_hidden_state_and_round_trip() {
        let dev = Device::Cpu;
        let head = small(3);
        head.weight
            .set(&Tensor::new(&[[1f32, -2.0, 0.5]], &dev).unwrap())
            .unwrap();
        head.bias
            .set(&Tensor::new(&[0.25f32], &dev).unwrap())
            .unwrap();
        let h = Tensor::new(&[[[1f32, 1.0, 2.0], [0.0, 0.5, 4.0]]], &dev).unwrap();
        let v = head.forward(&h).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(v, [[1.0 - 2.0 + 1.0 + 0.25, -1.0 + 2.0 + 0.25]]);
        let dir = std::env::temp_dir().join(format!("rlhost-vhead-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        head.save(&dir).unwrap();
        let back = small(3);
        back.load(&dir).unwrap();
        assert_eq!(back.forward(&h).unwrap().to_vec2::<f32>().unwrap(), v);
        let wrong = small(4);
        let e = wrong.load(&dir).unwrap_err().to_string();
        assert!(e.contains("has shape [1, 3]"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
        let e = back.load(&dir).unwrap_err().to_string();
        assert!(e.contains("no value head"), "{e}");
    }

    /// A separate critic adapter: its values differ from the shared hidden state's once it
    /// has moved, gradients reach it and not the policy's adapter, and it round-trips
    /// through the file (a shared/separate mismatch on resume is named).
    #[test]
    fn a_separate_adapter_trains_alone_and_round_trips() {
        let mut m = fixtures::load("qwen2");
        m.attach_lora(&LoraConfig::default(), 3).unwrap();
        let head = ValueHead::new(&m, true, 9).unwrap();
        head.weight
            .set(&Tensor::ones((1, m.cfg.hidden_size), DType::F32, m.device()).unwrap())
            .unwrap();
        let ids = Tensor::new(&[[1u32, 5, 9, 12]], m.device()).unwrap();
        let attn = ids.ones_like().unwrap();
        let pos = Tensor::new(&[[0u32, 1, 2, 3]], m.device()).unwrap();
        let shared = m.forward_batch(&ids, &attn, &pos, Mode::INFERENCE).unwrap();
        let v = head
            .values(&m, (&ids, &attn, &pos), Some(&shared), true)
            .unwrap();
        let grads = v.sum_all().unwrap().backward().unwrap();
        let critic_vars = head.vars();
        let b = &critic_vars
            .iter()
            .find(|(n, _)| n.ends_with("lora_B.weight"))
            .unwrap()
            .1;
        assert!(
            grads.get(b.as_tensor()).is_some(),
            "the critic's adapter gets gradients"
        );
        assert!(
            m.lora_vars()
                .iter()
                .all(|(_, v)| grads.get(v.as_tensor()).is_none()),
            "the policy's adapter gets none"
        );
        // Move the critic's B: its values now differ from the policy's hidden state's.
        b.set(&(b.as_tensor().ones_like().unwrap() * 0.05).unwrap())
            .unwrap();
        let own = head.values(&m, (&ids, &attn, &pos), None, false).unwrap();
        let via_shared = head.forward(&shared).unwrap();
        let d = (own - &via_shared)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert!(d.to_scalar::<f32>().unwrap() > 1e-3);
        let dir = std::env::temp_dir().join(format!("rlhost-critic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        head.save(&dir).unwrap();
        let back = ValueHead::new(&m, true, 10).unwrap();
        back.load(&dir).unwrap();
        let again = back.values(&m, (&ids, &attn, &pos), None, false).unwrap();
        let own = head.values(&m, (&ids, &attn, &pos), None, false).unwrap();
        assert_eq!(
            again.to_vec2::<f32>().unwrap(),
            own.to_vec2::<f32>().unwrap()
        );
        let e = ValueHead::new(&m, false, 0)
            .unwrap()
            .load(&dir)
            .unwrap_err()
            .to_string();
        assert!(e.contains("train.critic = \"separate\""), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
