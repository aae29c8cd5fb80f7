//! The Tinker server's answers that hold no state: the refusal shape the SDK raises
//! (`{"detail": …}`), a body's parse, and the routes that answer the same every time
//! (client config, health, telemetry, the fallbacks).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

/// A refusal from a check, boxed (a response is large).
pub type Refused = Box<Response>;

/// A refusal the SDK raises as `BadRequestError`/`NotFoundError` with this message.
pub fn refuse(status: StatusCode, message: impl Into<String>) -> Response {
    (status, axum::Json(json!({ "detail": message.into() }))).into_response()
}

pub fn ok(v: Value) -> Response {
    axum::Json(v).into_response()
}

pub fn parse<T: DeserializeOwned>(body: &[u8], what: &str) -> Result<T, Refused> {
    serde_json::from_slice(body).map_err(|e| {
        Box::new(refuse(
            StatusCode::BAD_REQUEST,
            format!("{what}: the body is not a valid request: {e}"),
        ))
    })
}

pub async fn not_found(uri: axum::http::Uri) -> Response {
    refuse(
        StatusCode::NOT_FOUND,
        format!(
            "rlhost's Tinker server has no {} (the subset it serves is in the book's \"Your own RL loop\" page)",
            uri.path()
        ),
    )
}

pub async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    refuse(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} does not take {method}", uri.path()),
    )
}

pub async fn client_config() -> Response {
    // The SDK's defaults, spelled out: no token exchange, uncompressed forward/backward
    // bodies (the server does not read zstd), sampling polled per request.
    ok(json!({
        "pjwt_auth_enabled": false,
        "proto_compress_fwdbwd": false,
        "sample_use_retrieve_futures": false,
        "custom_loss_server_side": false,
    }))
}

pub async fn empty() -> Response {
    ok(json!({}))
}

pub async fn healthz() -> Response {
    ok(json!({"status": "ok"}))
}

pub async fn telemetry() -> Response {
    ok(json!({"status": "accepted"}))
}
