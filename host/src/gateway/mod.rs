//! The OpenAI-compatible gateway of issue 46: an agent written against the Chat
//! Completions API points its `base_url` here, its calls are sampled from the policy and
//! recorded token-exactly per session, and finished sessions train the policy.
//!
//! - [`wire`]: the requests' checks and the answers' shapes (`docs/design/openai-wire.md`
//!   holds the format as openai-python, OpenAI's OpenAPI spec and vLLM define it);
//! - [`chat`]: messages to prompt ids with the model's template, sampled ids to answers
//!   with tool calls read in the model's format;
//! - [`record`]: a session's token-exact rows with drift detection;
//! - [`sessions`]: the open sessions, their tasks, groups and rewards;
//! - [`server`]: the routes and the gateway's state; `calls.rs` one sampling call
//!   (admitted, recorded in its session, answered); [`pump`]: the model's thread, where every call in flight is
//!   decoded in one batch (`sampler/local.rs`), or sent to vLLM servers
//!   (`rollout.engine = "vllm"`, `sampler/servers.rs`): one loop over the sampler seam;
//! - [`train`]: a `[gateway]` run's batches, made of the task groups agents finish.
//!
//! `rlhost serve` serves a model and records sessions to a file; `rlhost train` with
//! `[gateway]` trains on them (docs/src/gateway.md).

mod answers;
mod calls;
pub mod chat;
pub mod pump;
pub mod record;
mod rl_routes;
pub mod server;
pub mod sessions;
pub mod state;
mod stream;
pub mod train;
pub mod wire;
