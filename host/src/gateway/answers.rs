//! What a call's answer is made of, streamed or not: the guard that records a session's
//! call (or abandons it when its client goes away), the transcript a tool-calling answer
//! adds to the session, and a token's log-prob in OpenAI's shape.

use super::chat::ReadChoice;
use super::sessions::SessionError;
use super::state::{Gateway, session_error};
use super::wire::{ApiError, ChatRequest, TokenLogprob, TopLogprob};
use crate::sampler::Token;
use crate::sampler::decode::Completion;
use crate::task::{Message, MessageToolCall};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// A session's call in progress: abandoned when dropped unfinished (the client went
/// away, the request failed), so the session can take its next call.
pub(super) struct CallGuard {
    gw: Arc<Gateway>,
    session: Option<String>,
    /// Choices not yet recorded.
    left: usize,
}

impl CallGuard {
    /// Places `prompt` in the session (when there is one), for a call of `n` choices.
    pub(super) fn begin(
        gw: &Arc<Gateway>,
        session: Option<String>,
        prompt: &[u32],
        n: usize,
    ) -> Result<CallGuard, ApiError> {
        gw.counters.calls.fetch_add(1, Ordering::Relaxed);
        if let Some(id) = &session {
            let mut sessions = gw.sessions();
            let open = sessions.get_mut(id).map_err(session_error)?;
            let placed = open
                .record
                .begin_call(prompt, n)
                .map_err(|why| session_error(SessionError::Misuse(why)))?;
            open.calls += 1;
            open.last_call = std::time::Instant::now();
            gw.counters.session_calls.fetch_add(1, Ordering::Relaxed);
            match placed {
                super::record::Placed::Drifted(_) => {
                    gw.counters.drifts.fetch_add(1, Ordering::Relaxed);
                }
                super::record::Placed::Extended { .. } => {
                    gw.counters.extended.fetch_add(1, Ordering::Relaxed);
                }
                super::record::Placed::First => {}
            }
        }
        Ok(CallGuard {
            gw: gw.clone(),
            session,
            left: n,
        })
    }

    /// Records choice `choice`'s ids and log-probs (the row takes the one the agent goes
    /// on with, see `record.rs`), and choice 0's transcript.
    pub(super) fn finish(
        &mut self,
        choice: usize,
        c: &Completion,
        version: u64,
        transcript: Option<Vec<Message>>,
    ) {
        self.left = self.left.saturating_sub(1);
        let Some(id) = &self.session else { return };
        let mut sessions = self.gw.sessions();
        if let Ok(open) = sessions.get_mut(id) {
            if let Err(why) = open
                .record
                .finish_call(choice, &c.tokens, &c.logprobs, version)
            {
                tracing::warn!("gateway: session {id}: {why}");
            }
            if let (0, Some(t)) = (choice, transcript) {
                open.transcript = t;
            }
        }
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        if self.left == 0 {
            return;
        }
        if let Some(id) = &self.session {
            self.gw.counters.abandoned.fetch_add(1, Ordering::Relaxed);
            if let Ok(open) = self.gw.sessions().get_mut(id) {
                open.record.abandon_call();
            }
        }
    }
}

/// The conversation so far as reward plugins read it: the request's messages and the
/// answer.
pub(super) fn transcript(req: &ChatRequest, answer: &ReadChoice) -> Vec<Message> {
    let mut out: Vec<Message> = req
        .messages
        .iter()
        .map(|m| Message {
            role: m.role.template_role().to_string(),
            content: m.text().unwrap_or_default(),
            tool_calls: m
                .tool_calls
                .iter()
                .flatten()
                .map(|c| {
                    MessageToolCall::new(
                        c.id.clone(),
                        c.function.name.clone(),
                        serde_json::from_str(&c.function.arguments)
                            .unwrap_or_else(|_| json!(c.function.arguments)),
                    )
                })
                .collect(),
            tool_call_id: m.tool_call_id.clone(),
        })
        .collect();
    out.push(Message {
        role: "assistant".into(),
        content: answer.message.content.clone().unwrap_or_default(),
        tool_calls: answer
            .message
            .tool_calls
            .iter()
            .map(|c| {
                MessageToolCall::new(
                    c.id.clone(),
                    c.function.name.clone(),
                    serde_json::from_str(&c.function.arguments).unwrap_or(Value::Null),
                )
            })
            .collect(),
        tool_call_id: None,
    });
    out
}

pub(super) fn token_logprob(gw: &Gateway, t: &Token) -> TokenLogprob {
    let (token, bytes) = gw.renderer.token_text(t.id);
    TokenLogprob {
        token,
        logprob: t.logp,
        bytes,
        top_logprobs: t
            .top
            .iter()
            .map(|&(id, logprob)| {
                let (token, bytes) = gw.renderer.token_text(id);
                TopLogprob {
                    token,
                    logprob,
                    bytes,
                }
            })
            .collect(),
    }
}
