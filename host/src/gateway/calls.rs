//! One sampling call through the gateway, chat or completion: admitted (the model's name,
//! room in the queue and the KV budget), its prompt placed in its session, submitted to
//! the pump, its choices gathered (or streamed, `stream.rs`) and answered in OpenAI's
//! shape, log-probs included; a session's call recorded token-exactly, or abandoned when
//! its client goes away.

use super::answers::{CallGuard, token_logprob, transcript};
use super::pump::{Emitted, Job};
use super::state::{Gateway, MAX_IN_FLIGHT, Queued, Slots, now_s, over_limit, status_error};
use super::stream::stream_chat;
use super::wire::{
    ApiError, ChatCompletion, ChatRequest, Choice, ChoiceLogprobs, FinishReason, Usage,
};
use crate::sampler::decode::{Completion, Finish};
use crate::sampler::draw::SamplingParams;
use crate::sampler::{Request, Token};
use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::sync::mpsc::unbounded_channel;

/// The checks every sampling call shares: the model's name and the update pause.
pub(super) fn admit(gw: &Gateway, model: Option<&str>) -> Result<(), ApiError> {
    if let Some(m) = model
        && m != gw.model
    {
        return Err(ApiError::model_not_found(m, &gw.model));
    }
    if gw.refuse_while_updating && gw.updating.load(Ordering::Acquire) {
        gw.counters.refused_updating.fetch_add(1, Ordering::Relaxed);
        return Err(ApiError::updating(1));
    }
    Ok(())
}

/// `max_tokens` within the room the context leaves after the prompt (when not given, that
/// room within what the keys-and-values budget leaves one choice).
fn room(
    gw: &Gateway,
    prompt: usize,
    max_tokens: Option<usize>,
    param: &str,
) -> Result<usize, ApiError> {
    let room = gw.renderer.context.saturating_sub(prompt);
    match max_tokens {
        // Not given: to the end of the context, or of what the keys-and-values budget
        // leaves one choice after the prompt, whichever comes first (a 32k context of a
        // real model holds more than the CPU's default budget: the call runs, shorter,
        // rather than being refused for a size the client never asked for).
        None => Ok(match gw.kv {
            Some(kv) => {
                let fits = (kv.bytes / kv.per_token.max(1)).saturating_sub(prompt as u64);
                room.min(fits.max(1) as usize)
            }
            None => room,
        }),
        Some(n) if n <= room => Ok(n),
        Some(n) => Err(ApiError::invalid(
            param,
            format!(
                "`{param}` is {n}, but the prompt has {prompt} tokens and the model's context is {}: at most {room}",
                gw.renderer.context
            ),
        )),
    }
}

/// Queues a request; its events come on the returned channel (each token as it is drawn
/// when `stream`, else a choice's tokens with its end).
fn submit(gw: &Gateway, request: Request, stream: bool) -> Result<Queued, ApiError> {
    if gw.remote && request.top_logprobs > 0 {
        return Err(ApiError::invalid(
            "top_logprobs",
            "top log-probs (`top_logprobs`, or `logprobs` > 0 on /v1/completions) are not served when the run samples on vLLM servers (rollout.engine = \"vllm\"): vLLM names the alternatives by text, not by token id; ask for `logprobs: true` alone",
        ));
    }
    let n = request.n;
    let (prompt, max_new) = (request.prompt.len(), request.params.max_new_tokens);
    let bytes = gw.kv.map_or(0, |kv| kv.need(prompt, n, max_new));
    if let Some(kv) = gw.kv {
        let what = format!("`n` {n} × `max_tokens` {max_new} after a prompt of {prompt} tokens");
        if let Some(why) = kv.refusal(bytes, &what, "serve --kv-budget-mib") {
            return Err(ApiError::invalid("max_tokens", why));
        }
    }
    let before = gw.in_flight.fetch_add(n, Ordering::Relaxed);
    let held = gw.kv_in_flight.fetch_add(bytes, Ordering::Relaxed);
    let slots = Slots {
        count: gw.in_flight.clone(),
        n,
        kv: gw.kv_in_flight.clone(),
        bytes,
    };
    if before + n > MAX_IN_FLIGHT {
        return Err(over_limit(format!(
            "the gateway is decoding {before} choices, and this call's {n} would pass its limit of {MAX_IN_FLIGHT}: retry when calls have finished"
        )));
    }
    if let Some(kv) = gw.kv.filter(|kv| held + bytes > kv.bytes) {
        return Err(over_limit(format!(
            "the calls in flight hold {:.1} MiB of keys and values, and this call's {:.1} MiB would pass the budget of {} MiB: retry when calls have finished",
            held as f64 / (1u64 << 20) as f64,
            bytes as f64 / (1u64 << 20) as f64,
            kv.bytes >> 20
        )));
    }
    let (tx, rx) = unbounded_channel();
    gw.jobs
        .send(Job {
            request,
            tx,
            stream,
        })
        .map_err(|_| {
            status_error(
                503,
                "server_error",
                "the model's sampler has stopped (the run is ending)".into(),
            )
        })?;
    Ok(Queued { rx, _slots: slots })
}

/// One choice's tokens as they came.
#[derive(Default)]
struct Gathered {
    tokens: Vec<Token>,
    done: Option<(Completion, u64)>,
}

/// Waits for every choice of a request.
async fn gather(mut q: Queued, n: usize) -> Result<Vec<Gathered>, ApiError> {
    let rx = &mut q.rx;
    let mut out: Vec<Gathered> = (0..n).map(|_| Gathered::default()).collect();
    let mut left = n;
    while left > 0 {
        match rx.recv().await {
            Some(Emitted::Token(t)) => out[t.choice].tokens.push(t),
            Some(Emitted::Done {
                choice,
                completion,
                version,
            }) => {
                out[choice].done = Some((completion, version));
                left -= 1;
            }
            Some(Emitted::Failed(why)) => return Err(status_error(500, "server_error", why)),
            // The sampler let go of the call unanswered: the run ended with it queued.
            None => {
                return Err(status_error(
                    503,
                    "server_error",
                    "the run ended before this call was sampled".into(),
                ));
            }
        }
    }
    Ok(out)
}

fn params(
    gw: &Gateway,
    temperature: f64,
    top_p: f64,
    max: usize,
    stop: Vec<String>,
    seed: Option<u64>,
) -> SamplingParams {
    SamplingParams {
        temperature: temperature as f32,
        top_p: top_p as f32,
        max_new_tokens: max,
        stop_token_ids: gw.renderer.eos_token_ids.clone(),
        stop_strings: stop,
        seed: seed.unwrap_or_else(rand::random),
        ..SamplingParams::default()
    }
}

pub(super) async fn chat(
    gw: Arc<Gateway>,
    session: Option<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req = ChatRequest::parse(&body)?;
    admit(&gw, req.model.as_deref())?;
    let prompt = gw.renderer.prompt(&req)?;
    let max = room(&gw, prompt.len(), req.max_tokens, "max_tokens")?;
    let request = Request {
        prompt: prompt.clone(),
        n: req.n,
        params: params(
            &gw,
            req.temperature,
            req.top_p,
            max,
            req.stop.clone(),
            req.seed,
        ),
        index: 0,
        top_logprobs: req.logprobs.unwrap_or(0),
        adapter: None,
        first_choice: 0,
        base: false,
        hold: false,
    };
    let guard = CallGuard::begin(&gw, session, &prompt, req.n)?;
    let rx = submit(&gw, request, req.stream)?;
    let id = format!("chatcmpl-{:024x}", rand::random::<u128>() >> 32);
    if req.stream {
        return Ok(stream_chat(gw, req, rx, guard, id, prompt.len()));
    }
    let mut guard = guard;
    let gathered = gather(rx, req.n).await.inspect_err(|_| {
        gw.counters.failed.fetch_add(1, Ordering::Relaxed);
    })?;
    let mut choices = Vec::with_capacity(req.n);
    let mut completion_tokens = 0;
    for (index, g) in gathered.iter().enumerate() {
        let (c, version) = g.done.as_ref().expect("gathered until done");
        completion_tokens += c.tokens.len();
        let answer = gw.renderer.answer(&req, &c.tokens, &c.finish);
        gw.counters
            .malformed_calls
            .fetch_add(answer.malformed_calls as u64, Ordering::Relaxed);
        let said = (index == 0).then(|| transcript(&req, &answer));
        guard.finish(index, c, *version, said);
        choices.push(Choice {
            index,
            logprobs: req.logprobs.map(|_| logprobs(&gw, &g.tokens, &c.finish)),
            message: answer.message,
            finish_reason: answer.finish_reason,
        });
    }
    gw.counters
        .sampled_tokens
        .fetch_add(completion_tokens as u64, Ordering::Relaxed);
    let body = ChatCompletion {
        id,
        object: "chat.completion",
        created: now_s(),
        model: gw.model.clone(),
        choices,
        usage: Usage {
            prompt_tokens: prompt.len(),
            completion_tokens,
            total_tokens: prompt.len() + completion_tokens,
        },
    };
    Ok(axum::Json(body).into_response())
}

/// A choice's `logprobs`: every sampled token but an end-of-turn one.
fn logprobs(gw: &Gateway, tokens: &[Token], finish: &Finish) -> ChoiceLogprobs {
    let shown = match finish {
        Finish::StopToken(_) => tokens.len().saturating_sub(1),
        _ => tokens.len(),
    };
    ChoiceLogprobs {
        content: tokens[..shown]
            .iter()
            .map(|t| token_logprob(gw, t))
            .collect(),
        refusal: None,
    }
}

/// `POST /v1/completions`: a text prompt, or token ids, or a list of either.
pub(super) async fn complete(
    gw: Arc<Gateway>,
    session: Option<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req = super::wire::CompletionRequest::parse(&body, gw.renderer.tokenizer.vocab_size())?;
    admit(&gw, req.model.as_deref())?;
    if req.prompts.len() > 1 && session.is_some() {
        return Err(ApiError::invalid(
            "prompt",
            "a session's call has one prompt (its trajectory continues from one)",
        ));
    }
    let mut prompts = Vec::with_capacity(req.prompts.len());
    for (i, p) in req.prompts.iter().enumerate() {
        let ids = match p {
            super::wire::Prompt::Ids(ids) => ids.clone(),
            super::wire::Prompt::Text(t) if gw.renderer.surely_over_context(t) => {
                return Err(ApiError::invalid(
                    format!("prompt[{i}]"),
                    format!(
                        "it holds {} bytes, over the model's context of {} tokens at any tokenization",
                        t.len(),
                        gw.renderer.context
                    ),
                ));
            }
            super::wire::Prompt::Text(t) => {
                gw.renderer.tokenizer.encode_raw_prompt(t).map_err(|e| {
                    ApiError::invalid(format!("prompt[{i}]"), format!("cannot tokenize it: {e:#}"))
                })?
            }
        };
        if ids.is_empty() {
            return Err(ApiError::invalid(
                format!("prompt[{i}]"),
                "the prompt is empty",
            ));
        }
        if ids.len() >= gw.renderer.context {
            return Err(ApiError::invalid(
                format!("prompt[{i}]"),
                format!(
                    "the prompt has {} tokens and the model's context is {}",
                    ids.len(),
                    gw.renderer.context
                ),
            ));
        }
        prompts.push(ids);
    }
    // A session records the first prompt's choices (a batch of prompts is no
    // conversation to follow).
    let mut guard = CallGuard::begin(&gw, session, &prompts[0], req.n)?;
    let mut receivers = Vec::with_capacity(prompts.len());
    for (i, ids) in prompts.iter().enumerate() {
        // OpenAI's default for completions is 16 tokens.
        let max = match req.max_tokens {
            Some(_) => room(&gw, ids.len(), req.max_tokens, "max_tokens")?,
            None => room(&gw, ids.len(), None, "max_tokens")?.min(16),
        };
        let request = Request {
            prompt: ids.clone(),
            n: req.n,
            params: params(
                &gw,
                req.temperature,
                req.top_p,
                max,
                req.stop.clone(),
                req.seed,
            ),
            index: i,
            top_logprobs: req.logprobs.unwrap_or(0),
            adapter: None,
            first_choice: 0,
            base: false,
            hold: false,
        };
        receivers.push(submit(&gw, request, false)?);
    }
    let mut choices = Vec::new();
    let mut completion_tokens = 0;
    for (i, rx) in receivers.into_iter().enumerate() {
        let gathered = gather(rx, req.n).await.inspect_err(|_| {
            gw.counters.failed.fetch_add(1, Ordering::Relaxed);
        })?;
        for (j, g) in gathered.iter().enumerate() {
            let (c, version) = g.done.as_ref().expect("gathered until done");
            completion_tokens += c.tokens.len();
            if i == 0 {
                guard.finish(j, c, *version, None);
            }
            let text = gw.renderer.text_of(&c.tokens, &c.finish);
            let finish_reason = match c.finish {
                Finish::Length => FinishReason::Length,
                _ => FinishReason::Stop,
            };
            let logprobs = req.logprobs.map(|_| {
                let shown: Vec<&Token> = g.tokens.iter().collect();
                json!({
                    "tokens": shown.iter().map(|t| gw.renderer.token_text(t.id).0).collect::<Vec<_>>(),
                    "token_logprobs": shown.iter().map(|t| t.logp).collect::<Vec<_>>(),
                    "top_logprobs": shown.iter().map(|t| t.top.iter().map(|&(id, lp)| (gw.renderer.token_text(id).0, lp)).collect::<BTreeMap<_, _>>()).collect::<Vec<_>>(),
                    "text_offset": Value::Null,
                })
            });
            choices.push(json!({
                "index": i * req.n + j,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "token_ids": c.tokens,
            }));
        }
    }
    gw.counters
        .sampled_tokens
        .fetch_add(completion_tokens as u64, Ordering::Relaxed);
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    Ok(axum::Json(json!({
        "id": format!("cmpl-{:024x}", rand::random::<u128>() >> 32),
        "object": "text_completion",
        "created": now_s(),
        "model": gw.model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }))
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::chat::Renderer;
    use crate::model::fixtures;
    use crate::model::{LanguageModel, Placement};
    use crate::sampler::kv_budget::KvBudget;

    /// A gateway on the qwen2 fixture, not serving; its queue's receiving end.
    fn gateway(lm: &LanguageModel) -> (Gateway, std::sync::mpsc::Receiver<Job>) {
        let renderer = Renderer::new(lm, Default::default()).unwrap();
        let (jobs_tx, jobs) = std::sync::mpsc::channel();
        let (done_tx, _) = std::sync::mpsc::channel();
        (
            Gateway::new("policy".into(), renderer, jobs_tx, done_tx, None),
            jobs,
        )
    }

    /// A request of `n` choices after a three-token prompt.
    fn request_of(n: usize, params: SamplingParams) -> Request {
        Request {
            prompt: vec![1, 2, 3],
            n,
            params,
            index: 0,
            top_logprobs: 0,
            adapter: None,
            first_choice: 0,
            base: false,
            hold: false,
        }
    }

    /// Issue 68: choices in flight are bounded over every caller; a call past the bound
    /// gets a 429 and queues nothing, and a finished (or abandoned) call gives its
    /// places back.
    #[test]
    fn choices_in_flight_are_capped_and_given_back() {
        let lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
        let (gw, jobs) = gateway(&lm);
        let request = |n: usize| request_of(n, SamplingParams::default());
        let big = submit(&gw, request(MAX_IN_FLIGHT - 1), false).unwrap();
        let one = submit(&gw, request(1), false).unwrap();
        let refused = submit(&gw, request(1), false).err().unwrap();
        assert_eq!(refused.status, 429, "{refused:?}");
        assert!(
            refused.message.contains("limit of 4096"),
            "{}",
            refused.message
        );
        // The refused call queued nothing: two jobs reached the model's side.
        assert_eq!(jobs.try_iter().count(), 2);
        drop(one);
        let again = submit(&gw, request(1), false).unwrap();
        drop((big, again));
        assert_eq!(gw.in_flight.load(Ordering::Relaxed), 0);
    }

    /// Issue 68: the keys and values calls ask for are counted in bytes. A call that could
    /// never fit is refused (400, naming the flag); one that fits while others hold the
    /// room gets a 429 and queues nothing; an ended call gives its bytes back; a call with
    /// no `max_tokens` runs to what the budget leaves rather than being refused.
    #[test]
    fn keys_and_values_in_flight_are_budgeted() {
        let lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
        let (mut gw, jobs) = gateway(&lm);
        gw.kv = Some(KvBudget {
            per_token: 1000,
            bytes: 1_000_000,
        });
        let request = |max_new_tokens: usize| {
            request_of(
                1,
                SamplingParams {
                    max_new_tokens,
                    ..Default::default()
                },
            )
        };
        let never = submit(&gw, request(1000), false).err().unwrap();
        assert_eq!(never.status, 400, "{never:?}");
        assert!(
            never.message.contains("serve --kv-budget-mib"),
            "{}",
            never.message
        );
        let first = submit(&gw, request(600), false).unwrap();
        let busy = submit(&gw, request(600), false).err().unwrap();
        assert_eq!(busy.status, 429, "{busy:?}");
        assert_eq!(jobs.try_iter().count(), 1);
        drop(first);
        let again = submit(&gw, request(600), false).unwrap();
        drop(again);
        assert_eq!(gw.kv_in_flight.load(Ordering::Relaxed), 0);
        assert_eq!(gw.in_flight.load(Ordering::Relaxed), 0);
        // No max_tokens: what fits after the prompt (1000 tokens of 1000 bytes, less 3).
        let context = gw.renderer.context;
        assert_eq!(
            room(&gw, 3, None, "max_tokens").unwrap(),
            (context - 3).min(997)
        );
        gw.kv = None;
        assert_eq!(room(&gw, 3, None, "max_tokens").unwrap(), context - 3);
    }
}
