//! The language model: Hugging Face Qwen2/Qwen3/Llama directories loaded into candle, with
//! LoRA adapters in PEFT's format, the tokenizer and chat template, and sampling.
//!
//! One set of weights serves two paths (see [`decoder`]): a batched, differentiable path
//! for training and log-probs, and a KV-cached path for sampling.

pub mod alloc;
#[cfg(target_arch = "x86_64")]
pub mod attention;
pub mod bundle;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod decoder;
#[cfg(test)]
pub(crate) mod fixtures;
pub mod frozen;
pub mod fused;
// AVX2/FMA kernels for the training step; elsewhere candle's ops do the work.
#[cfg(target_arch = "x86_64")]
pub mod gemm;
pub mod gemv;
pub mod generate;
#[cfg(target_arch = "x86_64")]
pub mod head;
pub mod lora;
#[cfg(target_arch = "x86_64")]
pub mod lora_op;
#[cfg(target_arch = "x86_64")]
pub mod mlp_op;
pub mod nf4;
pub mod ops;
pub mod peft;
pub mod sample;
pub mod simd;
pub mod storage;
pub mod threads;
pub mod tokenizer;
pub mod weights;

pub use bundle::LanguageModel;
pub use config::{Arch, ModelConfig};
pub use decoder::{KvCache, Model};
pub use lora::{LoraConfig, Mode};
