//! A rollout's text as token ids: a sample's prompt rendered by the chat template, and
//! the text inserted into a trajectory (tool output, environment turns), with untrusted
//! text kept from writing special tokens. The engine, plugins' `model.generate` asks,
//! the setup's prompt checks and supervised fine-tuning all render through here.

use super::trajectory::SpanKind;
use crate::model::bundle::LanguageModel;
use crate::task::{Message, Sample};
use anyhow::Result;
use serde_json::{Map, Value as Json};

/// A sample's prompt as token ids: its messages rendered by the chat template with a
/// generation prompt. The contents are dataset text, not the template's: a special-token
/// string in them stays plain text (see [`crate::model::tokenizer`]).
pub fn prompt_tokens(
    lm: &LanguageModel,
    template_kwargs: &Map<String, Json>,
    tools: Option<&[Json]>,
    sample: &Sample,
) -> Result<Vec<u32>> {
    let tok = &lm.tokenizer;
    let messages: Vec<Json> = escaped(tok, &sample.messages)
        .iter()
        .map(|m| serde_json::to_value(m).expect("a message is JSON"))
        .collect();
    let text = lm
        .chat()?
        .render_with_kwargs(&messages, tools, true, template_kwargs)?;
    tok.encode_escaped(&text)
}

/// The ids of text inserted into a trajectory. Tool output is untrusted text; an
/// environment turn is the template's rendering of [`escaped`] messages: neither can
/// write a special token of its own (a turn boundary, an end of text).
pub fn inserted_ids(
    tok: &crate::model::tokenizer::Tokenizer,
    text: &str,
    kind: SpanKind,
) -> Result<Vec<u32>> {
    match kind {
        SpanKind::Env => tok.encode_escaped(text),
        _ => tok.encode_plain(text),
    }
}

/// Messages with their contents escaped for rendering (see [`prompt_tokens`]).
pub fn escaped(tok: &crate::model::tokenizer::Tokenizer, messages: &[Message]) -> Vec<Message> {
    messages
        .iter()
        .map(|m| Message {
            content: tok.escape_specials(&m.content).into_owned(),
            ..m.clone()
        })
        .collect()
}
