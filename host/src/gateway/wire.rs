//! The OpenAI wire format the gateway speaks (issue 46): requests of `POST
//! /v1/chat/completions`, their checks, and the answers (whole, streamed chunks, errors,
//! the model list), as `docs/design/openai-wire.md` gathers them from openai-python,
//! OpenAI's OpenAPI spec and vLLM.
//!
//! Two rules from there shape the types. An optional field may come absent or as `null`
//! (the client sends `null` for `None`), so every optional field is an `Option`, and
//! unknown fields are accepted (the client's `extra_body` adds any). And a field is either
//! honoured or refused with a 400 naming it, never silently ignored where ignoring it
//! would change what the caller gets (`logit_bias`, the penalties, `response_format`);
//! fields that change nothing here (`user`, `store`, `metadata`, …) are accepted.
//!
//! Errors are OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`,
//! with the offending field in `param` (`messages[2].tool_call_id`), so that a client's
//! `BadRequestError` says what to fix.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// An error answer: its HTTP status and OpenAI's error object.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `server_error`, …
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds a client should wait before trying again (a 503 while the policy updates);
    /// openai-python honours `Retry-After` up to 60 s (1.x) or 120 s (3.x).
    pub retry_after_s: Option<u32>,
}

impl ApiError {
    /// A 400 about `param`: what is wrong with it and how to fix it.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: None,
            retry_after_s: None,
        }
    }

    /// A 400 about the body as a whole (no one field to name).
    pub fn bad_body(message: impl Into<String>) -> ApiError {
        ApiError {
            param: None,
            ..ApiError::invalid("", message)
        }
    }

    /// A 404 for a model the gateway does not serve (400s and 404s are never retried by
    /// the client, as a missing model should not be).
    pub fn model_not_found(model: &str, served: &str) -> ApiError {
        ApiError {
            status: 404,
            message: format!(
                "The model `{model}` does not exist here: this gateway serves `{served}` \
                 (GET /v1/models lists it)"
            ),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
            retry_after_s: None,
        }
    }

    /// A 503 with `Retry-After`: the policy is being updated and the run refuses calls
    /// meanwhile rather than holding them (the client retries twice on its own).
    pub fn updating(retry_after_s: u32) -> ApiError {
        ApiError {
            status: 503,
            message: "the policy is being updated; try again shortly".into(),
            kind: "server_error",
            param: None,
            code: Some("policy_updating"),
            retry_after_s: Some(retry_after_s),
        }
    }

    /// A refusal made before the routes ([`crate::front`]): a missing key (401, OpenAI's
    /// `invalid_api_key`), a wrong method (405), a body too slow (408) or too large (413),
    /// or no room for another connection (503).
    pub fn from_front(status: axum::http::StatusCode, message: String) -> ApiError {
        let code = status.as_u16();
        ApiError {
            status: code,
            message,
            kind: if code >= 500 {
                "server_error"
            } else {
                "invalid_request_error"
            },
            param: None,
            code: (code == 401).then_some("invalid_api_key"),
            // The front adds `Retry-After` to its 503 itself, for every protocol.
            retry_after_s: None,
        }
    }

    /// The JSON body: all four keys, `param` and `code` as `null` when absent.
    pub fn body(&self) -> Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    /// Newer OpenAI models' name for `system`; rendered as `system`.
    Developer,
    User,
    Assistant,
    Tool,
}

impl Role {
    /// The role a chat template knows (`developer` is a system turn to it).
    pub fn template_role(self) -> &'static str {
        match self {
            Role::System | Role::Developer => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// A message's `content`: a string, or an array of parts of which this text-only model
/// reads `text` parts.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// One part of an array `content`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// A function call the assistant made, as the request replays it; `arguments` is the
/// JSON-encoded string the model wrote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}

/// One message of `messages`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: Option<Content>,
    pub name: Option<String>,
    pub tool_calls: Option<Vec<ToolCall>>,
    pub tool_call_id: Option<String>,
}

impl Message {
    /// The text of `content` (parts joined), `None` when absent or `null`.
    pub fn text(&self) -> Option<String> {
        match &self.content {
            None => None,
            Some(Content::Text(t)) => Some(t.clone()),
            Some(Content::Parts(parts)) => Some(
                parts
                    .iter()
                    .filter_map(|p| p.text.as_deref())
                    .collect::<Vec<_>>()
                    .join(""),
            ),
        }
    }
}

/// A function the model may call (`tools[i]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDef,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionDef {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON Schema object; absent means the function takes no arguments.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    /// This function and no other.
    Function(String),
}

/// `stop`: one string or up to four.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// A checked `POST /v1/chat/completions` request, defaults applied.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<Message>,
    pub tools: Vec<Tool>,
    pub tool_choice: ToolChoice,
    pub temperature: f64,
    pub top_p: f64,
    /// `max_completion_tokens`, else `max_tokens`; `None`: up to the model's room.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub n: usize,
    pub seed: Option<u64>,
    /// `Some(k)`: log-probs of the sampled tokens with the `k` likeliest beside them.
    pub logprobs: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    pub parallel_tool_calls: bool,
}

/// The largest `n` (OpenAI's).
pub const MAX_N: usize = 128;
/// The most `stop` strings (OpenAI's).
pub const MAX_STOP: usize = 4;
/// The most alternatives a token's `top_logprobs` lists (OpenAI's).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// `field` of `object` as `T`: absent and `null` are `None`; a value of another type is
/// a 400 naming the field.
fn field<T: DeserializeOwned>(
    object: &Map<String, Value>,
    name: &str,
) -> Result<Option<T>, ApiError> {
    match object.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v.clone())
            .map(Some)
            .map_err(|e| ApiError::invalid(name, format!("`{name}`: {e}"))),
    }
}

/// A number field within `[lo, hi]`.
fn bounded(
    object: &Map<String, Value>,
    name: &str,
    lo: f64,
    hi: f64,
) -> Result<Option<f64>, ApiError> {
    let v: Option<f64> = field(object, name)?;
    match v {
        Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::invalid(
            name,
            format!("`{name}` is {x}; it must be between {lo} and {hi}"),
        )),
        other => Ok(other),
    }
}

impl ChatRequest {
    /// Reads and checks a request body.
    pub fn parse(body: &[u8]) -> Result<ChatRequest, ApiError> {
        let value: Value = serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_body(format!("the request body is not JSON: {e}")))?;
        let Value::Object(object) = value else {
            return Err(ApiError::bad_body("the request body must be a JSON object"));
        };
        Self::from_object(&object)
    }

    fn from_object(o: &Map<String, Value>) -> Result<ChatRequest, ApiError> {
        let model: Option<String> = field(o, "model")?;
        let raw: Vec<Value> = field(o, "messages")?
            .ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
        if raw.is_empty() {
            return Err(ApiError::invalid(
                "messages",
                "`messages` must hold at least one message",
            ));
        }
        let mut messages = Vec::with_capacity(raw.len());
        for (i, m) in raw.into_iter().enumerate() {
            let param = format!("messages[{i}]");
            let message: Message = serde_json::from_value(m)
                .map_err(|e| ApiError::invalid(&param, format!("`{param}`: {e}")))?;
            check_message(&message, &param)?;
            messages.push(message);
        }
        let tools: Vec<Tool> = field(o, "tools")?.unwrap_or_default();
        if o.get("tools")
            .is_some_and(|t| t.as_array().is_some_and(Vec::is_empty))
        {
            return Err(ApiError::invalid(
                "tools",
                "`tools` is empty: leave it out instead",
            ));
        }
        for (i, t) in tools.iter().enumerate() {
            if t.kind != "function" {
                return Err(ApiError::invalid(
                    format!("tools[{i}].type"),
                    format!("tool type `{}`: only `function` tools are served", t.kind),
                ));
            }
            let name = &t.function.name;
            if name.is_empty()
                || name.len() > 64
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                return Err(ApiError::invalid(
                    format!("tools[{i}].function.name"),
                    format!("function name `{name}`: 1 to 64 of a-z, A-Z, 0-9, _ and -"),
                ));
            }
        }
        let tool_choice = tool_choice(o.get("tool_choice"), &tools)?;
        let Sampling {
            temperature,
            top_p,
            n,
            stop,
            seed,
        } = sampling(o)?;
        let max_tokens = match field::<u64>(o, "max_completion_tokens")? {
            Some(n) => Some((n, "max_completion_tokens")),
            None => field::<u64>(o, "max_tokens")?.map(|n| (n, "max_tokens")),
        };
        if let Some((0, name)) = max_tokens {
            return Err(ApiError::invalid(
                name,
                format!("`{name}` must be at least 1"),
            ));
        }
        let want_logprobs = field::<bool>(o, "logprobs")?.unwrap_or(false);
        let top = field::<u64>(o, "top_logprobs")?;
        let logprobs = match (want_logprobs, top) {
            (_, Some(k)) if k as usize > MAX_TOP_LOGPROBS => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!("`top_logprobs` is {k}; at most {MAX_TOP_LOGPROBS}"),
                ));
            }
            (false, Some(k)) if k > 0 => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs: true`",
                ));
            }
            (true, k) => Some(k.unwrap_or(0) as usize),
            (false, _) => None,
        };
        let stream = field::<bool>(o, "stream")?.unwrap_or(false);
        let options: Option<StreamOptions> = field(o, "stream_options")?;
        if options.is_some() && !stream {
            return Err(ApiError::invalid(
                "stream_options",
                "`stream_options` is only for `stream: true`",
            ));
        }
        if let Some(format) = field::<Value>(o, "response_format")?
            && format.get("type").and_then(Value::as_str) != Some("text")
        {
            return Err(ApiError::invalid(
                "response_format",
                "only `{\"type\": \"text\"}` is served (no constrained JSON decoding)",
            ));
        }
        Ok(ChatRequest {
            model,
            messages,
            tools,
            tool_choice,
            temperature,
            top_p,
            max_tokens: max_tokens.map(|(n, _)| n as usize),
            stop,
            n,
            seed,
            logprobs,
            stream,
            include_usage: options.and_then(|o| o.include_usage).unwrap_or(false),
            parallel_tool_calls: field::<bool>(o, "parallel_tool_calls")?.unwrap_or(true),
        })
    }
}

/// The sampling fields both requests share, checked.
struct Sampling {
    temperature: f64,
    top_p: f64,
    n: usize,
    stop: Vec<String>,
    seed: Option<u64>,
}

/// Reads the shared sampling fields, and refuses those that would change what the
/// caller gets if ignored (the penalties, `logit_bias`): honoured or refused, never
/// ignored.
fn sampling(o: &Map<String, Value>) -> Result<Sampling, ApiError> {
    let temperature = bounded(o, "temperature", 0.0, 2.0)?.unwrap_or(1.0);
    let lowest = crate::sampler::draw::MIN_TEMPERATURE;
    if temperature > 0.0 && temperature < lowest as f64 {
        return Err(ApiError::invalid(
            "temperature",
            format!(
                "`temperature` is {temperature}; it must be 0 (greedy) or at least {lowest}: \
                 below that the sampled tokens' log-probs cannot be computed"
            ),
        ));
    }
    let top_p = bounded(o, "top_p", 0.0, 1.0)?.unwrap_or(1.0);
    if top_p == 0.0 {
        return Err(ApiError::invalid("top_p", "`top_p` must be above 0"));
    }
    let n = field::<u64>(o, "n")?.unwrap_or(1) as usize;
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::invalid(
            "n",
            format!("`n` is {n}; it must be 1 to {MAX_N}"),
        ));
    }
    let stop = match field::<Stop>(o, "stop")? {
        None => vec![],
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > MAX_STOP || stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "`stop` holds {} strings; at most {MAX_STOP}, none empty",
                stop.len()
            ),
        ));
    }
    for name in ["presence_penalty", "frequency_penalty"] {
        if bounded(o, name, -2.0, 2.0)?.is_some_and(|x| x != 0.0) {
            return Err(ApiError::invalid(
                name,
                format!("`{name}` is not supported: the policy samples as it is trained"),
            ));
        }
    }
    if field::<Map<String, Value>>(o, "logit_bias")?.is_some_and(|m| !m.is_empty()) {
        return Err(ApiError::invalid(
            "logit_bias",
            "`logit_bias` is not supported: the policy samples as it is trained",
        ));
    }
    Ok(Sampling {
        temperature,
        top_p,
        n,
        stop,
        seed: field::<i64>(o, "seed")?.map(|s| s as u64),
    })
}

/// What each role must carry.
fn check_message(m: &Message, param: &str) -> Result<(), ApiError> {
    if let Some(Content::Parts(parts)) = &m.content {
        for (j, p) in parts.iter().enumerate() {
            if p.kind != "text" || p.text.is_none() {
                return Err(ApiError::invalid(
                    format!("{param}.content[{j}]"),
                    format!(
                        "content part of type `{}`: this model reads text parts \
                         (`{{\"type\": \"text\", \"text\": ...}}`) only",
                        p.kind
                    ),
                ));
            }
        }
    }
    match m.role {
        Role::Tool if m.tool_call_id.is_none() => Err(ApiError::invalid(
            format!("{param}.tool_call_id"),
            "a `tool` message needs the `tool_call_id` of the call it answers",
        )),
        Role::Assistant if m.content.is_none() && m.tool_calls.is_none() => Err(ApiError::invalid(
            format!("{param}.content"),
            "an `assistant` message needs `content` or `tool_calls`",
        )),
        Role::System | Role::Developer | Role::User | Role::Tool if m.content.is_none() => {
            Err(ApiError::invalid(
                format!("{param}.content"),
                format!("a `{}` message needs `content`", m.role.template_role()),
            ))
        }
        _ => Ok(()),
    }
}

/// `tool_choice`, checked against `tools`: `none` without tools, `auto` with them.
fn tool_choice(value: Option<&Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let bad = |why: String| Err(ApiError::invalid("tool_choice", why));
    let choice = match value {
        None | Some(Value::Null) => {
            return Ok(if tools.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            });
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return bad(format!(
                    "`tool_choice` `{other}`: none, auto, required or a named function"
                ));
            }
        },
        Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
            Some(name) if v.get("type").and_then(Value::as_str) == Some("function") => {
                ToolChoice::Function(name.to_string())
            }
            _ => {
                return bad(
                    "`tool_choice` object: `{\"type\": \"function\", \"function\": {\"name\": ...}}`"
                        .into(),
                );
            }
        },
    };
    match &choice {
        ToolChoice::None => {}
        _ if tools.is_empty() => return bad("`tool_choice` needs `tools`".into()),
        ToolChoice::Function(name) if !tools.iter().any(|t| &t.function.name == name) => {
            return bad(format!(
                "`tool_choice` names `{name}`, which is not among `tools`"
            ));
        }
        _ => {}
    }
    Ok(choice)
}

/// One prompt of `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

/// The most alternatives `/v1/completions`' `logprobs` asks for (OpenAI's).
pub const MAX_COMPLETION_LOGPROBS: usize = 5;

/// A checked `POST /v1/completions` request.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    pub model: Option<String>,
    /// One or several (a batch: choice `i * n + j` is prompt `i`'s `j`th).
    pub prompts: Vec<Prompt>,
    /// `None`: OpenAI's 16.
    pub max_tokens: Option<usize>,
    pub temperature: f64,
    pub top_p: f64,
    pub n: usize,
    pub stop: Vec<String>,
    pub seed: Option<u64>,
    /// `Some(k)`: sampled tokens' log-probs with the `k` likeliest beside them.
    pub logprobs: Option<usize>,
}

impl CompletionRequest {
    /// Reads and checks a request body; token ids must be below `vocab`.
    pub fn parse(body: &[u8], vocab: usize) -> Result<CompletionRequest, ApiError> {
        let value: Value = serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_body(format!("the request body is not JSON: {e}")))?;
        let Value::Object(o) = value else {
            return Err(ApiError::bad_body("the request body must be a JSON object"));
        };
        let model: Option<String> = field(&o, "model")?;
        let prompts = match o.get("prompt") {
            None | Some(Value::Null) => {
                return Err(ApiError::invalid("prompt", "`prompt` is required"));
            }
            Some(Value::String(s)) => vec![Prompt::Text(s.clone())],
            Some(Value::Array(items)) if items.is_empty() => {
                return Err(ApiError::invalid("prompt", "`prompt` is empty"));
            }
            Some(Value::Array(items)) if items.iter().all(Value::is_number) => {
                vec![Prompt::Ids(ids(items, "prompt", vocab)?)]
            }
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::String(s) => Ok(Prompt::Text(s.clone())),
                    Value::Array(a) => Ok(Prompt::Ids(ids(a, &format!("prompt[{i}]"), vocab)?)),
                    other => Err(ApiError::invalid(
                        format!("prompt[{i}]"),
                        format!("a prompt is a string or a list of token ids, got {other}"),
                    )),
                })
                .collect::<Result<_, _>>()?,
            Some(other) => {
                return Err(ApiError::invalid(
                    "prompt",
                    format!(
                        "`prompt` is a string, a list of token ids, or a list of either; got {other}"
                    ),
                ));
            }
        };
        let max_tokens = field::<u64>(&o, "max_tokens")?;
        if max_tokens == Some(0) {
            return Err(ApiError::invalid(
                "max_tokens",
                "`max_tokens` must be at least 1",
            ));
        }
        let Sampling {
            temperature,
            top_p,
            n,
            stop,
            seed,
        } = sampling(&o)?;
        if let Some(b) = field::<u64>(&o, "best_of")?
            && b as usize != n
        {
            return Err(ApiError::invalid(
                "best_of",
                "`best_of` is not supported (every sample is returned): leave it out",
            ));
        }
        let logprobs = field::<u64>(&o, "logprobs")?.map(|k| k as usize);
        if logprobs.is_some_and(|k| k > MAX_COMPLETION_LOGPROBS) {
            return Err(ApiError::invalid(
                "logprobs",
                format!("`logprobs` is at most {MAX_COMPLETION_LOGPROBS}"),
            ));
        }
        if field::<bool>(&o, "echo")? == Some(true) {
            return Err(ApiError::invalid(
                "echo",
                "`echo` is not supported: leave it out",
            ));
        }
        if field::<String>(&o, "suffix")?.is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid(
                "suffix",
                "`suffix` is not supported: leave it out",
            ));
        }
        if field::<bool>(&o, "stream")? == Some(true) {
            return Err(ApiError::invalid(
                "stream",
                "streaming is served for /v1/chat/completions; call /v1/completions without `stream`",
            ));
        }
        Ok(CompletionRequest {
            model,
            prompts,
            max_tokens: max_tokens.map(|n| n as usize),
            temperature,
            top_p,
            n,
            stop,
            seed,
            logprobs,
        })
    }
}

/// Token ids, each below `vocab`.
fn ids(items: &[Value], param: &str, vocab: usize) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .filter(|&id| (id as usize) < vocab)
                .map(|id| id as u32)
                .ok_or_else(|| {
                    ApiError::invalid(
                        format!("{param}[{i}]"),
                        format!("token id {v} is not in the vocabulary (0 to {})", vocab - 1),
                    )
                })
        })
        .collect()
}

/// Why a choice ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
    ToolCalls,
}

/// One sampled token's log-prob, with the likeliest alternatives when asked for.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    /// The token's UTF-8 bytes (`null` where it has none).
    pub bytes: Option<Vec<u8>>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Option<Vec<u8>>,
}

/// `choices[i].logprobs`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChoiceLogprobs {
    pub content: Vec<TokenLogprob>,
    pub refusal: Option<String>,
}

/// The assistant's answer in a whole response: `content` is `null` when the answer is
/// only tool calls, `refusal` always `null` (both keys present, as the spec requires).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AnswerMessage {
    pub role: &'static str,
    pub content: Option<String>,
    pub refusal: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Choice {
    pub index: usize,
    pub message: AnswerMessage,
    pub logprobs: Option<ChoiceLogprobs>,
    pub finish_reason: FinishReason,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

/// A whole `chat.completion`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<Choice>,
    pub usage: Usage,
}

/// One tool call's piece of a streamed delta: `id`, `type` and the name on its first
/// piece only (openai-python's stream helper concatenates every string it sees again).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// A chunk's `delta`: the role on a choice's first chunk only, then text or tool calls.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallDelta>,
}

/// One choice of a chunk: `finish_reason` is an explicit `null` until its last chunk.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChunkChoice {
    pub index: usize,
    pub delta: Delta,
    pub logprobs: Option<ChoiceLogprobs>,
    pub finish_reason: Option<FinishReason>,
}

/// A `chat.completion.chunk`: the same `id` and `created` in every chunk of a stream;
/// the usage chunk (with `stream_options.include_usage`) has no choices.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

impl ChatChunk {
    /// The chunk as one server-sent event (`data: …` and a blank line; never an `event:`
    /// line, which 1.x clients mis-parse).
    pub fn event(&self) -> String {
        format!(
            "data: {}\n\n",
            serde_json::to_string(self).expect("a chunk serializes")
        )
    }
}

/// The stream's last event.
pub const DONE_EVENT: &str = "data: [DONE]\n\n";

/// `GET /v1/models`'s entry.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
}

/// `GET /v1/models`.
pub fn model_list(cards: Vec<ModelCard>) -> Value {
    serde_json::json!({"object": "list", "data": cards})
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<ChatRequest, ApiError> {
        ChatRequest::parse(v.to_string().as_bytes())
    }

    /// A request as openai-python sends one with tools, a replayed tool call and its
    /// result, nulls for unset options and an `extra_body` key: read with the defaults.
    #[test]
    fn a_client_request_with_tools_reads_whole() {
        let r = parse(json!({
            "model": "policy",
            "messages": [
                {"role": "developer", "content": "Convert units."},
                {"role": "user", "content": [{"type": "text", "text": "3 km "}, {"type": "text", "text": "in m?"}]},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "convert", "arguments": "{\"v\":3}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3000"}
            ],
            "tools": [{"type": "function", "function": {"name": "convert", "parameters": {"type": "object"}}}],
            "temperature": null, "top_p": 0.9, "max_tokens": 64, "stop": "\n\n",
            "seed": 7, "logprobs": true, "top_logprobs": 3, "user": "ignored", "my_extra": 1
        }))
        .unwrap();
        assert_eq!(r.messages.len(), 4);
        assert_eq!(r.messages[0].role.template_role(), "system");
        assert_eq!(r.messages[1].text().unwrap(), "3 km in m?");
        assert_eq!(
            r.messages[2].tool_calls.as_ref().unwrap()[0].function.name,
            "convert"
        );
        assert_eq!(r.tool_choice, ToolChoice::Auto);
        assert_eq!(
            (r.temperature, r.top_p, r.max_tokens, r.n),
            (1.0, 0.9, Some(64), 1)
        );
        assert_eq!(r.stop, ["\n\n"]);
        assert_eq!((r.seed, r.logprobs, r.stream), (Some(7), Some(3), false));
    }

    /// Each malformed field is a 400 naming it in `param`.
    #[test]
    fn bad_fields_are_named() {
        let base = json!({"messages": [{"role": "user", "content": "hi"}]});
        let with = |k: &str, v: Value| {
            let mut b = base.clone();
            b[k] = v;
            parse(b).unwrap_err()
        };
        let cases = [
            (with("temperature", json!(3)), "temperature"),
            (with("temperature", json!("hot")), "temperature"),
            (with("temperature", json!(1e-40)), "temperature"),
            (with("top_p", json!(0)), "top_p"),
            (with("n", json!(0)), "n"),
            (with("max_tokens", json!(0)), "max_tokens"),
            (with("stop", json!(["a", "b", "c", "d", "e"])), "stop"),
            (with("top_logprobs", json!(2)), "top_logprobs"),
            (
                with("stream_options", json!({"include_usage": true})),
                "stream_options",
            ),
            (with("tools", json!([])), "tools"),
            (with("tool_choice", json!("required")), "tool_choice"),
            (with("logit_bias", json!({"42": 5})), "logit_bias"),
            (with("frequency_penalty", json!(0.5)), "frequency_penalty"),
            (
                with("response_format", json!({"type": "json_object"})),
                "response_format",
            ),
            (with("messages", json!([])), "messages"),
            (
                with("messages", json!([{"role": "tool", "content": "x"}])),
                "messages[0].tool_call_id",
            ),
            (
                with("messages", json!([{"role": "assistant"}])),
                "messages[0].content",
            ),
            (
                with("messages", json!([{"role": "robot", "content": "x"}])),
                "messages[0]",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": [{"type": "image_url"}]}]),
                ),
                "messages[0].content[0]",
            ),
        ];
        for (err, param) in cases {
            assert_eq!(err.status, 400, "{param}: {err:?}");
            assert_eq!(err.param.as_deref(), Some(param), "{err:?}");
            assert_eq!(err.kind, "invalid_request_error");
        }
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        let mut b = base.clone();
        b["tools"] = tools;
        b["tool_choice"] = json!({"type": "function", "function": {"name": "g"}});
        assert_eq!(parse(b).unwrap_err().param.as_deref(), Some("tool_choice"));
        let e = ChatRequest::parse(b"{not json").unwrap_err();
        assert_eq!((e.status, e.param.clone()), (400, None));
        assert!(e.message.contains("not JSON"), "{}", e.message);
    }

    /// The error object has all four keys; a 503 carries its wait.
    #[test]
    fn errors_have_openais_shape() {
        let e = ApiError::invalid("n", "`n` is 0");
        assert_eq!(
            e.body(),
            json!({"error": {"message": "`n` is 0", "type": "invalid_request_error", "param": "n", "code": null}})
        );
        let busy = ApiError::updating(2);
        assert_eq!((busy.status, busy.retry_after_s), (503, Some(2)));
        assert_eq!(busy.body()["error"]["param"], Value::Null);
        assert_eq!(ApiError::model_not_found("x", "policy").status, 404);
    }

    /// Answers keep the keys clients require as explicit nulls: `content` with only tool
    /// calls, `refusal`, `logprobs`, a chunk's `finish_reason`.
    #[test]
    fn answers_keep_their_required_nulls() {
        let c = ChatCompletion {
            id: "chatcmpl-1".into(),
            object: "chat.completion",
            created: 1,
            model: "policy".into(),
            choices: vec![Choice {
                index: 0,
                message: AnswerMessage {
                    role: "assistant",
                    content: None,
                    refusal: None,
                    tool_calls: vec![ToolCall {
                        id: "call_1".into(),
                        kind: "function".into(),
                        function: FunctionCall {
                            name: "convert".into(),
                            arguments: "{}".into(),
                        },
                    }],
                },
                logprobs: None,
                finish_reason: FinishReason::ToolCalls,
            }],
            usage: Usage {
                prompt_tokens: 5,
                completion_tokens: 3,
                total_tokens: 8,
            },
        };
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], Value::Null);
        assert!(
            v["choices"][0]["message"]
                .as_object()
                .unwrap()
                .contains_key("refusal")
        );
        assert!(
            v["choices"][0]
                .as_object()
                .unwrap()
                .contains_key("logprobs")
        );
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
        let chunk = ChatChunk {
            id: "chatcmpl-1".into(),
            object: "chat.completion.chunk",
            created: 1,
            model: "policy".into(),
            choices: vec![ChunkChoice {
                index: 0,
                delta: Delta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    tool_calls: vec![],
                },
                logprobs: None,
                finish_reason: None,
            }],
            usage: None,
        };
        let event = chunk.event();
        assert!(
            event.starts_with("data: {") && event.ends_with("}\n\n"),
            "{event}"
        );
        let v: Value = serde_json::from_str(&event["data: ".len()..]).unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], Value::Null);
        assert!(
            v["choices"][0]
                .as_object()
                .unwrap()
                .contains_key("finish_reason")
        );
        assert!(!v.as_object().unwrap().contains_key("usage"));
        assert_eq!(
            v["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
    }

    /// `/v1/completions` reads text, ids and batches of either, and names what is wrong.
    #[test]
    fn completion_prompts_read_in_every_shape() {
        let read = |v: Value| CompletionRequest::parse(v.to_string().as_bytes(), 100);
        let r = read(json!({"model": "m", "prompt": "hi", "max_tokens": null})).unwrap();
        assert_eq!(r.prompts, [Prompt::Text("hi".into())]);
        assert_eq!(r.max_tokens, None);
        let r = read(json!({"prompt": [1, 2, 99]})).unwrap();
        assert_eq!(r.prompts, [Prompt::Ids(vec![1, 2, 99])]);
        let r = read(json!({"prompt": ["a", [3]], "n": 2, "logprobs": 5})).unwrap();
        assert_eq!(r.prompts.len(), 2);
        assert_eq!((r.n, r.logprobs), (2, Some(5)));
        for (body, param) in [
            (json!({}), "prompt"),
            (json!({"prompt": []}), "prompt"),
            (json!({"prompt": [1, 100]}), "prompt[1]"),
            (json!({"prompt": ["a", [-1]]}), "prompt[1][0]"),
            (json!({"prompt": ["a", 3]}), "prompt[1]"),
            (json!({"prompt": "a", "logprobs": 6}), "logprobs"),
            (json!({"prompt": "a", "echo": true}), "echo"),
            (json!({"prompt": "a", "best_of": 3}), "best_of"),
            (json!({"prompt": "a", "stream": true}), "stream"),
            (json!({"prompt": "a", "max_tokens": 0}), "max_tokens"),
        ] {
            let e = read(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }
}
