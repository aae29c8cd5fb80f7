//! Native function calling in the rollout: the run's `tools` plugins, their functions as
//! the chat template's `tools` variable, and one assistant turn's calls run against them.
//!
//! The functions are asked once, when the run opens (one session per plugin with the
//! run's configuration), because the prompt is rendered with them before any
//! trajectory's session exists; TRL and verl fix a run's tools the same way. Each
//! trajectory then opens its own session per plugin, and its calls run there.
//!
//! A turn's calls are answered in the order written, each by one `tool` message:
//! - a call that could not be read, names no function of the run's, or whose arguments
//!   fail the function's schema gets `error: …` saying what was wrong, counted under its
//!   kind (`bad_json`, `unknown_function`, `invalid_arguments`, …);
//! - a *stateless* function's call runs in a fresh instance of its plugin, at the same
//!   time as the turn's other calls; a stateful one's in the trajectory's session, one
//!   after another in the order written (a session is one single-threaded instance);
//! - the function's own refusal of its input is `error: …` (`tool_error`), not a fault;
//!   a trap, the deadline or the memory cap is the plugin's fault (`fault`), recorded on
//!   the trajectory, and the model reads `error: the tool failed (…)`.

use crate::model::chat::ChatTemplate;
use crate::plugin::model::ModelLink;
use crate::plugin::{Fault, FunctionSpec, Plugin, Role, ToolsSession};
use crate::rollout::tool_calls::{self, CallError, CallFormat, Malformed, ToolCall};
use crate::task::{Message, MessageToolCall, Sample};
use anyhow::{Context, Result, bail};
use futures_util::future::{join, join_all};
use serde_json::{Value as Json, json};
use std::collections::BTreeMap;

/// A plugin in one role, with its configuration for that role.
#[derive(Clone)]
pub struct ToolSpec {
    pub plugin: Plugin,
    pub config: String,
}

/// `rollout.tool_call_format`.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum FormatSetting {
    /// The format the chat template's own markup shows: `<function=…><parameter=…>` is
    /// `qwen3_coder`, `<tool_call>` is `hermes`, `"parameters"` with an `ipython` role is
    /// `llama3_json`; a template showing none is refused (name the format).
    #[default]
    Auto,
    /// `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Qwen2.5, Qwen3, Hermes).
    Hermes,
    /// `{"name": …, "parameters": {…}}`, optionally after `<|python_tag|>`, several
    /// separated by `;` (Llama 3.1–3.3).
    Llama3Json,
    /// `<tool_call><function=NAME><parameter=P>…</parameter></function></tool_call>`
    /// (Qwen3-Coder).
    Qwen3Coder,
}

/// The run's tools plugins and their functions, before the model (and its chat
/// template) is loaded.
#[derive(Clone)]
pub struct Catalogue {
    pub plugins: Vec<ToolSpec>,
    /// Every plugin's functions, names unique across plugins.
    pub functions: Vec<FunctionSpec>,
    /// The plugin (index in `plugins`) of each function.
    owner: Vec<usize>,
}

/// The run's tools: its plugins, their functions and how the model writes calls.
pub struct Toolbox {
    pub plugins: Vec<ToolSpec>,
    pub functions: Vec<FunctionSpec>,
    owner: Vec<usize>,
    pub format: CallFormat,
    /// The template's `tools` variable: `[{"type": "function", "function": {name,
    /// description, parameters}}]`, as transformers passes JSON-schema tools.
    pub template_tools: Vec<Json>,
}

impl Catalogue {
    /// Opens one session of each plugin (`(config name, spec)`) with its configuration, to
    /// check the configuration and ask for the functions. Errors name the plugin; the
    /// caller says they are about `rollout.tools`. Names must be unique across
    /// plugins: the model calls a function by its name alone.
    pub async fn open(plugins: Vec<(String, ToolSpec)>) -> Result<Catalogue> {
        let mut functions: Vec<FunctionSpec> = Vec::new();
        let mut owner = Vec::new();
        let mut by_name: BTreeMap<String, String> = BTreeMap::new();
        let mut specs = Vec::new();
        for (i, (name, spec)) in plugins.into_iter().enumerate() {
            if !spec.plugin.roles().contains(&Role::Tools) {
                bail!(
                    "`{name}` ({}) exports {}, not the tools role",
                    spec.plugin.spec().path.display(),
                    crate::plugin::inspect::role_list(spec.plugin.roles())
                );
            }
            let session = spec
                .plugin
                .open_tools(&spec.config, &Sample::from_prompt(""), 0)
                .await
                .with_context(|| format!("rollout.tools_config.{name}"))?;
            if session.functions().is_empty() {
                bail!("`{name}` offers no functions");
            }
            for f in session.functions() {
                if let Some(other) = by_name.insert(f.name.clone(), name.clone()) {
                    bail!(
                        "`{other}` and `{name}` both offer a function `{}`; the model calls functions by name, so names must be unique across the run's tools",
                        f.name
                    );
                }
                functions.push(f.clone());
                owner.push(i);
            }
            specs.push(spec);
        }
        Ok(Catalogue {
            plugins: specs,
            functions,
            owner,
        })
    }
}

/// Checks that `chat` renders `tools` at all: a template that ignores them would leave the
/// model blind to the functions.
pub fn renders_tools(chat: &ChatTemplate, tools: &[Json]) -> Result<()> {
    let probe = [json!({"role": "user", "content": "hi"})];
    let with = chat.render(&probe, Some(tools), true)?;
    let without = chat.render(&probe, None, true)?;
    if with == without {
        bail!(
            "the chat template does not render `tools`: the model would never see the functions (use a model whose template renders them, or add a chat_template.jinja that does)"
        );
    }
    Ok(())
}

/// How the model writes calls: `setting`, or with `auto` the format `chat`'s markup shows.
pub fn call_format(setting: FormatSetting, chat: &ChatTemplate) -> Result<CallFormat> {
    Ok(match setting {
        FormatSetting::Hermes => CallFormat::Hermes,
        FormatSetting::Llama3Json => CallFormat::Llama3Json,
        FormatSetting::Qwen3Coder => CallFormat::Qwen3Coder,
        FormatSetting::Auto => CallFormat::implied_by(chat.source()).with_context(|| {
            format!(
                "rollout.tool_call_format = \"auto\", but the chat template shows no tool-call format (no `<tool_call>`, `<function=`, or Llama's `\"parameters\"`): set rollout.tool_call_format to one of {}",
                CallFormat::ALL.map(|f| format!("\"{}\"", f.name())).join(", ")
            )
        })?,
    })
}

impl Toolbox {
    /// The toolbox for `chat`: the call format from `setting`, and a check that the
    /// template renders `tools` at all (a template that ignores them would leave the
    /// model blind to the functions).
    pub fn new(
        catalogue: Catalogue,
        setting: FormatSetting,
        chat: &ChatTemplate,
    ) -> Result<Toolbox> {
        let Catalogue {
            plugins,
            functions,
            owner,
        } = catalogue;
        let format = call_format(setting, chat)?;
        let template_tools: Vec<Json> = functions
            .iter()
            .map(|f| {
                json!({"type": "function", "function": {
                    "name": f.name, "description": f.description, "parameters": f.parameters}})
            })
            .collect();
        renders_tools(chat, &template_tools)?;
        Ok(Toolbox {
            plugins,
            functions,
            owner,
            format,
            template_tools,
        })
    }

    /// Reads one assistant turn's calls (its text without the end-of-turn token).
    pub fn read(&self, text: &str) -> tool_calls::Turn {
        tool_calls::parse(self.format, text, &self.functions)
    }

    /// Whether plugin `p` has a stateful function: only those get a session per
    /// trajectory (a stateless function's calls each open a fresh instance).
    pub fn needs_session(&self, p: usize) -> bool {
        self.owner
            .iter()
            .zip(&self.functions)
            .any(|(&o, f)| o == p && !f.stateless)
    }

    fn function(&self, name: &str) -> Option<(usize, &FunctionSpec)> {
        let i = self.functions.iter().position(|f| f.name == name)?;
        Some((self.owner[i], &self.functions[i]))
    }
}

/// How one call went: `ok`, `tool_error` (the function refused its input), `fault`
/// (the plugin failed), or a malformed call's kind.
pub type CallKind = &'static str;

/// The kinds of calls that were well formed (ran, whatever their outcome); every other
/// kind is a malformed call's.
pub const WELL_FORMED: [CallKind; 3] = ["ok", "tool_error", "fault"];

/// The share of malformed calls among calls counted by kind; `None` without any call.
pub fn malformed_rate<'a>(kinds: impl Iterator<Item = (&'a String, &'a u32)>) -> Option<f64> {
    let (mut all, mut malformed) = (0u64, 0u64);
    for (kind, n) in kinds {
        all += u64::from(*n);
        if !WELL_FORMED.contains(&kind.as_str()) {
            malformed += u64::from(*n);
        }
    }
    (all > 0).then(|| malformed as f64 / all as f64)
}

/// Opens a trajectory's session of a tools plugin with a stateful function, seeded
/// `seed`, its `model.generate` calls on `link`.
pub async fn open(
    spec: ToolSpec,
    sample: Sample,
    seed: u64,
    link: ModelLink,
) -> Result<ToolsSession, Fault> {
    spec.plugin
        .open_tools(&spec.config, &sample, seed)
        .await
        .map(|mut s| {
            s.set_model(Some(link));
            s
        })
        .map_err(|e| spec.plugin.open_fault("tools.open", e))
}

/// One call's answer.
pub struct Answer {
    pub id: String,
    pub kind: CallKind,
    /// The `tool` message's content.
    pub text: String,
}

/// One call as the turn wrote it, with the id the host gave it.
pub struct Written {
    pub id: String,
    pub call: Result<ToolCall, Malformed>,
}

/// The assistant message of a turn with calls: its text outside the calls and the calls
/// that could be read, in the OpenAI shape.
pub fn assistant_message(content: String, calls: &[Written]) -> Message {
    Message {
        role: "assistant".into(),
        content,
        tool_calls: calls
            .iter()
            .filter_map(|w| w.call.as_ref().ok().map(|c| (w, c)))
            .map(|(w, c)| {
                MessageToolCall::new(
                    w.id.clone(),
                    c.name.clone(),
                    Json::Object(c.arguments.clone()),
                )
            })
            .collect(),
        tool_call_id: None,
    }
}

/// Runs one turn's calls. `sessions` are the trajectory's (one per plugin, `None` where
/// it failed to open); they come back with the answers, in the calls' order, and the
/// faults. `seed` seeds the fresh instances of stateless calls (with the call's index).
pub async fn run(
    toolbox: &Toolbox,
    mut sessions: Vec<Option<ToolsSession>>,
    sample: &Sample,
    seed: u64,
    calls: &[Written],
) -> (Vec<Option<ToolsSession>>, Vec<Answer>, Vec<Fault>) {
    let mut answers: Vec<Option<Answer>> = calls.iter().map(|_| None).collect();
    let mut faults = Vec::new();
    // Calls to run: (index, plugin, stateless, name, arguments).
    let mut stateful: BTreeMap<usize, Vec<(usize, String, String)>> = BTreeMap::new();
    let mut stateless = Vec::new();
    for (i, w) in calls.iter().enumerate() {
        let call = match &w.call {
            Ok(call) => call,
            Err(m) => {
                answers[i] = Some(refusal(&w.id, &m.error));
                continue;
            }
        };
        let Some((plugin, spec)) = toolbox.function(&call.name) else {
            answers[i] = Some(refusal(
                &w.id,
                &CallError::UnknownFunction(call.name.clone()),
            ));
            continue;
        };
        if let Err(e) = tool_calls::check(call, &toolbox.functions) {
            answers[i] = Some(refusal(&w.id, &e));
            continue;
        }
        let arguments = Json::Object(call.arguments.clone()).to_string();
        if spec.stateless {
            stateless.push((i, plugin, call.name.clone(), arguments));
        } else {
            stateful
                .entry(plugin)
                .or_default()
                .push((i, call.name.clone(), arguments));
        }
    }
    // Each plugin's stateful calls in order in its session; stateless calls each in a
    // fresh instance; all of it at once.
    let chains = stateful.into_iter().map(|(p, list)| {
        let session = sessions[p].take();
        let spec = &toolbox.plugins[p];
        async move {
            let mut session = session;
            let mut out = Vec::new();
            for (i, name, arguments) in list {
                let r = match session.as_mut() {
                    Some(s) => s.invoke(&name, &arguments).await,
                    None => Err(unopened(spec)),
                };
                out.push((i, r));
            }
            (p, session, out)
        }
    });
    let singles = stateless.into_iter().map(|(i, p, name, arguments)| {
        let spec = &toolbox.plugins[p];
        let seed = seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        async move {
            let r = match spec.plugin.open_tools(&spec.config, sample, seed).await {
                Ok(mut s) => s.invoke(&name, &arguments).await,
                Err(e) => Err(spec.plugin.open_fault("tools.open", e)),
            };
            (i, r)
        }
    });
    let (chains, singles) = join(join_all(chains), join_all(singles)).await;
    let mut results = singles;
    for (p, session, out) in chains {
        sessions[p] = session;
        results.extend(out);
    }
    for (i, r) in results {
        let id = calls[i].id.clone();
        answers[i] = Some(match r {
            Ok(Ok(text)) => Answer {
                id,
                kind: "ok",
                text,
            },
            Ok(Err(text)) => Answer {
                id,
                kind: "tool_error",
                text: format!("error: {text}"),
            },
            Err(fault) => {
                let text = format!("error: the tool failed ({})", fault.kind);
                faults.push(fault);
                Answer {
                    id,
                    kind: "fault",
                    text,
                }
            }
        });
    }
    let answers = answers
        .into_iter()
        .map(|a| a.expect("every call is answered"))
        .collect();
    (sessions, answers, faults)
}

fn refusal(id: &str, e: &CallError) -> Answer {
    Answer {
        id: id.to_string(),
        kind: e.kind(),
        text: format!("error: {}", e.message()),
    }
}

/// The fault of a call to a plugin whose session did not open (that fault is on record).
fn unopened(spec: &ToolSpec) -> Fault {
    Fault {
        plugin: spec.plugin.id().to_string(),
        call: "tools.call",
        kind: crate::plugin::FaultKind::Incompatible,
        message: "its session did not open for this trajectory".into(),
    }
}

/// The `tool` messages answering a turn's calls.
pub fn tool_messages(answers: &[Answer]) -> Vec<Message> {
    answers
        .iter()
        .map(|a| Message {
            role: "tool".into(),
            content: a.text.clone(),
            tool_calls: Vec::new(),
            tool_call_id: Some(a.id.clone()),
        })
        .collect()
}
