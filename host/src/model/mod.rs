//! The language model: Hugging Face Qwen2/Qwen3/Llama directories loaded into candle, with
//! LoRA adapters in PEFT's format, the tokenizer and chat template (sampling from it is
//! [`crate::sampler`]'s).
//!
//! One set of weights serves two paths (see [`decoder`]): a batched, differentiable path
//! for training and log-probs, and a KV-cached path for sampling.

pub mod bundle;
pub mod chat;
pub mod checkpoint;
pub mod compute;
pub mod config;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
pub mod decoder;
#[cfg(test)]
pub(crate) mod fixtures;
pub mod frozen;
pub mod joint;
pub mod kv_cache;
pub mod lora;
pub mod nf4;
pub mod ops;
pub mod peft;
pub mod placement;
pub mod profile;
pub mod tokenizer;
pub mod weights;

pub use bundle::LanguageModel;
pub use config::{Arch, ModelConfig};
pub use decoder::Model;
pub use kv_cache::KvCache;
pub use lora::{LoraConfig, Mode};
pub use placement::Placement;

/// The kernels themselves, for the benchmarks under `examples/` that time them: the
/// crate reaches `cpu/` and `cuda/` only through [`compute`], the compute seam.
#[doc(hidden)]
pub mod kernels {
    pub use super::cpu::gemm;
    #[cfg(feature = "cuda")]
    pub use super::cuda::{attention, flash, graph, lora};
}
