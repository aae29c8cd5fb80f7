//! Training against an OpenEnv server (`[rollout.openenv]`): each trajectory opens one
//! `/ws` session, `reset`s it, sends each assistant turn as a `step` action and reads the
//! observations back as the environment's turns.
//!
//! [`Remote`] is what every episode shares: the server, checked once at start (the run's
//! grant covers it, `/health` answers, its `/schema` admits the action mapping, and with
//! `action.kind = "call"` its functions from `/mcp`). [`RemoteEpisode`] is one session.
//!
//! The connection goes only where `rollout.openenv.allow` grants, by the rules of
//! plugins' `allow_http` ([`crate::plugin::net`]): the URL must be covered, every address
//! its name resolves to must be public or named by the entry, and the host connects to
//! the addresses it checked. Everything the server sends is bounded (message size, time
//! per exchange) and checked; what fails ends the episode as a counted fault, never the
//! run.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Full, Limited};
use serde_json::{Map, Value, json};
use tokio::net::TcpStream;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::{self, Message as WsMessage, protocol::WebSocketConfig};

use super::tools::Written;
use crate::openenv::endpoint::Endpoint;
use crate::openenv::settings::{ActionKind, ForkBy, OpenEnvSection, PromptFrom};
use crate::plugin::fork::digest;
use crate::plugin::net::HttpGrants;
use crate::plugin::{Fault, FaultKind, FunctionSpec, StepResult};
use crate::rollout::tool_calls::{CallError, CallFormat};
use crate::task::{Message, Sample};

/// The server, checked, with the mapping the run uses; shared by every episode.
pub struct Remote {
    /// The URL as configured: episodes' faults are filed under `openenv:<url>`.
    pub url: String,
    endpoint: Endpoint,
    /// The addresses the grant check passed; connections go only to these.
    addrs: Vec<SocketAddr>,
    pub section: OpenEnvSection,
    /// With `action.kind = "call"`: the server's functions, and how the model writes calls
    /// (set by [`Remote::set_format`] once the chat template is known).
    pub functions: Vec<FunctionSpec>,
    pub format: Option<CallFormat>,
    /// The template's `tools`: the functions as transformers passes them.
    pub template_tools: Vec<Value>,
    /// `/metadata`'s `name`, for messages.
    pub name: String,
    /// One permit per session open (`max_sessions`).
    sessions: Arc<tokio::sync::Semaphore>,
}

/// Why a run with an OpenEnv server cannot branch unless it says its episodes replay.
pub const UNFORKABLE: &str = "an OpenEnv server's episode cannot be forked: its state lives in the server, which has no way to copy a session; tree rollouts need plugin environments, or rollout.openenv.fork = \"replay\" for a server whose episodes follow from their reset's seed";

/// The `episode_id` an OpenEnv session of trajectory `j` of sample `id` is reset with.
pub fn episode_id(seed: u64, id: u64, j: usize) -> String {
    format!("rlhost-{seed:016x}-{id}-{j}")
}

/// With `prompt = "reset"` or `"append"`: opens and resets every session of a batch
/// (`group_size` a sample) before it samples, all at once, since each reset gives its
/// trajectory's prompt. Each is the episode and its reset observation's messages, or the
/// fault that left the trajectory without one. A batch that needs more sessions than
/// `max_sessions` allows is refused: it could never start.
pub async fn reset_all(
    remote: &Arc<Remote>,
    samples: &[(u64, Sample)],
    group_size: usize,
    seed: u64,
) -> Result<Vec<Result<(RemoteEpisode, Vec<Message>), Fault>>> {
    let n = samples.len() * group_size;
    if n > remote.max_sessions() {
        bail!(
            "rollout.openenv.prompt = \"reset\" opens every session of a batch before it samples: this batch has {n} trajectories, rollout.openenv.max_sessions is {}; raise it (and the server's own cap) or lower rollout.prompts_per_step",
            remote.max_sessions()
        );
    }
    // All the batch's places at once: a held-out evaluation opening beside it could
    // otherwise hold part of what each needs.
    let mut places = remote.places(n).await;
    let opening: Vec<_> = samples
        .iter()
        .flat_map(|(id, sample)| (0..group_size).map(move |j| (*id, sample, j)))
        .map(|(id, sample, j)| {
            let (remote, metadata) = (remote.clone(), sample.metadata.clone());
            let place = places.split(1).expect("one place per trajectory");
            tokio::spawn(async move {
                let id_text = episode_id(seed, id, j);
                RemoteEpisode::open(remote, id, id_text, &metadata, Some(place)).await
            })
        })
        .collect();
    futures_util::future::join_all(opening)
        .await
        .into_iter()
        .map(|r| r.context("an OpenEnv reset task panicked"))
        .collect()
}

/// What `reset` and `step` answer: the server side's type, read back here.
pub use crate::openenv::wire::Observed;

impl Remote {
    /// Checks `section` against the run's grant and the server: it answers `/health`, its
    /// `/schema` admits the action mapping, and a `call` mapping finds its functions on
    /// `/mcp`. Each error names the server and says what to change.
    pub async fn connect(section: &OpenEnvSection) -> Result<Remote> {
        section
            .check()
            .map_err(|e| anyhow::anyhow!("rollout.openenv.{e}"))?;
        let endpoint = Endpoint::parse(&section.url).map_err(anyhow::Error::msg)?;
        let grants = HttpGrants::parse(&section.allow).map_err(anyhow::Error::msg)?;
        let host = endpoint.bare_host().to_string();
        grants
            .check_url("http", &endpoint.host, endpoint.port)
            .map_err(|d| {
                anyhow::anyhow!("rollout.openenv.url is not granted by rollout.openenv.allow: {d}")
            })?;
        let resolved: Vec<SocketAddr> = tokio::time::timeout(
            Duration::from_secs(10),
            tokio::net::lookup_host((host.as_str(), endpoint.port)),
        )
        .await
        .map_err(|_| anyhow::anyhow!("resolving {host} took over 10 s"))?
        .with_context(|| format!("cannot resolve the OpenEnv server's host {host}"))?
        .collect();
        let ips: Vec<_> = resolved.iter().map(SocketAddr::ip).collect();
        let checked = grants
            .check_addresses("http", &endpoint.host, endpoint.port, &ips)
            .map_err(|d| {
                anyhow::anyhow!("rollout.openenv.url is not granted by rollout.openenv.allow: {d}")
            })?;
        let addrs = checked
            .into_iter()
            .map(|ip| SocketAddr::new(ip, endpoint.port))
            .collect();
        let mut remote = Remote {
            url: section.url.clone(),
            endpoint,
            addrs,
            section: section.clone(),
            functions: Vec::new(),
            format: None,
            template_tools: Vec::new(),
            name: String::new(),
            sessions: Arc::new(tokio::sync::Semaphore::new(section.max_sessions)),
        };
        let (status, _) = remote.http("GET", "/health", None).await.with_context(|| {
            format!(
                "the OpenEnv server at {} does not answer; start it (or fix rollout.openenv.url)",
                remote.url
            )
        })?;
        if status != 200 {
            bail!(
                "the OpenEnv server at {} answers /health with HTTP {status}; is it an OpenEnv server?",
                remote.url
            );
        }
        if let Ok((200, meta)) = remote.http("GET", "/metadata", None).await {
            remote.name = meta
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
        }
        let schema = match remote.http("GET", "/schema", None).await? {
            (200, schema) => schema,
            (status, _) => bail!(
                "the OpenEnv server at {} answers /schema with HTTP {status}: rlhost reads the action schema there to check rollout.openenv.action",
                remote.url
            ),
        };
        let action = schema.get("action").cloned().unwrap_or(Value::Null);
        admits(&action, &section.action.fixed, &remote.mapped_fields()).map_err(|why| {
            anyhow::anyhow!(
                "rollout.openenv.action cannot write this server's actions ({}): {why}; its /schema action is {}",
                remote.url,
                short(&action.to_string(), 600)
            )
        })?;
        if section.action.kind == ActionKind::Call {
            remote.functions = remote.list_tools().await?;
            remote.template_tools = remote
                .functions
                .iter()
                .map(|f| {
                    json!({"type": "function", "function": {
                        "name": f.name, "description": f.description, "parameters": f.parameters}})
                })
                .collect();
        }
        Ok(remote)
    }

    /// The fields the mapping fills from the model's turn.
    fn mapped_fields(&self) -> Vec<&str> {
        let a = &self.section.action;
        match a.kind {
            ActionKind::Text => vec![a.field.as_str()],
            ActionKind::Call => vec![a.name.as_str(), a.arguments.as_str()],
        }
    }

    /// With a `call` mapping: how the model writes calls (the chat template's format).
    pub fn set_format(&mut self, format: CallFormat) {
        self.format = Some(format);
    }

    /// Whether the reset observation makes (part of) the prompt.
    pub fn prompt_from_reset(&self) -> bool {
        self.section.prompt != PromptFrom::Dataset
    }

    /// Sessions open at once.
    pub fn max_sessions(&self) -> usize {
        self.section.max_sessions
    }

    /// `n` places under `max_sessions` at once (`n` at most that), to split one a session.
    pub async fn places(&self, n: usize) -> tokio::sync::OwnedSemaphorePermit {
        self.sessions
            .clone()
            .acquire_many_owned(n as u32)
            .await
            .expect("the session semaphore is never closed")
    }

    /// Whether the sample's messages come first in the prompt.
    pub fn prompt_keeps_sample(&self) -> bool {
        self.section.prompt != PromptFrom::Reset
    }

    fn max_message(&self) -> usize {
        (self.section.max_message_mib * 1024.0 * 1024.0) as usize
    }

    /// What the server's faults are filed under: `openenv:<url>`.
    pub fn source(&self) -> String {
        format!("openenv:{}", self.url)
    }

    fn fault(&self, call: &'static str, kind: FaultKind, message: String) -> Fault {
        Fault {
            plugin: self.source(),
            call,
            kind,
            message,
        }
    }

    async fn tcp(&self) -> std::io::Result<TcpStream> {
        let limit = Duration::from_secs_f64(self.section.connect_timeout_s);
        let mut last = None;
        for addr in &self.addrs {
            match tokio::time::timeout(limit, TcpStream::connect(addr)).await {
                Ok(Ok(s)) => {
                    s.set_nodelay(true)?;
                    return Ok(s);
                }
                Ok(Err(e)) => last = Some(e),
                Err(_) => {
                    last = Some(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no connection within {} s", self.section.connect_timeout_s),
                    ))
                }
            }
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("no address to connect to")))
    }

    /// One HTTP/1.1 request to the checked addresses: the status and the JSON body
    /// (`null` when the body is not JSON), the body bounded by `max_message_mib`.
    async fn http(&self, method: &str, path: &str, body: Option<Value>) -> Result<(u16, Value)> {
        let limit = Duration::from_secs_f64(self.section.connect_timeout_s);
        let work = async {
            let stream = self.tcp().await?;
            let (mut sender, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
            tokio::spawn(conn);
            let mut request = http::Request::builder()
                .method(method)
                .uri(format!("{}{path}", self.endpoint.base))
                .header(http::header::HOST, self.endpoint.authority());
            if body.is_some() {
                request = request.header(http::header::CONTENT_TYPE, "application/json");
            }
            let request = request.body(Full::new(Bytes::from(
                body.map(|b| b.to_string()).unwrap_or_default(),
            )))?;
            let response = sender.send_request(request).await?;
            let status = response.status().as_u16();
            let bytes = Limited::new(response.into_body(), self.max_message())
                .collect()
                .await
                .map_err(|e| anyhow::anyhow!("reading the answer: {e}"))?
                .to_bytes();
            anyhow::Ok((
                status,
                serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            ))
        };
        tokio::time::timeout(limit, work)
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "{method} {}{path} took over rollout.openenv.connect_timeout_s ({} s)",
                    self.url,
                    self.section.connect_timeout_s
                )
            })?
            .with_context(|| format!("{method} {}{path}", self.url))
    }

    /// The server's functions, from `POST /mcp` `tools/list` (JSON-RPC 2.0).
    async fn list_tools(&self) -> Result<Vec<FunctionSpec>> {
        let request = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}});
        let (status, answer) = self.http("POST", "/mcp", Some(request)).await?;
        let tools = answer
            .pointer("/result/tools")
            .and_then(Value::as_array)
            .filter(|_| status == 200)
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "rollout.openenv.action.kind = \"call\" needs the server's functions, but {}/mcp answers tools/list with HTTP {status}: {}",
                    self.url,
                    short(&answer.to_string(), 300)
                )
            })?;
        let mut functions = Vec::new();
        for (i, t) in tools.iter().enumerate() {
            let name = t.get("name").and_then(Value::as_str).ok_or_else(|| {
                anyhow::anyhow!("{}/mcp tools/list: tool {i} has no `name`", self.url)
            })?;
            // MCP's `inputSchema`; openenv-core's `/mcp` writes FastMCP's `input_schema`.
            let parameters = t
                .get("inputSchema")
                .or_else(|| t.get("input_schema"))
                .or_else(|| t.get("parameters"))
                .cloned()
                .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
            crate::plugin::schema::check_schema(&parameters).map_err(|e| {
                anyhow::anyhow!("{}/mcp tools/list: the schema of `{name}`: {e}", self.url)
            })?;
            functions.push(FunctionSpec {
                name: name.to_string(),
                description: t
                    .get("description")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
                parameters,
                stateless: false,
            });
        }
        if functions.is_empty() {
            bail!(
                "rollout.openenv.action.kind = \"call\", but {}/mcp lists no functions",
                self.url
            );
        }
        Ok(functions)
    }

    /// The environment's turn in `observation`: the first of `rollout.openenv.observation`
    /// present (and not null), as messages of `role` (a list of messages keeps its own
    /// roles, which must be in `roles`).
    fn messages(
        &self,
        call: &'static str,
        observation: &Value,
        role: &str,
        roles: &[&str],
    ) -> Result<Vec<Message>, Fault> {
        self.read(call, observation, role, roles).map(|(m, _)| m)
    }

    /// [`Self::messages`], and the field they came from.
    fn read(
        &self,
        call: &'static str,
        observation: &Value,
        role: &str,
        roles: &[&str],
    ) -> Result<(Vec<Message>, String), Fault> {
        let fields = &self.section.observation;
        let Some((field, value)) = fields
            .iter()
            .find_map(|f| observation.get(f).filter(|v| !v.is_null()).map(|v| (f, v)))
        else {
            let has: Vec<&String> = observation
                .as_object()
                .map(|o| o.keys().collect())
                .unwrap_or_default();
            return Err(self.fault(
                call,
                FaultKind::BadOutput,
                format!(
                    "the observation has none of rollout.openenv.observation's fields {fields:?} (it has {has:?})"
                ),
            ));
        };
        let messages = match value {
            Value::Array(items)
                if !items.is_empty() && items.iter().all(|m| m.get("role").is_some()) =>
            {
                let mut out = Vec::with_capacity(items.len());
                for m in items {
                    let mut m: Message = serde_json::from_value(m.clone()).map_err(|e| {
                        self.fault(
                            call,
                            FaultKind::BadOutput,
                            format!("an observation message: {e}"),
                        )
                    })?;
                    if !roles.contains(&m.role.as_str()) {
                        return Err(self.fault(
                            call,
                            FaultKind::BadOutput,
                            format!(
                                "the observation has a message with role `{}`; here only {roles:?}",
                                m.role
                            ),
                        ));
                    }
                    // A server's messages keep their role and text: calls and call ids
                    // are rendered unescaped by templates, so they are not taken from it.
                    m.tool_calls.clear();
                    m.tool_call_id = None;
                    out.push(m);
                }
                out
            }
            Value::Array(items) if items.is_empty() => Vec::new(),
            other => vec![Message::new(role, text_of(other))],
        };
        Ok((messages, field.clone()))
    }
}

/// An observation field as the model reads it: a string as it is; an MCP tool result
/// (`{"content": [{"type": "text", "text": …}, …]}`) as its texts; an MCP error
/// (`{"message": …}`) as its message; anything else as compact JSON.
fn text_of(value: &Value) -> String {
    if let Some(s) = value.as_str() {
        return s.to_string();
    }
    if let Some(content) = value.get("content").and_then(Value::as_array) {
        let texts: Vec<&str> = content
            .iter()
            .filter_map(|c| c.get("text").and_then(Value::as_str))
            .collect();
        if !texts.is_empty() {
            return texts.join("\n");
        }
    }
    if let Some(m) = value.get("message").and_then(Value::as_str) {
        return m.to_string();
    }
    value.to_string()
}

/// Whether an action schema admits actions with `mapped` fields (and `fixed`): the schema
/// itself or one of its `oneOf`/`anyOf` alternatives is an object whose properties have
/// the fields (or that takes other properties) and that requires nothing else.
fn admits(schema: &Value, fixed: &Map<String, Value>, mapped: &[&str]) -> Result<(), String> {
    let alternatives: Vec<&Value> = match schema
        .get("oneOf")
        .or_else(|| schema.get("anyOf"))
        .and_then(Value::as_array)
    {
        Some(list) => list.iter().collect(),
        None => vec![schema],
    };
    if alternatives.is_empty() || schema.is_null() {
        return Err("the server gives no action schema".into());
    }
    let mut why = Vec::new();
    for alt in alternatives {
        let properties = alt.get("properties").and_then(Value::as_object);
        let open = alt.get("additionalProperties") != Some(&Value::Bool(false));
        let missing: Vec<&str> = mapped
            .iter()
            .chain(fixed.keys().map(String::as_str).collect::<Vec<_>>().iter())
            .copied()
            .filter(|f| !open && !properties.is_some_and(|p| p.contains_key(*f)))
            .collect();
        let required: Vec<&str> = alt
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let unfilled: Vec<&str> = required
            .into_iter()
            .filter(|r| !mapped.contains(r) && !fixed.contains_key(*r))
            .collect();
        if missing.is_empty() && unfilled.is_empty() {
            return Ok(());
        }
        if !missing.is_empty() {
            why.push(format!("it has no field {missing:?}"));
        }
        if !unfilled.is_empty() {
            why.push(format!(
                "it requires {unfilled:?}, which the mapping does not fill (map it, or set it in action.fixed)"
            ));
        }
    }
    why.dedup();
    Err(why.join("; "))
}

fn short(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// One episode: a `/ws` session on the server.
pub struct RemoteEpisode {
    remote: Arc<Remote>,
    ws: Option<WebSocketStream<TcpStream>>,
    handle: tokio::runtime::Handle,
    /// Its place under `max_sessions`, given back once the server has been told the
    /// session is over (so that the next session does not find the server full).
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    /// With `fork = "replay"`: each message sent (the reset, then the actions) and the
    /// digest of the server's answer, which a fork sends again and checks.
    sent: Vec<(Value, u64)>,
}

/// Why an episode could not be forked, in one line.
#[derive(Debug, thiserror::Error)]
pub enum EpisodeForkError {
    #[error("{0}")]
    Refused(String),
    #[error("forking an OpenEnv episode: {0}")]
    Fault(#[from] Fault),
    #[error(
        "the OpenEnv server {url} answered message {index} of the episode's replay otherwise than the first time, so its episodes do not follow from their reset (leave rollout.openenv.fork unset for it)"
    )]
    Diverged { url: String, index: usize },
}

impl RemoteEpisode {
    /// Opens a session and resets it (`seed`, `episode_id`, `rollout.openenv.reset`, and
    /// with `reset_metadata` the sample's metadata fields): the episode, and the reset
    /// observation's messages when the prompt comes from it (else none).
    /// `permit` is the session's place under `max_sessions` when the caller took it (a
    /// batch that needs all its sessions at once takes them together: two batches taking
    /// places one by one could each hold part of what it needs); else it waits for one.
    pub async fn open(
        remote: Arc<Remote>,
        seed: u64,
        episode_id: String,
        metadata: &Value,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Result<(RemoteEpisode, Vec<Message>), Fault> {
        let call = "openenv.reset";
        let permit = match permit {
            Some(p) => p,
            None => remote
                .sessions
                .clone()
                .acquire_owned()
                .await
                .expect("the session semaphore is never closed"),
        };
        let mut episode = RemoteEpisode::connect(&remote, permit).await?;
        let mut data = Map::new();
        if remote.section.reset_metadata
            && let Some(meta) = metadata.as_object()
        {
            data.extend(meta.clone());
        }
        data.extend(remote.section.reset.clone());
        data.insert("seed".into(), json!(seed));
        data.insert("episode_id".into(), json!(episode_id));
        let limit = Duration::from_secs_f64(remote.section.connect_timeout_s);
        let observed = episode
            .exchange(call, json!({"type": "reset", "data": data}), limit)
            .await?;
        let prompt = if remote.prompt_from_reset() {
            remote.messages(
                call,
                &observed.observation,
                "user",
                &["system", "user", "assistant"],
            )?
        } else {
            Vec::new()
        };
        Ok((episode, prompt))
    }

    /// A new session on the server holding `permit`, not yet reset.
    async fn connect(
        remote: &Arc<Remote>,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<RemoteEpisode, Fault> {
        let call = "openenv.reset";
        let limit = Duration::from_secs_f64(remote.section.connect_timeout_s);
        let connect = async {
            let stream = remote.tcp().await.map_err(|e| e.to_string())?;
            let config = WebSocketConfig::default()
                .max_message_size(Some(remote.max_message()))
                .max_frame_size(Some(remote.max_message()));
            let url = format!(
                "ws://{}{}/ws",
                remote.endpoint.authority(),
                remote.endpoint.base
            );
            tokio_tungstenite::client_async_with_config(url, stream, Some(config))
                .await
                .map(|(ws, _)| ws)
                .map_err(|e| e.to_string())
        };
        let ws = match tokio::time::timeout(limit, connect).await {
            Ok(Ok(ws)) => ws,
            Ok(Err(e)) => {
                return Err(remote.fault(
                    call,
                    FaultKind::Connection,
                    format!("cannot open a session on {}/ws: {e}", remote.url),
                ));
            }
            Err(_) => {
                return Err(remote.fault(
                    call,
                    FaultKind::Timeout,
                    format!(
                        "no session on {}/ws within rollout.openenv.connect_timeout_s ({} s)",
                        remote.url, remote.section.connect_timeout_s
                    ),
                ));
            }
        };
        Ok(RemoteEpisode {
            remote: remote.clone(),
            ws: Some(ws),
            handle: tokio::runtime::Handle::current(),
            permit: Some(permit),
            sent: Vec::new(),
        })
    }

    /// What the server's faults are filed under.
    pub fn source(&self) -> String {
        self.remote.source()
    }

    /// With `rollout.openenv.fork = "replay"`: a new session in this episode's state,
    /// made by sending it the episode's reset and actions again; each answer must be the
    /// one the episode got, or the fork is refused. It waits for a place under
    /// `max_sessions` at most `connect_timeout_s`.
    pub async fn fork(&mut self) -> Result<RemoteEpisode, EpisodeForkError> {
        let remote = self.remote.clone();
        if remote.section.fork != ForkBy::Replay {
            return Err(EpisodeForkError::Refused(UNFORKABLE.into()));
        }
        if self.ws.is_none() {
            return Err(EpisodeForkError::Refused(format!(
                "the OpenEnv episode on {} cannot be forked: its session has ended",
                remote.url
            )));
        }
        let wait = Duration::from_secs_f64(remote.section.connect_timeout_s);
        let place = tokio::time::timeout(wait, remote.sessions.clone().acquire_owned());
        let Ok(permit) = place.await else {
            return Err(EpisodeForkError::Fault(remote.fault(
                "openenv.reset",
                FaultKind::Timeout,
                format!(
                    "no place for a fork's session within rollout.openenv.connect_timeout_s ({} s): rollout.openenv.max_sessions ({}) are all open",
                    remote.section.connect_timeout_s,
                    remote.max_sessions()
                ),
            )));
        };
        let permit = permit.expect("the session semaphore is never closed");
        let mut fork = RemoteEpisode::connect(&remote, permit).await?;
        for (index, (message, answer)) in self.sent.iter().enumerate() {
            let (call, limit) = if index == 0 {
                ("openenv.reset", remote.section.connect_timeout_s)
            } else {
                ("openenv.step", remote.section.step_timeout_s)
            };
            let limit = Duration::from_secs_f64(limit);
            let observed = fork.exchange(call, message.clone(), limit).await?;
            if digest(&observed) != *answer {
                return Err(EpisodeForkError::Diverged {
                    url: remote.url.clone(),
                    index,
                });
            }
        }
        Ok(fork)
    }

    /// Sends the assistant's turn as a text action.
    pub async fn step_text(&mut self, turn: &str) -> Result<StepResult, Fault> {
        let remote = self.remote.clone();
        let a = &remote.section.action;
        let mut action = a.fixed.clone();
        action.insert(a.field.clone(), json!(turn));
        let observed = self.step(action).await?;
        let messages = if observed.done {
            Vec::new()
        } else {
            remote.messages(
                "openenv.step",
                &observed.observation,
                &remote.section.role,
                &["user", "tool"],
            )?
        };
        Ok(StepResult {
            messages,
            done: observed.done,
            reward: observed.reward,
        })
    }

    /// Sends a turn's function calls as actions, in order, until the episode is done: a
    /// `tool` message answers each (a malformed call is answered with its error and
    /// sends nothing). The rewards are summed. Also how each call went, as
    /// `rollout.tools` counts calls: `ok`, `tool_error` (answered in one of
    /// `rollout.openenv.errors`) or the malformed call's kind.
    pub async fn step_calls(
        &mut self,
        calls: &[Written],
    ) -> Result<(StepResult, Vec<&'static str>), Fault> {
        let remote = self.remote.clone();
        let a = &remote.section.action;
        let (mut messages, mut reward, mut done) = (Vec::new(), None, false);
        let mut kinds = Vec::with_capacity(calls.len());
        for w in calls {
            let checked =
                w.call.as_ref().map_err(|m| m.error.clone()).and_then(|c| {
                    crate::rollout::tool_calls::check(c, &remote.functions).map(|()| c)
                });
            let text = match checked {
                Err(e) => {
                    kinds.push(e.kind());
                    format!("error: {}", refused(&e))
                }
                Ok(call) => {
                    let mut action = a.fixed.clone();
                    action.insert(a.name.clone(), json!(call.name));
                    action.insert(a.arguments.clone(), Value::Object(call.arguments.clone()));
                    let observed = self.step(action).await?;
                    if let Some(r) = observed.reward {
                        *reward.get_or_insert(0.0) += r;
                    }
                    done = observed.done;
                    if done {
                        kinds.push("ok");
                        break;
                    }
                    let (answer, field) =
                        remote.read("openenv.step", &observed.observation, "tool", &["tool"])?;
                    let text = answer
                        .into_iter()
                        .map(|m| m.content)
                        .collect::<Vec<_>>()
                        .join("\n");
                    // MCP's own flag on a result: the tool refused (`is_error`).
                    let flagged = observed.observation[&field]
                        .get("is_error")
                        .and_then(Value::as_bool)
                        == Some(true);
                    if flagged || remote.section.errors.contains(&field) {
                        kinds.push("tool_error");
                        format!("error: {text}")
                    } else {
                        kinds.push("ok");
                        text
                    }
                }
            };
            messages.push(Message {
                role: "tool".into(),
                content: text,
                tool_calls: Vec::new(),
                tool_call_id: Some(w.id.clone()),
            });
        }
        let result = StepResult {
            messages: if done { Vec::new() } else { messages },
            done,
            reward,
        };
        Ok((result, kinds))
    }

    async fn step(&mut self, action: Map<String, Value>) -> Result<Observed, Fault> {
        let limit = Duration::from_secs_f64(self.remote.section.step_timeout_s);
        self.exchange(
            "openenv.step",
            json!({"type": "step", "data": action}),
            limit,
        )
        .await
    }

    /// Sends one message and reads its answer (pings between are answered by the
    /// stream), within `limit`. A fault leaves the session closed.
    async fn exchange(
        &mut self,
        call: &'static str,
        message: Value,
        limit: Duration,
    ) -> Result<Observed, Fault> {
        let remote = self.remote.clone();
        let Some(ws) = self.ws.as_mut() else {
            return Err(remote.fault(call, FaultKind::Connection, "the session is closed".into()));
        };
        let work = async {
            ws.send(WsMessage::text(message.to_string()))
                .await
                .map_err(|e| (FaultKind::Connection, format!("sending: {e}")))?;
            loop {
                match ws.next().await {
                    None => {
                        return Err((
                            FaultKind::Connection,
                            "the server closed the connection".to_string(),
                        ));
                    }
                    Some(Err(tungstenite::Error::Capacity(e))) => {
                        return Err((
                            FaultKind::BadOutput,
                            format!(
                                "the server sent a message past rollout.openenv.max_message_mib ({} MiB): {e}",
                                remote.section.max_message_mib
                            ),
                        ));
                    }
                    Some(Err(e)) => return Err((FaultKind::Connection, e.to_string())),
                    Some(Ok(WsMessage::Text(text))) => return Ok(text.to_string()),
                    Some(Ok(WsMessage::Binary(b))) => {
                        return Ok(String::from_utf8_lossy(&b).into_owned());
                    }
                    Some(Ok(WsMessage::Close(frame))) => {
                        return Err((
                            FaultKind::Connection,
                            format!(
                                "the server closed the session{}",
                                frame.map(|f| format!(": {}", f.reason)).unwrap_or_default()
                            ),
                        ));
                    }
                    Some(Ok(_)) => continue,
                }
            }
        };
        let outcome = match tokio::time::timeout(limit, work).await {
            Ok(r) => r,
            Err(_) => Err((
                FaultKind::Timeout,
                format!("no answer within {} s", limit.as_secs_f64()),
            )),
        };
        let result = outcome.and_then(|text| read_answer(&text));
        match result {
            Ok(observed) => {
                if remote.section.fork == ForkBy::Replay {
                    self.sent.push((message, digest(&observed)));
                }
                Ok(observed)
            }
            Err((kind, message)) => {
                // The exchange is out of step (or the server is gone): no further use.
                self.close();
                Err(remote.fault(call, kind, message))
            }
        }
    }

    /// Tells the server the session is over (in the background) and drops it.
    fn close(&mut self) {
        let permit = self.permit.take();
        if let Some(mut ws) = self.ws.take() {
            self.handle.spawn(async move {
                // The place is given back once the server has let the session go (its
                // close answered, or the connection gone), so that the next session does
                // not find it still counted.
                let _ = tokio::time::timeout(Duration::from_secs(2), async {
                    let _ = ws.send(WsMessage::text(r#"{"type":"close"}"#)).await;
                    let _ = ws.close(None).await;
                    while let Some(Ok(_)) = ws.next().await {}
                })
                .await;
                drop(permit);
            });
        }
    }
}

impl Drop for RemoteEpisode {
    fn drop(&mut self) {
        self.close();
    }
}

/// What the model is told of a call that was not sent.
fn refused(e: &CallError) -> String {
    e.message()
}

/// A server's answer to `reset` or `step`: `{"type": "observation", "data":
/// {"observation", "reward", "done"}}`, or its error.
fn read_answer(text: &str) -> Result<Observed, (FaultKind, String)> {
    let bad = |why: String| (FaultKind::BadOutput, why);
    let answer: Value = serde_json::from_str(text).map_err(|e| {
        bad(format!(
            "an answer that is not JSON ({e}): {}",
            short(text, 200)
        ))
    })?;
    let data = answer.get("data").cloned().unwrap_or(Value::Null);
    match answer.get("type").and_then(Value::as_str) {
        Some("observation") => {}
        Some("error") => {
            return Err((
                FaultKind::GuestError,
                format!(
                    "{} ({})",
                    data.get("message")
                        .and_then(Value::as_str)
                        .unwrap_or("no message"),
                    data.get("code")
                        .and_then(Value::as_str)
                        .unwrap_or("no code")
                ),
            ));
        }
        _ => {
            return Err(bad(format!(
                "an answer that is neither an observation nor an error: {}",
                short(text, 200)
            )));
        }
    }
    let observation = match data.get("observation") {
        Some(o @ Value::Object(_)) => o.clone(),
        _ => {
            return Err(bad(
                "an observation answer without an `observation` object".into()
            ));
        }
    };
    let reward = match data.get("reward") {
        None | Some(Value::Null) => None,
        Some(r) => match r.as_f64() {
            Some(r) if r.is_finite() => Some(r),
            _ => {
                return Err(bad(format!(
                    "a reward of {r}; rewards must be finite numbers"
                )));
            }
        },
    };
    let done = match data.get("done") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(d)) => *d,
        Some(d) => return Err(bad(format!("`done` is {d}, not true or false"))),
    };
    Ok(Observed {
        observation,
        reward,
        done,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_action_schema_must_admit_the_mapping() {
        let echo = json!({"type": "object", "additionalProperties": false,
            "properties": {"message": {"type": "string"}, "metadata": {"type": "object"}},
            "required": ["message"]});
        let none = Map::new();
        assert!(admits(&echo, &none, &["message"]).is_ok());
        let err = admits(&echo, &none, &["text"]).unwrap_err();
        assert!(
            err.contains("no field [\"text\"]") && err.contains("[\"message\"]"),
            "{err}"
        );
        let mcp = json!({"oneOf": [
            {"type": "object", "properties": {"type": {"const": "list_tools"}}, "required": ["type"]},
            {"type": "object", "properties": {"type": {"const": "call_tool"},
                "tool_name": {"type": "string"}, "arguments": {"type": "object"}},
                "required": ["type", "tool_name"]}]});
        let mut fixed = Map::new();
        assert!(
            admits(&mcp, &fixed, &["tool_name", "arguments"])
                .unwrap_err()
                .contains("action.fixed")
        );
        fixed.insert("type".into(), json!("call_tool"));
        assert!(admits(&mcp, &fixed, &["tool_name", "arguments"]).is_ok());
        assert!(admits(&Value::Null, &fixed, &["x"]).is_err());
    }

    #[test]
    fn observation_fields_are_read_as_text() {
        assert_eq!(text_of(&json!("2026-01-04")), "2026-01-04");
        let mcp = json!({"content": [{"type": "text", "text": "2026-01-04", "annotations": null}],
            "structured_content": {"result": "2026-01-04"}, "is_error": false});
        assert_eq!(text_of(&mcp), "2026-01-04");
        let error =
            json!({"error_type": "invalid_args", "message": "Invalid isoformat string: 'bad'"});
        assert_eq!(text_of(&error), "Invalid isoformat string: 'bad'");
        assert_eq!(text_of(&json!({"n": 5})), r#"{"n":5}"#);
        assert_eq!(text_of(&json!(3.5)), "3.5");
    }

    #[test]
    fn answers_are_read_strictly() {
        let ok = read_answer(
            r#"{"type":"observation","data":{"observation":{"a":1},"reward":0.5,"done":true}}"#,
        )
        .unwrap();
        assert_eq!((ok.reward, ok.done), (Some(0.5), true));
        let ok = read_answer(r#"{"type":"observation","data":{"observation":{},"reward":null}}"#)
            .unwrap();
        assert_eq!((ok.reward, ok.done), (None, false));
        for (text, kind, says) in [
            ("not json", FaultKind::BadOutput, "not JSON"),
            (
                r#"{"type":"error","data":{"message":"boom","code":"EXECUTION_ERROR"}}"#,
                FaultKind::GuestError,
                "boom (EXECUTION_ERROR)",
            ),
            (
                r#"{"type":"state","data":{}}"#,
                FaultKind::BadOutput,
                "neither",
            ),
            (
                r#"{"type":"observation","data":{"observation":3}}"#,
                FaultKind::BadOutput,
                "without an `observation`",
            ),
            (
                r#"{"type":"observation","data":{"observation":{},"reward":"x"}}"#,
                FaultKind::BadOutput,
                "finite",
            ),
            (
                r#"{"type":"observation","data":{"observation":{},"done":1}}"#,
                FaultKind::BadOutput,
                "`done`",
            ),
        ] {
            let (k, m) = read_answer(text).unwrap_err();
            assert_eq!(k, kind, "{text}");
            assert!(m.contains(says), "{text}: {m}");
        }
    }
}
