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
use super::rl_routes::{end, next_task, open_session, reward, show_session};
use super::state::{Gateway, MAX_BODY, error, now_s, status_error};
use super::wire::{ApiError, ModelCard, model_list};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

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
    use crate::data::{Cursor, Dataset};
    use crate::gateway::chat::Renderer;
    use crate::gateway::pump::Job;
    use crate::gateway::state::Tasks;
    use crate::model::fixtures;
    use crate::model::{LanguageModel, Mode, Placement};
    use serde_json::{Value, json};
    use std::sync::atomic::Ordering;

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
