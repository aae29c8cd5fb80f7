//! One OpenEnv episode over a plugin: `reset` picks a sample and opens the plugin's
//! environment episode (and tools session), `step` maps the action onto it, `state` says
//! where the episode is. [`Served`] is what every session shares: the loaded plugin, its
//! config, where samples come from, and the counters the server reports.
//!
//! The action mapping: an environment takes `{"message": "<the assistant's turn>"}` and
//! answers `{"messages": [<user or tool messages>]}` with its reward and `done`; a tools
//! plugin takes `{"name": "<function>", "arguments": {…}}` (checked against the
//! function's schema) and answers `{"result": "<text>"}`, or `{"error": "<text>"}` when the
//! function refused its input. A plugin fault ends the episode: the client is told
//! (`EXECUTION_ERROR`) and resets; the server and the other sessions go on.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use super::wire::{self, Code, Observed, rpc};
use crate::plugin::{
    DatasetSource, EnvironmentEpisode, FunctionSpec, Plugin, Role, Sample, ToolsSession,
};

/// Where episodes' samples come from.
pub enum Samples {
    /// The plugin's own dataset role, opened once for the server's seed.
    Dataset(Box<tokio::sync::Mutex<DatasetSource>>),
    /// A JSONL file of `{"messages": […], "metadata": {…}}`.
    File(Vec<Sample>),
    /// No data: an episode starts from an empty prompt.
    Empty,
}

/// What the server serves, shared by its sessions, and what it has done (`GET /stats`).
pub struct Served {
    pub plugin: Plugin,
    pub config: String,
    pub samples: Samples,
    /// A tools plugin's functions, listed once at start.
    pub functions: Vec<FunctionSpec>,
    /// Episodes started without a seed or an index take the next sample.
    next: AtomicU64,
    pub episodes: AtomicU64,
    pub steps: AtomicU64,
    /// Plugin faults (each ended an episode) and dataset faults.
    pub faults: AtomicU64,
}

impl Served {
    /// Checks that `plugin` can be served (an environment or tools role), opens its
    /// dataset or reads `data`, and lists its functions.
    pub async fn new(
        plugin: Plugin,
        config: String,
        data: Option<&Path>,
        seed: u64,
    ) -> Result<Served> {
        let roles = plugin.roles();
        if !roles.contains(&Role::Environment) && !roles.contains(&Role::Tools) {
            bail!(
                "{} exports neither an environment nor tools (its roles: {}): only those are served over OpenEnv",
                plugin.id(),
                roles
                    .iter()
                    .map(|r| format!("{r:?}").to_lowercase())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        let samples = match data {
            Some(path) => Samples::File(read_samples(path)?),
            None if roles.contains(&Role::Dataset) => {
                let source = plugin
                    .open_dataset(&config, seed)
                    .await
                    .with_context(|| format!("{}: opening its dataset", plugin.id()))?;
                if source.is_empty() {
                    bail!("{}: its dataset is empty", plugin.id());
                }
                Samples::Dataset(Box::new(tokio::sync::Mutex::new(source)))
            }
            None => Samples::Empty,
        };
        let functions = if roles.contains(&Role::Tools) {
            let empty = Sample {
                messages: Vec::new(),
                metadata: json!({}),
            };
            let session = plugin
                .open_tools(&config, &empty, seed)
                .await
                .with_context(|| format!("{}: opening a tools session", plugin.id()))?;
            session.functions().to_vec()
        } else {
            Vec::new()
        };
        Ok(Served {
            plugin,
            config,
            samples,
            functions,
            next: AtomicU64::new(0),
            episodes: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            faults: AtomicU64::new(0),
        })
    }

    /// `GET /stats`: episodes started, steps taken, faults, sessions open.
    pub fn stats(&self, sessions: usize) -> Value {
        json!({
            "episodes": self.episodes.load(Ordering::Relaxed),
            "steps": self.steps.load(Ordering::Relaxed),
            "faults": self.faults.load(Ordering::Relaxed),
            "sessions": sessions,
        })
    }

    fn has(&self, role: Role) -> bool {
        self.plugin.roles().contains(&role)
    }

    /// `/metadata`: OpenEnv's `EnvironmentMetadata` from the plugin's `about`.
    pub fn metadata(&self) -> Value {
        let info = self.plugin.info();
        json!({
            "name": info.name,
            "description": info.description,
            "readme_content": null,
            "version": info.version,
            "author": null,
            "documentation_url": null,
        })
    }

    /// `/schema`: JSON Schemas of the action, the observation and the state.
    pub fn schema(&self) -> Value {
        let message = json!({
            "title": "Turn",
            "description": "The assistant's turn, as text without the chat template's markup.",
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "metadata": {"type": "object"},
            },
            "required": ["message"],
            "additionalProperties": false,
        });
        let calls: Vec<Value> = self
            .functions
            .iter()
            .map(|f| {
                json!({
                    "title": f.name,
                    "description": f.description,
                    "type": "object",
                    "properties": {
                        "name": {"const": f.name},
                        "arguments": f.parameters,
                        "metadata": {"type": "object"},
                    },
                    "required": ["name"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let action = match (self.has(Role::Environment), calls.is_empty()) {
            (true, true) => message,
            (false, _) => json!({"title": "Call", "oneOf": calls}),
            (true, false) => {
                let mut all = vec![message];
                all.extend(calls);
                json!({"title": "Action", "oneOf": all})
            }
        };
        let msg = json!({
            "type": "object",
            "properties": {"role": {"type": "string"}, "content": {"type": "string"}},
            "required": ["role", "content"],
        });
        json!({
            "action": action,
            "observation": {
                "title": "Observation",
                "type": "object",
                "properties": {
                    "messages": {"type": "array", "items": msg,
                        "description": "after reset, the prompt; after a turn, the environment's user or tool messages"},
                    "metadata": {"type": "object", "description": "after reset, the sample's metadata"},
                    "tools": {"type": "array", "description": "after reset, the functions a call may name"},
                    "result": {"type": "string", "description": "a call's result"},
                    "error": {"type": "string", "description": "a function's refusal of its input"},
                },
            },
            "state": {
                "title": "State",
                "type": "object",
                "properties": {
                    "episode_id": {"type": ["string", "null"]},
                    "step_count": {"type": "integer", "minimum": 0},
                    "done": {"type": "boolean"},
                    "sample_index": {"type": ["integer", "null"]},
                    "total_reward": {"type": "number"},
                },
            },
        })
    }

    /// The sample at `index` (modulo the number there are), and the index used.
    async fn sample(&self, index: Option<u64>) -> Result<(Option<u64>, Sample), String> {
        let pick = |len: u64| {
            index.unwrap_or_else(|| self.next.fetch_add(1, Ordering::Relaxed)) % len.max(1)
        };
        match &self.samples {
            Samples::Empty => Ok((
                None,
                Sample {
                    messages: Vec::new(),
                    metadata: json!({}),
                },
            )),
            Samples::File(rows) => {
                let i = pick(rows.len() as u64);
                Ok((Some(i), rows[i as usize].clone()))
            }
            Samples::Dataset(source) => {
                let mut source = source.lock().await;
                let i = pick(source.len());
                match source.get(i).await {
                    Ok(sample) => Ok((Some(i), sample)),
                    Err(fault) => {
                        self.faults.fetch_add(1, Ordering::Relaxed);
                        Err(format!("the plugin's dataset failed: {fault}"))
                    }
                }
            }
        }
    }
}

/// `path`'s samples, one JSON object a line.
fn read_samples(path: &Path) -> Result<Vec<Sample>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read --data {}", path.display()))?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let sample: Sample = serde_json::from_str(line).with_context(|| {
            format!(
                "{} line {}: not a sample (a JSON object with `messages`, a list of {{role, content}}, and `metadata`, an object)",
                path.display(),
                i + 1
            )
        })?;
        rows.push(sample);
    }
    if rows.is_empty() {
        bail!("{} has no samples", path.display());
    }
    Ok(rows)
}

/// Why a message could not be answered with an observation.
#[derive(Debug)]
pub enum Refusal {
    /// The input does not fit: Pydantic-shaped problems (`VALIDATION_ERROR`, HTTP 422).
    Invalid(Vec<Value>),
    /// The episode could not go on (`EXECUTION_ERROR`, HTTP 500).
    Execution(String),
}

impl Refusal {
    pub fn frame(&self) -> String {
        match self {
            Refusal::Invalid(errors) => wire::error_frame(
                Code::ValidationError,
                "Invalid message",
                json!({"errors": errors}),
            ),
            Refusal::Execution(message) => {
                wire::error_frame(Code::ExecutionError, message, json!({}))
            }
        }
    }
}

/// One session's episode.
pub struct Episode {
    served: Arc<Served>,
    id: Option<String>,
    steps: u64,
    done: bool,
    total_reward: f64,
    sample_index: Option<u64>,
    env: Option<EnvironmentEpisode>,
    tools: Option<ToolsSession>,
    /// Why the episode cannot go on (a plugin fault), until the next reset.
    ended: Option<String>,
    /// Whether any reset has happened.
    started: bool,
}

impl Episode {
    pub fn new(served: Arc<Served>) -> Episode {
        Episode {
            served,
            id: None,
            steps: 0,
            done: false,
            total_reward: 0.0,
            sample_index: None,
            env: None,
            tools: None,
            ended: None,
            started: false,
        }
    }

    fn fault(&mut self, what: &str, e: impl std::fmt::Display) -> Refusal {
        self.served.faults.fetch_add(1, Ordering::Relaxed);
        self.env = None;
        self.tools = None;
        let message = format!("{what}: {e}; reset to start a new episode");
        tracing::warn!("openenv: {message}");
        self.ended = Some(message.clone());
        Refusal::Execution(message)
    }

    /// `reset`: `{"seed": n, "episode_id": "…"}` (both optional; rlhost also takes
    /// `"index"`, the sample to start from). Unknown keys are ignored, as OpenEnv does.
    pub async fn reset(&mut self, data: &Value) -> Result<Observed, Refusal> {
        let empty = serde_json::Map::new();
        let data = match data {
            Value::Null => &empty,
            Value::Object(map) => map,
            _ => {
                return Err(Refusal::Invalid(vec![wire::invalid(
                    "dict_type",
                    &["data"],
                    "reset's data must be an object such as {\"seed\": 7}",
                )]));
            }
        };
        let whole = |key: &str| -> Result<Option<u64>, Refusal> {
            match data.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                    Refusal::Invalid(vec![wire::invalid(
                        "int_parsing",
                        &[key],
                        &format!("`{key}` must be a whole number ≥ 0, not {v}"),
                    )])
                }),
            }
        };
        let seed = whole("seed")?;
        let index = whole("index")?;
        let id = match data.get("episode_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.chars().count() <= 255 => Some(s.clone()),
            Some(_) => {
                return Err(Refusal::Invalid(vec![wire::invalid(
                    "string_type",
                    &["episode_id"],
                    "`episode_id` must be a string of at most 255 characters",
                )]));
            }
        };
        let (sample_index, sample) = self
            .served
            .sample(index.or(seed))
            .await
            .map_err(Refusal::Execution)?;
        let plugin_seed = seed.or(sample_index).unwrap_or(0);
        self.env = None;
        self.tools = None;
        let served = self.served.clone();
        if served.has(Role::Environment) {
            match served
                .plugin
                .open_environment(&served.config, &sample, plugin_seed)
                .await
            {
                Ok(env) => self.env = Some(env),
                Err(e) => {
                    return Err(self.fault("the environment refused the episode", format!("{e:#}")));
                }
            }
        }
        if served.has(Role::Tools) {
            match served
                .plugin
                .open_tools(&served.config, &sample, plugin_seed)
                .await
            {
                Ok(tools) => self.tools = Some(tools),
                Err(e) => return Err(self.fault("the tools refused the episode", format!("{e:#}"))),
            }
        }
        let n = self.served.episodes.fetch_add(1, Ordering::Relaxed) + 1;
        self.id = Some(id.unwrap_or_else(|| format!("{plugin_seed}-{n}")));
        self.steps = 0;
        self.done = false;
        self.total_reward = 0.0;
        self.sample_index = sample_index;
        self.ended = None;
        self.started = true;
        let mut observation = json!({
            "messages": sample.messages,
            "metadata": sample.metadata,
        });
        if !self.served.functions.is_empty() {
            observation["tools"] = self
                .served
                .functions
                .iter()
                .map(|f| json!({"name": f.name, "description": f.description, "parameters": f.parameters}))
                .collect();
        }
        Ok(Observed {
            observation,
            reward: None,
            done: false,
        })
    }

    /// `step`: the action object itself (`{"message": …}` or `{"name": …, "arguments": …}`).
    pub async fn step(&mut self, action: &Value) -> Result<Observed, Refusal> {
        let Some(fields) = action.as_object() else {
            return Err(Refusal::Invalid(vec![wire::invalid(
                "model_type",
                &[],
                "the action must be an object: {\"message\": \"…\"} or {\"name\": \"…\", \"arguments\": {…}}",
            )]));
        };
        let (env, tools) = (
            self.served.has(Role::Environment),
            self.served.has(Role::Tools),
        );
        if fields.contains_key("message") && env {
            self.turn(fields).await
        } else if fields.contains_key("name") && tools {
            self.call(fields).await
        } else {
            let wanted = match (env, tools) {
                (true, false) => "message",
                (false, true) => "name",
                _ => "message or name",
            };
            Err(Refusal::Invalid(vec![wire::invalid(
                "missing",
                &[wanted],
                &format!(
                    "Field required: this environment's actions have `{wanted}` (see /schema)"
                ),
            )]))
        }
    }

    /// Whether the episode can take a step (checked once the action itself is valid).
    fn ready(&self) -> Result<(), Refusal> {
        if !self.started {
            return Err(Refusal::Execution(
                "no episode yet: send reset first".into(),
            ));
        }
        if let Some(why) = &self.ended {
            return Err(Refusal::Execution(why.clone()));
        }
        if self.done {
            return Err(Refusal::Execution(
                "the episode is over (done): reset to start another".into(),
            ));
        }
        Ok(())
    }

    fn extra(fields: &serde_json::Map<String, Value>, allowed: &[&str]) -> Vec<Value> {
        fields
            .keys()
            .filter(|k| !allowed.contains(&k.as_str()))
            .map(|k| wire::invalid("extra_forbidden", &[k], "Extra inputs are not permitted"))
            .collect()
    }

    async fn turn(&mut self, fields: &serde_json::Map<String, Value>) -> Result<Observed, Refusal> {
        let mut errors = Episode::extra(fields, &["message", "metadata"]);
        let text = fields["message"].as_str();
        if text.is_none() {
            errors.push(wire::invalid(
                "string_type",
                &["message"],
                "Input should be a valid string",
            ));
        }
        let (Some(text), true) = (text, errors.is_empty()) else {
            return Err(Refusal::Invalid(errors));
        };
        self.ready()?;
        let Some(env) = self.env.as_mut() else {
            return Err(Refusal::Execution("no environment episode: reset".into()));
        };
        match env.step(text).await {
            Ok(result) => {
                self.steps += 1;
                self.served.steps.fetch_add(1, Ordering::Relaxed);
                self.done = result.done;
                self.total_reward += result.reward.unwrap_or(0.0);
                Ok(Observed {
                    observation: json!({"messages": if result.done { Vec::new() } else { result.messages }}),
                    reward: result.reward,
                    done: result.done,
                })
            }
            Err(fault) => Err(self.fault("the environment faulted", fault)),
        }
    }

    async fn call(&mut self, fields: &serde_json::Map<String, Value>) -> Result<Observed, Refusal> {
        let mut errors = Episode::extra(fields, &["name", "arguments", "metadata"]);
        let name = fields["name"].as_str().unwrap_or_default().to_string();
        let function = self.served.functions.iter().find(|f| f.name == name);
        let arguments = fields
            .get("arguments")
            .cloned()
            .unwrap_or_else(|| json!({}));
        match function {
            None => errors.push(wire::invalid(
                "literal_error",
                &["name"],
                &format!(
                    "no function `{name}`; the functions: {}",
                    self.served
                        .functions
                        .iter()
                        .map(|f| f.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )),
            Some(f) => {
                if let Err(why) = crate::plugin::schema::validate(&f.parameters, &arguments) {
                    errors.push(wire::invalid("value_error", &["arguments"], &why));
                }
            }
        }
        if !errors.is_empty() {
            return Err(Refusal::Invalid(errors));
        }
        self.ready()?;
        let Some(tools) = self.tools.as_mut() else {
            return Err(Refusal::Execution("no tools session: reset".into()));
        };
        match tools.invoke(&name, &arguments.to_string()).await {
            Ok(answer) => {
                self.steps += 1;
                self.served.steps.fetch_add(1, Ordering::Relaxed);
                let observation = match answer {
                    Ok(text) => json!({"result": text}),
                    Err(text) => json!({"error": text}),
                };
                Ok(Observed {
                    observation,
                    reward: None,
                    done: false,
                })
            }
            Err(fault) => Err(self.fault("the function faulted", fault)),
        }
    }

    /// `state`: where the episode is.
    pub fn state(&self) -> Value {
        json!({
            "episode_id": self.id,
            "step_count": self.steps,
            "done": self.done,
            "sample_index": self.sample_index,
            "total_reward": self.total_reward,
        })
    }

    /// A JSON-RPC 2.0 request to the episode's tools (`tools/list`, `tools/call`), as
    /// OpenEnv's `/mcp` answers it: errors in the JSON-RPC envelope.
    pub async fn mcp(&mut self, request: &Value) -> Value {
        let id = request.get("id").cloned().unwrap_or(Value::Null);
        let Some(method) = request.get("method").and_then(Value::as_str) else {
            return wire::rpc_error(&id, rpc::INVALID_REQUEST, "Invalid Request: no `method`");
        };
        if !self.served.has(Role::Tools) {
            return wire::rpc_error(&id, rpc::INTERNAL_ERROR, "Environment does not support MCP");
        }
        match method {
            "tools/list" => {
                let tools: Vec<Value> = self
                    .served
                    .functions
                    .iter()
                    .map(|f| json!({"name": f.name, "description": f.description, "inputSchema": f.parameters}))
                    .collect();
                wire::rpc_result(&id, json!({"tools": tools}))
            }
            "tools/call" => {
                let params = request.get("params").cloned().unwrap_or_else(|| json!({}));
                let Some(name) = params.get("name").and_then(Value::as_str) else {
                    return wire::rpc_error(
                        &id,
                        rpc::INVALID_PARAMS,
                        "Invalid params - 'name' is required",
                    );
                };
                if !self.started {
                    // A call outside any episode (`POST /mcp`): a fresh one first.
                    if let Err(e) = self.reset(&Value::Null).await {
                        let message = match e {
                            Refusal::Execution(m) => m,
                            Refusal::Invalid(v) => Value::Array(v).to_string(),
                        };
                        return wire::rpc_error(&id, rpc::SERVER_ERROR, &message);
                    }
                }
                let action = json!({
                    "name": name,
                    "arguments": params.get("arguments").cloned().unwrap_or_else(|| json!({})),
                });
                let fields = action.as_object().expect("an object").clone();
                match self.call(&fields).await {
                    Ok(o) => {
                        let (text, is_error) =
                            match (&o.observation["result"], &o.observation["error"]) {
                                (Value::String(t), _) => (t.clone(), false),
                                (_, Value::String(t)) => (t.clone(), true),
                                _ => (String::new(), true),
                            };
                        wire::rpc_result(
                            &id,
                            json!({"content": [{"type": "text", "text": text}], "isError": is_error}),
                        )
                    }
                    Err(Refusal::Invalid(errors)) => wire::rpc_error(
                        &id,
                        rpc::INVALID_PARAMS,
                        &format!("Invalid params - {}", Value::Array(errors)),
                    ),
                    Err(Refusal::Execution(m)) => wire::rpc_error(&id, rpc::INTERNAL_ERROR, &m),
                }
            }
            other => wire::rpc_error(
                &id,
                rpc::METHOD_NOT_FOUND,
                &format!("Method not found: {other}"),
            ),
        }
    }
}
