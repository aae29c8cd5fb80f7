//! The plugin contract's data as the host uses it, independent of any one WIT version.
//!
//! Each WIT version's bindings module converts its generated types to and from these,
//! so that the rest of rlhost never names a versioned type (Zed's pattern).

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

pub use crate::task::{Message, MessageToolCall, Sample};

/// A finished rollout as reward plugins see it (the contract's `trajectory` record): its
/// messages and final text, where `rollout::Trajectory` is the trainer's tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Transcript {
    pub messages: Vec<Message>,
    pub completion: String,
    #[serde(default = "empty_object")]
    pub metadata: serde_json::Value,
    #[serde(default)]
    pub turns: u32,
    #[serde(default)]
    pub truncated: bool,
}

impl Transcript {
    /// `sample` answered in one assistant turn by `completion`, not cut off.
    pub fn single_turn(sample: &Sample, completion: String) -> Transcript {
        let mut messages = sample.messages.clone();
        messages.push(Message {
            role: "assistant".into(),
            content: completion.clone(),
            ..Default::default()
        });
        Transcript {
            messages,
            completion,
            metadata: sample.metadata.clone(),
            turns: 1,
            truncated: false,
        }
    }
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(Default::default())
}

/// One named part of a reward.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Component {
    pub name: String,
    pub value: f64,
}

/// What an environment step returns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepResult {
    pub messages: Vec<Message>,
    pub done: bool,
    pub reward: Option<f64>,
}

/// What a plugin says about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginInfo {
    pub name: String,
    pub version: String,
    pub description: String,
}

/// A function a tools plugin offers the model: its name, what it does, its parameters as
/// a JSON Schema object (as OpenAI's and transformers' `tools` have it), and whether its
/// calls may run in fresh instances at once (`stateless`).
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionSpec {
    pub name: String,
    pub description: String,
    pub parameters: serde_json::Value,
    pub stateless: bool,
}

/// The roles a plugin can play; a component may export several.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Trigger,
    Environment,
    Dataset,
    Reward,
    /// Functions the model calls in its own format (WIT 0.2.0 on).
    Tools,
}

impl Role {
    pub const ALL: [Role; 5] = [
        Role::Trigger,
        Role::Environment,
        Role::Dataset,
        Role::Reward,
        Role::Tools,
    ];

    /// The WIT interface that exports this role.
    pub fn interface(self) -> &'static str {
        match self {
            Role::Trigger => "trigger",
            Role::Environment => "environment",
            Role::Dataset => "dataset",
            Role::Reward => "reward",
            Role::Tools => "tools",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.interface())
    }
}

impl FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Role::ALL
            .into_iter()
            .find(|role| role.interface() == s)
            .ok_or_else(|| {
                format!(
                    "unknown role `{s}`: expected trigger, environment, dataset, reward or tools"
                )
            })
    }
}
