//! A model's `config.json`, read in both the transformers 4 and transformers 5 forms.
//!
//! transformers 5 moved `rope_theta` and `rope_scaling` into `rope_parameters`, writes
//! `sliding_window: null` and a per-layer `layer_types` list; transformers 4 writes them at
//! the top level (`rope_scaling` may use the old key `type` instead of `rope_type`). Both
//! forms resolve to the same [`ModelConfig`]. Fields we do not implement (sliding-window
//! attention, other rope types, other activations) are refused with the field's name rather
//! than silently giving a different model.

use anyhow::{Context, Result, bail};
use serde_json::{Map, Value};
use std::path::Path;

/// The decoder families rlhost implements; they differ only in biases and norms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Qwen2 / Qwen2.5: bias on q/k/v.
    Qwen2,
    /// Qwen3: RMSNorm on each head's q and k, no attention bias by default.
    Qwen3,
    /// Llama 2/3: optional `attention_bias`/`mlp_bias`, Llama 3 rope scaling.
    Llama,
}

impl Arch {
    /// The `architectures` class name transformers uses for this family.
    pub fn class_name(self) -> &'static str {
        match self {
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Llama => "LlamaForCausalLM",
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Llama => "llama",
        }
    }
}

/// How rotary frequencies are scaled for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `rope_type: default`.
    None,
    /// `rope_type: linear`: positions divided by `factor`.
    Linear { factor: f64 },
    /// `rope_type: llama3`: low frequencies divided by `factor`, high ones kept, a smooth
    /// blend between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// Everything the decoder needs from `config.json`, resolved and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The dtype the weights were saved in (`dtype` in v5, `torch_dtype` in v4), as written.
    pub stored_dtype: Option<String>,
    /// How the checkpoint's projections are quantized (`quantization_config`), if at all.
    pub quantization: Option<Quantization>,
}

/// A checkpoint quantization rlhost loads: bitsandbytes NF4, QLoRA's 4-bit base.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Quantization {
    /// `bnb_4bit_use_double_quant` says whether the absmax values are themselves quantized.
    Nf4 { double: bool },
}

/// `quantization_config`: bitsandbytes NF4 loads; any other quantization is refused by
/// name (its weights are not in a layout rlhost reads).
fn quantization(value: Option<&Value>) -> Result<Option<Quantization>> {
    let Some(v) = value else {
        return Ok(None);
    };
    let q = v
        .as_object()
        .context("field `quantization_config` must be a JSON object")?;
    let method = q
        .get("quant_method")
        .and_then(Value::as_str)
        .unwrap_or("bitsandbytes");
    let refuse = |what: &str| -> Result<Option<Quantization>> {
        bail!(
            "field `quantization_config` describes {what}; rlhost loads bitsandbytes NF4 checkpoints only (QLoRA's 4-bit base): use the unquantized model, with model.quantize = \"nf4\" for a 4-bit base"
        )
    };
    let flag = |k: &str| q.get(k).and_then(Value::as_bool).unwrap_or(false);
    if method != "bitsandbytes" {
        return refuse(&format!(
            "a {method} quantization (quant_method = {method:?})"
        ));
    }
    if flag("load_in_8bit") {
        return refuse("bitsandbytes 8-bit weights (LLM.int8, load_in_8bit)");
    }
    if !flag("load_in_4bit") {
        return refuse("a bitsandbytes quantization that is neither 4-bit nor 8-bit");
    }
    // bitsandbytes' default 4-bit type is FP4.
    match q
        .get("bnb_4bit_quant_type")
        .and_then(Value::as_str)
        .unwrap_or("fp4")
    {
        "nf4" => Ok(Some(Quantization::Nf4 {
            double: flag("bnb_4bit_use_double_quant"),
        })),
        other => refuse(&format!(
            "bitsandbytes 4-bit {} weights (bnb_4bit_quant_type = {other:?})",
            other.to_uppercase()
        )),
    }
}

impl ModelConfig {
    /// Reads `DIR/config.json`.
    pub fn from_dir(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        if !path.is_file() {
            bail!(
                "{} not found: a model directory needs the Hugging Face config.json next to its *.safetensors",
                path.display()
            );
        }
        Self::from_file(&path)
    }

    pub fn from_file(path: &Path) -> Result<ModelConfig> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let value: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        Self::from_json(&value).with_context(|| format!("in {}", path.display()))
    }

    pub fn from_json(value: &Value) -> Result<ModelConfig> {
        let obj = value
            .as_object()
            .context("config.json must be a JSON object")?;
        let fields = Fields(obj);
        let arch = arch_of(&fields)?;

        let act = fields.str_or("hidden_act", "silu")?;
        if act != "silu" {
            bail!("field `hidden_act` = {act:?}: only \"silu\" is implemented");
        }
        if fields.bool_or("use_sliding_window", false)? {
            bail!(
                "field `use_sliding_window` is true: sliding-window attention is not implemented"
            );
        }
        if let Some(types) = obj.get("layer_types").and_then(Value::as_array)
            && let Some(other) = types.iter().find(|t| t.as_str() != Some("full_attention"))
        {
            bail!(
                "field `layer_types` has {other}: only \"full_attention\" layers are implemented"
            );
        }

        let hidden_size = fields.usize("hidden_size")?;
        let num_attention_heads = fields.usize("num_attention_heads")?;
        let num_key_value_heads = fields.usize_or("num_key_value_heads", num_attention_heads)?;
        if num_attention_heads == 0 || num_key_value_heads == 0 {
            bail!("fields `num_attention_heads` and `num_key_value_heads` must be positive");
        }
        if num_attention_heads % num_key_value_heads != 0 {
            bail!(
                "field `num_attention_heads` ({num_attention_heads}) must be a multiple of `num_key_value_heads` ({num_key_value_heads})"
            );
        }
        let head_dim = match obj.get("head_dim") {
            None | Some(Value::Null) => {
                if hidden_size % num_attention_heads != 0 {
                    bail!(
                        "field `hidden_size` ({hidden_size}) is not divisible by `num_attention_heads` ({num_attention_heads}) and there is no `head_dim`"
                    );
                }
                hidden_size / num_attention_heads
            }
            Some(_) => fields.usize("head_dim")?,
        };
        if head_dim % 2 != 0 {
            bail!("head dimension {head_dim} must be even for rotary embeddings");
        }
        let (rope_theta, rope_scaling) = rope_of(obj)?;
        let (attention_bias, mlp_bias) = match arch {
            Arch::Qwen2 => (true, false),
            Arch::Qwen3 => (fields.bool_or("attention_bias", false)?, false),
            Arch::Llama => (
                fields.bool_or("attention_bias", false)?,
                fields.bool_or("mlp_bias", false)?,
            ),
        };
        let cfg = ModelConfig {
            arch,
            vocab_size: fields.usize("vocab_size")?,
            hidden_size,
            intermediate_size: fields.usize("intermediate_size")?,
            num_hidden_layers: fields.usize("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            max_position_embeddings: fields.usize_or("max_position_embeddings", 4096)?,
            rms_norm_eps: fields.f64_or("rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: fields.bool_or("tie_word_embeddings", false)?,
            attention_bias,
            mlp_bias,
            bos_token_id: fields.opt_u32("bos_token_id")?,
            eos_token_ids: token_ids(obj.get("eos_token_id"), "eos_token_id")?,
            stored_dtype: obj
                .get("dtype")
                .or_else(|| obj.get("torch_dtype"))
                .and_then(Value::as_str)
                .map(str::to_owned),
            quantization: quantization(obj.get("quantization_config"))?,
        };
        Ok(cfg)
    }

    /// Query heads per key/value head (grouped-query attention).
    pub fn n_rep(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// The `config.json` of this model in transformers 5 form, for a merged export.
    pub fn to_json(&self, dtype: &str) -> Value {
        let mut rope = Map::new();
        rope.insert("rope_theta".into(), self.rope_theta.into());
        match &self.rope_scaling {
            RopeScaling::None => {
                rope.insert("rope_type".into(), "default".into());
            }
            RopeScaling::Linear { factor } => {
                rope.insert("rope_type".into(), "linear".into());
                rope.insert("factor".into(), (*factor).into());
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                rope.insert("rope_type".into(), "llama3".into());
                rope.insert("factor".into(), (*factor).into());
                rope.insert("low_freq_factor".into(), (*low_freq_factor).into());
                rope.insert("high_freq_factor".into(), (*high_freq_factor).into());
                rope.insert(
                    "original_max_position_embeddings".into(),
                    (*original_max_position_embeddings as u64).into(),
                );
            }
        }
        let eos: Value = match self.eos_token_ids.as_slice() {
            [one] => (*one).into(),
            many => many.to_vec().into(),
        };
        let mut obj = serde_json::json!({
            "architectures": [self.arch.class_name()],
            "model_type": self.arch.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": Value::Object(rope),
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "dtype": dtype,
            "use_cache": true,
        });
        let map = obj.as_object_mut().expect("object literal");
        match self.arch {
            Arch::Qwen2 => {
                map.insert("use_sliding_window".into(), false.into());
                map.insert("sliding_window".into(), Value::Null);
            }
            Arch::Qwen3 => {
                map.insert("attention_bias".into(), self.attention_bias.into());
                map.insert("use_sliding_window".into(), false.into());
                map.insert("sliding_window".into(), Value::Null);
            }
            Arch::Llama => {
                map.insert("attention_bias".into(), self.attention_bias.into());
                map.insert("mlp_bias".into(), self.mlp_bias.into());
            }
        }
        obj
    }
}

fn arch_of(fields: &Fields) -> Result<Arch> {
    let from_type = |t: &str| match t {
        "qwen2" => Some(Arch::Qwen2),
        "qwen3" => Some(Arch::Qwen3),
        "llama" => Some(Arch::Llama),
        _ => None,
    };
    if let Some(t) = fields.0.get("model_type").and_then(Value::as_str) {
        return from_type(t).with_context(|| {
            format!("field `model_type` = {t:?}: supported are \"qwen2\", \"qwen3\" and \"llama\"")
        });
    }
    let classes = fields.0.get("architectures").and_then(Value::as_array);
    for class in classes.into_iter().flatten().filter_map(Value::as_str) {
        for arch in [Arch::Qwen2, Arch::Qwen3, Arch::Llama] {
            if class == arch.class_name() {
                return Ok(arch);
            }
        }
    }
    bail!(
        "no `model_type` (or a known `architectures` entry): supported are qwen2, qwen3 and llama"
    )
}

/// Rope base and scaling from `rope_parameters` (v5) or `rope_theta` + `rope_scaling` (v4).
fn rope_of(obj: &Map<String, Value>) -> Result<(f64, RopeScaling)> {
    let (params, where_) = match obj.get("rope_parameters") {
        Some(Value::Object(p)) => (Some(p), "rope_parameters"),
        Some(Value::Null) | None => match obj.get("rope_scaling") {
            Some(Value::Object(p)) => (Some(p), "rope_scaling"),
            Some(Value::Null) | None => (None, "rope_scaling"),
            Some(other) => bail!("field `rope_scaling` must be an object or null, found {other}"),
        },
        Some(other) => bail!("field `rope_parameters` must be an object, found {other}"),
    };
    let theta = match params.and_then(|p| p.get("rope_theta")) {
        Some(v) => v
            .as_f64()
            .with_context(|| format!("field `{where_}.rope_theta` must be a number"))?,
        None => Fields(obj).f64_or("rope_theta", 10_000.0)?,
    };
    let Some(params) = params else {
        return Ok((theta, RopeScaling::None));
    };
    let p = Fields(params);
    let kind = params
        .get("rope_type")
        .or_else(|| params.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: p.f64(&format!("factor (in `{where_}`)"), "factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: p.f64(&format!("{where_}.factor"), "factor")?,
            low_freq_factor: p.f64(&format!("{where_}.low_freq_factor"), "low_freq_factor")?,
            high_freq_factor: p.f64(&format!("{where_}.high_freq_factor"), "high_freq_factor")?,
            original_max_position_embeddings: p.f64(
                &format!("{where_}.original_max_position_embeddings"),
                "original_max_position_embeddings",
            )?,
        },
        other => bail!(
            "field `{where_}.rope_type` = {other:?}: implemented are \"default\", \"linear\" and \"llama3\""
        ),
    };
    Ok((theta, scaling))
}

/// `eos_token_id`: absent, null, one id or a list of ids.
pub(crate) fn token_ids(value: Option<&Value>, field: &str) -> Result<Vec<u32>> {
    let one = |v: &Value| {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .with_context(|| {
                format!("field `{field}` must be a token id or a list of them, found {v}")
            })
    };
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

/// Typed access to a JSON object with errors that name the field.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn usize(&self, key: &str) -> Result<usize> {
        let v = self
            .get(key)
            .with_context(|| format!("missing field `{key}`"))?;
        v.as_u64()
            .map(|n| n as usize)
            .with_context(|| format!("field `{key}` must be a non-negative integer, found {v}"))
    }

    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.get(key) {
            None => Ok(default),
            Some(_) => self.usize(key),
        }
    }

    fn opt_u32(&self, key: &str) -> Result<Option<u32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .with_context(|| format!("field `{key}` must be a token id, found {v}")),
        }
    }

    fn f64(&self, name: &str, key: &str) -> Result<f64> {
        let v = self
            .get(key)
            .with_context(|| format!("missing field `{name}`"))?;
        v.as_f64()
            .with_context(|| format!("field `{name}` must be a number, found {v}"))
    }

    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(_) => self.f64(key, key),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .with_context(|| format!("field `{key}` must be true or false, found {v}")),
        }
    }

    fn str_or<'b>(&'b self, key: &str, default: &'b str) -> Result<&'b str> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .with_context(|| format!("field `{key}` must be a string, found {v}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixtures() -> PathBuf {
        PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/models"
        ))
    }

    #[test]
    fn v4_and_v5_forms_resolve_to_the_same_config() {
        let v5 = ModelConfig::from_dir(&fixtures().join("qwen2")).unwrap();
        let v4 = ModelConfig::from_file(&fixtures().join("qwen2/config.v4.json")).unwrap();
        assert_eq!(v5.arch, Arch::Qwen2);
        assert_eq!(v5.head_dim, 16);
        assert!(v5.tie_word_embeddings && v5.attention_bias);
        let v4 = ModelConfig {
            stored_dtype: v5.stored_dtype.clone(),
            ..v4
        };
        assert_eq!(v4, v5);
    }

    #[test]
    fn llama3_rope_and_qwen3_fields() {
        let llama = ModelConfig::from_dir(&fixtures().join("llama")).unwrap();
        assert_eq!(
            llama.rope_scaling,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 64.0
            }
        );
        assert!(!llama.tie_word_embeddings);
        let qwen3 = ModelConfig::from_dir(&fixtures().join("qwen3")).unwrap();
        assert_eq!(qwen3.arch, Arch::Qwen3);
        assert!(!qwen3.attention_bias);
        assert_eq!(qwen3.stored_dtype.as_deref(), Some("bfloat16"));
    }

    #[test]
    fn exported_config_reads_back_identically() {
        for name in ["qwen2", "qwen3", "llama"] {
            let cfg = ModelConfig::from_dir(&fixtures().join(name)).unwrap();
            let back = ModelConfig::from_json(&cfg.to_json("float32")).unwrap();
            assert_eq!(back.stored_dtype.as_deref(), Some("float32"));
            assert_eq!(
                ModelConfig {
                    stored_dtype: None,
                    ..back
                },
                ModelConfig {
                    stored_dtype: None,
                    ..cfg
                }
            );
        }
    }

    /// bitsandbytes NF4 is read; FP4, 8-bit, GPTQ and AWQ are each one error that names
    /// what was found.
    #[test]
    fn quantization_configs_are_read_or_named() {
        let nf4 = ModelConfig::from_dir(&fixtures().join("qwen2-nf4")).unwrap();
        assert_eq!(nf4.quantization, Some(Quantization::Nf4 { double: true }));
        assert_eq!(
            ModelConfig::from_dir(&fixtures().join("qwen2"))
                .unwrap()
                .quantization,
            None
        );
        let base: Value = serde_json::from_str(
            &std::fs::read_to_string(fixtures().join("qwen2/config.json")).unwrap(),
        )
        .unwrap();
        for (q, named) in [
            (
                serde_json::json!({"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "fp4"}),
                "FP4",
            ),
            (
                serde_json::json!({"quant_method": "bitsandbytes", "load_in_8bit": true}),
                "8-bit",
            ),
            (
                serde_json::json!({"quant_method": "gptq", "bits": 4}),
                "gptq",
            ),
            (serde_json::json!({"quant_method": "awq", "bits": 4}), "awq"),
        ] {
            let mut v = base.clone();
            v["quantization_config"] = q;
            let e = format!("{:#}", ModelConfig::from_json(&v).unwrap_err());
            assert!(e.contains(named) && e.contains("model.quantize"), "{e}");
        }
    }

    #[test]
    fn errors_name_the_field() {
        let base = ModelConfig::from_dir(&fixtures().join("qwen2"))
            .unwrap()
            .to_json("float32");
        let check = |edit: &dyn Fn(&mut Map<String, Value>), want: &str| {
            let mut v = base.clone();
            edit(v.as_object_mut().unwrap());
            let err = format!("{:#}", ModelConfig::from_json(&v).unwrap_err());
            assert!(err.contains(want), "{err:?} should contain {want:?}");
        };
        check(
            &|m| drop(m.remove("hidden_size")),
            "missing field `hidden_size`",
        );
        check(
            &|m| drop(m.insert("vocab_size".into(), "x".into())),
            "`vocab_size`",
        );
        check(
            &|m| drop(m.insert("model_type".into(), "gpt2".into())),
            "`model_type`",
        );
        check(
            &|m| drop(m.insert("num_key_value_heads".into(), 3.into())),
            "multiple",
        );
        check(
            &|m| drop(m.insert("use_sliding_window".into(), true.into())),
            "sliding",
        );
        check(
            &|m| {
                drop(m.insert(
                    "rope_parameters".into(),
                    serde_json::json!({"rope_type": "yarn"}),
                ))
            },
            "rope_parameters.rope_type",
        );
        check(
            &|m| drop(m.insert("hidden_act".into(), "gelu".into())),
            "hidden_act",
        );
    }

    #[test]
    fn missing_config_names_the_file() {
        let err = ModelConfig::from_dir(Path::new("/nonexistent/model")).unwrap_err();
        assert!(format!("{err:#}").contains("/nonexistent/model/config.json"));
    }
}
