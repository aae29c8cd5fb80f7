//! Bindings for `rlhost:plugin@0.1.0` and conversions to the host's own types.

use crate::plugin::types;

wasmtime::component::bindgen!({
    path: "../wit/v0.1.0",
    world: "host-view",
    // Exports are called with `call_async` so that a plugin blocked in an async WASI call
    // (a sleep, a poll) can be cancelled by the host's deadline; see `sandbox.rs`.
    exports: { default: async },
});

pub use self::rlhost::plugin::host::{Host, Level};
pub use self::rlhost::plugin::types as wit;
pub use exports::rlhost::plugin::{about, dataset, environment, reward, trigger};

impl From<&types::Message> for wit::Message {
    fn from(m: &types::Message) -> Self {
        wit::Message {
            role: m.role.clone(),
            content: m.content.clone(),
        }
    }
}

impl From<wit::Message> for types::Message {
    fn from(m: wit::Message) -> Self {
        types::Message {
            role: m.role,
            content: m.content,
        }
    }
}

impl From<&types::Sample> for wit::Sample {
    fn from(s: &types::Sample) -> Self {
        wit::Sample {
            messages: s.messages.iter().map(Into::into).collect(),
            metadata: s.metadata.to_string(),
        }
    }
}

impl From<&types::Trajectory> for wit::Trajectory {
    fn from(t: &types::Trajectory) -> Self {
        wit::Trajectory {
            messages: t.messages.iter().map(Into::into).collect(),
            completion: t.completion.clone(),
            metadata: t.metadata.to_string(),
            turns: t.turns,
            truncated: t.truncated,
        }
    }
}

impl From<wit::Component> for types::Component {
    fn from(c: wit::Component) -> Self {
        types::Component {
            name: c.name,
            value: c.value,
        }
    }
}

impl From<wit::StepResult> for types::StepResult {
    fn from(s: wit::StepResult) -> Self {
        types::StepResult {
            messages: s.messages.into_iter().map(Into::into).collect(),
            done: s.done,
            reward: s.reward,
        }
    }
}

impl From<wit::PluginInfo> for types::PluginInfo {
    fn from(i: wit::PluginInfo) -> Self {
        types::PluginInfo {
            name: i.name,
            version: i.version,
            description: i.description,
        }
    }
}

impl From<Level> for tracing::Level {
    fn from(level: Level) -> Self {
        match level {
            Level::Trace => tracing::Level::TRACE,
            Level::Debug => tracing::Level::DEBUG,
            Level::Info => tracing::Level::INFO,
            Level::Warn => tracing::Level::WARN,
            Level::Error => tracing::Level::ERROR,
        }
    }
}
