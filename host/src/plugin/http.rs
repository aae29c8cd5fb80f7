//! Plugins' outbound HTTP (`wasi:http/outgoing-handler`), sent only as granted.
//!
//! Every request a plugin makes goes through [`HttpGate::send`], the `send_request` hook
//! of wasmtime-wasi-http (whose own sender is not built: it resolves and connects by name,
//! after any check). In order:
//!
//! 1. at most `max_in_flight` requests of the plugin at a time; one more is refused;
//! 2. the URL against the plugin's `allow_http` grants ([`super::net`]);
//! 3. the name resolved here, and every address checked: loopback, private and other
//!    special addresses only when a grant names them;
//! 4. the connection made to a checked address, never to the name again (no second
//!    lookup a hostile resolver could answer differently); TLS verified against the
//!    Mozilla roots for the name the plugin asked for;
//! 5. request and response bodies capped at `max_bytes` each (a declared length over it
//!    is refused before anything is sent), and the whole exchange, body included, inside
//!    `deadline`.
//!
//! Redirects are not followed here: a 3xx reaches the plugin as it is, and the request it
//! makes next is checked like any other. A refusal is an error code the plugin sees
//! (`HTTP-request-denied`, `destination-IP-prohibited`, `connection-limit-reached`, ...)
//! and one warning in the host's log naming the destination and the grant that would
//! allow it.

use super::fork::digest;
use super::net::{Denial, HttpGrants};
use super::tape::{Cue, Ending, Exchange, Piece, ResponseHead, Tape, lock};
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Limited};
use std::future::Future;
use std::hash::{DefaultHasher, Hasher};
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep, timeout_at};
use wasmtime_wasi_http::io::TokioIo;
use wasmtime_wasi_http::p2::bindings::http::types::{
    DnsErrorPayload, ErrorCode, FieldSizePayload, TlsAlertReceivedPayload,
};
use wasmtime_wasi_http::{Error, RequestOptions, WasiBody, WasiHttpHooks};

/// What a plugin may do over HTTP.
#[derive(Debug, Clone)]
pub struct HttpAccess {
    pub grants: HttpGrants,
    /// Cap on each request body and each response body, bytes.
    pub max_bytes: u64,
    /// For the whole of one request: connecting, sending, the response and its body.
    pub deadline: Duration,
    /// Requests of the plugin in flight at once (its instances together).
    pub max_in_flight: usize,
}

/// Counted per plugin.
#[derive(Debug, Default)]
pub struct HttpCounts {
    /// Requests that got a response.
    pub answered: AtomicU64,
    /// Refused by a grant, an address or the in-flight cap.
    pub denied: AtomicU64,
    /// Failed on the way: resolution, connection, TLS, a cap or the deadline.
    pub failed: AtomicU64,
}

/// One plugin's outbound HTTP: its access, its in-flight permits and its counts.
#[derive(Debug)]
pub struct HttpGate {
    /// `name@version` once the plugin has said who it is, its file's name before.
    plugin: std::sync::RwLock<String>,
    access: HttpAccess,
    in_flight: Arc<Semaphore>,
    pub counts: HttpCounts,
}

/// What the response future of the `send_request` hook resolves to.
pub type Sent = (
    http::Response<WasiBody>,
    Box<dyn Future<Output = Result<(), Error>> + Send>,
);

trait Stream: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Stream for T {}

impl HttpGate {
    pub fn new(plugin: &str, access: HttpAccess) -> Arc<HttpGate> {
        Arc::new(HttpGate {
            plugin: std::sync::RwLock::new(plugin.to_string()),
            in_flight: Arc::new(Semaphore::new(access.max_in_flight)),
            access,
            counts: HttpCounts::default(),
        })
    }

    pub fn access(&self) -> &HttpAccess {
        &self.access
    }

    /// The plugin's name in log lines.
    pub fn set_name(&self, id: &str) {
        if let Ok(mut name) = self.plugin.write() {
            *name = id.to_string();
        }
    }

    fn name(&self) -> String {
        self.plugin.read().map(|n| n.clone()).unwrap_or_default()
    }

    /// Sends `req` as the module header says, or refuses it.
    pub async fn send(
        self: Arc<Self>,
        req: http::Request<WasiBody>,
        options: Option<RequestOptions>,
    ) -> Result<Sent, Error> {
        let r = self.clone().send_checked(req, options).await;
        match &r {
            Ok(_) => self.counts.answered.fetch_add(1, Ordering::Relaxed),
            Err(Error::HttpRequestDenied)
            | Err(Error::DestinationIpProhibited)
            | Err(Error::ConnectionLimitReached) => {
                self.counts.denied.fetch_add(1, Ordering::Relaxed)
            }
            Err(_) => self.counts.failed.fetch_add(1, Ordering::Relaxed),
        };
        r
    }

    fn deny(&self, why: &Denial, code: Error) -> Error {
        tracing::warn!(target: "plugin", plugin = %self.name(), "{why}");
        code
    }

    async fn send_checked(
        self: Arc<Self>,
        mut req: http::Request<WasiBody>,
        options: Option<RequestOptions>,
    ) -> Result<Sent, Error> {
        // A plugin's own (shorter) timeouts apply inside ours.
        let own = options.and_then(|o| {
            [o.connect_timeout, o.first_byte_timeout]
                .into_iter()
                .flatten()
                .min()
        });
        let deadline =
            Instant::now() + own.map_or(self.access.deadline, |d| d.min(self.access.deadline));
        let Ok(permit) = self.in_flight.clone().try_acquire_owned() else {
            tracing::warn!(
                target: "plugin", plugin = %self.name(),
                "HTTP to {} refused: {} requests already in flight (the plugin's max_http_in_flight)",
                req.uri(), self.access.max_in_flight
            );
            return Err(Error::ConnectionLimitReached);
        };
        let uri = req.uri().clone();
        let scheme = uri.scheme_str().unwrap_or_default().to_ascii_lowercase();
        let host = uri.host().ok_or(Error::HttpRequestUriInvalid)?.to_string();
        let bare = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let port = match explicit_port(&uri) {
            Ok(port) => port.unwrap_or(if scheme == "https" { 443 } else { 80 }),
            Err(written) => {
                tracing::warn!(
                    target: "plugin", plugin = %self.name(),
                    "HTTP to {uri} refused: port `{written}` is not a port (1 to 65535)"
                );
                return Err(Error::HttpRequestUriInvalid);
            }
        };
        let grants = &self.access.grants;
        grants
            .check_url(&scheme, &host, port)
            .map_err(|d| self.deny(&d, Error::HttpRequestDenied))?;
        let max = self.access.max_bytes;
        if content_length(req.headers()).is_some_and(|n| n > max) {
            return Err(Error::HttpRequestBodySize(Some(max)));
        }
        let resolved: Vec<IpAddr> = match bare.parse::<IpAddr>() {
            Ok(ip) => vec![ip],
            Err(_) => {
                match timeout_at(deadline, tokio::net::lookup_host((bare.as_str(), port))).await {
                    Err(_) => return Err(Error::DnsTimeout),
                    Ok(Err(e)) => {
                        return Err(Error::DnsError {
                            rcode: Some(e.to_string()),
                            info_code: None,
                        });
                    }
                    Ok(Ok(addrs)) => addrs.map(|a| a.ip()).collect(),
                }
            }
        };
        let checked = grants
            .check_addresses(&scheme, &host, port, &resolved)
            .map_err(|d| self.deny(&d, Error::DestinationIpProhibited))?;
        let mut tcp = None;
        let mut last = None;
        for ip in checked {
            match timeout_at(deadline, TcpStream::connect((ip, port))).await {
                Err(_) => return Err(Error::ConnectionTimeout),
                Ok(Ok(s)) => {
                    tcp = Some(s);
                    break;
                }
                Ok(Err(e)) => last = Some(e),
            }
        }
        let tcp = tcp.ok_or_else(|| match last {
            Some(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                Error::ConnectionRefused
            }
            Some(e) => Error::Connect(e),
            None => Error::DestinationUnavailable,
        })?;
        let stream: Box<dyn Stream> = if scheme == "https" {
            Box::new(
                timeout_at(deadline, tls(&bare, tcp))
                    .await
                    .map_err(|_| Error::ConnectionTimeout)??,
            )
        } else {
            Box::new(tcp)
        };
        let (mut sender, conn) = timeout_at(
            deadline,
            hyper::client::conn::http1::handshake::<_, Capped<WasiBody>>(TokioIo::new(stream)),
        )
        .await
        .map_err(|_| Error::ConnectionTimeout)??;
        // On the wire the request line holds the path only (the authority went into Host).
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        *req.uri_mut() = http::Uri::try_from(path).map_err(|_| Error::HttpRequestUriInvalid)?;
        let req = req.map(|b| Capped::new(b, max, deadline, Side::Request, None));
        let mut conn = Box::pin(conn);
        let mut conn_done = false;
        let send = sender.send_request(req);
        tokio::pin!(send);
        let answer = timeout_at(deadline, async {
            loop {
                tokio::select! {
                    r = &mut send => break r.map_err(Error::from),
                    c = &mut conn, if !conn_done => {
                        conn_done = true;
                        if let Err(e) = c {
                            break Err(Error::from(e));
                        }
                    }
                }
            }
        })
        .await
        .map_err(|_| Error::HttpResponseTimeout)??;
        if content_length(answer.headers()).is_some_and(|n| n > max) {
            return Err(Error::HttpResponseBodySize(Some(max)));
        }
        let answer = answer
            .map(|b| Capped::new(b, max, deadline, Side::Response, Some(permit)).boxed_unsync());
        let io = async move {
            if conn_done {
                return Ok(());
            }
            // The connection ends with the response body, or at the deadline.
            match timeout_at(deadline, conn).await {
                Ok(r) => r.map_err(Error::from),
                Err(_) => Err(Error::HttpResponseTimeout),
            }
        };
        Ok((answer, Box::new(io)))
    }
}

/// The port a URL writes, if any, or `Err` with what it wrote when that is no port (1 to
/// 65535): `http` reads a port past 65535 as none at all, which would send the request to
/// the scheme's default port. An empty port (`host:`) is the default (RFC 3986).
fn explicit_port(uri: &http::Uri) -> Result<Option<u16>, String> {
    let Some(authority) = uri.authority() else {
        return Ok(None);
    };
    let host_port = authority.as_str().rsplit('@').next().unwrap_or_default();
    let after_host = match host_port.strip_prefix('[') {
        Some(v6) => v6.split_once(']').map_or("", |(_, rest)| rest),
        None => host_port,
    };
    match after_host.rsplit_once(':') {
        None | Some((_, "")) => Ok(None),
        Some((_, written)) => match written.parse::<u16>() {
            Ok(port) if port > 0 => Ok(Some(port)),
            _ => Err(written.to_string()),
        },
    }
}

/// A message's declared body length, when it declares one that reads as a number
/// (wasmtime-wasi-http has refused malformed ones in requests already).
fn content_length(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// TLS to `host` (a name or an IP address) over `tcp`, verified against the Mozilla roots.
async fn tls(
    host: &str,
    tcp: TcpStream,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, Error> {
    let roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.into(),
    };
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| Error::InternalError(Some(e.to_string())))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| Error::InternalError(Some(format!("TLS name {host}: {e}"))))?;
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(Error::Tls)
}

/// One instance's side of [`WasiHttpHooks`]: every request through its plugin's
/// [`HttpGate`], and its answer on the instance's [`Tape`] (a fork's replay is answered
/// from there instead).
pub struct GateHooks {
    pub gate: Arc<HttpGate>,
    pub tape: Arc<Tape>,
}

impl WasiHttpHooks for GateHooks {
    fn send_request(
        &mut self,
        request: http::Request<WasiBody>,
        options: Option<RequestOptions>,
        _fut: Box<dyn Future<Output = Result<(), Error>> + Send>,
    ) -> Box<dyn Future<Output = Result<Sent, Error>> + Send> {
        let head = digest(&(request.method(), request.uri(), request.headers()));
        match self.tape.http(head) {
            Cue::Live(Some(exchange)) => {
                Box::new(record(self.gate.clone(), request, options, exchange))
            }
            Cue::Live(None) => Box::new(self.gate.clone().send(request, options)),
            Cue::Replay(exchange) => Box::new(replay(
                self.gate.access.clone(),
                self.tape.clone(),
                request,
                exchange,
            )),
            Cue::Diverged(why) => Box::new(async move { Err(Error::InternalError(Some(why))) }),
        }
    }
}

/// Sends `request` through the gate, recording on `exchange` its body's digest, the
/// response and as much of the response body as the guest reads.
async fn record(
    gate: Arc<HttpGate>,
    request: http::Request<WasiBody>,
    options: Option<RequestOptions>,
    exchange: Arc<Mutex<Exchange>>,
) -> Result<Sent, Error> {
    /// Marks the exchange abandoned if the guest drops the response's future first.
    struct Abandoned(Option<Arc<Mutex<Exchange>>>);
    impl Drop for Abandoned {
        fn drop(&mut self) {
            if let Some(x) = self.0.take() {
                lock(&x).abandoned = true;
            }
        }
    }
    let mut guard = Abandoned(Some(exchange.clone()));
    let taping = Taping::Request(DefaultHasher::new());
    let request = request.map(|b| Taped::body(b, exchange.clone(), taping));
    let sent = gate.send(request, options).await;
    guard.0 = None;
    let mut x = lock(&exchange);
    match sent {
        Ok((response, io)) => {
            x.answer = Some(Ok(ResponseHead {
                status: response.status(),
                version: response.version(),
                headers: response.headers().clone(),
            }));
            drop(x);
            let response = response.map(|b| Taped::body(b, exchange.clone(), Taping::Response));
            Ok((response, io))
        }
        Err(e) => {
            x.answer = Some(Err(code_of(&e)));
            Err(e)
        }
    }
}

/// Answers a fork's replayed `request` as `exchange` recorded, once the request's body
/// (which the guest writes meanwhile) is in and matches the recorded one. A guest that
/// waits for the response before it ends its body gets the deadline's error, and the
/// fork is refused.
async fn replay(
    access: HttpAccess,
    tape: Arc<Tape>,
    request: http::Request<WasiBody>,
    exchange: Arc<Mutex<Exchange>>,
) -> Result<Sent, Error> {
    let x = lock(&exchange).clone();
    if x.abandoned {
        // The guest dropped this future the first time, and will again.
        return std::future::pending().await;
    }
    let body = request.into_body();
    // A body the first request sent in whole is read again and compared; one it did not
    // (refused before it was read, or cut off) is dropped unread, as it was then.
    if let Some(sent) = x.body {
        let deadline = Instant::now() + access.deadline;
        let read = timeout_at(
            deadline,
            Limited::new(body, access.max_bytes as usize).collect(),
        );
        let same = match read.await {
            Ok(Ok(collected)) => {
                let mut hash = DefaultHasher::new();
                hash.write(&collected.to_bytes());
                hash.finish() == sent
            }
            _ => false,
        };
        if !same {
            let why = "a replayed HTTP request's body was not the one recorded".to_string();
            tape.diverge(why.clone());
            return Err(Error::InternalError(Some(why)));
        }
    }
    match x.answer {
        None => Err(Error::InternalError(Some(
            "a replayed HTTP request had no recorded answer".into(),
        ))),
        Some(Err(code)) => Err(again(code)),
        Some(Ok(head)) => {
            let mut response = http::Response::new(
                Replayed {
                    frames: x.frames.into(),
                    end: x.end,
                }
                .boxed_unsync(),
            );
            *response.status_mut() = head.status;
            *response.version_mut() = head.version;
            *response.headers_mut() = head.headers;
            let io: Box<dyn Future<Output = Result<(), Error>> + Send> = Box::new(async { Ok(()) });
            Ok((response, io))
        }
    }
}

/// What a [`Taped`] body puts on its exchange.
enum Taping {
    /// A request body: the digest of its bytes, once it ends.
    Request(DefaultHasher),
    /// A response body: each frame the guest reads, and how it ended.
    Response,
}

/// A body passed on as it is, recorded on its exchange as it is read.
struct Taped {
    inner: WasiBody,
    exchange: Arc<Mutex<Exchange>>,
    taping: Taping,
}

impl Taped {
    /// `inner`, recorded on `exchange` as `taping` says.
    fn body(inner: WasiBody, exchange: Arc<Mutex<Exchange>>, taping: Taping) -> WasiBody {
        Taped {
            inner,
            exchange,
            taping,
        }
        .boxed_unsync()
    }
}

impl Body for Taped {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        let Poll::Ready(ready) = &polled else {
            return polled;
        };
        let this = &mut *self;
        let mut x = lock(&this.exchange);
        match (&mut this.taping, ready) {
            (Taping::Request(hash), Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    hash.write(data);
                }
            }
            (Taping::Request(hash), None) => x.body = Some(hash.finish()),
            (Taping::Request(_), Some(Err(_))) => {}
            (Taping::Response, Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    x.frames.push(Piece::Data(data.clone()));
                } else if let Some(trailers) = frame.trailers_ref() {
                    x.frames.push(Piece::Trailers(trailers.clone()));
                }
            }
            (Taping::Response, Some(Err(e))) => x.end = Some(Ending::Failed(code_of(e))),
            (Taping::Response, None) => x.end = Some(Ending::Complete),
        }
        drop(x);
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Taped {
    fn drop(&mut self) {
        if let Taping::Response = self.taping {
            lock(&self.exchange).end.get_or_insert(Ending::Dropped);
        }
    }
}

/// A recorded response body, given again.
struct Replayed {
    frames: std::collections::VecDeque<Piece>,
    end: Option<Ending>,
}

impl Body for Replayed {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        if let Some(piece) = self.frames.pop_front() {
            return Poll::Ready(Some(Ok(match piece {
                Piece::Data(data) => Frame::data(data),
                Piece::Trailers(trailers) => Frame::trailers(trailers),
            })));
        }
        Poll::Ready(match self.end.take() {
            Some(Ending::Complete) => None,
            Some(Ending::Failed(code)) => Some(Err(again(code))),
            // The guest stopped reading here the first time; it asks for no more.
            Some(Ending::Dropped) | None => Some(Err(Error::HttpResponseIncomplete)),
        })
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty() && matches!(self.end, Some(Ending::Complete))
    }
}

/// The error that the guest sees as `code` again: wasmtime-wasi-http's own conversion,
/// except for the one code it turns into a request's (48.0.8 maps a response header's
/// size to `HttpRequestHeaderSize`).
fn again(code: ErrorCode) -> Error {
    match code {
        ErrorCode::HttpResponseHeaderSize(p) => Error::HttpResponseHeaderSize {
            field_name: p.field_name,
            field_size: p.field_size,
        },
        code => Error::from(code),
    }
}

/// The error code the guest sees for `e`, as wasmtime-wasi-http turns it into one (with
/// the default hooks, which [`GateHooks`] keeps): what a replay gives again ([`again`]).
fn code_of(e: &Error) -> ErrorCode {
    use std::error::Error as _;
    let size = |field_name: &Option<String>, field_size: &Option<u32>| FieldSizePayload {
        field_name: field_name.clone(),
        field_size: *field_size,
    };
    let dns = |rcode: &str| {
        ErrorCode::DnsError(DnsErrorPayload {
            rcode: Some(rcode.to_string()),
            info_code: None,
        })
    };
    match e {
        Error::Hyper(err) => err
            .source()
            .and_then(|cause| cause.downcast_ref::<ErrorCode>())
            .cloned()
            .unwrap_or(ErrorCode::HttpProtocolError),
        Error::Connect(err) => {
            if err.kind() == std::io::ErrorKind::AddrNotAvailable
                || err
                    .to_string()
                    .starts_with("failed to lookup address information")
            {
                dns("address not available")
            } else {
                ErrorCode::ConnectionRefused
            }
        }
        Error::Tls(_) => ErrorCode::TlsProtocolError,
        Error::HttpRequestBodySize(n) => ErrorCode::HttpRequestBodySize(*n),
        Error::DnsTimeout => ErrorCode::DnsTimeout,
        Error::DnsError { rcode, info_code } => ErrorCode::DnsError(DnsErrorPayload {
            rcode: rcode.clone(),
            info_code: *info_code,
        }),
        Error::DestinationNotFound => ErrorCode::DestinationNotFound,
        Error::DestinationUnavailable => ErrorCode::DestinationUnavailable,
        Error::DestinationIpProhibited => ErrorCode::DestinationIpProhibited,
        Error::DestinationIpUnroutable => ErrorCode::DestinationIpUnroutable,
        Error::ConnectionRefused => ErrorCode::ConnectionRefused,
        Error::ConnectionTerminated => ErrorCode::ConnectionTerminated,
        Error::ConnectionTimeout => ErrorCode::ConnectionTimeout,
        Error::ConnectionReadTimeout => ErrorCode::ConnectionReadTimeout,
        Error::ConnectionWriteTimeout => ErrorCode::ConnectionWriteTimeout,
        Error::ConnectionLimitReached => ErrorCode::ConnectionLimitReached,
        Error::TlsProtocolError => ErrorCode::TlsProtocolError,
        Error::TlsCertificateError => ErrorCode::TlsCertificateError,
        Error::TlsAlertReceived {
            alert_id,
            alert_message,
        } => ErrorCode::TlsAlertReceived(TlsAlertReceivedPayload {
            alert_id: *alert_id,
            alert_message: alert_message.clone(),
        }),
        Error::HttpRequestDenied => ErrorCode::HttpRequestDenied,
        Error::HttpRequestLengthRequired => ErrorCode::HttpRequestLengthRequired,
        Error::HttpRequestMethodInvalid => ErrorCode::HttpRequestMethodInvalid,
        Error::HttpRequestUriInvalid => ErrorCode::HttpRequestUriInvalid,
        Error::HttpRequestUriTooLong => ErrorCode::HttpRequestUriTooLong,
        Error::HttpRequestHeaderSectionSize(n) => ErrorCode::HttpRequestHeaderSectionSize(*n),
        Error::HttpRequestHeaderSize {
            field_name,
            field_size,
        } => ErrorCode::HttpRequestHeaderSize(Some(size(field_name, field_size))),
        Error::HttpRequestTrailerSectionSize(n) => ErrorCode::HttpRequestTrailerSectionSize(*n),
        Error::HttpRequestTrailerSize {
            field_name,
            field_size,
        } => ErrorCode::HttpRequestTrailerSize(size(field_name, field_size)),
        Error::HttpResponseIncomplete => ErrorCode::HttpResponseIncomplete,
        Error::HttpResponseHeaderSectionSize(n) => ErrorCode::HttpResponseHeaderSectionSize(*n),
        Error::HttpResponseHeaderSize {
            field_name,
            field_size,
        } => ErrorCode::HttpResponseHeaderSize(size(field_name, field_size)),
        Error::HttpResponseBodySize(n) => ErrorCode::HttpResponseBodySize(*n),
        Error::HttpResponseTrailerSectionSize(n) => ErrorCode::HttpResponseTrailerSectionSize(*n),
        Error::HttpResponseTrailerSize {
            field_name,
            field_size,
        } => ErrorCode::HttpResponseTrailerSize(size(field_name, field_size)),
        Error::HttpResponseTransferCoding(c) => ErrorCode::HttpResponseTransferCoding(c.clone()),
        Error::HttpResponseContentCoding(c) => ErrorCode::HttpResponseContentCoding(c.clone()),
        Error::HttpResponseTimeout => ErrorCode::HttpResponseTimeout,
        Error::HttpUpgradeFailed => ErrorCode::HttpUpgradeFailed,
        Error::HttpProtocolError => ErrorCode::HttpProtocolError,
        Error::LoopDetected => ErrorCode::LoopDetected,
        Error::ConfigurationError => ErrorCode::ConfigurationError,
        Error::InternalError(text) => ErrorCode::InternalError(text.clone()),
        // `InvalidDnsNameError`, only made by wasmtime-wasi-http's own sender (not built
        // here), and what later versions add.
        other => ErrorCode::InternalError(Some(other.to_string())),
    }
}

#[derive(Clone, Copy, Debug)]
enum Side {
    Request,
    Response,
}

/// A body cut off with an error past `max` bytes or `deadline`; holds the plugin's
/// in-flight permit (a response's) until it ends.
struct Capped<B> {
    inner: B,
    seen: u64,
    max: u64,
    deadline: Pin<Box<Sleep>>,
    side: Side,
    permit: Option<OwnedSemaphorePermit>,
}

impl<B> Capped<B> {
    fn new(
        inner: B,
        max: u64,
        deadline: Instant,
        side: Side,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Self {
        Capped {
            inner,
            seen: 0,
            max,
            deadline: Box::pin(tokio::time::sleep_until(deadline)),
            side,
            permit,
        }
    }

    fn too_big(&self) -> Error {
        match self.side {
            Side::Request => Error::HttpRequestBodySize(Some(self.max)),
            Side::Response => Error::HttpResponseBodySize(Some(self.max)),
        }
    }
}

impl<B> Body for Capped<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Error>,
{
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        if self.deadline.as_mut().poll(cx).is_ready() {
            self.permit = None;
            return Poll::Ready(Some(Err(match self.side {
                Side::Request => Error::ConnectionWriteTimeout,
                Side::Response => Error::HttpResponseTimeout,
            })));
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.seen += data.len() as u64;
                    if self.seen > self.max {
                        self.permit = None;
                        return Poll::Ready(Some(Err(self.too_big())));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                self.permit = None;
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Ready(None) => {
                self.permit = None;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{Empty, Full};
    use std::sync::atomic::AtomicUsize;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A real HTTP/1.1 server on loopback: `/ok`, `/big` (2 MiB, chunked, no length),
    /// `/big-declared` (a 2 MiB Content-Length), `/slow` (answers after 3 s), `/redirect`
    /// (302 to `localhost` on the same port). Counts the connections it accepts.
    async fn server() -> (u16, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut sock, _)) = listener.accept().await else {
                    return;
                };
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match sock.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let text = String::from_utf8_lossy(&head).to_string();
                    let path = text.split_whitespace().nth(1).unwrap_or("/").to_string();
                    let reply: Vec<u8> = match path.as_str() {
                        "/ok" => b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello".to_vec(),
                        "/redirect" => format!(
                            "HTTP/1.1 302 Found\r\nLocation: http://localhost:{port}/ok\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                        )
                        .into_bytes(),
                        "/big-declared" => b"HTTP/1.1 200 OK\r\nContent-Length: 2097152\r\nConnection: close\r\n\r\n".to_vec(),
                        "/big" => {
                            let mut r = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".to_vec();
                            for _ in 0..32 {
                                r.extend_from_slice(b"10000\r\n");
                                r.extend(std::iter::repeat_n(b'x', 0x10000));
                                r.extend_from_slice(b"\r\n");
                            }
                            r.extend_from_slice(b"0\r\n\r\n");
                            r
                        }
                        "/slow" => {
                            tokio::time::sleep(Duration::from_secs(3)).await;
                            b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nConnection: close\r\n\r\nlate".to_vec()
                        }
                        _ => b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec(),
                    };
                    let _ = sock.write_all(&reply).await;
                    let _ = sock.shutdown().await;
                });
            }
        });
        (port, accepted)
    }

    fn gate(
        entries: &[String],
        max_bytes: u64,
        deadline_ms: u64,
        max_in_flight: usize,
    ) -> Arc<HttpGate> {
        HttpGate::new(
            "test",
            HttpAccess {
                grants: HttpGrants::parse(entries).unwrap(),
                max_bytes,
                deadline: Duration::from_millis(deadline_ms),
                max_in_flight,
            },
        )
    }

    fn get(url: &str) -> http::Request<WasiBody> {
        let body = Empty::<Bytes>::new()
            .map_err(|never| match never {})
            .boxed_unsync();
        http::Request::get(url).body(body).unwrap()
    }

    /// Sends and reads the whole body, driving the connection as wasmtime-wasi-http does.
    async fn fetch(
        g: &Arc<HttpGate>,
        req: http::Request<WasiBody>,
    ) -> Result<(u16, Vec<u8>, http::HeaderMap), Error> {
        let (res, io) = g.clone().send(req, None).await?;
        tokio::spawn(Pin::from(io));
        let status = res.status().as_u16();
        let headers = res.headers().clone();
        let body = res.into_body().collect().await?.to_bytes().to_vec();
        Ok((status, body, headers))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn granted_requests_go_through_and_others_never_connect() {
        let (port, accepted) = server().await;
        let g = gate(&[format!("http://127.0.0.1:{port}")], 1 << 20, 5000, 4);
        let (status, body, _) = fetch(&g, get(&format!("http://127.0.0.1:{port}/ok")))
            .await
            .unwrap();
        assert_eq!((status, body.as_slice()), (200, b"hello".as_slice()));
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        // Another port, and the same server by a name the grant does not give.
        for url in [
            format!("http://127.0.0.1:{}/ok", port.wrapping_add(1)),
            format!("http://localhost:{port}/ok"),
        ] {
            let err = fetch(&g, get(&url)).await.unwrap_err();
            assert!(matches!(err, Error::HttpRequestDenied), "{url}: {err:?}");
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "a denied request never connects"
        );
        assert_eq!(g.counts.answered.load(Ordering::Relaxed), 1);
        assert_eq!(g.counts.denied.load(Ordering::Relaxed), 2);
        // No grants at all: nothing goes anywhere.
        let none = gate(&[], 1 << 20, 5000, 4);
        let err = fetch(&none, get(&format!("http://127.0.0.1:{port}/ok")))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::HttpRequestDenied));
    }

    /// Issue 51: `http://127.0.0.1:65616/` was sent to port 80 (the URL's port past 65535
    /// read as none). A port that is no port is an invalid URL, refused before any
    /// connection, whatever the grant.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_port_past_65535_is_an_invalid_url() {
        let (port, accepted) = server().await;
        let g = gate(&["http://127.0.0.1:*".to_string()], 1 << 20, 5000, 4);
        for url in [
            format!("http://127.0.0.1:{}/ok", u32::from(port) + 65536),
            "http://127.0.0.1:65616/ok".to_string(),
            "http://127.0.0.1:99999999999/ok".to_string(),
            "http://127.0.0.1:0/ok".to_string(),
        ] {
            let err = fetch(&g, get(&url)).await.unwrap_err();
            assert!(
                matches!(err, Error::HttpRequestUriInvalid),
                "{url}: {err:?}"
            );
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 0);
        // Ports written in full, or left empty (the default), are read as written.
        let uri = |u: &str| u.parse::<http::Uri>().unwrap();
        assert_eq!(explicit_port(&uri("http://[::1]:8080/")), Ok(Some(8080)));
        assert_eq!(explicit_port(&uri("http://[::1]/")), Ok(None));
        assert_eq!(explicit_port(&uri("http://a:b@h:81/")), Ok(Some(81)));
        assert_eq!(explicit_port(&uri("http://h:/")), Ok(None));
        assert_eq!(
            explicit_port(&uri("http://[::1]:70000/")),
            Err("70000".into())
        );
        let (status, _, _) = fetch(&g, get(&format!("http://127.0.0.1:{port}/ok")))
            .await
            .unwrap();
        assert_eq!(status, 200);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_name_resolving_to_loopback_needs_a_grant_naming_it() {
        let (port, accepted) = server().await;
        let any = gate(&[format!("http://*:{port}")], 1 << 20, 5000, 4);
        let err = fetch(&any, get(&format!("http://localhost:{port}/ok")))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::DestinationIpProhibited), "{err:?}");
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            0,
            "checked before connecting"
        );
        let named = gate(&[format!("http://localhost:{port}")], 1 << 20, 5000, 4);
        let (status, _, _) = fetch(&named, get(&format!("http://localhost:{port}/ok")))
            .await
            .unwrap();
        assert_eq!(status, 200);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_redirect_is_the_plugins_to_follow_and_is_checked_again() {
        let (port, accepted) = server().await;
        let g = gate(&[format!("http://127.0.0.1:{port}")], 1 << 20, 5000, 4);
        let (status, _, headers) = fetch(&g, get(&format!("http://127.0.0.1:{port}/redirect")))
            .await
            .unwrap();
        assert_eq!(status, 302, "not followed by the host");
        let to = headers[http::header::LOCATION]
            .to_str()
            .unwrap()
            .to_string();
        assert_eq!(to, format!("http://localhost:{port}/ok"));
        let err = fetch(&g, get(&to)).await.unwrap_err();
        assert!(matches!(err, Error::HttpRequestDenied), "{err:?}");
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bodies_past_the_cap_are_cut_off() {
        let (port, _) = server().await;
        let g = gate(&[format!("http://127.0.0.1:{port}")], 1 << 20, 5000, 4);
        // A response streamed without a length: cut off at the cap.
        let err = fetch(&g, get(&format!("http://127.0.0.1:{port}/big")))
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::HttpResponseBodySize(Some(n)) if n == 1 << 20),
            "{err:?}"
        );
        // A declared length over the cap: refused on the headers.
        let err = fetch(&g, get(&format!("http://127.0.0.1:{port}/big-declared")))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::HttpResponseBodySize(_)), "{err:?}");
        // A request body declared over the cap is not sent.
        let body = Full::new(Bytes::from(vec![b'y'; 2 << 20]))
            .map_err(|never| match never {})
            .boxed_unsync();
        let req = http::Request::post(format!("http://127.0.0.1:{port}/ok"))
            .header(http::header::CONTENT_LENGTH, 2 << 20)
            .body(body)
            .unwrap();
        let err = fetch(&g, req).await.unwrap_err();
        assert!(matches!(err, Error::HttpRequestBodySize(_)), "{err:?}");
        // Within the cap it is.
        let (status, body, _) = fetch(&g, get(&format!("http://127.0.0.1:{port}/ok")))
            .await
            .unwrap();
        assert_eq!((status, body.len()), (200, 5));
    }

    /// HTTPS is verified: a server whose certificate no Mozilla root signed (the
    /// self-signed one in tests/fixtures/tls) is refused in the handshake, before the
    /// request is sent.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn https_refuses_a_certificate_no_root_signed() {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tls");
        let cert = CertificateDer::from_pem_file(dir.join("cert.pem")).unwrap();
        let key = PrivateKeyDer::from_pem_file(dir.join("key.pem")).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let served = Arc::new(AtomicUsize::new(0));
        let count = served.clone();
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                let (acceptor, count) = (acceptor.clone(), count.clone());
                tokio::spawn(async move {
                    if let Ok(mut tls) = acceptor.accept(sock).await {
                        count.fetch_add(1, Ordering::SeqCst);
                        let _ = tls
                            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi")
                            .await;
                    }
                });
            }
        });
        for host in ["127.0.0.1", "localhost"] {
            let g = gate(&[format!("https://{host}:{port}")], 1 << 20, 5000, 4);
            let err = fetch(&g, get(&format!("https://{host}:{port}/ok")))
                .await
                .unwrap_err();
            assert!(matches!(err, Error::Tls(_)), "{host}: {err:?}");
            assert!(
                format!("{err:?}").contains("UnknownIssuer"),
                "{host}: {err:?}"
            );
        }
        assert_eq!(served.load(Ordering::SeqCst), 0, "no request got through");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slow_server_meets_the_deadline_and_a_flood_meets_the_cap() {
        let (port, _) = server().await;
        let g = gate(&[format!("http://127.0.0.1:{port}")], 1 << 20, 400, 2);
        let t = std::time::Instant::now();
        let err = fetch(&g, get(&format!("http://127.0.0.1:{port}/slow")))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::HttpResponseTimeout), "{err:?}");
        let took = t.elapsed();
        assert!(took < Duration::from_secs(2), "gave up after {took:?}");
        // Two slow requests hold both permits; a third is refused at once.
        let slow = |g: Arc<HttpGate>| {
            tokio::spawn(
                async move { fetch(&g, get(&format!("http://127.0.0.1:{port}/slow"))).await },
            )
        };
        let (a, b) = (slow(g.clone()), slow(g.clone()));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let err = fetch(&g, get(&format!("http://127.0.0.1:{port}/ok")))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::ConnectionLimitReached), "{err:?}");
        assert!(a.await.unwrap().is_err() && b.await.unwrap().is_err());
        // Their permits came back when they timed out.
        let (status, _, _) = fetch(&g, get(&format!("http://127.0.0.1:{port}/ok")))
            .await
            .unwrap();
        assert_eq!(status, 200);
        assert_eq!(g.counts.denied.load(Ordering::Relaxed), 1);
        assert_eq!(g.counts.failed.load(Ordering::Relaxed), 3);
    }
}
