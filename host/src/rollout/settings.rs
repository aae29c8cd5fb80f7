//! What the rollout engine needs besides the model: the group size, sampling, the
//! per-trajectory limits, the template's variables, what answers turns (the environment
//! seam's [`Answerers`]), who samples, and whether groups grow as trees.

use super::env::Answerers;
use super::tree::TreeSettings;
use crate::sampler::draw::SamplingParams;
use crate::sampler::vllm::Pool;
use serde_json::{Map, Value as Json};
use std::sync::Arc;

/// Per-trajectory limits.
#[derive(Debug, Clone)]
pub struct RolloutLimits {
    /// Assistant turns (with an environment); the episode is cut after this many.
    pub max_turns: u32,
    /// Tool outputs and environment answers inserted.
    pub max_tool_calls: u32,
    /// Tokens of one tool output; longer output is cut and `truncation_marker` appended.
    pub max_tool_output_tokens: usize,
    /// Prompt plus completion.
    pub max_total_tokens: usize,
    pub truncation_marker: String,
}

impl Default for RolloutLimits {
    fn default() -> Self {
        RolloutLimits {
            max_turns: 8,
            max_tool_calls: 8,
            max_tool_output_tokens: 256,
            max_total_tokens: 4096,
            truncation_marker: "…[truncated]".into(),
        }
    }
}

/// What the engine needs besides the model.
#[derive(Clone)]
pub struct RolloutSettings {
    pub group_size: usize,
    /// `max_new_tokens` is per assistant turn; stop tokens and strings end a turn.
    pub sampling: SamplingParams,
    pub limits: RolloutLimits,
    /// Extra chat template variables, e.g. `enable_thinking = false`.
    pub template_kwargs: Map<String, Json>,
    /// What answers turns: trigger, environment plugin, tools, OpenEnv server.
    pub env: Answerers,
    /// vLLM servers that sample in place of the local model (`rollout.engine = "vllm"`).
    pub remote: Option<Arc<Pool>>,
    /// Groups sampled as trees (`[rollout.tree]`); `group_size` bounds their leaves.
    pub tree: Option<TreeSettings>,
}
