//! From a Chat Completions request to prompt ids, and from sampled ids back to an
//! OpenAI answer: the messages rendered by the model's chat template (with `tools` as
//! transformers passes them), untrusted text escaped so no message can write a special
//! token; the answer's tool calls read in the model's own format by the parsers rollouts
//! use (`rollout/tool_calls.rs`).
//!
//! A [`Renderer`] holds copies of the tokenizer and template, not the model: the HTTP
//! handlers render while the model's thread samples (and, in a training run, updates).

use super::wire::{
    AnswerMessage, ApiError, ChatRequest, FinishReason, FunctionCall, Message, Role, Tool,
    ToolCall, ToolChoice,
};
use crate::model::LanguageModel;
use crate::model::chat::ChatTemplate;
use crate::model::tokenizer::Tokenizer;
use crate::plugin::FunctionSpec;
use crate::rollout::tool_calls::{self, CallFormat};
use crate::sampler::decode::Finish;
use anyhow::{Context, Result};
use serde_json::{Map, Value, json};

/// What the handlers need of the model to render prompts and read answers.
use crate::model::tokenizer::BYTES_PER_TOKEN;

/// The text a message adds to a prompt (its content, name and calls), in bytes.
fn message_bytes(m: &super::wire::Message) -> usize {
    m.text().map_or(0, |t| t.len())
        + m.name.as_ref().map_or(0, String::len)
        + m.tool_call_id.as_ref().map_or(0, String::len)
        + m.tool_calls.as_ref().map_or(0, |calls| {
            calls
                .iter()
                .map(|c| c.function.name.len() + c.function.arguments.len())
                .sum()
        })
}

pub struct Renderer {
    pub tokenizer: Tokenizer,
    pub chat: ChatTemplate,
    /// Extra template variables (`enable_thinking`), as the run's `rollout.template_kwargs`.
    pub kwargs: Map<String, Value>,
    /// How the model writes tool calls; `None` when its template shows no format (a
    /// request with `tools` is then refused).
    pub format: Option<CallFormat>,
    pub eos_token_ids: Vec<u32>,
    /// The model's context (prompt and completion together).
    pub context: usize,
}

/// One choice's answer, read.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadChoice {
    pub message: AnswerMessage,
    pub finish_reason: FinishReason,
    /// Calls written but unreadable (bad JSON, unknown function, …): the text is then
    /// answered as content, and the count reported.
    pub malformed_calls: usize,
}

impl Renderer {
    pub fn new(lm: &LanguageModel, kwargs: Map<String, Value>) -> Result<Renderer> {
        let chat = lm
            .chat()
            .context("the gateway renders chat messages: the model needs a chat template")?
            .clone();
        Ok(Renderer {
            format: CallFormat::implied_by(chat.source()),
            tokenizer: lm.tokenizer.clone(),
            chat,
            kwargs,
            eos_token_ids: lm.eos_token_ids.clone(),
            context: lm.model.cfg.max_position_embeddings,
        })
    }

    /// Whether `text` is over the model's context whatever it tokenizes to (checked before
    /// it is tokenized).
    pub fn surely_over_context(&self, text: &str) -> bool {
        text.len() > BYTES_PER_TOKEN * self.context
    }

    /// The request's prompt ids: its messages (and `tools`) rendered with the generation
    /// prompt, message text escaped.
    pub fn prompt(&self, req: &ChatRequest) -> Result<Vec<u32>, ApiError> {
        if !req.tools.is_empty() && self.format.is_none() {
            return Err(ApiError::invalid(
                "tools",
                "this model's chat template shows no tool-call format, so its calls could not be read",
            ));
        }
        // Refused by their byte length before anything renders or tokenizes them: one
        // 10 MiB message took 28 s and 3.8 GB to render and tokenize before its refusal.
        let bytes: usize = req.messages.iter().map(message_bytes).sum::<usize>()
            + req
                .tools
                .iter()
                .map(|t| serde_json::to_string(t).map_or(0, |s| s.len()))
                .sum::<usize>();
        if bytes > BYTES_PER_TOKEN * self.context {
            return Err(ApiError::invalid(
                if req.tools.is_empty() {
                    "messages"
                } else {
                    "messages/tools"
                },
                format!(
                    "the messages and tools hold {bytes} bytes of text, over the model's context \
                     of {} tokens at any tokenization (no token is longer than {BYTES_PER_TOKEN} bytes here)",
                    self.context
                ),
            ));
        }
        let messages: Vec<Value> = req
            .messages
            .iter()
            .map(|m| self.template_message(m))
            .collect();
        let tools: Vec<Value> = req
            .tools
            .iter()
            .map(|t| serde_json::to_value(t).expect("a tool is JSON"))
            .collect();
        let text = self
            .chat
            .render_with_kwargs(
                &messages,
                (!tools.is_empty()).then_some(tools.as_slice()),
                true,
                &self.kwargs,
            )
            .map_err(|e| {
                ApiError::invalid("messages", format!("the chat template refused them: {e:#}"))
            })?;
        let ids = self
            .tokenizer
            .encode_escaped(&text)
            .map_err(|e| ApiError::invalid("messages", format!("cannot tokenize them: {e:#}")))?;
        if ids.len() >= self.context {
            return Err(ApiError::invalid(
                "messages",
                format!(
                    "the messages render to {} tokens and the model's context is {}: no room to answer",
                    ids.len(),
                    self.context
                ),
            ));
        }
        Ok(ids)
    }

    /// A message as the template reads it (transformers passes the caller's dicts): the
    /// role the template knows, the text escaped, a replayed call's `arguments` as the
    /// object it encodes (templates write `arguments | tojson`), `null` content kept.
    fn template_message(&self, m: &Message) -> Value {
        let mut out = Map::new();
        out.insert("role".into(), json!(m.role.template_role()));
        out.insert(
            "content".into(),
            match m.text() {
                Some(t) => json!(self.tokenizer.escape_specials(&t)),
                None => Value::Null,
            },
        );
        if let Some(calls) = &m.tool_calls {
            let calls: Vec<Value> = calls
                .iter()
                .map(|c| {
                    let args = serde_json::from_str::<Value>(&c.function.arguments)
                        .unwrap_or_else(|_| json!(c.function.arguments));
                    json!({"id": c.id, "type": "function", "function": {
                        "name": self.tokenizer.escape_specials(&c.function.name),
                        "arguments": escape_strings(&self.tokenizer, args)}})
                })
                .collect();
            out.insert("tool_calls".into(), Value::Array(calls));
        }
        if let Some(id) = &m.tool_call_id {
            out.insert("tool_call_id".into(), json!(id));
        }
        if let (Some(name), Role::Tool) = (&m.name, m.role) {
            out.insert("name".into(), json!(name));
        }
        Value::Object(out)
    }

    /// The answer of one choice: its text without the end-of-turn token or the stop
    /// string, read for tool calls when the request has `tools`.
    pub fn answer(&self, req: &ChatRequest, tokens: &[u32], finish: &Finish) -> ReadChoice {
        let text = self.text_of(tokens, finish);
        let finish_reason = match finish {
            Finish::Length => FinishReason::Length,
            _ => FinishReason::Stop,
        };
        let plain = |malformed_calls| ReadChoice {
            message: AnswerMessage {
                role: "assistant",
                content: Some(text.clone()),
                refusal: None,
                tool_calls: Vec::new(),
            },
            finish_reason,
            malformed_calls,
        };
        let Some(format) = self.format.filter(|_| !req.tools.is_empty()) else {
            return plain(0);
        };
        if req.tool_choice == ToolChoice::None {
            return plain(0);
        }
        let specs = specs(&req.tools);
        let turn = tool_calls::parse(format, &text, &specs);
        if turn.calls.is_empty() {
            return plain(0);
        }
        let malformed = turn.calls.iter().filter(|c| c.is_err()).count();
        if malformed > 0 {
            // The agent sees what the model wrote rather than a part of it.
            return plain(malformed);
        }
        let mut calls: Vec<ToolCall> = turn
            .calls
            .into_iter()
            .flatten()
            .map(|c| ToolCall {
                id: call_id(),
                kind: "function".into(),
                function: FunctionCall {
                    name: c.name,
                    arguments: Value::Object(c.arguments).to_string(),
                },
            })
            .collect();
        if !req.parallel_tool_calls {
            calls.truncate(1);
        }
        ReadChoice {
            message: AnswerMessage {
                role: "assistant",
                content: (!turn.content.is_empty()).then_some(turn.content),
                refusal: None,
                tool_calls: calls,
            },
            // OpenAI answers a call forced by name with `stop` (vLLM copies it).
            finish_reason: match (&req.tool_choice, finish) {
                (_, Finish::Length) => FinishReason::Length,
                (ToolChoice::Function(_), _) => FinishReason::Stop,
                _ => FinishReason::ToolCalls,
            },
            malformed_calls: 0,
        }
    }

    /// The completion's text as the caller gets it: no end-of-turn token, no stop string
    /// (OpenAI leaves it out).
    pub fn text_of(&self, tokens: &[u32], finish: &Finish) -> String {
        let ids = match finish {
            Finish::StopToken(_) => &tokens[..tokens.len().saturating_sub(1)],
            _ => tokens,
        };
        let mut text = self.tokenizer.decode(ids, false).unwrap_or_default();
        if let Finish::StopString(stop) = finish
            && let Some(at) = text.find(stop.as_str())
        {
            text.truncate(at);
        }
        text
    }

    /// A token's text and UTF-8 bytes for `logprobs` (`bytes` is `null` for a token
    /// that is not whole characters on its own).
    pub fn token_text(&self, id: u32) -> (String, Option<Vec<u8>>) {
        let text = self.tokenizer.decode(&[id], false).unwrap_or_default();
        if text.contains('\u{FFFD}') {
            let raw = self
                .tokenizer
                .id_to_token(id)
                .unwrap_or_else(|| text.clone());
            return (raw, None);
        }
        let bytes = text.as_bytes().to_vec();
        (text, Some(bytes))
    }
}

/// The functions of `tools` as the call parsers type them.
fn specs(tools: &[Tool]) -> Vec<FunctionSpec> {
    tools
        .iter()
        .map(|t| FunctionSpec {
            name: t.function.name.clone(),
            description: t.function.description.clone().unwrap_or_default(),
            parameters: t
                .function
                .parameters
                .clone()
                .unwrap_or_else(|| json!({"type": "object", "properties": {}})),
            stateless: true,
        })
        .collect()
}

/// The strings inside a replayed call's arguments, escaped as message text is.
fn escape_strings(tok: &Tokenizer, v: Value) -> Value {
    match v {
        Value::String(s) => Value::String(tok.escape_specials(&s).into_owned()),
        Value::Array(a) => Value::Array(a.into_iter().map(|v| escape_strings(tok, v)).collect()),
        Value::Object(o) => Value::Object(
            o.into_iter()
                .map(|(k, v)| (k, escape_strings(tok, v)))
                .collect(),
        ),
        other => other,
    }
}

/// `call_` and 24 random hex digits, as OpenAI's ids look.
pub fn call_id() -> String {
    format!("call_{:024x}", rand::random::<u128>() >> 32)
}
