//! The gateway's HTTP side: OpenAI's routes (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/models`), each also under a session's prefix `/sessions/{id}/v1/...` and reached
//! with a session's id as the API key; `/status`; the router, which also takes the RL
//! routes (`rl_routes.rs`: `/rl/tasks/next`, `/rl/sessions`, `/sessions/{id}`,
//! `.../reward`, `.../end`). A streamed chat answer is `stream.rs`'s.
//!
//! Handlers render and read; sampling happens on the model's thread ([`super::pump`]),
//! reached through a queue. A call in a session is recorded token-exactly: its prompt
//! placed in the session's row before sampling, choice 0's ids and log-probs appended when
//! it ends; a call whose client goes away (or that fails) is abandoned, nothing else lost.

use super::chat::{Answer, Renderer};
use super::pump::{Event, Job};
use super::rl_routes::{end, next_task, open_session, reward, show_session};
use super::sessions::{Finished, SessionError, Sessions, Task};
use super::stream::stream_chat;
use super::wire::{
    ApiError, ChatCompletion, ChatRequest, Choice, ChoiceLogprobs, FinishReason, ModelCard,
    TokenLogprob, TopLogprob, Usage, model_list,
};
use crate::data::{Cursor, Dataset};
use crate::sampler::decode::{Completion, Finish};
use crate::sampler::draw::SamplingParams;
use crate::sampler::kv_budget::KvBudget;
use crate::sampler::{Request, Token};
use crate::task::{Message, MessageToolCall};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

/// The largest request body read (a long conversation with tools fits many times over).
pub const MAX_BODY: usize = 16 << 20;

/// Counters `/status` and the metrics report.
#[derive(Debug, Default)]
pub struct Counters {
    pub calls: AtomicU64,
    pub session_calls: AtomicU64,
    pub extended: AtomicU64,
    pub drifts: AtomicU64,
    pub malformed_calls: AtomicU64,
    pub abandoned: AtomicU64,
    pub refused_updating: AtomicU64,
    pub failed: AtomicU64,
    pub bad_requests: AtomicU64,
    pub sampled_tokens: AtomicU64,
    /// A training run's: session rows left out as too stale, sessions that timed out.
    pub stale_rows: AtomicU64,
    pub timed_out_sessions: AtomicU64,
    /// A training run's session rows left out for a log-prob that is not a number.
    pub non_finite_rows: AtomicU64,
}

/// Where `/rl/tasks/next` takes tasks: the run's dataset, G sessions a task.
pub struct Tasks {
    pub dataset: Arc<Dataset>,
    pub group_size: usize,
    /// The cursor, and the group being handed out (its task and sessions still to give).
    pub(super) state: Arc<tokio::sync::Mutex<TaskState>>,
    /// The groups drawn from the data and not yet taken for training, each with where the
    /// data stood before it was drawn: a checkpoint resumes from the earliest, so that no
    /// task handed out is skipped by a resumed run.
    pub(super) out: Arc<Mutex<std::collections::BTreeMap<u64, Cursor>>>,
}

type TaskState = (Cursor, Option<(Task, usize)>);

/// [`Tasks`] not handing out yet: `/rl/tasks/next` waits until [`TasksHeld::start`] says
/// where in the data to begin (a training run knows once its checkpoint is read).
pub struct TasksHeld(tokio::sync::OwnedMutexGuard<TaskState>);

impl TasksHeld {
    /// Hands out tasks from `cursor` on.
    pub fn start(mut self, cursor: Cursor) {
        self.0.0 = cursor;
    }
}

impl Tasks {
    /// Tasks from the start of the data.
    pub fn new(dataset: Arc<Dataset>, group_size: usize) -> Tasks {
        Tasks {
            dataset,
            group_size: group_size.max(1),
            state: Arc::new(tokio::sync::Mutex::new((Cursor::default(), None))),
            out: Arc::default(),
        }
    }

    /// Tasks that wait to be [started](TasksHeld::start).
    pub fn held(dataset: Arc<Dataset>, group_size: usize) -> (Tasks, TasksHeld) {
        let tasks = Tasks::new(dataset, group_size);
        let guard = tasks
            .state
            .clone()
            .try_lock_owned()
            .expect("a new lock is free");
        (tasks, TasksHeld(guard))
    }

    /// Where in the data the next task comes from (the group being handed out is
    /// already past it).
    pub async fn cursor(&self) -> Cursor {
        self.state.lock().await.0
    }

    /// Where a run resumed from now should draw again: before the earliest group handed
    /// out and not yet taken for training (its sessions open, or ended and waiting for the
    /// rest of their group), else [`Self::cursor`]. A group taken after a later one was is
    /// handed out again too: at least once, never skipped.
    pub async fn resume_cursor(&self) -> Cursor {
        let next = self.cursor().await;
        let out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        out.values().next().copied().unwrap_or(next)
    }

    /// Marks `groups` taken for training.
    pub fn taken(&self, groups: &[u64]) {
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        for g in groups {
            out.remove(g);
        }
    }
}

/// Everything the handlers share.
pub struct Gateway {
    /// The model id clients name (`GET /v1/models` lists it).
    pub model: String,
    pub renderer: Renderer,
    jobs: std::sync::mpsc::Sender<Job>,
    pub sessions: Mutex<Sessions>,
    pub tasks: Option<Tasks>,
    /// Ended sessions go here (the trainer or the record file takes them).
    pub(super) finished: std::sync::mpsc::Sender<Finished>,
    /// The policy version sampling now.
    pub version: AtomicU64,
    /// Set while the policy is being updated.
    pub updating: AtomicBool,
    /// Refuse calls with a 503 while updating (else they wait in the queue).
    pub refuse_while_updating: bool,
    /// Calls are sampled on vLLM servers ([`super::remote`]): no top log-probs.
    pub remote: bool,
    pub counters: Counters,
    /// The address it listens on (set once bound): the base URLs it hands out.
    pub addr: OnceLock<SocketAddr>,
    /// Choices queued or decoding now, over every caller ([`MAX_IN_FLIGHT`]).
    in_flight: Arc<AtomicUsize>,
    /// Sessions open at once, at most ([`MAX_SESSIONS`]).
    pub max_sessions: usize,
    /// The keys and values calls may hold at once (`None`: not counted, as for calls
    /// sampled on vLLM servers, which keep their own).
    pub kv: Option<KvBudget>,
    /// Bytes of that budget the calls queued or decoding hold now.
    kv_in_flight: Arc<AtomicU64>,
}

/// The most choices queued or decoding at once, over every caller: past it a call is
/// refused with a 429 rather than queued, so that a flood of calls (or of `n`) cannot
/// grow the queue, and the memory it holds, without bound. A batch this wide already
/// decodes at the model's full rate.
pub const MAX_IN_FLIGHT: usize = 4096;

/// The most sessions open at once ([`super::sessions`]): past it `/rl/tasks/next` and
/// `/rl/sessions` answer 429 until sessions end (or, with `--session-timeout`, are ended
/// for silence).
pub const MAX_SESSIONS: usize = 16_384;

/// A queued request's events, holding its choices' places in [`MAX_IN_FLIGHT`] until
/// the caller is done with it (or goes away).
pub struct Queued {
    pub(super) rx: UnboundedReceiver<Event>,
    _slots: Slots,
}

struct Slots {
    count: Arc<AtomicUsize>,
    n: usize,
    kv: Arc<AtomicU64>,
    bytes: u64,
}

impl Drop for Slots {
    fn drop(&mut self) {
        self.count.fetch_sub(self.n, Ordering::Relaxed);
        self.kv.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl Gateway {
    /// Ends the sessions silent for longer than `timeout` and hands them on as ended
    /// (marked timed out), as `rlhost serve` does on a timer: a session an agent left
    /// open held its transcript for good (30 sessions of 10 MiB kept 400 MB).
    pub fn end_silent(&self, timeout: std::time::Duration) -> usize {
        let reaped = self.sessions().reap(timeout);
        let n = reaped.len();
        for f in reaped {
            tracing::warn!(
                "gateway: session {} timed out (no call or end in {timeout:?}): ended",
                f.session
            );
            self.counters
                .timed_out_sessions
                .fetch_add(1, Ordering::Relaxed);
            let _ = self.finished.send(f);
        }
        n
    }

    pub fn new(
        model: String,
        renderer: Renderer,
        jobs: std::sync::mpsc::Sender<Job>,
        finished: std::sync::mpsc::Sender<Finished>,
        tasks: Option<Tasks>,
    ) -> Gateway {
        Gateway {
            model,
            renderer,
            jobs,
            sessions: Mutex::new(Sessions::default()),
            tasks,
            finished,
            version: AtomicU64::new(0),
            updating: AtomicBool::new(false),
            refuse_while_updating: false,
            remote: false,
            counters: Counters::default(),
            addr: OnceLock::new(),
            in_flight: Arc::new(AtomicUsize::new(0)),
            max_sessions: MAX_SESSIONS,
            kv: None,
            kv_in_flight: Arc::new(AtomicU64::new(0)),
        }
    }

    pub(super) fn sessions(&self) -> std::sync::MutexGuard<'_, Sessions> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn base_url(&self, session: &str) -> String {
        match self.addr.get() {
            Some(addr) => format!("http://{addr}/sessions/{session}/v1"),
            None => format!("/sessions/{session}/v1"),
        }
    }

    /// `/status`'s body.
    pub fn status(&self) -> Value {
        let c = &self.counters;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let s = self.sessions();
        json!({
            "model": self.model,
            "version": self.version.load(Ordering::Relaxed),
            "updating": self.updating.load(Ordering::Relaxed),
            "sessions": {"open": s.len(), "opened": s.opened, "ended": s.ended},
            "calls": n(&c.calls),
            "session_calls": n(&c.session_calls),
            "extended_calls": n(&c.extended),
            "drifts": n(&c.drifts),
            "malformed_tool_calls": n(&c.malformed_calls),
            "abandoned_calls": n(&c.abandoned),
            "refused_while_updating": n(&c.refused_updating),
            "failed_calls": n(&c.failed),
            "bad_requests": n(&c.bad_requests),
            "sampled_tokens": n(&c.sampled_tokens),
            "stale_rows": n(&c.stale_rows),
            "timed_out_sessions": n(&c.timed_out_sessions),
            "non_finite_rows": n(&c.non_finite_rows),
        })
    }
}

/// The routes, without a listener (tests call it in process).
pub fn router(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_anywhere))
        .route("/sessions/{id}/v1/chat/completions", post(chat_in_session))
        .route("/v1/completions", post(complete_anywhere))
        .route("/sessions/{id}/v1/completions", post(complete_in_session))
        .route("/v1/models", get(models))
        .route("/sessions/{id}/v1/models", get(models))
        .route("/rl/tasks/next", post(next_task))
        .route("/rl/sessions", post(open_session))
        .route("/sessions/{id}", get(show_session))
        .route("/sessions/{id}/reward", post(reward))
        .route("/sessions/{id}/end", post(end))
        .route("/status", get(status))
        .fallback(not_found)
        .method_not_allowed_fallback(wrong_method)
        // The front has read the body within MAX_BODY already.
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(gw)
}

pub(super) fn error(e: ApiError) -> Response {
    let mut r = (
        StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        axum::Json(e.body()),
    )
        .into_response();
    if let Some(s) = e.retry_after_s {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(s));
    }
    r
}

pub(super) fn status_error(status: u16, kind: &'static str, message: String) -> ApiError {
    ApiError {
        status,
        message,
        kind,
        param: None,
        code: None,
        retry_after_s: None,
    }
}

/// A 429 in OpenAI's shape for a limit that frees up by itself (`type: requests`, `code:
/// rate_limit_exceeded`), with `Retry-After`: the official clients retry it.
pub(super) fn over_limit(message: String) -> ApiError {
    ApiError {
        code: Some("rate_limit_exceeded"),
        retry_after_s: Some(1),
        ..status_error(429, "requests", message)
    }
}

pub(super) fn session_error(e: SessionError) -> ApiError {
    match e {
        SessionError::Unknown(_) => ApiError {
            code: Some("session_not_found"),
            ..status_error(404, "invalid_request_error", e.to_string())
        },
        SessionError::Misuse(_) => ApiError {
            code: Some("session_busy"),
            ..status_error(409, "invalid_request_error", e.to_string())
        },
    }
}

async fn not_found() -> Response {
    error(status_error(
        404,
        "invalid_request_error",
        "no such route: the gateway serves /v1/chat/completions, /v1/completions, /v1/models \
         (also under /sessions/{id}/v1), /rl/tasks/next, /rl/sessions, /sessions/{id}[/reward|/end] \
         and /status"
            .into(),
    ))
}

async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    error(ApiError::from_front(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} does not take {method}", uri.path()),
    ))
}

pub(super) fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The session a call belongs to: the path's, else an `Authorization: Bearer sess_…` key
/// (any other key is a call outside sessions).
fn session_of(path: Option<String>, headers: &HeaderMap) -> Option<String> {
    path.or_else(|| {
        let auth = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
        let key = auth.strip_prefix("Bearer ")?.trim();
        key.starts_with("sess_").then(|| key.to_string())
    })
}

async fn models(State(gw): State<Arc<Gateway>>) -> Response {
    axum::Json(model_list(vec![ModelCard {
        id: gw.model.clone(),
        object: "model",
        created: now_s(),
        owned_by: "rlhost",
    }]))
    .into_response()
}

async fn status(State(gw): State<Arc<Gateway>>) -> Response {
    axum::Json(gw.status()).into_response()
}

async fn chat_anywhere(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let session = session_of(None, &headers);
    answered(&gw, chat(gw.clone(), session, body).await)
}

async fn chat_in_session(
    State(gw): State<Arc<Gateway>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    answered(&gw, chat(gw.clone(), Some(id), body).await)
}

async fn complete_anywhere(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let session = session_of(None, &headers);
    answered(&gw, complete(gw.clone(), session, body).await)
}

async fn complete_in_session(
    State(gw): State<Arc<Gateway>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    answered(&gw, complete(gw.clone(), Some(id), body).await)
}

/// A sampling route's answer, or its error (a 400 counted as a bad request).
fn answered(gw: &Gateway, result: Result<Response, ApiError>) -> Response {
    result.unwrap_or_else(|e| {
        if e.status == 400 {
            gw.counters.bad_requests.fetch_add(1, Ordering::Relaxed);
        }
        error(e)
    })
}

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
    fn begin(
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

/// The checks every sampling call shares: the model's name and the update pause.
fn admit(gw: &Gateway, model: Option<&str>) -> Result<(), ApiError> {
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
            Some(Event::Token(t)) => out[t.choice].tokens.push(t),
            Some(Event::Done {
                choice,
                completion,
                version,
            }) => {
                out[choice].done = Some((completion, version));
                left -= 1;
            }
            Some(Event::Failed(why)) => return Err(status_error(500, "server_error", why)),
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

async fn chat(
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

/// The conversation so far as reward plugins read it: the request's messages and the
/// answer.
pub(super) fn transcript(req: &ChatRequest, answer: &Answer) -> Vec<Message> {
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

/// `POST /v1/completions`: a text prompt, or token ids, or a list of either.
async fn complete(
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

/// Connections served at once: agents hold one each while their calls are sampled; past
/// this the oldest idle one is closed to admit a new one (or the new one waits).
pub const MAX_CONNECTIONS: usize = 1024;

/// Binds `addr` now (a taken port is an error before anything loads) and serves the
/// routes on a runtime of their own, on two threads; returns the bound address.
pub fn spawn(
    gw: Arc<Gateway>,
    addr: &str,
    max_connections: usize,
    key: Option<String>,
) -> anyhow::Result<SocketAddr> {
    let mut policy = crate::front::Policy::new(
        "gateway",
        max_connections,
        MAX_BODY,
        &["/status"],
        |status, message| error(ApiError::from_front(status, message)),
    )
    .with_key(key);
    // A session's id is its agent's API key: handed out by the key-guarded /rl routes, it
    // opens that session's own calls (`/v1/...` with it as bearer, `/sessions/{id}/...`),
    // not the task routes.
    let sessions = Arc::downgrade(&gw);
    policy.also = Some(Arc::new(move |token: &str, path: &str| {
        let own = path.starts_with("/v1/")
            || path
                .strip_prefix("/sessions/")
                .and_then(|rest| rest.strip_prefix(token))
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'));
        own && sessions
            .upgrade()
            .is_some_and(|gw| gw.sessions().get(token).is_ok())
    }));
    let local = crate::front::spawn(
        addr,
        policy,
        Box::new({
            let gw = gw.clone();
            move || router(gw)
        }),
    )?;
    let _ = gw.addr.set(local);
    Ok(local)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures;
    use crate::model::{LanguageModel, Mode, Placement};

    fn post(url: &str, body: &Value) -> (u16, Option<String>, Value) {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(std::time::Duration::from_secs(60)))
            .build()
            .into();
        let mut r = agent
            .post(url)
            .header("content-type", "application/json")
            .send(body.to_string())
            .unwrap();
        let retry = r
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        let text = r.body_mut().read_to_string().unwrap();
        (
            r.status().as_u16(),
            retry,
            serde_json::from_str(&text).unwrap(),
        )
    }

    /// A gateway on the qwen2 fixture that is updating; its queue's receiving end.
    fn updating(
        lm: &LanguageModel,
        refuse: bool,
    ) -> (Arc<Gateway>, String, std::sync::mpsc::Receiver<Job>) {
        let renderer = Renderer::new(lm, Default::default()).unwrap();
        let (jobs_tx, jobs_rx) = std::sync::mpsc::channel();
        let (done_tx, _) = std::sync::mpsc::channel();
        let mut gw = Gateway::new("policy".into(), renderer, jobs_tx, done_tx, None);
        gw.refuse_while_updating = refuse;
        gw.updating.store(true, Ordering::Release);
        let gw = Arc::new(gw);
        let addr = spawn(gw.clone(), "127.0.0.1:0", 16, None).unwrap();
        (gw, format!("http://{addr}/v1/chat/completions"), jobs_rx)
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
        let (gw, _, jobs) = updating(&lm, false);
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
        let (jobs_tx, jobs) = std::sync::mpsc::channel();
        let renderer = Renderer::new(&lm, Default::default()).unwrap();
        let mut gw = Gateway::new(
            "policy".into(),
            renderer,
            jobs_tx,
            std::sync::mpsc::channel().0,
            None,
        );
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

    /// Issue 68: open sessions are bounded; past the bound `/rl/sessions` answers 429 in
    /// OpenAI's shape with `Retry-After`, and an ended session makes room.
    #[test]
    fn open_sessions_are_capped() {
        let lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
        let renderer = Renderer::new(&lm, Default::default()).unwrap();
        let (jobs_tx, _jobs) = std::sync::mpsc::channel();
        let (done_tx, _done) = std::sync::mpsc::channel();
        let mut gw = Gateway::new("policy".into(), renderer, jobs_tx, done_tx, None);
        gw.max_sessions = 2;
        let gw = Arc::new(gw);
        let addr = spawn(gw.clone(), "127.0.0.1:0", 16, None).unwrap();
        let url = format!("http://{addr}/rl/sessions");
        let first = post(&url, &json!({}));
        assert_eq!(post(&url, &json!({})).0, 201);
        let (status, retry, body) = post(&url, &json!({}));
        assert_eq!((status, retry.as_deref()), (429, Some("1")), "{body}");
        assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
        let id = first.2["session_id"].as_str().unwrap();
        assert_eq!(
            post(&format!("http://{addr}/sessions/{id}/end"), &json!({})).0,
            200
        );
        assert_eq!(post(&url, &json!({})).0, 201);
    }

    /// A training run's tasks wait for its checkpoint's cursor, then go on from there:
    /// a resumed run does not hand out the data's first tasks again.
    #[test]
    fn held_tasks_start_where_the_data_was_left() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let dir = crate::data::test_dir("gateway-tasks");
        std::fs::create_dir_all(&dir).unwrap();
        let rows: String = (0..12)
            .map(|i| format!("{{\"prompt\": \"p{i}\"}}\n"))
            .collect();
        std::fs::write(dir.join("train.jsonl"), rows).unwrap();
        let cfg = crate::data::DataConfig {
            path: Some("train.jsonl".into()),
            eval_size: Some(0),
            ..Default::default()
        };
        let dataset = Arc::new(rt.block_on(Dataset::open(&cfg, &dir, None, 7)).unwrap());
        let at = Cursor {
            epoch: 0,
            position: 5,
        };
        let mut c = at;
        let want = rt.block_on(dataset.next_batch(&mut c, 1)).unwrap()[0].0;

        let lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
        let renderer = Renderer::new(&lm, Default::default()).unwrap();
        let (jobs_tx, _jobs) = std::sync::mpsc::channel();
        let (done_tx, _done) = std::sync::mpsc::channel();
        let (tasks, held) = Tasks::held(dataset, 2);
        let gw = Arc::new(Gateway::new(
            "policy".into(),
            renderer,
            jobs_tx,
            done_tx,
            Some(tasks),
        ));
        let addr = spawn(gw.clone(), "127.0.0.1:0", 16, None).unwrap();
        let url = format!("http://{addr}/rl/tasks/next");
        let first = {
            let url = url.clone();
            std::thread::spawn(move || post(&url, &json!({})))
        };
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(
            !first.is_finished(),
            "a task was handed out before the start"
        );
        held.start(at);
        let (status, _, v) = first.join().unwrap();
        assert_eq!(status, 201, "{v}");
        assert_eq!(v["task"]["id"], want, "{v}");
        // The group's second session is the same task; the cursor is past it.
        assert_eq!(post(&url, &json!({})).2["task"]["id"], want);
        let tasks = gw.tasks.as_ref().unwrap();
        assert_eq!(
            rt.block_on(tasks.cursor()),
            Cursor {
                epoch: 0,
                position: 6
            }
        );
        // Issue 68, point 19: until the group is taken for training, a resumed run draws
        // its task again (it skipped groups still open when the checkpoint's batch was
        // taken); once taken, it goes on past it.
        assert_eq!(rt.block_on(tasks.resume_cursor()), at);
        let (_, _, third) = post(&url, &json!({}));
        let (group, next_group) = (
            v["group"]["id"].as_u64().unwrap(),
            third["group"]["id"].as_u64().unwrap(),
        );
        tasks.taken(&[next_group]);
        assert_eq!(rt.block_on(tasks.resume_cursor()), at);
        tasks.taken(&[group]);
        assert_eq!(
            rt.block_on(tasks.resume_cursor()),
            Cursor {
                epoch: 0,
                position: 7
            }
        );
    }

    /// While the policy updates, a call is refused with a 503, `Retry-After` and the
    /// error object (`while_updating = "refuse"`), or waits in the queue and is answered
    /// once sampling resumes (`hold`).
    #[test]
    fn calls_during_an_update_are_refused_or_held() {
        let lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
        let body = json!({"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
        let (gw, url, _queue) = updating(&lm, true);
        let (status, retry, v) = post(&url, &body);
        assert_eq!((status, retry.as_deref()), (503, Some("1")), "{v}");
        assert_eq!(v["error"]["code"], "policy_updating", "{v}");
        assert_eq!(gw.counters.refused_updating.load(Ordering::Relaxed), 1);

        let (gw, url, queue) = updating(&lm, false);
        let held = std::thread::spawn(move || post(&url, &body));
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(
            !held.is_finished(),
            "a held call was answered while updating"
        );
        gw.updating.store(false, Ordering::Release);
        let pumped =
            crate::gateway::pump::pump(&lm, Mode::INFERENCE, &queue, 7, &|| held.is_finished())
                .unwrap();
        assert_eq!(pumped.requests, 1);
        let (status, _, v) = held.join().unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["object"], "chat.completion");
    }
}
