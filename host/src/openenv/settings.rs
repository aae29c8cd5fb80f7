//! `[rollout.openenv]`: an OpenEnv server as the run's environment, in place of an
//! environment plugin. What the section says and the checks serde cannot make; the
//! client that follows it is [`crate::rollout::env::openenv`]. The config file's section is this type
//! (`config/` reads it into `RunConfig` and re-exports it as `config::openenv`), so that
//! the client reads its settings without importing `config/`.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// `[rollout.openenv]`.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct OpenEnvSection {
    /// The server's base URL, `http://host:port` (sessions go to its `/ws`).
    #[schemars(example = &"http://127.0.0.1:8000")]
    pub url: String,
    /// Where the run may connect, in `allow_http`'s syntax (`scheme://host[:port]`); an
    /// entry must cover `url`, and a loopback or private address must be named by it.
    #[schemars(example = vec!["http://127.0.0.1:8000"])]
    pub allow: Vec<String>,
    /// How an assistant turn becomes the environment's action.
    pub action: ActionMapping,
    /// Observation fields read as the environment's turn, the first one present (and not
    /// null) wins: a list of `{role, content}` messages, a string, or any other JSON
    /// (written compactly).
    #[schemars(example = vec!["echoed_message"])]
    pub observation: Vec<String>,
    /// The role of a turn made from a string field: `user` or `tool` (a call's answer is
    /// always a `tool` message).
    pub role: String,
    /// Observation fields that carry a function's refusal of a call (with
    /// `action.kind = "call"`): the model reads `error: <text>`, as rlhost's own tools
    /// write a refusal, and the call counts as a `tool_error`.
    #[schemars(example = vec!["error"])]
    pub errors: Vec<String>,
    /// Where the prompt comes from: `dataset` (the sample's messages), `reset` (the reset
    /// observation's, read as `observation` says; the dataset then gives each episode
    /// its seed, its metadata and the rewards' references) or `append` (the sample's
    /// messages, then the reset observation's).
    pub prompt: PromptFrom,
    /// Fields every `reset` carries besides `seed` and `episode_id`.
    pub reset: Map<String, Value>,
    /// Whether the sample's metadata fields go into `reset` too (as TRL's
    /// `environment_factory` passes a dataset row's columns); the server keeps those its
    /// `reset` takes.
    pub reset_metadata: bool,
    /// Sessions open at once (the server's own cap: `rlhost env serve --max-sessions`,
    /// `max_concurrent_envs` in openenv-core's `create_app`); a trajectory waits for one.
    /// With `prompt = "reset"` a batch's sessions all open before it samples, so a batch
    /// may have at most this many trajectories.
    pub max_sessions: usize,
    /// Seconds to open a session (connect, handshake, `reset`).
    pub connect_timeout_s: f64,
    /// Seconds one `step` may take; past it the episode ends with a timeout fault.
    pub step_timeout_s: f64,
    /// Largest message the server may send, in MiB; a larger one ends the episode.
    pub max_message_mib: f64,
    /// How a tree rollout (`[rollout.tree]`) forks an episode: `none`, it cannot (the
    /// episode's state lives in the server, which has no way to copy a session), or
    /// `replay`: a new session is reset as the episode was and sent its actions again,
    /// each answer checked against the first time's (a different one ends that branch
    /// with a fault). Only for servers whose episodes follow from their reset's seed.
    pub fork: ForkBy,
}

/// `rollout.openenv.fork`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum ForkBy {
    /// Episodes are not forked: a tree rollout is refused.
    #[default]
    None,
    /// A new session replays the episode's reset and actions.
    Replay,
}

impl Default for OpenEnvSection {
    fn default() -> Self {
        OpenEnvSection {
            url: String::new(),
            allow: Vec::new(),
            action: ActionMapping::default(),
            observation: vec!["messages".into()],
            role: "user".into(),
            errors: Vec::new(),
            prompt: PromptFrom::Dataset,
            reset: Map::new(),
            reset_metadata: true,
            max_sessions: 16,
            connect_timeout_s: 10.0,
            step_timeout_s: 60.0,
            max_message_mib: 16.0,
            fork: ForkBy::None,
        }
    }
}

/// `rollout.openenv.prompt`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum PromptFrom {
    /// The sample's messages.
    #[default]
    Dataset,
    /// The reset observation's messages.
    Reset,
    /// The sample's messages, then the reset observation's.
    Append,
}

/// `[rollout.openenv.action]`.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ActionMapping {
    /// `text`: the turn's whole text into `field`. `call`: a function call read in the
    /// model's format (`rollout.tool_call_format`), its name into `name` and its
    /// arguments into `arguments`; the functions are the server's (`/mcp` `tools/list`).
    pub kind: ActionKind,
    /// With `text`: the field the turn's text goes into.
    #[schemars(example = &"message")]
    pub field: String,
    /// With `call`: the field the function's name goes into.
    #[schemars(example = &"tool_name")]
    pub name: String,
    /// With `call`: the field the call's arguments (an object) go into.
    #[schemars(example = &"arguments")]
    pub arguments: String,
    /// Fields every action carries, e.g. `{ type = "call_tool" }` for OpenEnv's MCP
    /// environments.
    #[schemars(example = &serde_json::json!({"type": "call_tool"}))]
    pub fixed: Map<String, Value>,
}

impl Default for ActionMapping {
    fn default() -> Self {
        ActionMapping {
            kind: ActionKind::Text,
            field: "message".into(),
            name: "name".into(),
            arguments: "arguments".into(),
            fixed: Map::new(),
        }
    }
}

#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum ActionKind {
    /// The turn's whole text into one field.
    #[default]
    Text,
    /// Each function call the turn writes, one action each.
    Call,
}

impl OpenEnvSection {
    /// The checks serde cannot make; the error names the key (after `rollout.openenv.`).
    pub fn check(&self) -> Result<(), String> {
        if self.url.is_empty() {
            return Err(
                "url is empty: name the server, e.g. url = \"http://127.0.0.1:8000\"".into(),
            );
        }
        crate::openenv::endpoint::Endpoint::parse(&self.url).map_err(|e| format!("url: {e}"))?;
        if self.allow.is_empty() {
            return Err(format!(
                "allow is empty: the run connects only where it is granted; add allow = [\"{}\"]",
                crate::openenv::endpoint::Endpoint::parse(&self.url)
                    .map(|e| e.grant())
                    .unwrap_or_default()
            ));
        }
        crate::plugin::net::HttpGrants::parse(&self.allow).map_err(|e| format!("allow: {e}"))?;
        if self.observation.is_empty() || self.observation.iter().any(String::is_empty) {
            return Err(
                "observation must name at least one field, e.g. observation = [\"messages\"]"
                    .into(),
            );
        }
        if self.role != "user" && self.role != "tool" {
            return Err(format!(
                "role = {:?}: write \"user\" or \"tool\"",
                self.role
            ));
        }
        let a = &self.action;
        let fields: &[(&str, &String)] = match a.kind {
            ActionKind::Text => &[("action.field", &a.field)],
            ActionKind::Call => &[("action.name", &a.name), ("action.arguments", &a.arguments)],
        };
        for (key, field) in fields {
            if field.is_empty() {
                return Err(format!("{key} is empty: name the action's field"));
            }
            if a.fixed.contains_key(field.as_str()) {
                return Err(format!(
                    "action.fixed sets `{field}`, which {key} fills from the model's turn"
                ));
            }
        }
        if a.kind == ActionKind::Call && a.name == a.arguments {
            return Err("action.name and action.arguments name the same field".into());
        }
        for (key, v) in [
            ("connect_timeout_s", self.connect_timeout_s),
            ("step_timeout_s", self.step_timeout_s),
            ("max_message_mib", self.max_message_mib),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                return Err(format!("{key} must be a positive number, not {v}"));
            }
        }
        for (key, v) in [
            ("connect_timeout_s", self.connect_timeout_s),
            ("step_timeout_s", self.step_timeout_s),
        ] {
            if v > 86_400.0 {
                return Err(format!("{key} = {v} is past a day (86400 s)"));
            }
        }
        if let Some(field) = self.errors.iter().find(|f| !self.observation.contains(f)) {
            return Err(format!(
                "errors names `{field}`, which observation ({:?}) does not read: add it there",
                self.observation
            ));
        }
        if !self.errors.is_empty() && self.action.kind == ActionKind::Text {
            return Err(
                "errors applies to function calls (action.kind = \"call\"); a text action's observation is the turn as it is"
                    .into(),
            );
        }
        if let Some(key) = ["seed", "episode_id"]
            .into_iter()
            .find(|k| self.reset.contains_key(*k))
        {
            return Err(format!(
                "reset sets `{key}`, which rlhost sends itself (the sample's index, and the trajectory's id)"
            ));
        }
        if self.max_sessions == 0 {
            return Err("max_sessions must be at least 1".into());
        }
        if self.max_message_mib > 1024.0 {
            return Err(format!(
                "max_message_mib = {} is past 1024: one observation that large would not fit a prompt anyway",
                self.max_message_mib
            ));
        }
        Ok(())
    }
}
