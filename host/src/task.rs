//! A task instance, as it crosses rooms (RL2's sample format): datasets yield samples,
//! rollouts render their messages with the chat template, plugins receive them. Named for
//! the task, not the sampling (`sampler/` draws tokens). Its own module, so that data,
//! rollouts and training need not import the plugin sandbox for two structs.

use serde::{Deserialize, Serialize};

/// One chat message, in the Hugging Face / OpenAI chat format.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An assistant message's function calls, in the order written.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<MessageToolCall>,
    /// A `tool` message: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    /// A plain message: a role and its text.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
            ..Default::default()
        }
    }
}

/// One function call of an assistant message, in the OpenAI shape chat templates read
/// (`{"id", "type": "function", "function": {"name", "arguments"}}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: CalledFunction,
}

fn function_type() -> String {
    "function".into()
}

/// The function a call names and its arguments: a JSON object as the model wrote it, or
/// (from datasets in that form) a JSON string holding one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CalledFunction {
    pub name: String,
    pub arguments: serde_json::Value,
}

impl MessageToolCall {
    pub fn new(id: String, name: String, arguments: serde_json::Value) -> MessageToolCall {
        MessageToolCall {
            id,
            kind: function_type(),
            function: CalledFunction { name, arguments },
        }
    }

    /// The arguments as JSON text (a string holding JSON is passed as it is).
    pub fn arguments_text(&self) -> String {
        match &self.function.arguments {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        }
    }
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
                ..Default::default()
            }],
            metadata: serde_json::Value::Object(Default::default()),
        }
    }
}
