//! Remote engines against servers that misbehave (issue 51): a fault-injecting HTTP proxy
//! in front of a server that answers the OpenAI completions shape, one fault per mode, and
//! the outcome each must have. The book's table (docs/src/troubleshooting.md, "vLLM
//! servers", "A server that answers what no server can") lists the same modes and
//! outcomes.
//!
//! The server behind the proxy is [`TinyServer`], a real HTTP server on loopback written
//! for these tests: it answers `/v1/completions` greedily from rlhost's own model (the
//! fixture Qwen2, which a vLLM CPU server cannot load: its head size is 16), so that the
//! run's start-up checks pass on its true log-probs and only the injected fault differs
//! from an honest server. [`FaultProxy`] forwards to any base URL, a real vLLM server
//! included, and knows nothing of the server behind it but the completions shape: a
//! future remote engine (SGLang, the gateway's clients) reuses it with its own
//! [`Fault`] mutations.

use rlhost::model::{LanguageModel, Mode, Placement};
use rlhost_tests::{fixture_countdown, temp_dir};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One HTTP/1.1 request as read off a socket: method, path and body.
struct Incoming {
    method: String,
    path: String,
    body: Vec<u8>,
}

/// Reads one request (a `Content-Length` body, as ureq sends it).
fn read_request(sock: &TcpStream) -> Option<Incoming> {
    let mut r = BufReader::new(sock);
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next()?.to_string(), parts.next()?.to_string());
    let mut length = 0;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).ok()?;
        if h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            length = v.trim().parse().ok()?;
        }
    }
    let mut body = vec![0; length];
    r.read_exact(&mut body).ok()?;
    Some(Incoming { method, path, body })
}

/// A complete answer with `status` and a JSON or text body; the connection closes after.
fn reply(status: u16, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// Serves `handle` on a fresh loopback port, a thread per connection; returns the port.
fn serve(handle: impl Fn(TcpStream) + Send + Sync + 'static) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let handle = Arc::new(handle);
    std::thread::spawn(move || {
        for sock in listener.incoming().flatten() {
            let handle = handle.clone();
            std::thread::spawn(move || handle(sock));
        }
    });
    port
}

/// An honest completions server on loopback: `/v1/models` lists `NAME` with its context,
/// `/v1/completions` samples greedily from the model (stopping at the request's stop ids
/// or `max_tokens`) and returns each id's log-prob under softmax(logits / T), as vLLM's
/// `processed_logprobs` does; adapter loads and unloads are accepted (the tests sample
/// with the base weights, which a fresh adapter leaves unchanged).
struct TinyServer;

impl TinyServer {
    const NAME: &str = "fixture";

    /// The server's base URL.
    fn start() -> String {
        let dir = rlhost_tests::repo_root().join("tests/fixtures/models/qwen2");
        let lm = Arc::new(Mutex::new(
            LanguageModel::open(&dir, &Placement::CPU).expect("the fixture model"),
        ));
        let port = serve(move |mut sock| {
            let Some(req) = read_request(&sock) else {
                return;
            };
            let answer = match (req.method.as_str(), req.path.as_str()) {
                ("GET", "/v1/models") => reply(
                    200,
                    json!({"data": [{"id": Self::NAME, "max_model_len": 4096}]})
                        .to_string()
                        .as_bytes(),
                ),
                ("POST", "/v1/completions") => {
                    let body: Value = serde_json::from_slice(&req.body).unwrap();
                    let lm = lm.lock().unwrap_or_else(|e| e.into_inner());
                    reply(200, complete(&lm, &body).to_string().as_bytes())
                }
                ("POST", "/v1/load_lora_adapter" | "/v1/unload_lora_adapter") => {
                    reply(200, b"Success")
                }
                _ => reply(404, br#"{"detail":"Not Found"}"#),
            };
            let _ = sock.write_all(&answer);
        });
        format!("http://127.0.0.1:{port}")
    }
}

/// A `/v1/completions` answer to `body`, greedy from `lm`.
fn complete(lm: &LanguageModel, body: &Value) -> Value {
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .map(|a| a.iter().map(|t| t.as_u64().unwrap() as u32).collect())
            .unwrap_or_default()
    };
    let prompt = ids(&body["prompt"]);
    let stops = ids(&body["stop_token_ids"]);
    let max_tokens = body["max_tokens"].as_u64().unwrap() as usize;
    let t = body["temperature"].as_f64().unwrap_or(1.0) as f32;
    let t = if t > 0.0 { t } else { 1.0 };
    let mut cache = lm.model.new_cache();
    let mut next: Vec<u32> = prompt.clone();
    let (mut token_ids, mut logprobs, mut finish) = (Vec::new(), Vec::new(), "length");
    while token_ids.len() < max_tokens {
        let logits = lm
            .model
            .forward_cached(&mut [&mut cache], &[next.as_slice()], Mode::BASE, false)
            .unwrap();
        let row: Vec<f32> = logits.to_vec2::<f32>().unwrap().remove(0);
        let tok = (0..row.len())
            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
            .unwrap();
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x / t));
        let sum: f64 = row.iter().map(|&x| ((x / t - max) as f64).exp()).sum();
        logprobs.push(row[tok] / t - max - sum.ln() as f32);
        token_ids.push(tok as u32);
        if stops.contains(&(tok as u32)) {
            finish = "stop";
            break;
        }
        next = vec![tok as u32];
    }
    json!({"choices": [{
        "index": 0, "text": "", "token_ids": token_ids, "prompt_token_ids": prompt,
        "logprobs": {"token_logprobs": logprobs}, "finish_reason": finish,
    }]})
}

/// What the proxy does to a completion request it faults.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// The first id plus 2^32 (once narrowed to the id itself).
    IdPast32Bits,
    /// The first id replaced by one far outside the vocabulary.
    IdOutsideVocab,
    /// The first log-prob `null`, as JSON writes a NaN or an infinity.
    NullLogprob,
    /// The first log-prob positive.
    PositiveLogprob,
    /// One log-prob fewer than ids.
    CountMismatch,
    /// Status 200 with JSON cut off mid-way.
    TruncatedJson,
    /// A 50 MB body.
    HugeBody,
    /// 500 with a message.
    Status500,
    /// The connection reset without an answer.
    Reset,
    /// No answer, ever (the connection stays open).
    Hang,
}

/// A fault-injecting HTTP proxy in front of `upstream`: every request is forwarded, and
/// of the completion requests after the first `spare` (the start-up checks' probe), the
/// first `times` are faulted (`usize::MAX`: all).
struct FaultProxy {
    url: String,
    faulted: Arc<AtomicUsize>,
}

impl FaultProxy {
    fn start(upstream: &str, fault: Fault, spare: usize, times: usize) -> FaultProxy {
        let upstream = upstream.to_string();
        let completions = Arc::new(AtomicUsize::new(0));
        let faulted = Arc::new(AtomicUsize::new(0));
        let count = faulted.clone();
        let port = serve(move |mut sock| {
            let Some(req) = read_request(&sock) else {
                return;
            };
            let n = match req.path.as_str() {
                "/v1/completions" => completions.fetch_add(1, Ordering::SeqCst),
                _ => 0,
            };
            let fault =
                (req.path == "/v1/completions" && n >= spare && n - spare < times).then_some(fault);
            if fault.is_some() {
                count.fetch_add(1, Ordering::SeqCst);
            }
            match fault {
                Some(Fault::Reset) => {
                    reset(&sock);
                    return;
                }
                Some(Fault::Hang) => {
                    std::thread::sleep(Duration::from_secs(600));
                    return;
                }
                Some(Fault::Status500) => {
                    let _ = sock.write_all(&reply(
                        500,
                        br#"{"error":{"message":"injected: EngineCore died","code":500}}"#,
                    ));
                    return;
                }
                Some(Fault::HugeBody) => {
                    let mut body = br#"{"choices":[{"text":""#.to_vec();
                    body.resize(50_000_000, b'x');
                    body.extend_from_slice(br#""}]}"#);
                    let _ = sock.write_all(&reply(200, &body));
                    return;
                }
                _ => {}
            }
            let (status, body) = forward(&upstream, &req);
            let body = match fault {
                Some(f) => mutate(f, body),
                None => body,
            };
            let _ = sock.write_all(&reply(status, &body));
        });
        FaultProxy {
            url: format!("http://127.0.0.1:{port}"),
            faulted,
        }
    }

    /// Completion requests faulted so far.
    fn faulted(&self) -> usize {
        self.faulted.load(Ordering::SeqCst)
    }
}

/// Closes `sock` with a TCP reset (SO_LINGER 0), as a crashed server's kernel does.
fn reset(sock: &TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket and a correctly sized option value.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

/// Sends `req` on to `upstream`: its status and body.
fn forward(upstream: &str, req: &Incoming) -> (u16, Vec<u8>) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let url = format!("{upstream}{}", req.path);
    let mut resp = if req.method == "GET" {
        agent.get(&url).call().unwrap()
    } else {
        agent
            .post(&url)
            .header("content-type", "application/json")
            .send(&req.body[..])
            .unwrap()
    };
    let status = resp.status().as_u16();
    (status, resp.body_mut().read_to_vec().unwrap())
}

/// A completion answer with `fault` injected.
fn mutate(fault: Fault, body: Vec<u8>) -> Vec<u8> {
    if let Fault::TruncatedJson = fault {
        return body[..body.len() / 2].to_vec();
    }
    let mut v: Value = serde_json::from_slice(&body).unwrap();
    let choice = &mut v["choices"][0];
    let first = choice["token_ids"][0].as_u64().unwrap();
    match fault {
        Fault::IdPast32Bits => choice["token_ids"][0] = json!(first + (1u64 << 32)),
        Fault::IdOutsideVocab => choice["token_ids"][0] = json!(1_000_000),
        Fault::NullLogprob => choice["logprobs"]["token_logprobs"][0] = Value::Null,
        Fault::PositiveLogprob => choice["logprobs"]["token_logprobs"][0] = json!(0.7),
        Fault::CountMismatch => {
            choice["logprobs"]["token_logprobs"]
                .as_array_mut()
                .unwrap()
                .pop();
        }
        _ => unreachable!("answered by the proxy itself"),
    }
    v.to_string().into_bytes()
}

/// The upstream all tests share: one fixture model loaded once.
fn upstream() -> &'static str {
    static URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    URL.get_or_init(TinyServer::start)
}

/// `rlhost rollout` of the fixture countdown config (2 prompts × 4) sampled by `server`,
/// and the trajectories it wrote.
fn rollout(server: &str, name: &str, timeout_s: u64) -> (rlhost_tests::Ran, usize) {
    let dir = temp_dir(name);
    let ran = fixture_countdown("rollout")
        .args(["--prompts", "2", "--show", "0", "--set"])
        .arg("rollout.engine=\"vllm\"")
        .arg("--set")
        .arg(format!("rollout.vllm.servers=[\"{server}\"]"))
        .arg("--set")
        .arg(format!("rollout.vllm.model=\"{}\"", TinyServer::NAME))
        .arg("--set")
        .arg(format!("rollout.vllm.timeout_s={timeout_s}"))
        .arg("--out")
        .arg(dir.join("out.jsonl"))
        .run();
    let written = std::fs::read_to_string(dir.join("out.jsonl")).map_or(0, |t| t.lines().count());
    (ran, written)
}

/// The run failed with one error line that names the server and says `why`.
fn fails_naming(ran: &rlhost_tests::Ran, server: &str, why: &str) {
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    let last = ran.stderr.trim().lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error") && last.contains(server) && last.contains(why),
        "the last line should name {server} and say {why:?}:\n{}",
        ran.stderr
    );
}

/// The honest server passes the start-up checks and samples the batch: the proxy is
/// transparent until it faults.
#[test]
fn an_honest_server_behind_the_proxy_samples_the_batch() {
    let proxy = FaultProxy::start(upstream(), Fault::Status500, 1, 0);
    let (ran, written) = rollout(&proxy.url, "faults-honest", 30);
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(written, 8);
    assert!(
        ran.stdout.contains("(0 sent again after a fault)"),
        "{}",
        ran.stdout
    );
}

/// Answers no server can give (ids past 32 bits or outside the vocabulary, log-probs that
/// are null, positive, or fewer than the ids, JSON cut off, 50 MB) are refused, on every
/// try: the run stops with one line naming the server and what was wrong, nothing of the
/// answer trained on or written.
#[test]
fn a_server_answering_the_impossible_is_refused_by_name() {
    for (fault, why) in [
        (
            Fault::IdPast32Bits,
            "is outside the trainer's vocabulary (0..512)",
        ),
        (Fault::IdOutsideVocab, "token id 1000000 is outside"),
        (
            Fault::NullLogprob,
            "is null, not a finite number of at most 0",
        ),
        (
            Fault::PositiveLogprob,
            "is 0.7, not a finite number of at most 0",
        ),
        (Fault::CountMismatch, "log-probs"),
        (Fault::TruncatedJson, "the answer is not JSON"),
        (Fault::HugeBody, "the answer is larger than"),
    ] {
        let proxy = FaultProxy::start(upstream(), fault, 1, usize::MAX);
        let (ran, written) = rollout(&proxy.url, &format!("faults-{fault:?}"), 30);
        fails_naming(&ran, &proxy.url, why);
        assert_eq!(written, 0, "{fault:?}");
        assert!(
            ran.stderr.contains("on each of 4 tries"),
            "{fault:?}: {}",
            ran.stderr
        );
        // The 2^32 + id of the first mode is never read as the id.
        if let Fault::IdPast32Bits = fault {
            assert!(ran.stderr.contains("token id 42949"), "{}", ran.stderr);
        }
    }
}

/// A 500 or a reset connection once is sent again and the batch finishes, the retry
/// counted; a server that answers 500 every time is taken out after a few tries, the
/// run's last line naming it and its message.
#[test]
fn a_transient_fault_is_retried_and_a_lasting_one_named() {
    for fault in [Fault::Status500, Fault::Reset] {
        let proxy = FaultProxy::start(upstream(), fault, 1, 1);
        let (ran, written) = rollout(&proxy.url, &format!("faults-once-{fault:?}"), 30);
        assert_eq!(ran.code, Some(0), "{fault:?}: {}", ran.stderr);
        assert_eq!(proxy.faulted(), 1);
        assert!(
            ran.stdout.contains("(1 sent again after a fault)"),
            "{fault:?}: {}",
            ran.stdout
        );
        assert_eq!(written, 8);
    }
    let proxy = FaultProxy::start(upstream(), Fault::Status500, 1, usize::MAX);
    let (ran, _) = rollout(&proxy.url, "faults-500-always", 30);
    fails_naming(
        &ran,
        &proxy.url,
        "answered 500: injected: EngineCore died (on each of 4 tries)",
    );
    let proxy = FaultProxy::start(upstream(), Fault::Reset, 1, usize::MAX);
    let (ran, _) = rollout(&proxy.url, "faults-reset-always", 30);
    fails_naming(&ran, &proxy.url, "connection failed");
}

/// A server that never answers is taken out after `timeout_s`, not tried again (the
/// request already waited), the last line naming it and the limit.
#[test]
fn a_hanging_server_is_named_with_the_limit() {
    let proxy = FaultProxy::start(upstream(), Fault::Hang, 1, usize::MAX);
    let (ran, _) = rollout(&proxy.url, "faults-hang", 2);
    fails_naming(
        &ran,
        &proxy.url,
        "no answer in 2 s (rollout.vllm.timeout_s)",
    );
    assert!(!ran.stderr.contains("tries"), "{}", ran.stderr);
}
