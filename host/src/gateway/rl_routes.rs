//! The gateway's RL routes: `/rl/tasks/next` (the run's next task with a new session),
//! `/rl/sessions` (a session an agent opens with its own task), `/sessions/{id}` and its
//! `reward` and `end`.

use super::sessions::{Reward, Task, read_reward};
use super::state::{Gateway, error, over_limit, session_error, status_error};
use super::wire::ApiError;
use crate::task::{Message, Sample};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;

/// `POST /rl/tasks/next`: the next task of the run's dataset with a new session; the
/// same task goes to G sessions in a row (its group).
pub(super) async fn next_task(State(gw): State<Arc<Gateway>>) -> Response {
    if let Err(e) = room_for_a_session(&gw) {
        return error(e);
    }
    let Some(tasks) = &gw.tasks else {
        return error(status_error(
            404,
            "invalid_request_error",
            "this gateway has no dataset to hand out: open sessions with POST /rl/sessions".into(),
        ));
    };
    let task = {
        let mut state = tasks.state.lock().await;
        let (cursor, current) = &mut *state;
        if current.as_ref().is_none_or(|(_, left)| *left == 0) {
            let from = *cursor;
            let batch = match tasks.dataset.next_batch(cursor, 1).await {
                Ok(b) => b,
                Err(e) => {
                    return error(status_error(
                        500,
                        "server_error",
                        format!("the dataset failed: {e:#}"),
                    ));
                }
            };
            let Some((id, sample)) = batch.into_iter().next() else {
                return error(status_error(
                    500,
                    "server_error",
                    "the dataset is empty".into(),
                ));
            };
            let group = gw.sessions().new_group();
            tasks
                .out
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(group, from);
            *current = Some((
                Task {
                    id: Some(id),
                    group,
                    index: 0,
                    group_size: tasks.group_size,
                    sample,
                },
                tasks.group_size,
            ));
        }
        let (task, left) = current.as_mut().expect("set above");
        let mut handed = task.clone();
        handed.index = tasks.group_size - *left;
        *left -= 1;
        handed
    };
    opened(&gw, task)
}

/// A 429 when [`MAX_SESSIONS`] are open, checked before a task is taken from the
/// dataset (so a refused call skips no task).
pub(super) fn room_for_a_session(gw: &Gateway) -> Result<(), ApiError> {
    let open = gw.sessions().len();
    if open >= gw.max_sessions {
        return Err(over_limit(format!(
            "{open} sessions are open, the gateway's limit: end finished sessions (POST /sessions/{{id}}/end), or retry when others have ended"
        )));
    }
    Ok(())
}

/// A new session's answer: its id (also its API key), its base URL and its task.
pub(super) fn opened(gw: &Arc<Gateway>, task: Task) -> Response {
    let body = json!({
        "task": {"id": task.id, "messages": task.sample.messages, "metadata": task.sample.metadata},
        "group": {"id": task.group, "index": task.index, "size": task.group_size},
        "model": gw.model,
    });
    let id = gw.sessions().open(task);
    let mut body = body;
    body["session_id"] = json!(id);
    body["api_key"] = json!(id);
    body["base_url"] = json!(gw.base_url(&id));
    (StatusCode::CREATED, axum::Json(body)).into_response()
}

/// A route's JSON body; an empty body is `{}`.
fn json_body(body: &Bytes) -> Result<Value, ApiError> {
    if body.is_empty() {
        return Ok(json!({}));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_body(format!("the body is not JSON: {e}")))
}

/// `POST /rl/sessions`: a session for a task the agent brings (`messages`, `metadata`,
/// both optional), in a group of its own.
pub(super) async fn open_session(State(gw): State<Arc<Gateway>>, body: Bytes) -> Response {
    if let Err(e) = room_for_a_session(&gw) {
        return error(e);
    }
    let v = match json_body(&body) {
        Ok(v) => v,
        Err(e) => return error(e),
    };
    let messages: Vec<Message> = match v.get("messages") {
        None | Some(Value::Null) => Vec::new(),
        Some(m) => match serde_json::from_value(m.clone()) {
            Ok(m) => m,
            Err(e) => return error(ApiError::invalid("messages", format!("`messages`: {e}"))),
        },
    };
    let metadata = v.get("metadata").cloned().unwrap_or_else(|| json!({}));
    if !metadata.is_object() {
        return error(ApiError::invalid(
            "metadata",
            "`metadata` must be an object",
        ));
    }
    let group = gw.sessions().new_group();
    opened(
        &gw,
        Task {
            id: None,
            group,
            index: 0,
            group_size: 1,
            sample: Sample { messages, metadata },
        },
    )
}

/// `GET /sessions/{id}`: the recording so far.
pub(super) async fn show_session(
    State(gw): State<Arc<Gateway>>,
    Path(id): Path<String>,
) -> Response {
    let sessions = gw.sessions();
    match sessions.get(&id) {
        Ok(open) => axum::Json(json!({
            "session_id": id,
            "task": open.task,
            "rows": open.record.settled_rows(),
            "drifts": open.record.drifts,
            "reward": open.reward,
            "calls": open.calls,
        }))
        .into_response(),
        Err(e) => error(session_error(e)),
    }
}

/// `POST /sessions/{id}/reward`.
pub(super) async fn reward(
    State(gw): State<Arc<Gateway>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let v = match json_body(&body) {
        Ok(v) => v,
        Err(e) => return error(e),
    };
    let r: Reward = match read_reward(&v) {
        Ok(r) => r,
        Err(why) => return error(ApiError::invalid("reward", why)),
    };
    let mut sessions = gw.sessions();
    match sessions.get_mut(&id) {
        Ok(open) => {
            open.reward = Some(r.clone());
            axum::Json(json!({"session_id": id, "reward": r})).into_response()
        }
        Err(e) => error(session_error(e)),
    }
}

/// `POST /sessions/{id}/end` (a body may carry the reward too).
pub(super) async fn end(
    State(gw): State<Arc<Gateway>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let v = match json_body(&body) {
        Ok(v) => v,
        Err(e) => return error(e),
    };
    if v.get("reward").is_some() || v.get("rewards").is_some() {
        match read_reward(&v) {
            Ok(r) => {
                if let Ok(open) = gw.sessions().get_mut(&id) {
                    open.reward = Some(r);
                }
            }
            Err(why) => return error(ApiError::invalid("reward", why)),
        }
    }
    let finished = match gw.sessions().end(&id) {
        Ok(f) => f,
        Err(e) => return error(session_error(e)),
    };
    let body = json!({
        "session_id": id,
        "rows": finished.rows.len(),
        "drifts": finished.drifts.len(),
        "sampled_tokens": finished.rows.iter().map(|r| r.sampled()).sum::<usize>(),
        "reward": finished.reward,
    });
    if gw.finished.send(finished).is_err() {
        tracing::warn!("gateway: session {id} ended after the run stopped taking sessions");
    }
    axum::Json(body).into_response()
}
