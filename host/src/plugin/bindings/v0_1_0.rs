//! Bindings for `rlhost:plugin@0.1.0`: its export indices, its host functions, and
//! conversions to the host's own types.

use crate::plugin::sandbox::StoreState;
use crate::plugin::types::{self, Role};
use wasmtime::component::{HasSelf, InstancePre, Linker};

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

/// This version's export indices, looked up once per plugin.
pub struct Exports {
    pub about: about::GuestIndices,
    pub trigger: Option<trigger::GuestIndices>,
    pub environment: Option<environment::GuestIndices>,
    pub dataset: Option<dataset::GuestIndices>,
    pub reward: Option<reward::GuestIndices>,
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
        })
    }

    /// A role's indices; an error (a host bug: sessions check the role first) if the
    /// plugin does not export it.
    pub fn role<'a, T>(indices: &'a Option<T>, role: &str) -> wasmtime::Result<&'a T> {
        indices
            .as_ref()
            .ok_or_else(|| wasmtime::format_err!("the plugin exports no {role} interface"))
    }
}

/// Adds this version's host functions (`log`) to `linker`.
pub fn add_to_linker(linker: &mut Linker<StoreState>) -> wasmtime::Result<()> {
    HostView::add_to_linker::<_, HasSelf<StoreState>>(linker, |state| state)
}

impl Host for StoreState {
    fn log(&mut self, level: Level, message: String) {
        self.log_line(level.into(), &message);
    }
}

impl wit::Host for StoreState {}

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
        types::Message::new(m.role, m.content)
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
