//! The sample format that crosses parts (RL2's): datasets yield samples, rollouts render
//! their messages with the chat template, plugins receive them. Its own module, so that
//! data, rollouts and training need not import the plugin sandbox for two structs.

use serde::{Deserialize, Serialize};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// A task instance: the prompt and its metadata (RL2's sample format).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub messages: Vec<Message>,
    /// A JSON object, e.g. `{"answer": "42"}`.
    pub metadata: serde_json::Value,
}

impl Sample {
    /// A sample with one user message and no metadata.
    pub fn from_prompt(prompt: &str) -> Self {
        Sample {
            messages: vec![Message {
                role: "user".into(),
                content: prompt.into(),
            }],
            metadata: serde_json::Value::Object(Default::default()),
        }
    }
}
