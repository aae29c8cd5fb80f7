//! The OpenAI-compatible gateway of issue 46: an agent written against the Chat
//! Completions API points its `base_url` here, its calls are sampled from the policy and
//! recorded token-exactly per session, and finished sessions train the policy.
//!
//! Where it stands: [`wire`], the request checks and the answer shapes, and [`record`], a
//! session's token-exact rows with drift detection, are in; the server, sessions' routes
//! and rewards, training from them and the sampler seam they need (`rollout/engine.rs`
//! serving any source of requests in one decode loop) are not yet. `docs/design/openai-wire.md` holds
//! the wire format as openai-python, OpenAI's OpenAPI spec and vLLM define it.

pub mod record;
pub mod wire;
