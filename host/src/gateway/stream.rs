//! A chat answer streamed as server-sent events (`"stream": true`), token by token as the
//! model's thread decodes it, in OpenAI's chunk shape.

use super::answers::{CallGuard, token_logprob, transcript};
use super::pump::Emitted;
use super::state::{Gateway, Queued, now_s, status_error};
use super::wire::{
    ChatChunk, ChatRequest, ChoiceLogprobs, ChunkChoice, DONE_EVENT, Delta, FunctionDelta,
    ToolCallDelta, ToolChoice, Usage,
};
use crate::rollout::tool_calls;
use crate::sampler::Token;
use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::Response;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// One streamed choice's state.
pub(super) struct Streamed {
    /// Text decoded so far (end-of-turn tokens left out) and how much of it was sent.
    text: String,
    sent: usize,
    /// Tokens whose log-probs are not sent yet.
    unsent: Vec<Token>,
    done: bool,
}

/// Streams a chat answer as server-sent events. Text goes out as it is decoded, less the
/// tail a stop string could still claim. With `tools`, only the text that is settled
/// content whatever follows (`tool_calls::settled`: the text before a call's tag) goes out
/// as it comes; the rest of the content and the calls go out when the choice ends, its
/// calls read from the complete text.
pub(super) fn stream_chat(
    gw: Arc<Gateway>,
    req: ChatRequest,
    rx: Queued,
    guard: CallGuard,
    id: String,
    prompt_len: usize,
) -> Response {
    let created = now_s();
    let holdback = req.stop.iter().map(String::len).max().unwrap_or(1) - 1;
    // The format the answer's calls are read in, when they are.
    let calls = gw
        .renderer
        .format
        .filter(|_| !req.tools.is_empty() && req.tool_choice != ToolChoice::None);
    let choices: Vec<Streamed> = (0..req.n)
        .map(|_| Streamed {
            text: String::new(),
            sent: 0,
            unsent: Vec::new(),
            done: false,
        })
        .collect();
    let chunk = {
        let (id, model) = (id.clone(), gw.model.clone());
        move |choice: ChunkChoice| {
            Bytes::from(
                ChatChunk {
                    id: id.clone(),
                    object: "chat.completion.chunk",
                    created,
                    model: model.clone(),
                    choices: vec![choice],
                    usage: None,
                }
                .event(),
            )
        }
    };
    // The role chunk of every choice first, as vLLM sends them.
    let mut first: Vec<Bytes> = (0..req.n)
        .map(|index| {
            chunk(ChunkChoice {
                index,
                delta: Delta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    tool_calls: Vec::new(),
                },
                logprobs: None,
                finish_reason: None,
            })
        })
        .collect();
    first.reverse();
    struct St {
        gw: Arc<Gateway>,
        req: ChatRequest,
        rx: Queued,
        guard: CallGuard,
        choices: Vec<Streamed>,
        queue: Vec<Bytes>,
        completion_tokens: usize,
        ended: bool,
    }
    let st = St {
        gw,
        req,
        rx,
        guard,
        choices,
        queue: first,
        completion_tokens: 0,
        ended: false,
    };
    let stream = futures_util::stream::unfold(st, move |mut st| {
        let chunk = chunk.clone();
        let id = id.clone();
        async move {
            loop {
                if let Some(b) = st.queue.pop() {
                    return Some((Ok::<Bytes, std::convert::Infallible>(b), st));
                }
                if st.ended {
                    return None;
                }
                let mut out: Vec<Bytes> = Vec::new();
                match st.rx.rx.recv().await {
                    Some(Emitted::Token(t)) => {
                        st.completion_tokens += 1;
                        let c = &mut st.choices[t.choice];
                        if !st.gw.renderer.eos_token_ids.contains(&t.id) {
                            c.text.push_str(&t.text);
                        }
                        let index = t.choice;
                        c.unsent.push(t);
                        let mut upto = c.text.len().saturating_sub(holdback);
                        if let Some(format) = calls {
                            upto = upto.min(tool_calls::settled(format, &c.text));
                        }
                        while !c.text.is_char_boundary(upto) {
                            upto -= 1;
                        }
                        if upto > c.sent {
                            let delta = c.text[c.sent..upto].to_string();
                            c.sent = upto;
                            let lp = st.req.logprobs.map(|_| ChoiceLogprobs {
                                content: c
                                    .unsent
                                    .drain(..)
                                    .map(|t| token_logprob(&st.gw, &t))
                                    .collect(),
                                refusal: None,
                            });
                            out.push(chunk(ChunkChoice {
                                index,
                                delta: Delta {
                                    content: Some(delta),
                                    ..Delta::default()
                                },
                                logprobs: lp,
                                finish_reason: None,
                            }));
                        }
                    }
                    Some(Emitted::Done {
                        choice,
                        completion,
                        version,
                    }) => {
                        let gw = st.gw.clone();
                        let answer =
                            gw.renderer
                                .answer(&st.req, &completion.tokens, &completion.finish);
                        gw.counters
                            .malformed_calls
                            .fetch_add(answer.malformed_calls as u64, Ordering::Relaxed);
                        let said = (choice == 0).then(|| transcript(&st.req, &answer));
                        st.guard.finish(choice, &completion, version, said);
                        let c = &mut st.choices[choice];
                        c.done = true;
                        let lp = st.req.logprobs.map(|_| {
                            let shown: Vec<Token> = c
                                .unsent
                                .drain(..)
                                .filter(|t| !gw.renderer.eos_token_ids.contains(&t.id))
                                .collect();
                            ChoiceLogprobs {
                                content: shown.iter().map(|t| token_logprob(&gw, t)).collect(),
                                refusal: None,
                            }
                        });
                        // What is left of the final content (the held-back tail, less a
                        // stop string; text after or between calls).
                        let rest = answer
                            .message
                            .content
                            .as_deref()
                            .and_then(|t| t.get(c.sent..))
                            .unwrap_or("")
                            .to_string();
                        if !answer.message.tool_calls.is_empty() {
                            let tool_calls: Vec<ToolCallDelta> = answer
                                .message
                                .tool_calls
                                .iter()
                                .enumerate()
                                .map(|(i, call)| ToolCallDelta {
                                    index: i,
                                    id: Some(call.id.clone()),
                                    kind: Some("function"),
                                    function: FunctionDelta {
                                        name: Some(call.function.name.clone()),
                                        arguments: call.function.arguments.clone(),
                                    },
                                })
                                .collect();
                            out.push(chunk(ChunkChoice {
                                index: choice,
                                delta: Delta {
                                    role: None,
                                    content: (!rest.is_empty()).then_some(rest),
                                    tool_calls,
                                },
                                logprobs: lp,
                                finish_reason: None,
                            }));
                        } else if !rest.is_empty()
                            || lp.as_ref().is_some_and(|l| !l.content.is_empty())
                        {
                            out.push(chunk(ChunkChoice {
                                index: choice,
                                delta: Delta {
                                    content: Some(rest),
                                    ..Delta::default()
                                },
                                logprobs: lp,
                                finish_reason: None,
                            }));
                        }
                        out.push(chunk(ChunkChoice {
                            index: choice,
                            delta: Delta::default(),
                            logprobs: None,
                            finish_reason: Some(answer.finish_reason),
                        }));
                        if st.choices.iter().all(|c| c.done) {
                            st.gw
                                .counters
                                .sampled_tokens
                                .fetch_add(st.completion_tokens as u64, Ordering::Relaxed);
                            if st.req.include_usage {
                                out.push(Bytes::from(
                                    ChatChunk {
                                        id: id.clone(),
                                        object: "chat.completion.chunk",
                                        created,
                                        model: st.gw.model.clone(),
                                        choices: Vec::new(),
                                        usage: Some(Usage {
                                            prompt_tokens: prompt_len,
                                            completion_tokens: st.completion_tokens,
                                            total_tokens: prompt_len + st.completion_tokens,
                                        }),
                                    }
                                    .event(),
                                ));
                            }
                            out.push(Bytes::from_static(DONE_EVENT.as_bytes()));
                            st.ended = true;
                        }
                    }
                    Some(Emitted::Failed(why)) => {
                        st.gw.counters.failed.fetch_add(1, Ordering::Relaxed);
                        let e = status_error(500, "server_error", why);
                        out.push(Bytes::from(format!("data: {}\n\n", e.body())));
                        out.push(Bytes::from_static(DONE_EVENT.as_bytes()));
                        st.ended = true;
                    }
                    None => {
                        st.ended = true;
                    }
                }
                out.reverse();
                st.queue = out;
            }
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .expect("a valid response")
}
