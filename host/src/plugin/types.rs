//! The plugin contract's data as the host uses it, independent of any one WIT version.
//!
//! Each WIT version's bindings module converts its generated types to and from these,
//! so that the rest of rlhost never names a versioned type (Zed's pattern).

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

pub use crate::sample::{Message, Sample};

/// A finished rollout as reward plugins see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Trajectory {
    pub messages: Vec<Message>,
    pub completion: String,
    #[serde(default = "empty_object")]
    pub metadata: serde_json::Value,
    #[serde(default)]
    pub turns: u32,
    #[serde(default)]
    pub truncated: bool,
}

impl Trajectory {
    /// `sample` answered in one assistant turn by `completion`, not cut off.
    pub fn single_turn(sample: &Sample, completion: String) -> Trajectory {
        let mut messages = sample.messages.clone();
        messages.push(Message {
            role: "assistant".into(),
            content: completion.clone(),
        });
        Trajectory {
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

/// The roles a plugin can play; a component may export several.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Trigger,
    Environment,
    Dataset,
    Reward,
}

impl Role {
    pub const ALL: [Role; 4] = [
        Role::Trigger,
        Role::Environment,
        Role::Dataset,
        Role::Reward,
    ];

    /// The WIT interface that exports this role.
    pub fn interface(self) -> &'static str {
        match self {
            Role::Trigger => "trigger",
            Role::Environment => "environment",
            Role::Dataset => "dataset",
            Role::Reward => "reward",
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
                format!("unknown role `{s}`: expected trigger, environment, dataset or reward")
            })
    }
}
