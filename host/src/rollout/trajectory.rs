//! A finished rollout as the trainer, the reward plugins and `rollouts.jsonl` see it.
//!
//! `tokens` are exactly the ids the model saw, prompt first. Everything after the prompt
//! is covered by `spans`: what the model sampled (trained on, `loss_mask` 1) and what the
//! host inserted — trigger output and environment turns — (not trained on, mask 0).

use super::tree::TreePlace;
use crate::plugin::Fault;
use crate::task::Message;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Who wrote a stretch of the completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpanKind {
    /// Sampled by the model.
    Model,
    /// Inserted by a trigger (tool output, or a tool-error text).
    Tool,
    /// Inserted for an environment: the end of the assistant turn and the environment's
    /// messages, rendered by the chat template, up to the next assistant header.
    Env,
}

/// Tokens `start..end` of the completion (0 = the first token after the prompt).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenSpan {
    pub kind: SpanKind,
    pub start: usize,
    pub end: usize,
    /// The tokens' text (decoded, special tokens kept).
    pub text: String,
}

/// Why a trajectory ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model ended its turn (a stop token or stop string) and no environment asked
    /// for more.
    EndOfTurn,
    /// The environment ended the episode.
    EnvDone,
    /// One assistant turn reached `sampling.max_new_tokens`.
    TurnTokens,
    /// The whole sequence reached `rollout.max_total_tokens`.
    TotalTokens,
    /// `rollout.max_turns` assistant turns were taken and the environment wanted more.
    MaxTurns,
    /// `rollout.max_tool_calls` tool calls were made and the model asked for another.
    MaxToolCalls,
    /// The environment plugin failed; the episode cannot go on.
    EnvFault,
    /// The chat template could not render the environment's messages as a continuation.
    TemplateError,
}

impl StopReason {
    /// Whether a limit cut the rollout off before the model or the environment ended it.
    pub fn truncated(self) -> bool {
        matches!(
            self,
            StopReason::TurnTokens
                | StopReason::TotalTokens
                | StopReason::MaxTurns
                | StopReason::MaxToolCalls
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::EndOfTurn => "end_of_turn",
            StopReason::EnvDone => "env_done",
            StopReason::TurnTokens => "turn_tokens",
            StopReason::TotalTokens => "total_tokens",
            StopReason::MaxTurns => "max_turns",
            StopReason::MaxToolCalls => "max_tool_calls",
            StopReason::EnvFault => "env_fault",
            StopReason::TemplateError => "template_error",
        }
    }
}

/// A plugin fault met during the rollout (a serializable copy of [`Fault`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultRecord {
    pub plugin: String,
    pub call: String,
    pub kind: String,
    pub message: String,
}

impl From<&Fault> for FaultRecord {
    fn from(f: &Fault) -> Self {
        FaultRecord {
            plugin: f.plugin.clone(),
            call: f.call.to_string(),
            kind: f.kind.as_str().to_string(),
            message: f.message.clone(),
        }
    }
}

/// One finished rollout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trajectory {
    /// The dataset's id of the sample this answers.
    pub sample_id: u64,
    /// Index within its group (0..group_size).
    pub index: usize,
    /// The adapter version the rollout was sampled with.
    pub version: u64,
    /// Prompt and completion token ids, exactly as the model saw them.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Per completion token: the sampling log-prob (log softmax(logits / T)); `None` for
    /// inserted tokens.
    pub logps: Vec<Option<f32>>,
    pub spans: Vec<TokenSpan>,
    /// The conversation: the prompt's messages, each assistant turn (with trigger output
    /// in place) and each environment message.
    pub messages: Vec<Message>,
    /// The completion's text as decoded (special tokens kept).
    pub completion: String,
    pub metadata: serde_json::Value,
    /// Assistant turns taken.
    pub turns: u32,
    /// Trigger outputs and environment answers inserted.
    pub tool_calls: u32,
    /// Tool outputs cut to `rollout.max_tool_output_tokens`.
    pub tool_truncations: u32,
    /// Function calls (the `tools` role) by how they went: `ok`, `tool_error`, `fault`,
    /// or a malformed call's kind (`bad_json`, `unknown_function`, ...).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub call_kinds: BTreeMap<String, u32>,
    pub stop: StopReason,
    pub truncated: bool,
    pub faults: Vec<FaultRecord>,
    /// What a reward plugin said about its score, by plugin: the first line it logged at
    /// `warn` or above while scoring (a code reward's first failed test).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub notes: BTreeMap<String, String>,
    /// Reward components by name (weighted sum in `reward`); empty until scored.
    pub rewards: BTreeMap<String, f64>,
    pub reward: f64,
    /// Its place in its group's tree, when the group was sampled as one
    /// (`[rollout.tree]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tree: Option<TreePlace>,
}

impl Trajectory {
    /// A bare trajectory: `tokens` whose completion (after `prompt_len`) was sampled with
    /// the log-probs `logps` (`None` on inserted tokens), one assistant turn ended by its
    /// stop token, nothing else recorded yet (no spans, messages, calls, faults or
    /// rewards). What the gateway's runs, benchmarks and tests start from; the fields a
    /// caller knows go on top with struct update syntax.
    pub fn sampled(tokens: Vec<u32>, prompt_len: usize, logps: Vec<Option<f32>>) -> Trajectory {
        Trajectory {
            sample_id: 0,
            index: 0,
            version: 0,
            tokens,
            prompt_len,
            logps,
            spans: Vec::new(),
            messages: Vec::new(),
            completion: String::new(),
            metadata: serde_json::json!({}),
            turns: 1,
            tool_calls: 0,
            tool_truncations: 0,
            call_kinds: BTreeMap::new(),
            stop: StopReason::EndOfTurn,
            truncated: false,
            faults: Vec::new(),
            notes: BTreeMap::new(),
            rewards: BTreeMap::new(),
            reward: 0.0,
            tree: None,
        }
    }

    /// 1 for tokens the model sampled (trained on), 0 for inserted ones; one per
    /// completion token.
    pub fn loss_mask(&self) -> Vec<u8> {
        self.logps.iter().map(|l| l.is_some() as u8).collect()
    }

    pub fn completion_tokens(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Tokens the model sampled.
    pub fn sampled_tokens(&self) -> usize {
        self.logps.iter().filter(|l| l.is_some()).count()
    }

    /// The trajectory as the reward plugins receive it.
    pub fn for_reward(&self) -> crate::plugin::Transcript {
        crate::plugin::Transcript {
            messages: self.messages.clone(),
            completion: self.completion.clone(),
            metadata: self.metadata.clone(),
            turns: self.turns,
            truncated: self.truncated,
        }
    }
}

/// The G trajectories sampled for one prompt.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Group {
    pub sample_id: u64,
    pub trajectories: Vec<Trajectory>,
}

/// Each reward component's mean over `trajectories` (a component a trajectory lacks
/// counts as 0 for it).
pub fn component_means<'a>(
    trajectories: impl ExactSizeIterator<Item = &'a Trajectory>,
) -> BTreeMap<String, f64> {
    let n = trajectories.len().max(1) as f64;
    let mut out: BTreeMap<String, f64> = BTreeMap::new();
    for t in trajectories {
        for (k, v) in &t.rewards {
            *out.entry(k.clone()).or_default() += v / n;
        }
    }
    out
}
