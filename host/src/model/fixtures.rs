//! Test access to `tests/fixtures/` (made by `scripts/make_fixtures.py` with transformers
//! and PEFT): the tiny models and their reference outputs.

use super::decoder::Model;
use super::lora::Mode;
use super::placement::Placement;
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::PathBuf;

pub const MODELS: [&str; 3] = ["qwen2", "qwen3", "llama"];

pub fn model_dir(name: &str) -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/models"
    ))
    .join(name)
}

/// `reference.safetensors` of one fixture model.
pub struct Reference {
    pub t: HashMap<String, Tensor>,
}

impl Reference {
    pub fn load(name: &str) -> Reference {
        Self::load_file(name, "reference.safetensors")
    }

    /// `reference_half.safetensors`: the bf16/f16 references (`bf16.logits`, ...).
    pub fn load_half(name: &str) -> Reference {
        Self::load_file(name, "reference_half.safetensors")
    }

    /// PEFT with the adapter cast to the half dtype (`reference_half_adapter.safetensors`,
    /// made by scripts/make_half_adapter_refs.py): the reference of the GPU's
    /// half-precision LoRA path.
    pub fn load_half_adapter(name: &str) -> Reference {
        Self::load_file(name, "reference_half_adapter.safetensors")
    }

    fn load_file(name: &str, file: &str) -> Reference {
        let t = candle_core::safetensors::load(model_dir(name).join(file), &device()).unwrap();
        Reference { t }
    }

    pub fn get(&self, k: &str) -> &Tensor {
        self.t
            .get(k)
            .unwrap_or_else(|| panic!("reference has no {k}"))
    }

    pub fn input_ids(&self) -> Tensor {
        self.get("input_ids").to_dtype(DType::U32).unwrap()
    }

    pub fn attention_mask(&self) -> Tensor {
        self.get("attention_mask").to_dtype(DType::U32).unwrap()
    }

    pub fn position_ids(&self) -> Tensor {
        self.get("position_ids").to_dtype(DType::U32).unwrap()
    }

    /// The real (unpadded) tokens of each row.
    pub fn rows(&self) -> Vec<Vec<u32>> {
        let ids = self.input_ids().to_vec2::<u32>().unwrap();
        let mask = self.attention_mask().to_vec2::<u32>().unwrap();
        ids.iter()
            .zip(&mask)
            .map(|(r, m)| {
                r.iter()
                    .zip(m)
                    .filter(|(_, m)| **m == 1)
                    .map(|(t, _)| *t)
                    .collect()
            })
            .collect()
    }

    /// Logits `[B, T, vocab]` of `model` on this reference's batch (batch path).
    pub fn logits(&self, model: &Model, mode: Mode) -> Tensor {
        // On the model's device, whatever RLHOST_TEST_DEVICE says: some tests load
        // theirs on the CPU on purpose.
        let dev = model.device();
        let h = model
            .forward_batch(
                &self.input_ids().to_device(dev).unwrap(),
                &self.attention_mask().to_device(dev).unwrap(),
                &self.position_ids().to_device(dev).unwrap(),
                mode,
            )
            .unwrap();
        model.logits(&h).unwrap()
    }

    /// `make_fixtures.py`'s `lora_loss` of `model` on this batch: the mean negative
    /// log-likelihood of each next token over positions where it and its target are real.
    pub fn lora_loss(&self, model: &Model, mode: Mode) -> Tensor {
        let dev = model.device();
        let (ids, mask, pos) = (
            self.input_ids().to_device(dev).unwrap(),
            self.attention_mask().to_device(dev).unwrap(),
            self.position_ids().to_device(dev).unwrap(),
        );
        let hidden = model.forward_batch(&ids, &mask, &pos, mode).unwrap();
        let t = ids.dim(1).unwrap();
        let hidden = hidden.narrow(1, 0, t - 1).unwrap();
        let targets = ids.narrow(1, 1, t - 1).unwrap();
        let (logp, _) = model.logprobs(&hidden, &targets).unwrap();
        let m = mask.to_dtype(candle_core::DType::F32).unwrap();
        let valid = (m.narrow(1, 0, t - 1).unwrap() * m.narrow(1, 1, t - 1).unwrap()).unwrap();
        let count = valid.sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
        ((logp * &valid).unwrap().sum_all().unwrap().neg().unwrap() / count).unwrap()
    }

    /// Index of the first real token of each row (rows are left-padded).
    pub fn first_real(&self) -> Vec<usize> {
        let mask = self.attention_mask().to_vec2::<u32>().unwrap();
        mask.iter()
            .map(|m| m.iter().position(|&x| x == 1).unwrap())
            .collect()
    }
}

/// The device the parity tests run on: the CPU, or the GPU that `RLHOST_TEST_DEVICE`
/// names (`cuda`, `cuda:N`) in a binary built with the `cuda` feature.
pub fn device() -> Device {
    match std::env::var("RLHOST_TEST_DEVICE") {
        Ok(d) => {
            let choice = d.parse().expect("RLHOST_TEST_DEVICE: cpu, cuda or cuda:N");
            Placement::open(choice, super::placement::DTypeChoice::F32)
                .expect("RLHOST_TEST_DEVICE")
                .device
        }
        Err(_) => Device::Cpu,
    }
}

/// The fixture model `name` in f32 on [`device`].
pub fn load(name: &str) -> Model {
    let at = Placement {
        device: device(),
        dtype: DType::F32,
    };
    Model::load(&model_dir(name), &at).unwrap()
}

/// Max |a - b| over positions where the mask is 1 (logits `[B, T, V]`).
pub fn masked_max_diff(a: &Tensor, b: &Tensor, mask: &Tensor) -> f32 {
    let [a, b, mask] = [a, b, mask].map(|t| t.to_device(&Device::Cpu).unwrap());
    let m = mask.to_dtype(DType::F32).unwrap().unsqueeze(2).unwrap();
    let d = (&a - &b).unwrap().abs().unwrap().broadcast_mul(&m).unwrap();
    d.flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// `‖a − b‖ / ‖b‖` (Euclidean norms, in f32): the measure the GPU ops' tests hold fused
/// against composed forms with.
#[cfg(feature = "cuda")]
pub fn relative_diff(a: &Tensor, b: &Tensor) -> f32 {
    let [a, b] = [a, b].map(|t| {
        t.to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    });
    let norm = |t: &Tensor| {
        t.sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            .sqrt()
    };
    norm(&(&a - &b).unwrap()) / norm(&b).max(f32::MIN_POSITIVE)
}

pub fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    let [a, b] = [a, b].map(|t| t.to_device(&Device::Cpu).unwrap());
    (&a - &b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// [`uniform`] times `gain`, on `device` in `dtype`: the GPU tests' inputs.
pub fn uniform_on(shape: &[usize], seed: u64, gain: f64, device: &Device, dtype: DType) -> Tensor {
    (uniform(shape, seed) * gain)
        .unwrap()
        .to_device(device)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// A fixed pseudo-random fill in [-1, 1): op tests must not depend on candle's unseeded
/// CPU generator.
pub fn uniform(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let data: Vec<f32> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

pub fn max_abs(a: &Tensor) -> f32 {
    a.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// The worst difference, relative to the reference's largest magnitude, between the
/// gradient of every LoRA tensor of `model` and `reference(PEFT name)`, where the PEFT name
/// is `base_model.model.<path>.default.weight`.
pub fn worst_lora_grad_diff<'a>(
    model: &Model,
    grads: &candle_core::backprop::GradStore,
    reference: impl Fn(&str) -> &'a Tensor,
) -> f32 {
    let mut worst = 0f32;
    for (path, var) in model.lora_vars() {
        let want = reference(&format!("base_model.model.{path}.default.weight"));
        let got = grads.get(var.as_tensor()).unwrap();
        worst = worst.max(max_diff(got, want) / max_abs(want));
    }
    worst
}
