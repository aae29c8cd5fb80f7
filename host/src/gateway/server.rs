//! The gateway's HTTP side: OpenAI's routes (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/models`), each also under a session's prefix `/sessions/{id}/v1/...` and reached
//! with a session's id as the API key; `/status`; the router, which also takes the RL
//! routes (`rl_routes.rs`: `/rl/tasks/next`, `/rl/sessions`, `/sessions/{id}`,
//! `.../reward`, `.../end`); the gateway's shared state (counters, the held tasks, the
//! bounds on calls and sessions in flight). One sampling call's path is `calls.rs`'s, and
//! a streamed chat answer `stream.rs`'s.
//!
//! Handlers render and read; sampling happens on the model's thread ([`super::pump`]),
//! reached through a queue.

use super::calls::{chat, complete};
use super::chat::Renderer;
use super::pump::{Event, Job};
use super::rl_routes::{end, next_task, open_session, reward, show_session};
use super::sessions::{Finished, SessionError, Sessions, Task};
use super::wire::{ApiError, ModelCard, model_list};
use crate::data::{Cursor, Dataset};
use crate::sampler::kv_budget::KvBudget;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedReceiver;

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
    pub(super) jobs: std::sync::mpsc::Sender<Job>,
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
    pub(super) in_flight: Arc<AtomicUsize>,
    /// Sessions open at once, at most ([`MAX_SESSIONS`]).
    pub max_sessions: usize,
    /// The keys and values calls may hold at once (`None`: not counted, as for calls
    /// sampled on vLLM servers, which keep their own).
    pub kv: Option<KvBudget>,
    /// Bytes of that budget the calls queued or decoding hold now.
    pub(super) kv_in_flight: Arc<AtomicU64>,
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
    pub(super) _slots: Slots,
}

pub(super) struct Slots {
    pub(super) count: Arc<AtomicUsize>,
    pub(super) n: usize,
    pub(super) kv: Arc<AtomicU64>,
    pub(super) bytes: u64,
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
