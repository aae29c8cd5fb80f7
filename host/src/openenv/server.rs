//! The OpenEnv server: `/ws` sessions (one [`Episode`] per connection, at most
//! `max_sessions` at once, closed after `idle` without a message: pings do not count),
//! OpenEnv's HTTP routes (`/health`, `/metadata`, `/schema`, and `/reset`, `/step`,
//! `/state` on a fresh episode per request, as OpenEnv's own server runs them), `POST
//! /mcp` (JSON-RPC 2.0: a tools plugin's functions; OpenEnv's WebSocket `/mcp` is not
//! served, `mcp` messages on `/ws` are), and rlhost's `GET /stats`.
//!
//! A session's messages are answered in order, one frame each: a step runs to its end
//! (bounded by the plugin's deadline) before the next message is read. OpenEnv's clients
//! ping every 20 s and give up after 20 s more without a pong, which the socket answers
//! when it is next read: a plugin deadline under 20 s (the default is 5 s) keeps sessions
//! alive through the longest step.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::Semaphore;

use super::episode::{Episode, Refusal, Served};
use super::wire::{self, Code, Incoming, rpc};

/// The server's bounds.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Sessions (and stateless HTTP episodes) open at once.
    pub max_sessions: usize,
    /// A session with no message for this long is closed.
    pub idle: Duration,
    /// The largest message a client may send.
    pub max_message_bytes: usize,
}

struct App {
    served: Arc<Served>,
    permits: Arc<Semaphore>,
    options: ServeOptions,
}

/// The routes, over `served`.
pub fn router(served: Arc<Served>, options: ServeOptions) -> Router {
    let max_body = options.max_message_bytes;
    let app = Arc::new(App {
        served,
        permits: Arc::new(Semaphore::new(options.max_sessions)),
        options,
    });
    Router::new()
        .route(
            "/health",
            get(|| async { axum::Json(json!({"status": "healthy"})) }),
        )
        .route("/metadata", get(metadata))
        .route("/schema", get(schema))
        .route("/reset", post(reset))
        .route("/step", post(step))
        .route("/state", get(state))
        .route("/mcp", post(mcp))
        .route("/ws", get(ws))
        .route("/stats", get(stats))
        .method_not_allowed_fallback(wrong_method)
        .layer(axum::extract::DefaultBodyLimit::max(max_body))
        .with_state(app)
}

/// A refusal the front ([`crate::front`]) makes, in FastAPI's shape as OpenEnv's own
/// server gives it: `{"detail": "…"}`.
pub fn refusal(status: StatusCode, message: String) -> Response {
    detail(status, Value::String(message))
}

async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    refusal(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} does not take {method}", uri.path()),
    )
}

async fn metadata(State(app): State<Arc<App>>) -> Response {
    axum::Json(app.served.metadata()).into_response()
}

async fn stats(State(app): State<Arc<App>>) -> Response {
    let open = app.options.max_sessions - app.permits.available_permits();
    axum::Json(app.served.stats(open)).into_response()
}

async fn schema(State(app): State<Arc<App>>) -> Response {
    axum::Json(app.served.schema()).into_response()
}

/// FastAPI's error body: `{"detail": …}`.
fn detail(status: StatusCode, detail: Value) -> Response {
    (status, axum::Json(json!({ "detail": detail }))).into_response()
}

fn refused(r: Refusal) -> Response {
    match r {
        Refusal::Invalid(errors) => detail(StatusCode::UNPROCESSABLE_ENTITY, Value::Array(errors)),
        Refusal::Execution(m) => detail(StatusCode::INTERNAL_SERVER_ERROR, Value::String(m)),
    }
}

/// A body that is JSON, or empty (`None`); else why not.
fn json_body(body: &Bytes) -> Result<Option<Value>, serde_json::Error> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    serde_json::from_slice(body).map(Some)
}

/// FastAPI's 422 for a body that is not JSON.
fn not_json(e: serde_json::Error) -> Response {
    detail(
        StatusCode::UNPROCESSABLE_ENTITY,
        json!([{"type": "json_invalid", "loc": ["body", 0], "msg": format!("JSON decode error: {e}")}]),
    )
}

fn at_capacity(app: &App) -> Response {
    detail(
        StatusCode::SERVICE_UNAVAILABLE,
        Value::String(format!(
            "Server at capacity: {} sessions active",
            app.options.max_sessions
        )),
    )
}

/// `POST /reset`: a fresh episode, reset.
async fn reset(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let body = match json_body(&body) {
        Ok(b) => b.unwrap_or(Value::Null),
        Err(e) => return not_json(e),
    };
    let Ok(_permit) = app.permits.clone().try_acquire_owned() else {
        return at_capacity(&app);
    };
    let mut episode = Episode::new(app.served.clone());
    match episode.reset(&body).await {
        Ok(o) => axum::Json(o.body()).into_response(),
        Err(r) => refused(r),
    }
}

/// `POST /step` `{"action": {…}}`: a fresh episode, reset, then the action.
async fn step(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let body = match json_body(&body) {
        Ok(b) => b.unwrap_or_else(|| json!({})),
        Err(e) => return not_json(e),
    };
    let Some(action) = body.get("action") else {
        return detail(
            StatusCode::UNPROCESSABLE_ENTITY,
            json!([{"type": "missing", "loc": ["body", "action"], "msg": "Field required"}]),
        );
    };
    let Ok(_permit) = app.permits.clone().try_acquire_owned() else {
        return at_capacity(&app);
    };
    let mut episode = Episode::new(app.served.clone());
    if let Err(r) = episode.reset(&Value::Null).await {
        return refused(r);
    }
    match episode.step(action).await {
        Ok(o) => axum::Json(o.body()).into_response(),
        Err(r) => refused(r),
    }
}

/// `GET /state`: a fresh episode's.
async fn state(State(app): State<Arc<App>>) -> Response {
    axum::Json(Episode::new(app.served.clone()).state()).into_response()
}

/// `POST /mcp`: one JSON-RPC request on a fresh episode; always HTTP 200.
async fn mcp(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return axum::Json(wire::rpc_error(
            &Value::Null,
            rpc::PARSE_ERROR,
            "Parse error",
        ))
        .into_response();
    };
    let Ok(_permit) = app.permits.clone().try_acquire_owned() else {
        let id = request.get("id").cloned().unwrap_or(Value::Null);
        return axum::Json(wire::rpc_error(
            &id,
            rpc::SERVER_ERROR,
            "Server at capacity",
        ))
        .into_response();
    };
    let mut episode = Episode::new(app.served.clone());
    axum::Json(episode.mcp(&request).await).into_response()
}

async fn ws(State(app): State<Arc<App>>, upgrade: WebSocketUpgrade) -> Response {
    let max = app.options.max_message_bytes;
    upgrade
        .max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| session(socket, app))
}

fn close(code: u16, reason: &str) -> Message {
    Message::Close(Some(CloseFrame {
        code,
        reason: reason.into(),
    }))
}

/// One `/ws` session: accepted, then refused with `CAPACITY_REACHED` when every slot is
/// taken (as OpenEnv does, so the client reads why), else served until `close`, the
/// client's going away, or `idle`.
async fn session(mut socket: WebSocket, app: Arc<App>) {
    let Ok(permit) = app.permits.clone().try_acquire_owned() else {
        let max = app.options.max_sessions;
        let frame = wire::error_frame(
            Code::CapacityReached,
            &format!(
                "Server at capacity: {max}/{max} sessions active. Cannot accept new connections."
            ),
            json!({"active_sessions": max, "max_sessions": max}),
        );
        let _ = socket.send(Message::Text(frame.into())).await;
        let _ = socket.send(close(1000, "at capacity")).await;
        return;
    };
    let mut episode = Episode::new(app.served.clone());
    // Only a message moves the deadline: a client that pings and never asks keeps no slot.
    let mut deadline = tokio::time::Instant::now() + app.options.idle;
    loop {
        let message = match tokio::time::timeout_at(deadline, socket.recv()).await {
            Err(_) => {
                tracing::debug!("openenv: closed a session idle for {:?}", app.options.idle);
                let _ = socket.send(close(1000, "idle")).await;
                break;
            }
            Ok(Some(Err(e))) => {
                // A message over --max-message-mib: tell the client why before closing,
                // with 1009 (message too big), as RFC 6455 has it. tungstenite reports it
                // as a capacity error; axum passes it on boxed, so it is told by its text.
                if format!("{e:#}").contains("Message too long") {
                    let _ = socket
                        .send(close(
                            1009,
                            &format!(
                                "message over the server's {max} bytes",
                                max = app.options.max_message_bytes
                            ),
                        ))
                        .await;
                }
                break;
            }
            Ok(None) => break,
            Ok(Some(Ok(m))) => m,
        };
        let text = match message {
            Message::Text(t) => t,
            Message::Binary(_) => {
                let frame = wire::error_frame(
                    Code::SessionError,
                    "binary frames are not messages: send JSON text",
                    json!({}),
                );
                let _ = socket.send(Message::Text(frame.into())).await;
                let _ = socket.send(close(1003, "binary frame")).await;
                break;
            }
            Message::Close(_) => break,
            Message::Ping(_) | Message::Pong(_) => continue,
        };
        deadline = tokio::time::Instant::now() + app.options.idle;
        let reply = match answer(&mut episode, text.as_str()).await {
            Some(reply) => reply,
            None => {
                let _ = socket.send(close(1000, "closed")).await;
                break;
            }
        };
        if socket.send(Message::Text(reply.into())).await.is_err() {
            break;
        }
    }
    drop(permit);
}

/// The frame answering one message; `None` for `close`.
async fn answer(episode: &mut Episode, text: &str) -> Option<String> {
    let value: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            return Some(wire::error_frame(
                Code::InvalidJson,
                &format!("Invalid JSON: {e}"),
                json!({}),
            ));
        }
    };
    let known = ["reset", "step", "state", "close", "mcp"];
    let kind = value.get("type").and_then(Value::as_str).unwrap_or("");
    if !known.contains(&kind) {
        return Some(wire::error_frame(
            Code::UnknownType,
            &format!("Unknown message type: {kind}"),
            json!({}),
        ));
    }
    let incoming: Incoming = match serde_json::from_value(value) {
        Ok(m) => m,
        Err(e) => {
            let errors = json!([{"type": "value_error", "loc": [], "msg": e.to_string()}]);
            return Some(wire::error_frame(
                Code::ValidationError,
                &format!("Invalid message: {e}"),
                json!({ "errors": errors }),
            ));
        }
    };
    Some(match incoming {
        Incoming::Close {} => return None,
        Incoming::Reset { data } => match episode.reset(&data.unwrap_or(Value::Null)).await {
            Ok(o) => o.frame(),
            Err(r) => r.frame(),
        },
        Incoming::Step { data } => match episode.step(&data).await {
            Ok(o) => o.frame(),
            Err(r) => r.frame(),
        },
        Incoming::State {} => wire::state_frame(&episode.state()),
        Incoming::Mcp { data } => wire::mcp_frame(&episode.mcp(&data).await),
    })
}
