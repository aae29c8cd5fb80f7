//! Bindings for `rlhost:plugin@0.2.0`: its export indices, its host functions (`log`, and
//! `model.generate`, answered as the plugin's grant allows), and conversions to the host's
//! own types. See docs/design/wit-0.2.0.md.

use crate::plugin::model as host_model;
use crate::plugin::sandbox::StoreState;
use crate::plugin::types::{self, Role};
use wasmtime::component::{HasSelf, InstancePre, Linker};

wasmtime::component::bindgen!({
    path: "../wit/v0.2.0",
    world: "host-view",
    // As for 0.1.0: exports called with `call_async`, so the deadline can cancel them.
    exports: { default: async },
    // `generate` waits for the rollout engine's answer without holding a worker thread.
    imports: { "rlhost:plugin/model.generate": async },
});

pub use self::rlhost::plugin::host::{Host, Level};
pub use self::rlhost::plugin::model;
pub use self::rlhost::plugin::types as wit;
pub use exports::rlhost::plugin::{about, dataset, environment, reward, tools, trigger};

/// This version's export indices, looked up once per plugin.
pub struct Exports {
    pub about: about::GuestIndices,
    pub trigger: Option<trigger::GuestIndices>,
    pub environment: Option<environment::GuestIndices>,
    pub dataset: Option<dataset::GuestIndices>,
    pub reward: Option<reward::GuestIndices>,
    pub tools: Option<tools::GuestIndices>,
}

impl Exports {
    /// The indices of `about` and of each of `roles`.
    pub fn new(pre: &InstancePre<StoreState>, roles: &[Role]) -> wasmtime::Result<Exports> {
        let has = |role| roles.contains(&role);
        Ok(Exports {
            about: about::GuestIndices::new(pre)?,
            trigger: has(Role::Trigger)
                .then(|| trigger::GuestIndices::new(pre))
                .transpose()?,
            environment: has(Role::Environment)
                .then(|| environment::GuestIndices::new(pre))
                .transpose()?,
            dataset: has(Role::Dataset)
                .then(|| dataset::GuestIndices::new(pre))
                .transpose()?,
            reward: has(Role::Reward)
                .then(|| reward::GuestIndices::new(pre))
                .transpose()?,
            tools: has(Role::Tools)
                .then(|| tools::GuestIndices::new(pre))
                .transpose()?,
        })
    }
}

/// Adds this version's host functions to `linker`.
pub fn add_to_linker(linker: &mut Linker<StoreState>) -> wasmtime::Result<()> {
    HostView::add_to_linker::<_, HasSelf<StoreState>>(linker, |state| state)
}

impl Host for StoreState {
    fn log(&mut self, level: Level, message: String) {
        let level = match level {
            Level::Trace => tracing::Level::TRACE,
            Level::Debug => tracing::Level::DEBUG,
            Level::Info => tracing::Level::INFO,
            Level::Warn => tracing::Level::WARN,
            Level::Error => tracing::Level::ERROR,
        };
        self.log_line(level, &message);
    }
}

impl model::Host for StoreState {
    /// Checked against the plugin's grant, then answered by the engine sampling the
    /// session's trajectory (see [`crate::plugin::model`]).
    async fn generate(
        &mut self,
        request: model::GenerateRequest,
    ) -> Result<model::Completion, String> {
        let access = self.model.clone();
        let c = access.generate(&self.plugin, request.into()).await?;
        Ok(model::Completion {
            text: c.text,
            token_ids: c.token_ids,
            finish_reason: c.finish_reason,
        })
    }
}

impl From<model::GenerateRequest> for host_model::GenerateRequest {
    fn from(r: model::GenerateRequest) -> Self {
        host_model::GenerateRequest {
            prompt: match r.prompt {
                model::Prompt::Messages(m) => {
                    host_model::Prompt::Messages(m.into_iter().map(Into::into).collect())
                }
                model::Prompt::TokenIds(ids) => host_model::Prompt::TokenIds(ids),
            },
            max_new_tokens: r.max_new_tokens,
            temperature: r.temperature,
            top_p: r.top_p,
            stop: r.stop,
            weights: match r.weights {
                model::Weights::Policy => host_model::Answerer::Policy,
                model::Weights::Base => host_model::Answerer::Base,
            },
        }
    }
}

impl wit::Host for StoreState {}

impl From<&types::Message> for wit::Message {
    fn from(m: &types::Message) -> Self {
        wit::Message {
            role: m.role.clone(),
            content: m.content.clone(),
            tool_calls: m
                .tool_calls
                .iter()
                .map(|c| wit::ToolCall {
                    id: c.id.clone(),
                    name: c.function.name.clone(),
                    arguments: c.arguments_text(),
                })
                .collect(),
            tool_call_id: m.tool_call_id.clone(),
        }
    }
}

impl From<wit::Message> for types::Message {
    fn from(m: wit::Message) -> Self {
        types::Message {
            role: m.role,
            content: m.content,
            // Arguments that are not JSON stay the text the plugin wrote.
            tool_calls: m
                .tool_calls
                .into_iter()
                .map(|c| {
                    let arguments = serde_json::from_str(&c.arguments)
                        .unwrap_or(serde_json::Value::String(c.arguments));
                    types::MessageToolCall::new(c.id, c.name, arguments)
                })
                .collect(),
            tool_call_id: m.tool_call_id,
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

impl From<&types::Transcript> for wit::Trajectory {
    fn from(t: &types::Transcript) -> Self {
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
