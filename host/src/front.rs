//! The HTTP front every rlhost server stands behind (status, gateway, Tinker): one policy
//! for what a client may hold, held here once rather than in four copies
//! (docs/src/security.md, "Servers facing clients").
//!
//! - **Connections.** At most [`Policy::max_connections`] at once. When the table is full,
//!   a new connection takes the place of the oldest idle one (connected, kept alive, or
//!   still sending a request's body, with no request being served). When every one is
//!   serving, up to [`OVERFLOW`] more are let in to answer the health routes only (others
//!   get 503 in the protocol's shape), so `/healthz` or `/status` answers through a full
//!   table; past that a new connection waits.
//! - **Timeouts.** A request's header must arrive within [`Policy::header_timeout`] (hyper's
//!   own timer, counted after accepting and after each response of a keep-alive
//!   connection), its body within [`Policy::body_timeout`] after that (408).
//! - **Body cap.** A body over [`Policy::max_body`] is refused with 413 before it is read
//!   further (by its `Content-Length` when it has one, else once that much has come).
//! - **Key.** With [`Policy::key`] set, every route but the health routes needs
//!   `Authorization: Bearer KEY` or `X-API-Key: KEY` (401); [`check_exposure`] refuses an
//!   address beyond loopback without `--public`.
//!
//! Refusals made here come in the server's own error shape ([`Policy::refusal`]).

use anyhow::{Context, Result};
use axum::Router;
use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore};

/// Connections let in past a full table of busy ones, to answer health routes only.
pub const OVERFLOW: usize = 32;
/// How long a request's header may take to arrive.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a request's body may take to arrive once its header is in. A body that never
/// completes held its connection for good (1,030 of them stopped `/healthz`).
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// A refusal in a server's own error shape: its status and message.
pub type ErrorShape = fn(StatusCode, String) -> Response;

/// Whether a bearer token is taken in the key's place on a path: `(token, path)`.
pub type Also = Arc<dyn Fn(&str, &str) -> bool + Send + Sync>;

/// What one server holds its clients to.
#[derive(Clone)]
pub struct Policy {
    /// The server's name in logs (`gateway`, `tinker`, `status server`).
    pub name: &'static str,
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    /// The largest request body read, in bytes.
    pub max_body: usize,
    /// Routes answered without the key, and through a full table.
    pub health: &'static [&'static str],
    /// The bearer key every other route needs, when set.
    pub key: Option<Arc<str>>,
    /// Other bearer tokens taken in the key's place on some paths (token, path): the
    /// gateway's live session ids on their own calls, which it hands out (as each
    /// session's `api_key`) only to holders of the key.
    pub also: Option<Also>,
    pub refusal: ErrorShape,
}

impl Policy {
    /// The defaults for `name`: [`HEADER_TIMEOUT`], [`BODY_TIMEOUT`] (the environment's
    /// `RLHOST_BODY_TIMEOUT_MS` instead, for tests), no key.
    pub fn new(
        name: &'static str,
        max_connections: usize,
        max_body: usize,
        health: &'static [&'static str],
        refusal: ErrorShape,
    ) -> Policy {
        Policy {
            name,
            max_connections,
            header_timeout: HEADER_TIMEOUT,
            body_timeout: std::env::var("RLHOST_BODY_TIMEOUT_MS")
                .ok()
                .and_then(|v| v.parse().ok())
                .map_or(BODY_TIMEOUT, Duration::from_millis),
            max_body,
            health,
            key: None,
            also: None,
            refusal,
        }
    }

    /// With the bearer key `key` required (none: open).
    pub fn with_key(mut self, key: Option<String>) -> Policy {
        self.key = key.map(Arc::from);
        self
    }
}

/// Refuses to listen beyond loopback unless the operator said so: with `public` (the
/// server's `--public` flag or config key, named by `flag`) it warns, and without it it is
/// an error naming `what` (the option that set the address). `keyed`: whether a key is
/// required.
pub fn check_exposure(addr: &str, public: bool, keyed: bool, what: &str, flag: &str) -> Result<()> {
    let ips: Vec<std::net::IpAddr> = match std::net::ToSocketAddrs::to_socket_addrs(addr) {
        Ok(addrs) => addrs.map(|a| a.ip()).collect(),
        // Not resolvable: the bind fails later with its own message.
        Err(_) => return Ok(()),
    };
    let Some(open) = ips.iter().find(|ip| !ip.is_loopback()) else {
        return Ok(());
    };
    let guard = if keyed {
        "every route but health needs the bearer key given at start"
    } else {
        "it has no authentication: anyone who can reach it can use it"
    };
    if !public {
        anyhow::bail!(
            "{what} {addr} listens beyond this machine ({open}), and {guard}. Use 127.0.0.1 \
             (and an SSH tunnel to reach it from elsewhere), or set {flag} to expose it on \
             purpose, with a key in RLHOST_API_KEY that every client must send"
        );
    }
    eprintln!("warning: {what} {addr} listens beyond this machine ({open}); {guard}");
    Ok(())
}

/// The key `--api-key` or RLHOST_API_KEY gives (none when neither is set).
pub fn api_key(flag: Option<String>) -> Result<Option<String>> {
    let key = flag.or_else(|| std::env::var("RLHOST_API_KEY").ok());
    match key {
        Some(k) if k.trim().is_empty() || k.chars().any(|c| c.is_control() || c == ' ') => {
            anyhow::bail!(
                "the API key (--api-key or RLHOST_API_KEY) must be non-empty, without spaces or control characters"
            )
        }
        other => Ok(other),
    }
}

/// Binds `addr` now (a taken port is an error before anything loads) and serves the app
/// `make` builds on a runtime of its own, on two threads named `rlhost-NAME`, held to
/// `policy`; returns the bound address.
pub fn spawn(
    addr: &str,
    policy: Policy,
    make: Box<dyn FnOnce() -> Router + Send>,
) -> Result<SocketAddr> {
    let name = policy.name;
    let listener = std::net::TcpListener::bind(addr).with_context(|| {
        format!("cannot listen on {addr} (is the port taken? `127.0.0.1:0` picks a free one)")
    })?;
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(format!("rlhost-{name}"))
        .enable_all()
        .build()
        .with_context(|| format!("cannot start the {name}'s runtime"))?;
    std::thread::Builder::new()
        .name(format!("rlhost-{name}"))
        .spawn(move || {
            runtime.block_on(async move {
                match TcpListener::from_std(listener) {
                    Ok(listener) => serve(listener, make(), policy).await,
                    Err(e) => tracing::error!("{name}: {e}"),
                }
            })
        })
        .with_context(|| format!("cannot start the {name}'s thread"))?;
    Ok(local)
}

/// One open connection, as the accept loop sees it.
struct Open {
    id: u64,
    /// Requests being served (from a whole body in until the response, an event stream
    /// included, has been sent).
    busy: Arc<AtomicUsize>,
    /// Closes the connection when notified.
    close: Arc<Notify>,
}

/// The open connections, oldest first.
type Table = Arc<Mutex<VecDeque<Open>>>;

/// Accepts connections and serves each over HTTP/1.1 as `policy` says.
pub async fn serve(listener: TcpListener, app: Router, policy: Policy) {
    let permits = Arc::new(Semaphore::new(policy.max_connections));
    let spare = Arc::new(Semaphore::new(OVERFLOW));
    let table: Table = Arc::default();
    let policy = Arc::new(policy);
    for id in 0u64.. {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            // E.g. out of file descriptors: wait rather than spin.
            Err(e) => {
                tracing::debug!("{}: accept failed: {e}", policy.name);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (permit, overflow) = match permits.clone().try_acquire_owned() {
            Ok(permit) => (permit, false),
            Err(_) => {
                close_oldest_idle(&table);
                // The closed one's permit comes back at once; when none was idle, a spare
                // one answers health routes only.
                tokio::select! {
                    biased;
                    p = permits.clone().acquire_owned() => (p.expect("never closed"), false),
                    p = spare.clone().acquire_owned() => (p.expect("never closed"), true),
                }
            }
        };
        let _ = stream.set_nodelay(true);
        let (busy, close) = (Arc::new(AtomicUsize::new(0)), Arc::new(Notify::new()));
        if !overflow {
            lock(&table).push_back(Open {
                id,
                busy: busy.clone(),
                close: close.clone(),
            });
        }
        let service = Tracking {
            app: TowerToHyperService::new(app.clone()),
            busy,
            policy: policy.clone(),
            overflow,
        };
        let table = table.clone();
        let name = policy.name;
        let header_timeout = policy.header_timeout;
        tokio::spawn(async move {
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(TokioIo::new(stream), service)
                // OpenEnv's /ws: the connection hands its socket on once upgraded.
                .with_upgrades();
            tokio::select! {
                ended = connection => if let Err(e) = ended {
                    tracing::debug!("{name}: connection closed: {e}");
                },
                () = close.notified() => {
                    tracing::debug!("{name}: closed an idle connection to admit a new one");
                }
            }
            lock(&table).retain(|o| o.id != id);
            drop(permit);
        });
    }
}

fn lock(table: &Table) -> std::sync::MutexGuard<'_, VecDeque<Open>> {
    table.lock().unwrap_or_else(|e| e.into_inner())
}

/// Tells the oldest connection with no request being served to close (it leaves the
/// table then); none when every one is busy.
fn close_oldest_idle(table: &Table) {
    let mut open = lock(table);
    if let Some(at) = open
        .iter()
        .position(|o| o.busy.load(Ordering::Acquire) == 0)
        && let Some(o) = open.remove(at)
    {
        o.close.notify_one();
    }
}

/// The router behind one connection: checks the key, reads the body within the policy's
/// bounds, then counts the request as served until its response body is dropped.
struct Tracking {
    app: TowerToHyperService<Router>,
    busy: Arc<AtomicUsize>,
    policy: Arc<Policy>,
    /// A connection past the table, for health routes only.
    overflow: bool,
}

impl hyper::service::Service<hyper::Request<hyper::body::Incoming>> for Tracking {
    type Response = hyper::Response<Tracked>;
    type Error = Infallible;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, req: hyper::Request<hyper::body::Incoming>) -> Self::Future {
        let (app, busy, policy, overflow) = (
            self.app.clone(),
            self.busy.clone(),
            self.policy.clone(),
            self.overflow,
        );
        Box::pin(async move {
            let response = match admit(req, &policy, overflow).await {
                Ok(req) => {
                    let busy = Busy::new(busy);
                    let response = hyper::service::Service::call(&app, req).await?;
                    return Ok(response.map(|body| Tracked {
                        body,
                        _busy: Some(busy),
                    }));
                }
                Err(refused) => refused,
            };
            Ok(response.map(|body| Tracked { body, _busy: None }))
        })
    }
}

/// The request with its whole body read, or the refusal to answer instead.
async fn admit(
    req: hyper::Request<hyper::body::Incoming>,
    policy: &Policy,
    overflow: bool,
) -> Result<hyper::Request<Body>, Response> {
    let refuse = |status: StatusCode, message: String| {
        let mut r = (policy.refusal)(status, message);
        if status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::PAYLOAD_TOO_LARGE {
            // The rest of an unread body would be taken for the next request.
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        r
    };
    let health = policy.health.contains(&req.uri().path());
    if overflow && !health {
        let mut r = refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the {} is serving its {} connections, its most; retry shortly",
                policy.name, policy.max_connections
            ),
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return Err(r);
    }
    if let Some(key) = &policy.key
        && !health
        && !bearer_matches(req.headers(), key)
        && !policy.also.as_ref().is_some_and(|also| {
            bearer(req.headers())
                .is_some_and(|t| std::str::from_utf8(t).is_ok_and(|t| also(t, req.uri().path())))
        })
    {
        let mut r = refuse(
            StatusCode::UNAUTHORIZED,
            "this server requires `Authorization: Bearer KEY` (the key it was started with)".into(),
        );
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return Err(r);
    }
    let too_large = || {
        refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request body is over the {}'s limit of {} bytes",
                policy.name, policy.max_body
            ),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > policy.max_body as u64) {
        return Err(too_large());
    }
    let (parts, body) = req.into_parts();
    let limited = http_body_util::Limited::new(body, policy.max_body);
    let bytes = match tokio::time::timeout(policy.body_timeout, limited.collect()).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => return Err(too_large()),
        Ok(Err(e)) => {
            return Err(refuse(
                StatusCode::BAD_REQUEST,
                format!("the request body could not be read: {e}"),
            ));
        }
        Err(_) => {
            return Err(refuse(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {:.1} s of its header",
                    policy.body_timeout.as_secs_f64()
                ),
            ));
        }
    };
    Ok(hyper::Request::from_parts(parts, Body::from(bytes)))
}

/// Whether `headers` carry the key: `Authorization: Bearer KEY` (the `openai` client's
/// `api_key`) or `X-API-Key: KEY` (the `tinker` SDK's), compared in time independent of
/// where the first difference lies.
fn bearer_matches(headers: &axum::http::HeaderMap, key: &str) -> bool {
    let Some(given) = bearer(headers) else {
        return false;
    };
    let want = key.as_bytes();
    given.len() == want.len() && given.iter().zip(want).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0
}

/// The token of `Authorization: Bearer TOKEN`, else of `X-API-Key: TOKEN`.
fn bearer(headers: &axum::http::HeaderMap) -> Option<&[u8]> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        .or_else(|| headers.get("x-api-key").map(|v| v.as_bytes()))
}

/// A refusal as plain text (the status server's shape).
pub fn plain(status: StatusCode, message: String) -> Response {
    (status, format!("{message}\n")).into_response()
}

/// One request being served; counted down when dropped.
struct Busy(Arc<AtomicUsize>);

impl Busy {
    fn new(count: Arc<AtomicUsize>) -> Busy {
        count.fetch_add(1, Ordering::AcqRel);
        Busy(count)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted while it is sent.
struct Tracked {
    body: Body,
    _busy: Option<Busy>,
}

impl hyper::body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_is_compared_whole() {
        let mut h = axum::http::HeaderMap::new();
        assert!(!bearer_matches(&h, "k3y"));
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer k3y"),
        );
        assert!(bearer_matches(&h, "k3y"));
        assert!(!bearer_matches(&h, "k3"));
        assert!(!bearer_matches(&h, "k3yy"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic k3y"));
        assert!(!bearer_matches(&h, "k3y"));
        let mut h = axum::http::HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("k3y"));
        assert!(bearer_matches(&h, "k3y"));
    }

    #[test]
    fn loopback_is_open_and_other_addresses_need_the_flag() {
        let check = |addr, public| check_exposure(addr, public, false, "--addr", "--public");
        assert!(check("127.0.0.1:0", false).is_ok());
        assert!(check("[::1]:0", false).is_ok());
        let e = check("0.0.0.0:8000", false).unwrap_err();
        assert!(e.to_string().contains("--public"), "{e}");
        assert!(check("0.0.0.0:8000", true).is_ok());
    }
}
