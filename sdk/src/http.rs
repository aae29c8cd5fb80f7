//! Outbound HTTP from a plugin, through `wasi:http` (so any WASI HTTP client works as
//! well). Nothing goes anywhere the run config does not grant: `[plugins.NAME] allow_http
//! = ["https://api.example.com", "http://127.0.0.1:8080"]`. A refused request is an
//! error naming wasi:http's code (`HttpRequestDenied`, `DestinationIpProhibited`,
//! `ConnectionLimitReached`, ...); bodies are capped and each request has a deadline
//! inside the call's (`max_http_bytes`, the plugin's `timeout_ms`). Redirects are not
//! followed: a 3xx comes back as it is, and a request to its `Location` is checked again.

use wasi::http::outgoing_handler;
use wasi::http::types::{
    ErrorCode, FutureIncomingResponse, Headers, IncomingResponse, Method, OutgoingBody,
    OutgoingRequest, Scheme,
};
use wasi::io::streams::StreamError;

/// A response: its status, headers and whole body.
#[derive(Debug, Clone, PartialEq)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    /// The first header called `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as text (invalid UTF-8 replaced).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// One request to send.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub method: String,
    pub url: String,
    pub headers: Vec<(String, String)>,
    pub body: Option<Vec<u8>>,
}

impl Request {
    pub fn get(url: &str) -> Request {
        Request {
            method: "GET".into(),
            url: url.into(),
            headers: Vec::new(),
            body: None,
        }
    }

    /// A POST of `json` with `content-type: application/json`.
    pub fn post_json(url: &str, json: &str) -> Request {
        Request {
            method: "POST".into(),
            url: url.into(),
            headers: vec![("content-type".into(), "application/json".into())],
            body: Some(json.as_bytes().to_vec()),
        }
    }
}

/// `GET url`.
pub fn get(url: &str) -> Result<Response, String> {
    send(Request::get(url))
}

/// Sends one request and reads its whole response.
pub fn send(request: Request) -> Result<Response, String> {
    send_all(vec![request])
        .pop()
        .expect("one request, one answer")
}

/// Sends every request at once (the host runs them concurrently, up to the plugin's
/// `max_http_in_flight`; one past it is refused), then reads each response in order.
pub fn send_all(requests: Vec<Request>) -> Vec<Result<Response, String>> {
    let pending: Vec<Result<FutureIncomingResponse, String>> = requests.iter().map(start).collect();
    pending
        .into_iter()
        .map(|p| p.and_then(|fut| read(wait(&fut)?)))
        .collect()
}

fn code(e: ErrorCode) -> String {
    format!("{e:?}")
}

/// Starts `r`: the request with its body written, handed to the host.
fn start(r: &Request) -> Result<FutureIncomingResponse, String> {
    let (scheme, rest) = r
        .url
        .split_once("://")
        .ok_or_else(|| format!("{}: not scheme://host/path", r.url))?;
    let scheme = match scheme.to_ascii_lowercase().as_str() {
        "http" => Scheme::Http,
        "https" => Scheme::Https,
        other => Scheme::Other(other.into()),
    };
    let (authority, path) = match rest.find(['/', '?']) {
        Some(i) if rest[i..].starts_with('/') => (&rest[..i], rest[i..].to_string()),
        Some(i) => (&rest[..i], format!("/{}", &rest[i..])),
        None => (rest, "/".to_string()),
    };
    let fields: Vec<(String, Vec<u8>)> = r
        .headers
        .iter()
        .map(|(n, v)| (n.clone(), v.as_bytes().to_vec()))
        .collect();
    let headers = Headers::from_list(&fields).map_err(|e| format!("headers: {e:?}"))?;
    let req = OutgoingRequest::new(headers);
    let method = match r.method.to_ascii_uppercase().as_str() {
        "GET" => Method::Get,
        "POST" => Method::Post,
        "PUT" => Method::Put,
        "DELETE" => Method::Delete,
        "HEAD" => Method::Head,
        "PATCH" => Method::Patch,
        "OPTIONS" => Method::Options,
        other => Method::Other(other.into()),
    };
    let bad = |what: &str| format!("{}: invalid {what}", r.url);
    req.set_method(&method).map_err(|_| bad("method"))?;
    req.set_scheme(Some(&scheme)).map_err(|_| bad("scheme"))?;
    req.set_authority(Some(authority))
        .map_err(|_| bad("authority"))?;
    req.set_path_with_query(Some(&path))
        .map_err(|_| bad("path"))?;
    let body = req.body().map_err(|_| bad("body"))?;
    let fut = outgoing_handler::handle(req, None).map_err(code)?;
    if let Some(bytes) = &r.body {
        let out = body.write().map_err(|_| bad("body"))?;
        for chunk in bytes.chunks(4096) {
            out.blocking_write_and_flush(chunk)
                .map_err(|e| stream_error(e, "request body"))?;
        }
    }
    OutgoingBody::finish(body, None).map_err(code)?;
    Ok(fut)
}

/// Waits for the response's headers.
fn wait(fut: &FutureIncomingResponse) -> Result<IncomingResponse, String> {
    loop {
        match fut.get() {
            Some(Ok(Ok(response))) => return Ok(response),
            Some(Ok(Err(e))) => return Err(code(e)),
            Some(Err(())) => return Err("the response was already taken".into()),
            None => fut.subscribe().block(),
        }
    }
}

/// Reads the status, headers and whole body.
fn read(response: IncomingResponse) -> Result<Response, String> {
    let status = response.status();
    let headers = response
        .headers()
        .entries()
        .into_iter()
        .map(|(n, v)| (n, String::from_utf8_lossy(&v).into_owned()))
        .collect();
    let incoming = response
        .consume()
        .map_err(|_| "the body was already taken".to_string())?;
    let stream = incoming
        .stream()
        .map_err(|_| "the body was already taken".to_string())?;
    let mut body = Vec::new();
    loop {
        match stream.blocking_read(64 << 10) {
            Ok(chunk) => body.extend_from_slice(&chunk),
            Err(StreamError::Closed) => break,
            Err(e) => return Err(stream_error(e, "response body")),
        }
    }
    Ok(Response {
        status,
        headers,
        body,
    })
}

fn stream_error(e: StreamError, what: &str) -> String {
    match e {
        StreamError::LastOperationFailed(err) => match wasi::http::types::http_error_code(&err) {
            Some(c) => code(c),
            None => format!("{what}: {}", err.to_debug_string()),
        },
        StreamError::Closed => format!("{what}: closed"),
    }
}
