//! The Tinker API's JSON bodies (SDK 0.38): what clients send and what rlhost answers.
//! Fields the SDK may add later are ignored; fields it sends that ask for something
//! rlhost does not do are read so that the request can be refused by name.

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Deserialize)]
pub struct CreateSession {
    #[serde(default)]
    pub tags: Vec<String>,
}

#[derive(Debug, Deserialize)]
pub struct SessionRef {
    pub session_id: String,
}

#[derive(Debug, Deserialize)]
pub struct CreateModel {
    pub session_id: String,
    pub model_seq_id: i64,
    pub base_model: String,
    #[serde(default)]
    pub lora_config: Option<LoraConfig>,
    #[serde(default)]
    pub optimizer_config: Option<OptimizerConfig>,
}

#[derive(Debug, Deserialize)]
pub struct LoraConfig {
    pub rank: usize,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default = "yes")]
    pub train_unembed: bool,
    #[serde(default = "yes")]
    pub train_mlp: bool,
    #[serde(default = "yes")]
    pub train_attn: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize)]
pub struct OptimizerConfig {
    #[serde(rename = "type")]
    pub kind: String,
}

#[derive(Debug, Deserialize)]
pub struct ModelRef {
    pub model_id: String,
}

#[derive(Debug, Deserialize)]
pub struct OptimStep {
    pub model_id: String,
    #[serde(default)]
    pub seq_id: Option<i64>,
    #[serde(default)]
    pub adam_params: Option<AdamParams>,
    #[serde(default)]
    pub optimizer_params: Option<Value>,
}

/// `AdamParams` as the SDK sends them (its defaults are not PyTorch's: β2 0.95, ε 1e-12).
#[derive(Debug, Clone, Copy, Deserialize)]
/// A `null` reads as NaN, which the checks refuse by name: the SDK sends a NaN as `null`.
pub struct AdamParams {
    #[serde(deserialize_with = "nan_if_null")]
    pub learning_rate: f64,
    #[serde(default = "beta1", deserialize_with = "nan_if_null")]
    pub beta1: f64,
    #[serde(default = "beta2", deserialize_with = "nan_if_null")]
    pub beta2: f64,
    #[serde(default = "eps", deserialize_with = "nan_if_null")]
    pub eps: f64,
    #[serde(default, deserialize_with = "nan_if_null")]
    pub weight_decay: f64,
    #[serde(default, deserialize_with = "nan_if_null")]
    pub grad_clip_norm: f64,
}

fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// The largest learning rate taken: an AdamW step moves each weight by about the learning
/// rate, so anything above this only wrecks the adapter (1e30 made it NaN).
pub const MAX_LEARNING_RATE: f64 = 1.0;

impl AdamParams {
    /// Each setting in the range where AdamW is defined, or the first that is not, by name.
    pub fn check(&self) -> Result<(), String> {
        let field = |name: &str, v: f64, ok: bool, range: &str| {
            if ok && v.is_finite() {
                Ok(())
            } else {
                let shown = if v.is_nan() {
                    "NaN or null".to_string()
                } else {
                    v.to_string()
                };
                Err(format!("adam_params.{name} must be {range}, got {shown}"))
            }
        };
        let lr = self.learning_rate;
        field(
            "learning_rate",
            lr,
            (0.0..=MAX_LEARNING_RATE).contains(&lr),
            "from 0 to 1",
        )?;
        field(
            "beta1",
            self.beta1,
            (0.0..1.0).contains(&self.beta1),
            "in [0, 1)",
        )?;
        field(
            "beta2",
            self.beta2,
            (0.0..1.0).contains(&self.beta2),
            "in [0, 1)",
        )?;
        field("eps", self.eps, self.eps > 0.0, "above 0")?;
        field(
            "weight_decay",
            self.weight_decay,
            (0.0..=1.0).contains(&self.weight_decay),
            "from 0 to 1",
        )?;
        field(
            "grad_clip_norm",
            self.grad_clip_norm,
            self.grad_clip_norm >= 0.0,
            "0 (no clipping) or above",
        )
    }
}

fn beta1() -> f64 {
    0.9
}
fn beta2() -> f64 {
    0.95
}
fn eps() -> f64 {
    1e-12
}

#[derive(Debug, Deserialize)]
pub struct SaveWeights {
    pub model_id: String,
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default)]
    pub seq_id: Option<i64>,
    /// `save_weights_and_get_sampling_client`: a sampling session instead of a path.
    #[serde(default)]
    pub sampling_session_seq_id: Option<i64>,
    #[serde(default)]
    pub kind: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct LoadWeights {
    /// A training client loading into itself (`load_state`).
    #[serde(default)]
    pub model_id: Option<String>,
    /// Or a new training client made from the checkpoint (`create_training_client_from_state`).
    #[serde(default)]
    pub session_id: Option<String>,
    #[serde(default)]
    pub model_seq_id: Option<i64>,
    #[serde(default)]
    pub seq_id: Option<i64>,
    pub path: String,
    #[serde(default)]
    pub optimizer: bool,
}

#[derive(Debug, Deserialize)]
pub struct CreateSamplingSession {
    pub session_id: String,
    pub sampling_session_seq_id: i64,
    #[serde(default)]
    pub model_path: Option<String>,
    #[serde(default)]
    pub base_model: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct Sample {
    pub num_samples: usize,
    pub prompt: ModelInput,
    pub sampling_params: SamplingParams,
    #[serde(default)]
    pub sampling_session_id: Option<String>,
    #[serde(default)]
    pub base_model: Option<String>,
    #[serde(default)]
    pub model_path: Option<String>,
    #[serde(default)]
    pub prompt_logprobs: bool,
    #[serde(default)]
    pub topk_prompt_logprobs: usize,
    #[serde(default)]
    pub topk_sample_logprobs: usize,
    #[serde(default)]
    pub prompt_alt_tokens_k: usize,
    #[serde(default)]
    pub target_prompt_logprobs: Option<Value>,
    #[serde(default)]
    pub prompt_logprobs_last_n: Option<usize>,
}

#[derive(Debug, Deserialize)]
pub struct ModelInput {
    pub chunks: Vec<Value>,
}

#[derive(Debug, Deserialize)]
pub struct SamplingParams {
    #[serde(default)]
    pub max_tokens: Option<usize>,
    #[serde(default)]
    pub seed: Option<i64>,
    /// A string, strings, or token ids; absent: stop at EOS; `[]`: never stop early.
    #[serde(default)]
    pub stop: Option<Value>,
    #[serde(default = "one")]
    pub temperature: f32,
    #[serde(default = "minus_one")]
    pub top_k: i64,
    #[serde(default = "one")]
    pub top_p: f32,
}

fn one() -> f32 {
    1.0
}
fn minus_one() -> i64 {
    -1
}

#[derive(Debug, Deserialize)]
pub struct RetrieveFuture {
    pub request_id: String,
}

/// A submitted operation's handle.
#[derive(Debug, Serialize)]
pub struct Future {
    pub request_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sample_sequence_ids: Option<Vec<String>>,
}

/// A failed operation, as `retrieve_future` reports it (`RequestFailedResponse`).
#[derive(Debug, Serialize)]
pub struct Failed {
    pub error: String,
    /// `user` (the request cannot succeed as sent), `server`, or `unknown`.
    pub category: &'static str,
}

/// An error in what the client sent (reported with category `user`).
#[derive(Debug)]
pub struct UserError(pub String);

impl std::fmt::Display for UserError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UserError {}
