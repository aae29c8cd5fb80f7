//! The gateway's shared state: the model's name and template, the queue to the model's
//! thread, the held tasks, the open sessions, the counters `/status` reports, and the
//! bounds on calls, keys and values and sessions in flight; the errors its routes answer
//! with, in OpenAI's shape. The routes (`server.rs`, `rl_routes.rs`) and one call's path
//! (`calls.rs`, `stream.rs`) take it from here.

use super::chat::Renderer;
use super::pump::{Emitted, Job};
use super::sessions::{Finished, SessionError, Sessions, Task};
use super::wire::ApiError;
use crate::data::{Cursor, Dataset};
use crate::sampler::kv_budget::KvBudget;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
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
    pub(super) rx: UnboundedReceiver<Emitted>,
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

pub fn error(e: ApiError) -> Response {
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

pub(super) fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
