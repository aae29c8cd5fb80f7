//! Sampling: where a model's tokens come from, for every caller.
//!
//! - [`seam`]: the seam every caller samples through ([`Sampling`]: requests, sinks,
//!   tokens, released choices) — the trajectory engine, the gateway, plugins'
//!   `model.generate`, [`generate`].
//! - [`local`]: its in-process side, continuous batching over the model's KV-cached path.
//! - [`servers`]: its side on vLLM servers ([`vllm`]: the server pool, requests, checks
//!   and adapter versions).
//! - [`decode`]: batched, cached sequences and the decode step under the local sampler.
//! - [`kv_budget`]: the bytes of keys and values a server's requests may hold.
//! - [`draw`]: the sampling parameters and the next token's draw from logits on the host;
//!   [`device_draw`] the same draw where the logits are (a GPU).

pub mod decode;
pub mod device_draw;
pub mod draw;
pub mod kv_budget;
pub mod local;
pub mod seam;
pub mod servers;
pub mod vllm;

pub use draw::SamplingParams;
pub use local::{Sampler, generate};
pub use seam::{Held, Request, Sampling, Sink, Ticket, Token};
