//! The status server: a read-only axum router over a [`StatusHub`], on its own thread and
//! tokio runtime so that serving never takes a core the trainer's plugins wait on.
//!
//! - `GET /status` JSON, `GET /history` every step's metrics, `GET /metrics` Prometheus,
//!   `GET /events` server-sent events (one `step` per step, `status` on phase changes),
//!   `GET /rollouts/latest?n=8` recent trajectories, `GET /` the dashboard.
//! - Bounded: at most [`MAX_CONNECTIONS`] open connections (more wait in the kernel's
//!   backlog), and a subscriber that reads too slowly skips events instead of holding
//!   the trainer (see [`super`]). No CORS headers: other origins cannot read it.

use super::{Event, StatusHub};
use anyhow::{Context, Result};
use axum::Router;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, broadcast};

/// Open connections served at once. A dashboard holds two or three (page, events); the
/// rest is room for scrapers and `rlhost status`.
pub const MAX_CONNECTIONS: usize = 64;
/// Trajectories `/rollouts/latest` returns when `n` is not given.
const DEFAULT_ROLLOUTS: usize = 8;

const INDEX_HTML: &str = include_str!("assets/index.html");
const DASHBOARD_JS: &str = include_str!("assets/dashboard.js");
const DASHBOARD_CSS: &str = include_str!("assets/dashboard.css");
const UPLOT_JS: &str = include_str!("assets/vendor/uPlot.iife.min.js");
const UPLOT_CSS: &str = include_str!("assets/vendor/uPlot.min.css");

/// The routes, without a listener (tests call it in process).
pub fn router(hub: Arc<StatusHub>) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/status", get(status))
        .route("/history", get(history))
        .route("/metrics", get(metrics))
        .route("/events", get(events))
        .route("/rollouts/latest", get(rollouts))
        .route("/assets/{file}", get(asset))
        .with_state(hub)
}

async fn index() -> Response {
    page(INDEX_HTML, "text/html; charset=utf-8")
}

async fn asset(axum::extract::Path(file): axum::extract::Path<String>) -> Response {
    match file.as_str() {
        "dashboard.js" => page(DASHBOARD_JS, "text/javascript; charset=utf-8"),
        "dashboard.css" => page(DASHBOARD_CSS, "text/css; charset=utf-8"),
        "uPlot.iife.min.js" => page(UPLOT_JS, "text/javascript; charset=utf-8"),
        "uPlot.min.css" => page(UPLOT_CSS, "text/css; charset=utf-8"),
        _ => (StatusCode::NOT_FOUND, "no such asset\n").into_response(),
    }
}

fn page(body: &'static str, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            // The page may only load what this server serves.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; style-src 'self' 'unsafe-inline'",
            ),
        ],
        body,
    )
        .into_response()
}

fn json(body: String) -> Response {
    (
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

async fn status(State(hub): State<Arc<StatusHub>>) -> Response {
    json(serde_json::to_string(&hub.status()).unwrap_or_default())
}

async fn history(State(hub): State<Arc<StatusHub>>) -> Response {
    json(hub.history_json())
}

async fn metrics(State(hub): State<Arc<StatusHub>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        hub.metrics.encode(),
    )
        .into_response()
}

#[derive(Deserialize)]
struct RolloutsQuery {
    n: Option<usize>,
}

async fn rollouts(State(hub): State<Arc<StatusHub>>, Query(q): Query<RolloutsQuery>) -> Response {
    let n = q.n.unwrap_or(DEFAULT_ROLLOUTS).min(super::MAX_ROLLOUTS);
    let (step, trajectories) = hub.rollouts(n);
    json(
        serde_json::to_string(&serde_json::json!({
            "step": step,
            "trajectories": trajectories,
        }))
        .unwrap_or_default(),
    )
}

async fn events(State(hub): State<Arc<StatusHub>>) -> impl IntoResponse {
    use axum::response::sse::Event as Sse_;
    let rx = hub.subscribe();
    // The current status first, so a client knows where it joined.
    let first = Sse_::default()
        .event("status")
        .data(serde_json::to_string(&hub.status()).unwrap_or_default());
    let stream = futures_util::stream::unfold((rx, Some(first)), |(mut rx, first)| async move {
        if let Some(ev) = first {
            return Some((Ok::<_, Infallible>(ev), (rx, None)));
        }
        let ev = match rx.recv().await {
            Ok(Event { name, data }) => Sse_::default().event(name).data(&*data),
            // Fell behind the trainer: the client re-reads `/history`.
            Err(broadcast::error::RecvError::Lagged(n)) => {
                Sse_::default().event("resync").data(n.to_string())
            }
            Err(broadcast::error::RecvError::Closed) => return None,
        };
        Some((Ok(ev), (rx, None)))
    });
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

/// A running server; dropping it does not stop it (it lives as long as the process).
pub struct Server {
    pub addr: SocketAddr,
}

impl Server {
    /// `http://ADDR/`.
    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }
}

/// Binds `addr` now (so a taken port is an error before the run starts) and serves on a
/// thread of its own.
pub fn spawn(hub: Arc<StatusHub>, addr: &str) -> Result<Server> {
    let std_listener = std::net::TcpListener::bind(addr).with_context(|| {
        format!("cannot listen on --status-addr {addr} (is the port taken? `127.0.0.1:0` picks a free one)")
    })?;
    std_listener.set_nonblocking(true)?;
    let local = std_listener.local_addr()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("rlhost-status")
        .enable_all()
        .build()
        .context("cannot start the status server's runtime")?;
    std::thread::Builder::new()
        .name("rlhost-status".into())
        .spawn(move || {
            runtime.block_on(async move {
                let listener = match TcpListener::from_std(std_listener) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!("status server: {e}");
                        return;
                    }
                };
                let limited = Limited {
                    listener,
                    permits: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
                };
                if let Err(e) = axum::serve(limited, router(hub)).await {
                    tracing::error!("status server stopped: {e}");
                }
            })
        })
        .context("cannot start the status server's thread")?;
    Ok(Server { addr: local })
}

/// A listener that holds a semaphore permit per open connection: at most
/// [`MAX_CONNECTIONS`] are served; the next waits until one closes.
struct Limited {
    listener: TcpListener,
    permits: Arc<Semaphore>,
}

impl axum::serve::Listener for Limited {
    type Io = LimitedStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        loop {
            match self.listener.accept().await {
                Ok((stream, addr)) => {
                    let _ = stream.set_nodelay(true);
                    return (
                        LimitedStream {
                            stream,
                            _permit: permit,
                        },
                        addr,
                    );
                }
                // E.g. out of file descriptors: wait rather than spin.
                Err(e) => {
                    tracing::debug!("status server: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}

/// A connection and its permit (released when the connection is dropped).
struct LimitedStream {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
}

impl AsyncRead for LimitedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for LimitedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}
