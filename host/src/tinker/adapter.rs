//! One training client's adapter on the shared base: its LoRA pairs (any rank, any of the
//! projections), the AdamW state and the gradients summed since the last step. The base
//! model carries a rank-1 host adapter with `B = 0` on every projection; a client's
//! forward reads its own pairs through [`AdapterSnapshot`] in place of the host's (keyed
//! by the host pair's id, with the client's own scaling), and a projection the client does
//! not train falls back to the host pair, which adds nothing. The base weights are held
//! once whatever the number of clients.

use crate::model::lora::{AdapterSnapshot, Lora, LoraConfig, TARGETS, seeded};
use crate::model::{Model, peft};
use crate::rl::optim::{Accumulator, AdamW, AdamWConfig, clip_grad_norm};
use anyhow::{Context, Result, bail};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId, Var};
use std::collections::HashMap;
use std::path::Path;

/// The host adapter every client's pairs stand in for.
pub fn host_config() -> LoraConfig {
    LoraConfig {
        r: 1,
        alpha: 1.0,
        dropout: 0.0,
        use_rslora: false,
        target_modules: TARGETS.iter().map(|s| s.to_string()).collect(),
    }
}

/// Attaches the host adapter (`B = 0`: the base model's outputs unchanged).
pub fn attach_host(model: &mut Model) -> Result<()> {
    model.attach_lora(&host_config(), 0)
}

/// The module paths of the host pairs, by the id of their `lora_A`.
fn host_ids(model: &Model) -> Result<HashMap<String, TensorId>> {
    let mut ids = HashMap::new();
    for (path, _, lin) in model.projections() {
        let l = lin
            .lora
            .as_ref()
            .with_context(|| format!("{path} has no host adapter (attach_host first)"))?;
        ids.insert(path, l.lora_a.as_tensor().id());
    }
    Ok(ids)
}

/// The highest LoRA rank a client may ask for (Tinker's own largest). An adapter's size
/// grows with it, so without a bound one request could size the server's memory.
pub const MAX_RANK: usize = 128;

/// What Tinker's `create_model` asks for, as rlhost's LoRA config: rank `r`, alpha 32
/// (Tinker's, for every rank), the attention and/or MLP projections (the output head,
/// `train_unembed`, is [`Adapter::fresh`]'s `head`).
pub fn lora_config(
    rank: usize,
    train_attn: bool,
    train_mlp: bool,
    train_unembed: bool,
) -> Result<LoraConfig> {
    if !(1..=MAX_RANK).contains(&rank) {
        bail!("lora rank must be 1 to {MAX_RANK}, got {rank}");
    }
    let mut targets = Vec::new();
    if train_attn {
        targets.extend(["q_proj", "k_proj", "v_proj", "o_proj"]);
    }
    if train_mlp {
        targets.extend(["gate_proj", "up_proj", "down_proj"]);
    }
    let cfg = LoraConfig {
        r: rank,
        alpha: 32.0,
        dropout: 0.0,
        use_rslora: false,
        target_modules: targets.into_iter().map(String::from).collect(),
    };
    if cfg.target_modules.is_empty() {
        if !train_unembed {
            bail!(
                "train_attn, train_mlp and train_unembed are all false: the adapter would train nothing"
            );
        }
    } else {
        cfg.validate()?;
    }
    Ok(cfg)
}

pub struct Adapter {
    pub cfg: LoraConfig,
    /// `(module path, A, B)` for each projection trained.
    pairs: Vec<(String, Var, Var)>,
    /// The output head's pair (`A: [r, hidden]`, `B: [vocab, r]`), when trained.
    head: Option<(Var, Var)>,
    /// The live pairs keyed for a forward.
    set: AdapterSnapshot,
    optim: AdamW,
    grads: Option<Accumulator>,
    /// `optim_step`s taken.
    pub steps: u64,
}

impl Adapter {
    /// A fresh adapter (PEFT's initialisation from `seed`: A Kaiming-uniform, B zero), on
    /// the output head too when `head`.
    pub fn fresh(model: &Model, cfg: LoraConfig, head: bool, seed: u64) -> Result<Adapter> {
        let mut rng = seeded(seed);
        let mut pairs = Vec::new();
        for (path, name, lin) in model.projections() {
            if cfg.targets(name) {
                let l = Lora::init(
                    lin.in_features(),
                    lin.out_features(),
                    &cfg,
                    &mut rng,
                    model.device(),
                )?;
                pairs.push((path, l.lora_a, l.lora_b));
            }
        }
        let head = if head {
            let (vocab, hidden) = model.lm_head.dims2()?;
            let l = Lora::init(hidden, vocab, &cfg, &mut rng, model.device())?;
            Some((l.lora_a, l.lora_b))
        } else {
            None
        };
        Self::from_pairs(model, cfg, pairs, head)
    }

    fn from_pairs(
        model: &Model,
        cfg: LoraConfig,
        pairs: Vec<(String, Var, Var)>,
        head: Option<(Var, Var)>,
    ) -> Result<Adapter> {
        let ids = host_ids(model)?;
        let set = AdapterSnapshot::from_pairs(
            0,
            pairs
                .iter()
                .map(|(p, a, b)| (ids[p], a.as_tensor().clone(), b.as_tensor().clone())),
        )
        .with_scaling(Some(cfg.scaling()))
        .with_head(
            head.as_ref()
                .map(|(a, b)| (a.as_tensor().clone(), b.as_tensor().clone())),
        );
        let mut params = named(&pairs);
        if let Some((a, b)) = &head {
            params.push((format!("{}.lora_A", peft::HEAD), a.clone()));
            params.push((format!("{}.lora_B", peft::HEAD), b.clone()));
        }
        Ok(Adapter {
            optim: AdamW::new(params, AdamWConfig::default())?,
            cfg,
            pairs,
            head,
            set,
            grads: None,
            steps: 0,
        })
    }

    /// The live pairs, for a forward that trains them.
    pub fn live(&self) -> &AdapterSnapshot {
        &self.set
    }

    /// A detached copy of the pairs as they are now, for sampling while training goes on.
    pub fn snapshot(&self, model: &Model, version: u64) -> Result<AdapterSnapshot> {
        let ids = host_ids(model)?;
        let mut copies = Vec::with_capacity(self.pairs.len());
        for (p, a, b) in &self.pairs {
            copies.push((
                ids[p],
                a.as_tensor().copy()?.detach(),
                b.as_tensor().copy()?.detach(),
            ));
        }
        let head = match &self.head {
            Some((a, b)) => Some((
                a.as_tensor().copy()?.detach(),
                b.as_tensor().copy()?.detach(),
            )),
            None => None,
        };
        Ok(AdapterSnapshot::from_pairs(version, copies)
            .with_scaling(Some(self.cfg.scaling()))
            .with_head(head)
            .frozen())
    }

    /// Whether it trains the output head.
    pub fn trains_head(&self) -> bool {
        self.head.is_some()
    }

    /// The trainable tensors by name (`<module path>.lora_A` / `.lora_B`).
    pub fn params(&self) -> &[(String, Var)] {
        self.optim.params()
    }

    /// Adds one backward pass's gradients to those summed since the last step.
    pub fn accumulate(&mut self, grads: &GradStore) -> Result<()> {
        let n = self.optim.params().len();
        let acc = self.grads.get_or_insert_with(|| Accumulator::new(n));
        acc.add(self.optim.params(), grads)
    }

    /// One AdamW step with the summed gradients, clipped to `clip` by global norm when
    /// `clip` > 0; returns the norm before clipping. With nothing accumulated the step is
    /// skipped, as PyTorch's optimizers skip parameters without a gradient (`None`).
    pub fn step(&mut self, lr: f64, cfg: AdamWConfig, clip: f64) -> Result<Option<f64>> {
        let Some(acc) = self.grads.take() else {
            return Ok(None);
        };
        let mut grads = acc.take(self.optim.params())?;
        let norm = clip_grad_norm(&mut grads, clip)?;
        if !norm.is_finite() {
            // A step on a NaN or infinite gradient would turn every weight NaN for good.
            return Err(super::wire::UserError(format!(
                "the summed gradient's norm is {norm}: the step was not taken (the adapter \
                 is as before; its gradients are dropped)"
            ))
            .into());
        }
        self.optim.cfg = cfg;
        self.optim.update(&grads, lr)?;
        self.steps += 1;
        Ok(Some(norm))
    }

    /// Writes the adapter in PEFT's format to `dir` (and, with `optimizer`, the AdamW
    /// moments and step count beside it, to resume training exactly).
    pub fn save(&self, dir: &Path, base: &str, optimizer: bool) -> Result<()> {
        let mut pairs: Vec<(String, Tensor, Tensor)> = self
            .pairs
            .iter()
            .map(|(p, a, b)| (p.clone(), a.as_tensor().clone(), b.as_tensor().clone()))
            .collect();
        let mut cfg = self.cfg.clone();
        if let Some((a, b)) = &self.head {
            pairs.push((
                peft::HEAD.into(),
                a.as_tensor().clone(),
                b.as_tensor().clone(),
            ));
            cfg.target_modules.push(peft::HEAD.into());
        }
        peft::save_pairs(pairs, &cfg, dir, Some(base))?;
        if optimizer {
            let mut tensors = self.optim.state()?;
            tensors.push((
                "step".to_string(),
                Tensor::new(&[self.optim.step as f32], &candle_core::Device::Cpu)?,
            ));
            let path = dir.join(OPTIMIZER_FILE);
            let tmp = dir.join(format!("{OPTIMIZER_FILE}.tmp"));
            let map: HashMap<String, Tensor> = tensors.into_iter().collect();
            candle_core::safetensors::save(&map, &tmp)
                .with_context(|| format!("writing {}", tmp.display()))?;
            std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }

    /// An adapter read from `dir` (PEFT's format), with its optimizer state when the
    /// directory has one and `optimizer` is asked for.
    pub fn load(model: &Model, dir: &Path, optimizer: bool) -> Result<Adapter> {
        let read = peft::read_pairs(model, dir)?;
        let pairs = read
            .pairs
            .into_iter()
            .map(|(p, a, b)| Ok((p, Var::from_tensor(&a)?, Var::from_tensor(&b)?)))
            .collect::<Result<Vec<_>>>()?;
        let head = match read.head {
            Some((a, b)) => Some((Var::from_tensor(&a)?, Var::from_tensor(&b)?)),
            None => None,
        };
        let mut adapter = Self::from_pairs(model, read.cfg, pairs, head)?;
        let path = dir.join(OPTIMIZER_FILE);
        if optimizer {
            if !path.is_file() {
                bail!(
                    "{} has no optimizer state ({OPTIMIZER_FILE}): it was saved for sampling; \
                     load it without the optimizer",
                    dir.display()
                );
            }
            let state =
                candle_core::safetensors::load(&path, model.device()).with_context(|| {
                    format!("{} is not a readable safetensors file", path.display())
                })?;
            let step = state
                .get("step")
                .with_context(|| format!("{} has no `step`", path.display()))?
                .to_dtype(candle_core::DType::F32)?
                .to_vec1::<f32>()?
                .first()
                .copied()
                .unwrap_or(0.0) as u64;
            adapter.optim.load_state(&state, step)?;
            adapter.steps = step;
        }
        Ok(adapter)
    }
}

/// The optimizer's file in a full checkpoint (`save_weights`).
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

fn named(pairs: &[(String, Var, Var)]) -> Vec<(String, Var)> {
    pairs
        .iter()
        .flat_map(|(p, a, b)| {
            [
                (format!("{p}.lora_A"), a.clone()),
                (format!("{p}.lora_B"), b.clone()),
            ]
        })
        .collect()
}

/// Log-probs `[B, T]` of `targets` from hidden states `[B, T, H]`: through the model's
/// chunked head, or, where `set` has an output head adapter, from the whole logits with
/// its delta added (`log_softmax(h Wᵀ + s (h Aᵀ) Bᵀ)`, gradients to A and B).
pub(crate) fn target_logprobs(
    model: &Model,
    hidden: &Tensor,
    targets: &Tensor,
    set: Option<&AdapterSnapshot>,
) -> Result<Tensor> {
    Ok(match set.and_then(|s| s.head()) {
        None => model.logprobs(hidden, targets)?.0,
        Some((a, b, s)) => {
            let logits =
                (model.logits(hidden)? + crate::model::compute::head_delta(hidden, a, b, s)?)?;
            let logz = candle_nn::ops::log_softmax(&logits, candle_core::D::Minus1)?;
            logz.gather(&targets.unsqueeze(2)?, 2)?.squeeze(2)?
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures;

    /// An adapter on the attention projections and the output head is written in PEFT's
    /// layout (`lm_head` among its targets) and read back the same; the trainer's loader
    /// refuses it by name rather than dropping the head.
    #[test]
    fn a_head_adapter_round_trips_and_the_trainer_refuses_it() {
        let mut model = fixtures::load("qwen2");
        attach_host(&mut model).unwrap();
        let cfg = lora_config(4, true, false, true).unwrap();
        let adapter = Adapter::fresh(&model, cfg, true, 3).unwrap();
        // B starts at zero; give the pairs values to compare.
        for (_, p) in adapter.params() {
            let t = p.as_tensor();
            p.set(&(t.ones_like().unwrap() * 0.25).unwrap()).unwrap();
        }
        let dir = std::env::temp_dir().join(format!("rlhost-head-adapter-{}", std::process::id()));
        adapter.save(&dir, "qwen2", true).unwrap();
        let text = std::fs::read_to_string(dir.join(peft::CONFIG_FILE)).unwrap();
        assert!(
            text.contains("\"lm_head\"") && text.contains("\"q_proj\""),
            "{text}"
        );
        let back = Adapter::load(&model, &dir, true).unwrap();
        assert!(back.trains_head());
        let names = |a: &Adapter| {
            a.params()
                .iter()
                .map(|(n, _)| n.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&back), names(&adapter));
        for ((n, a), (_, b)) in adapter.params().iter().zip(back.params()) {
            let d = (a.as_tensor() - b.as_tensor()).unwrap().abs().unwrap();
            let d = d
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert_eq!(d, 0.0, "{n}");
        }
        let mut plain = fixtures::load("qwen2");
        let e = peft::load_adapter(&mut plain, &dir)
            .unwrap_err()
            .to_string();
        assert!(e.contains("output head") && e.contains("lm_head"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
