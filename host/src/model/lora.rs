//! A linear layer over a frozen base weight with an optional LoRA adapter,
//! `y = x W^T + b + s · B A dropout(x)`, as in PEFT's `lora.Linear`.
//!
//! `A: [r, in]` starts Kaiming-uniform (PEFT: `kaiming_uniform_(a=√5)`, i.e.
//! U(-1/√in, 1/√in)) and `B: [out, r]` at zero, so a fresh adapter leaves the model
//! unchanged. `s = alpha / r`, or `alpha / √r` with rsLoRA. Adapters can be switched off
//! per forward: that is the reference policy for KL, with no second copy of the weights.

use super::frozen::Weight;
use super::nf4::linear::Nf4Linear;
use candle_core::{DType, Device, Result, Tensor, TensorId, Var};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;

/// The projections LoRA can target, by their checkpoint names.
pub const TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// What an adapter looks like (PEFT's `LoraConfig` fields we implement).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    pub r: usize,
    pub alpha: f64,
    pub dropout: f64,
    pub use_rslora: bool,
    /// Module names from [`TARGETS`].
    pub target_modules: Vec<String>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            r: 16,
            alpha: 32.0,
            dropout: 0.0,
            use_rslora: false,
            target_modules: TARGETS.iter().map(|s| s.to_string()).collect(),
        }
    }
}

impl LoraConfig {
    pub fn scaling(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }

    pub fn targets(&self, module: &str) -> bool {
        self.target_modules.iter().any(|m| m == module)
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if self.r == 0 {
            anyhow::bail!("lora rank `r` must be at least 1");
        }
        if !(0.0..1.0).contains(&self.dropout) {
            anyhow::bail!("lora dropout must be in [0, 1), got {}", self.dropout);
        }
        if self.target_modules.is_empty() {
            anyhow::bail!("lora `target_modules` is empty: name some of {TARGETS:?}");
        }
        if let Some(bad) = self
            .target_modules
            .iter()
            .find(|m| !TARGETS.contains(&m.as_str()))
        {
            anyhow::bail!("lora target module {bad:?} is not one of {TARGETS:?}");
        }
        Ok(())
    }
}

/// One adapter's trainable pair.
#[derive(Clone)]
pub struct Lora {
    pub lora_a: Var,
    pub lora_b: Var,
    pub scaling: f64,
    pub dropout: f64,
}

impl Lora {
    /// The `(A, B)` tensors a forward reads: from `set` when it holds this adapter (a
    /// snapshot, PPO's critic), the live variables otherwise.
    pub fn pair<'s>(&'s self, set: Option<&'s AdapterSnapshot>) -> (&'s Tensor, &'s Tensor) {
        match set.and_then(|s| s.get(self)) {
            Some((a, b)) => (a, b),
            None => (self.lora_a.as_tensor(), self.lora_b.as_tensor()),
        }
    }

    /// The scaling a forward applies: `set`'s own when it holds this adapter and has one
    /// (an adapter of another rank or alpha on the same projections: the Tinker API's
    /// tenants), the live adapter's otherwise.
    pub fn scaling_in(&self, set: Option<&AdapterSnapshot>) -> f64 {
        match set {
            Some(s) if s.get(self).is_some() => s.scaling.unwrap_or(self.scaling),
            _ => self.scaling,
        }
    }

    /// PEFT's initialisation: A Kaiming-uniform, B zero.
    pub fn init(
        in_f: usize,
        out_f: usize,
        cfg: &LoraConfig,
        rng: &mut StdRng,
        device: &Device,
    ) -> Result<Lora> {
        let bound = 1.0 / (in_f as f32).sqrt();
        let a: Vec<f32> = (0..cfg.r * in_f)
            .map(|_| rng.random_range(-bound..bound))
            .collect();
        Ok(Lora {
            lora_a: Var::from_tensor(&Tensor::from_vec(a, (cfg.r, in_f), device)?)?,
            lora_b: Var::zeros((out_f, cfg.r), DType::F32, device)?,
            scaling: cfg.scaling(),
            dropout: cfg.dropout,
        })
    }
}

/// How a forward pass treats adapters.
#[derive(Clone, Copy)]
pub struct Mode<'a> {
    /// Apply LoRA (false: the base model, i.e. the reference policy).
    pub adapters: bool,
    /// Build the gradient graph through the LoRA weights (training); otherwise they are
    /// read detached so that sampling builds no graph at all.
    pub grad: bool,
    /// Dropout on the LoRA input, drawn from this generator (training only).
    pub dropout_rng: Option<&'a Mutex<StdRng>>,
    /// Read the adapter from this set instead of the live tensors: a snapshot while
    /// sampling (the optimizer may be writing the live ones), or PPO's critic adapter,
    /// whose tensors are variables of their own and train with `grad`.
    pub adapter: Option<&'a AdapterSnapshot>,
    /// Sampling only: consecutive runs of the packed rows, each with its own adapter set
    /// (`None`: the base model), so that sequences of different adapters decode in one
    /// forward. Takes the place of `adapter` where given.
    pub segments: Option<&'a [Segment<'a>]>,
}

/// `rows` consecutive rows of a packed forward and the adapter set they read.
#[derive(Clone, Copy)]
pub struct Segment<'a> {
    pub rows: usize,
    pub adapter: Option<&'a AdapterSnapshot>,
}

/// Runs of equal adapters from one adapter per sequence and its row count: the
/// [`Mode::segments`] of a packed forward over those sequences.
pub fn segments<'a>(
    per_sequence: impl IntoIterator<Item = (usize, Option<&'a AdapterSnapshot>)>,
) -> Vec<Segment<'a>> {
    let mut out: Vec<Segment<'a>> = Vec::new();
    for (rows, adapter) in per_sequence {
        match out.last_mut() {
            Some(last) if same(last.adapter, adapter) => last.rows += rows,
            _ => out.push(Segment { rows, adapter }),
        }
    }
    out
}

fn same(a: Option<&AdapterSnapshot>, b: Option<&AdapterSnapshot>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => std::ptr::eq(a, b),
        _ => false,
    }
}

impl Mode<'_> {
    pub const INFERENCE: Mode<'static> = Mode {
        adapters: true,
        grad: false,
        dropout_rng: None,
        adapter: None,
        segments: None,
    };
    /// Training with the live adapter and no dropout.
    pub const TRAIN: Mode<'static> = Mode {
        adapters: true,
        grad: true,
        dropout_rng: None,
        adapter: None,
        segments: None,
    };
    pub const BASE: Mode<'static> = Mode {
        adapters: false,
        grad: false,
        dropout_rng: None,
        adapter: None,
        segments: None,
    };
}

/// A consistent copy of every adapter tensor, labelled with the adapter version it holds.
/// The optimizer writes the live `lora_A`/`lora_B` in place; a sampler running ahead of
/// the trainer (`rollout.max_staleness > 0`) reads a snapshot instead, so a batch labelled
/// version v is version v in every layer, not v in some and v + 1 in others. An adapter
/// is small (r · (in + out) floats per projection): a copy per step costs little.
pub struct AdapterSnapshot {
    pub version: u64,
    /// Keyed by the live `lora_A` tensor's id (the optimizer updates it in place, so the
    /// id stays).
    tensors: HashMap<TensorId, (Tensor, Tensor)>,
    /// `alpha / r` of a set whose adapter is not the live one's shape (`None`: the live
    /// adapter's scaling).
    pub scaling: Option<f64>,
    /// An adapter on the output head, `A: [r, hidden]`, `B: [vocab, r]` (the Tinker API's
    /// `train_unembed`): the logits gain `s · (h Aᵀ) Bᵀ`.
    pub head: Option<(Tensor, Tensor)>,
    /// Whether nothing writes these tensors (a version's copy, [`Self::frozen`]): only
    /// then are forms derived from them kept in `derived` (a trainable set, PPO's critic,
    /// changes under them).
    frozen: bool,
    /// Forms of this set's pairs a sampling forward reads every step, made once: a pair
    /// in a compute dtype, or the pairs of projections that share their input laid out as
    /// one product's ([`Self::joint`]). Keyed by the first pair's `lora_A` id, the dtype
    /// and how many projections it joins.
    derived: Mutex<HashMap<DerivedKey, Arc<(Tensor, Tensor)>>>,
}

/// What a derived pair is of: the first pair's `lora_A` id, the dtype, how many
/// projections it joins.
type DerivedKey = (TensorId, DType, usize);

impl std::fmt::Debug for AdapterSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdapterSnapshot")
            .field("version", &self.version)
            .field("pairs", &self.tensors.len())
            .field("scaling", &self.scaling)
            .field("head", &self.head.is_some())
            .finish()
    }
}

impl AdapterSnapshot {
    /// A set of `(A, B)` pairs keyed by the live `lora_A` tensors they stand in for.
    pub fn from_pairs(
        version: u64,
        pairs: impl IntoIterator<Item = (TensorId, Tensor, Tensor)>,
    ) -> Self {
        AdapterSnapshot {
            version,
            tensors: pairs.into_iter().map(|(id, a, b)| (id, (a, b))).collect(),
            scaling: None,
            head: None,
            frozen: false,
            derived: Mutex::new(HashMap::new()),
        }
    }

    /// The set marked as one nothing writes (its tensors are copies of its own), so that
    /// a sampling forward keeps what it derives from them ([`Self::cast`],
    /// [`Self::joint`]) for every later step instead of making it again each time.
    pub fn frozen(mut self) -> Self {
        self.frozen = true;
        self
    }

    /// `lora`'s pair in `dtype`, made once for a frozen set: a decode step in half
    /// precision reads every projection's adapter, and casting the f32 pair each time
    /// was two launches a projection (392 a step of the 1.5B shape). `None` where the set
    /// does not hold `lora` or is not frozen.
    pub fn cast(&self, lora: &Lora, dtype: DType) -> Result<Option<Arc<(Tensor, Tensor)>>> {
        if !self.frozen {
            return Ok(None);
        }
        let Some((a, b)) = self.get(lora) else {
            return Ok(None);
        };
        self.derive((a.id(), dtype, 1), || {
            Ok((a.to_dtype(dtype)?, b.to_dtype(dtype)?))
        })
        .map(Some)
    }

    /// The adapters of projections that share their input (q/k/v, gate/up) as one
    /// product's, in `dtype`: `A = [A₁; A₂; …]`, `[Σ rᵢ, in]`, and `B` block-diagonal,
    /// `[Σ outᵢ, Σ rᵢ]`, with `Bᵢ` where part `i`'s rows meet its rank's columns and zeros
    /// elsewhere, so that `(x Aᵀ) Bᵀ = [(x A₁ᵀ) B₁ᵀ, (x A₂ᵀ) B₂ᵀ, …]` (the zeros add
    /// nothing). A part without an adapter here (`None`, or one this set does not hold)
    /// gets zero rows of B and rank 0. Made once for a frozen set; `None` where the set is
    /// not frozen or holds none of the parts. `parts` gives each projection's adapter and
    /// out features.
    pub fn joint(
        &self,
        parts: &[(Option<&Lora>, usize)],
        dtype: DType,
    ) -> Result<Option<Arc<(Tensor, Tensor)>>> {
        if !self.frozen {
            return Ok(None);
        }
        let pairs: Vec<Option<&(Tensor, Tensor)>> = parts
            .iter()
            .map(|(lora, _)| lora.and_then(|l| self.get(l)))
            .collect();
        let Some(first) = pairs.iter().flatten().next() else {
            return Ok(None);
        };
        let key = (first.0.id(), dtype, parts.len());
        self.derive(key, || {
            joint_pair(
                &pairs,
                &parts.iter().map(|(_, out)| *out).collect::<Vec<_>>(),
            )
            .and_then(|(a, b)| Ok((a.to_dtype(dtype)?, b.to_dtype(dtype)?)))
        })
        .map(Some)
    }

    fn derive(
        &self,
        key: DerivedKey,
        make: impl FnOnce() -> Result<(Tensor, Tensor)>,
    ) -> Result<Arc<(Tensor, Tensor)>> {
        let mut derived = self
            .derived
            .lock()
            .map_err(|_| candle_core::Error::Msg("adapter set cache poisoned".into()))?;
        if let Some(made) = derived.get(&key) {
            return Ok(made.clone());
        }
        let made = Arc::new(make()?);
        derived.insert(key, made.clone());
        Ok(made)
    }

    /// The set with an adapter on the output head.
    pub fn with_head(mut self, head: Option<(Tensor, Tensor)>) -> Self {
        self.head = head;
        self
    }

    /// The output head's pair and its scaling, when the set has one.
    pub fn head(&self) -> Option<(&Tensor, &Tensor, f64)> {
        self.head
            .as_ref()
            .map(|(a, b)| (a, b, self.scaling.unwrap_or(1.0)))
    }

    /// The set with `scaling` in place of the live adapter's.
    pub fn with_scaling(mut self, scaling: Option<f64>) -> Self {
        self.scaling = scaling;
        self
    }

    pub fn get(&self, lora: &Lora) -> Option<&(Tensor, Tensor)> {
        self.tensors.get(&lora.lora_a.as_tensor().id())
    }
}

/// `[A₁; A₂; …]` and the block-diagonal `B` of [`AdapterSnapshot::joint`], in the pairs'
/// own dtype, from each part's pair (`None`: no adapter, rank 0) and out features.
fn joint_pair(pairs: &[Option<&(Tensor, Tensor)>], outs: &[usize]) -> Result<(Tensor, Tensor)> {
    let Some((a0, _)) = pairs.iter().flatten().next() else {
        candle_core::bail!("joint adapter: none of the parts has one");
    };
    let (dtype, device, in_f) = (a0.dtype(), a0.device().clone(), a0.dim(1)?);
    let ranks: Vec<usize> = pairs
        .iter()
        .map(|p| p.map_or(0, |(a, _)| a.dim(0).unwrap_or(0)))
        .collect();
    let total: usize = ranks.iter().sum();
    let a = Tensor::cat(
        &pairs.iter().flatten().map(|(a, _)| a).collect::<Vec<_>>(),
        0,
    )?;
    debug_assert_eq!(a.dims(), [total, in_f]);
    let mut rows = Vec::with_capacity(pairs.len());
    let mut before = 0;
    for ((pair, &r), &out) in pairs.iter().zip(&ranks).zip(outs) {
        let after = total - before - r;
        let block = match pair {
            Some((_, b)) => {
                if b.dims() != [out, r] {
                    candle_core::bail!(
                        "joint adapter: B {:?} for {out} outputs of rank {r}",
                        b.dims()
                    );
                }
                b.pad_with_zeros(1, before, after)?
            }
            None => Tensor::zeros((out, total), dtype, &device)?,
        };
        rows.push(block);
        before += r;
    }
    Ok((a, Tensor::cat(&rows, 0)?))
}

/// A projection: frozen `weight: [out, in]`, optional `bias`, optional `lora`.
#[derive(Clone)]
pub struct Linear {
    pub weight: Weight,
    pub bias: Option<Tensor>,
    pub lora: Option<Lora>,
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Linear {
        Self::with_weight(Weight::Dense(weight), bias)
    }

    pub fn with_weight(weight: Weight, bias: Option<Tensor>) -> Linear {
        Linear {
            weight,
            bias,
            lora: None,
        }
    }

    pub fn in_features(&self) -> usize {
        self.weight.dims2().1
    }

    pub fn out_features(&self) -> usize {
        self.weight.dims2().0
    }

    /// Replaces a dense base weight by its NF4 quantization (double-quantized absmax when
    /// `nested`); an NF4 weight stays as it is.
    pub fn quantize_nf4(&mut self, nested: bool) -> anyhow::Result<()> {
        if let Weight::Dense(w) = &self.weight {
            let (rows, cols) = w.dims2()?;
            let values = w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            let q = super::nf4::Nf4::quantize(&values, rows, cols, nested)?;
            self.weight = Weight::Nf4(Arc::new(Nf4Linear::new(q)));
        }
        Ok(())
    }

    /// `W + s · B A`: the weight with the adapter folded in (for a merged export).
    pub fn merged_weight(&self, device: &Device) -> Result<Tensor> {
        let weight = self.weight.to_dense(device)?;
        match &self.lora {
            None => Ok(weight),
            Some(l) => {
                // Summed in f32 (the adapter's dtype), stored in the base's.
                let delta = l.lora_b.as_tensor().matmul(l.lora_a.as_tensor())?;
                (weight.to_dtype(DType::F32)? + (delta * l.scaling)?)?.to_dtype(weight.dtype())
            }
        }
    }
}

/// A generator for LoRA initialisation or dropout from a seed.
pub fn seeded(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_adapter_is_a_no_op_and_a_is_kaiming_uniform() {
        let dev = Device::Cpu;
        let w = Tensor::from_vec((0..24).map(|i| i as f32 / 10.0).collect(), (4, 6), &dev).unwrap();
        let mut lin = Linear::new(w, None);
        let cfg = LoraConfig {
            r: 2,
            ..LoraConfig::default()
        };
        lin.lora = Some(Lora::init(6, 4, &cfg, &mut seeded(0), &dev).unwrap());
        let x = Tensor::ones((3, 6), DType::F32, &dev).unwrap();
        let on = crate::model::compute::lora_linear(&lin, &x, Mode::INFERENCE).unwrap();
        let off = crate::model::compute::lora_linear(&lin, &x, Mode::BASE).unwrap();
        assert_eq!(on.to_vec2::<f32>().unwrap(), off.to_vec2::<f32>().unwrap());
        let a = lin.lora.as_ref().unwrap().lora_a.as_tensor();
        let bound = 1.0 / 6f32.sqrt();
        let max = a.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        assert!(max.to_scalar::<f32>().unwrap() <= bound);
        assert_eq!(cfg.scaling(), 16.0);
        let rs = LoraConfig {
            r: 4,
            alpha: 8.0,
            use_rslora: true,
            ..cfg
        };
        assert_eq!(rs.scaling(), 4.0);
    }

    #[test]
    fn config_validation_names_the_problem() {
        let bad = LoraConfig {
            target_modules: vec!["qproj".into()],
            ..LoraConfig::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("\"qproj\"")
        );
    }
}
