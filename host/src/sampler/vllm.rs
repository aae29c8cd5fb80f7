//! vLLM servers as a rollout sampler, driven token-in/token-out.
//!
//! Each assistant turn of a trajectory is one `POST /v1/completions` whose `prompt` is the
//! trajectory's whole id list so far; the answer's `token_ids` and per-token log-probs are
//! the truth (never re-tokenized text). `/v1/completions` rather than
//! `/inference/v1/generate`: it needs no extra server flag (`--enable-scale-out`), takes
//! the stop strings, stop ids, seed and `n` in one place, and returns the same ids and
//! log-probs for the same seed (measured, see the README).
//!
//! The servers are a [`Pool`]: a trajectory's requests go to one server while it answers
//! (its prefix cache holds the trajectory), new trajectories to the least loaded one, at
//! most `max_in_flight` requests each. Adapters are written in PEFT's format and loaded
//! under a new name per version (`NAME-rlhost-RUN-vN`): the prefix cache is keyed by
//! adapter name, so a reused name would mix two policies' keys and values (vllm#42125).
//! Versions older than the staleness bound allows are unloaded once no request uses them.
//!
//! Nothing a server answers is trusted: an answer whose ids fall outside the trainer's
//! vocabulary (or past `u32`), whose log-probs are not finite or above 0, that holds more
//! ids than asked for, that is not JSON or that is larger than its request can explain is
//! refused as malformed, naming the server. A request that fails in a way the server may
//! get over (a 5xx, a reset connection, a malformed answer) is sent again a few times with
//! back-off ([`RETRIES`], counted); a server that keeps failing, or that does not answer
//! in time, is taken out, and the error that ends a run for want of servers names the
//! last one and why.

use crate::model::{LanguageModel, Mode, peft};
use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Value as Json, json};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `[rollout.vllm]` resolved: where the servers are and how to use them.
#[derive(Debug, Clone)]
pub struct VllmSettings {
    /// Base URLs, e.g. `http://127.0.0.1:8000`.
    pub servers: Vec<String>,
    /// The served base model's name (`--served-model-name`).
    pub model: String,
    /// Where rlhost writes adapters for the servers to read.
    pub adapter_dir: PathBuf,
    /// The same folder as the servers see it, when that differs.
    pub server_adapter_dir: Option<String>,
    /// Per request; a server that takes longer is taken for dead.
    pub timeout: Duration,
    /// Requests in flight per server.
    pub max_in_flight: usize,
    /// Adapter versions kept loaded: `max_staleness + 2`.
    pub keep_versions: u64,
}

/// A request's failure: the server's own message where it gave one.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The server could not be reached, or the connection failed: try another.
    #[error("{url}: {message}")]
    Unreachable { url: String, message: String },
    /// The server did not answer in time: try another.
    #[error("{url}: {message}")]
    TimedOut { url: String, message: String },
    /// The server answered with an error status: its message.
    #[error("{url} answered {status}: {message}")]
    Refused {
        url: String,
        status: u16,
        message: String,
    },
    /// The server answered 200 with something that is not a completion.
    #[error("{url}: malformed answer ({message})")]
    Malformed { url: String, message: String },
}

impl RequestError {
    /// Whether another server may succeed where this one failed.
    pub fn server_fault(&self) -> bool {
        match self {
            RequestError::Unreachable { .. }
            | RequestError::TimedOut { .. }
            | RequestError::Malformed { .. } => true,
            RequestError::Refused { status, .. } => *status >= 500,
        }
    }

    /// Whether the same server may succeed if asked again: a server fault other than
    /// running out of time (the request already waited `timeout_s`).
    fn transient(&self) -> bool {
        !matches!(self, RequestError::TimedOut { .. }) && self.server_fault()
    }

    /// The error, saying it happened on each of `tries` tries.
    fn tried(self, tries: u32) -> RequestError {
        let more = |m: String| format!("{m} (on each of {tries} tries)");
        match self {
            RequestError::Unreachable { url, message } => RequestError::Unreachable {
                url,
                message: more(message),
            },
            RequestError::TimedOut { url, message } => RequestError::TimedOut {
                url,
                message: more(message),
            },
            RequestError::Refused {
                url,
                status,
                message,
            } => RequestError::Refused {
                url,
                status,
                message: more(message),
            },
            RequestError::Malformed { url, message } => RequestError::Malformed {
                url,
                message: more(message),
            },
        }
    }
}

/// One completion request: the ids so far and how to sample what follows.
#[derive(Debug, Clone)]
pub struct TokensRequest {
    pub model: String,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
}

/// What the server sampled: ids, the log-prob of each under the distribution it sampled
/// from, and why it stopped (`stop` or `length`).
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub finish_reason: String,
}

/// How long the start-up checks wait for a server's answer, at least.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(180);

/// Times a completion request is sent again after a fault the server may get over (a 5xx,
/// a reset connection, a malformed answer), waiting [`FIRST_BACKOFF`], then twice that,
/// and so on: a server restarting or briefly overloaded is not taken out for one failed
/// request, and one that keeps failing is out after about 1.75 s. A timeout is not tried
/// again: the request already waited `timeout_s`.
pub const RETRIES: u32 = 3;
const FIRST_BACKOFF: Duration = Duration::from_millis(250);

/// The largest answer read for a request of `prompt` ids and `max_tokens` to sample: 1
/// MiB, and 1 KiB per id (vLLM echoes the prompt's ids; each sampled one comes with its
/// text and log-prob). More than that is no completion of this request, and reading it
/// would let a server make the host hold whatever it sends.
fn answer_limit(prompt: usize, max_tokens: usize) -> u64 {
    (1u64 << 20) + 1024 * (prompt as u64 + max_tokens as u64)
}

/// Routes whose answers are small (models, adapter loading).
const SMALL_ANSWER: u64 = 4 << 20;

/// One vLLM server.
pub struct Server {
    pub url: String,
    agent: ureq::Agent,
    /// What a request that runs out of time is told: which limit it ran into.
    limit: String,
    in_flight: AtomicUsize,
    /// Cleared when it stops answering: no new trajectory goes there.
    alive: AtomicBool,
    /// The trainer's vocabulary size: an id the server returns must be below it.
    vocab: u32,
    /// Completion requests sent again after a fault ([`RETRIES`]).
    retries: AtomicU64,
}

impl Server {
    /// A server whose answers are checked against a vocabulary of `vocab` ids.
    pub fn new(url: &str, timeout: Duration, vocab: u32) -> Server {
        Server::with_limit(
            url,
            timeout,
            format!(
                "no answer in {} s (rollout.vllm.timeout_s)",
                timeout.as_secs_f64()
            ),
            vocab,
        )
    }

    fn with_limit(url: &str, timeout: Duration, limit: String, vocab: u32) -> Server {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            // Error statuses carry vLLM's message in the body: read it.
            .http_status_as_error(false)
            .build()
            .into();
        Server {
            url: url.trim_end_matches('/').to_string(),
            agent,
            limit,
            in_flight: AtomicUsize::new(0),
            alive: AtomicBool::new(true),
            vocab,
            retries: AtomicU64::new(0),
        }
    }

    /// Completion requests sent again so far.
    pub fn retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    pub fn alive(&self) -> bool {
        self.alive.load(Ordering::Relaxed)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Sends a request and reads a 2xx answer's body, at most `max_bytes` of it.
    fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&Json>,
        max_bytes: u64,
    ) -> Result<String, RequestError> {
        let url = format!("{}{path}", self.url);
        let unreachable = |e: ureq::Error| match e {
            ureq::Error::BodyExceedsLimit(n) => RequestError::Malformed {
                url: self.url.clone(),
                message: format!(
                    "the answer is larger than {n} bytes, more than this request can take"
                ),
            },
            ureq::Error::Timeout(_) => RequestError::TimedOut {
                url: self.url.clone(),
                message: self.limit.clone(),
            },
            e => RequestError::Unreachable {
                url: self.url.clone(),
                message: match e {
                    // A reset or a cut answer as much as a refused connection: say what
                    // the system said, once.
                    ureq::Error::Io(e) => format!("connection failed: {e}"),
                    ureq::Error::ConnectionFailed => "cannot connect".into(),
                    other => other.to_string(),
                },
            },
        };
        let mut resp = match body {
            Some(b) => self
                .agent
                .post(&url)
                .header("content-type", "application/json")
                .send(b.to_string())
                .map_err(unreachable)?,
            None if method == "GET" => self.agent.get(&url).call().map_err(unreachable)?,
            None => self.agent.post(&url).send_empty().map_err(unreachable)?,
        };
        let status = resp.status().as_u16();
        let text = resp
            .body_mut()
            .with_config()
            .limit(max_bytes)
            .read_to_string()
            .map_err(unreachable)?;
        if !(200..300).contains(&status) {
            return Err(RequestError::Refused {
                url: self.url.clone(),
                status,
                message: error_message(&text),
            });
        }
        Ok(text)
    }

    /// A request whose answer may be JSON or plain text (adapter loading answers text).
    fn call(&self, method: &str, path: &str, body: Option<&Json>) -> Result<Json, RequestError> {
        let text = self.send(method, path, body, SMALL_ANSWER)?;
        if text.trim().is_empty() {
            return Ok(Json::Null);
        }
        // Some routes (adapter loading) answer plain text.
        Ok(serde_json::from_str(&text).unwrap_or(Json::String(text)))
    }

    /// `GET /v1/models`: the served models and adapters with their context lengths.
    pub fn models(&self) -> Result<Vec<ServedModel>, RequestError> {
        let v = self.call("GET", "/v1/models", None)?;
        let data =
            v.get("data")
                .and_then(Json::as_array)
                .ok_or_else(|| RequestError::Malformed {
                    url: self.url.clone(),
                    message: "/v1/models has no `data` list".into(),
                })?;
        Ok(data
            .iter()
            .filter_map(|m| {
                Some(ServedModel {
                    id: m.get("id")?.as_str()?.to_string(),
                    parent: m.get("parent").and_then(Json::as_str).map(str::to_string),
                    max_model_len: m.get("max_model_len").and_then(Json::as_u64),
                })
            })
            .collect())
    }

    /// Counts a request as in flight from now (so that trajectories assigned in the same
    /// round already see it) until the returned guard is dropped.
    pub fn reserve(self: &Arc<Self>) -> Reserved {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Reserved(self.clone())
    }

    /// Samples one continuation of `req.prompt`, sending the request again after a fault
    /// the server may get over, at most [`RETRIES`] times (each counted).
    pub fn complete(&self, req: &TokensRequest) -> Result<Sampled, RequestError> {
        let mut wait = FIRST_BACKOFF;
        let mut tries = 0;
        loop {
            match self.complete_once(req) {
                Err(e) if tries < RETRIES && e.transient() => {
                    tracing::debug!("{e}: sending the request again in {wait:?}");
                    std::thread::sleep(wait);
                    wait *= 2;
                    tries += 1;
                    self.retries.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) if tries > 0 => {
                    return Err(e.tried(tries + 1));
                }
                r => return r,
            }
        }
    }

    fn complete_once(&self, req: &TokensRequest) -> Result<Sampled, RequestError> {
        let body = json!({
            "model": req.model,
            "prompt": req.prompt,
            "max_tokens": req.max_tokens,
            "temperature": req.temperature,
            // vLLM: -1 and 0 both switch top-k off; -1 is understood by every version.
            "top_k": if req.top_k == 0 { -1 } else { req.top_k as i64 },
            "top_p": req.top_p,
            "min_p": req.min_p,
            "seed": req.seed,
            "n": 1,
            "stop": req.stop,
            "stop_token_ids": req.stop_token_ids,
            // The stop ids are ours: the model's own EOS is in them where it should be.
            "ignore_eos": true,
            "logprobs": 0,
            "return_token_ids": true,
            "skip_special_tokens": false,
        });
        let limit = answer_limit(req.prompt.len(), req.max_tokens);
        let text = self.send("POST", "/v1/completions", Some(&body), limit)?;
        let malformed = |message| RequestError::Malformed {
            url: self.url.clone(),
            message,
        };
        let v: Json = serde_json::from_str(&text).map_err(|e| {
            malformed(format!(
                "the answer is not JSON ({e}; it begins {:?})",
                text.chars().take(80).collect::<String>()
            ))
        })?;
        parse_completion(&v, self.vocab, req.max_tokens).map_err(malformed)
    }

    pub fn load_adapter(&self, name: &str, path: &str) -> Result<(), RequestError> {
        let body = json!({"lora_name": name, "lora_path": path});
        self.call("POST", "/v1/load_lora_adapter", Some(&body))
            .map(|_| ())
    }

    pub fn unload_adapter(&self, name: &str) -> Result<(), RequestError> {
        let body = json!({"lora_name": name});
        self.call("POST", "/v1/unload_lora_adapter", Some(&body))
            .map(|_| ())
    }
}

/// A request counted in its server's load ([`Server::reserve`]).
pub struct Reserved(Arc<Server>);

impl Reserved {
    pub fn complete(&self, req: &TokensRequest) -> Result<Sampled, RequestError> {
        self.0.complete(req)
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An entry of `/v1/models`.
#[derive(Debug, Clone)]
pub struct ServedModel {
    pub id: String,
    /// The base model of an adapter.
    pub parent: Option<String>,
    pub max_model_len: Option<u64>,
}

/// vLLM's error bodies: `{"error": {"message"}}`, `{"message"}`, `{"detail"}` or text.
fn error_message(text: &str) -> String {
    let v: Json = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(_) => return text.trim().chars().take(500).collect(),
    };
    for ptr in ["/error/message", "/message", "/detail", "/error"] {
        if let Some(s) = v.pointer(ptr).and_then(Json::as_str) {
            return s.to_string();
        }
    }
    v.to_string()
}

/// Log-probs above 0 by at most this much are rounding (taken as 0); more is no
/// log-probability.
const LOGPROB_ROUNDING: f64 = 1e-4;

/// The first choice of a `/v1/completions` answer to a request for at most `max_tokens`
/// ids, checked: every id below `vocab`, one finite log-prob of at most 0 per id. Unknown
/// and null fields are ignored (vLLM adds fields from version to version).
fn parse_completion(v: &Json, vocab: u32, max_tokens: usize) -> Result<Sampled, String> {
    let choice = v
        .pointer("/choices/0")
        .ok_or("no `choices[0]`".to_string())?;
    let ids = choice
        .get("token_ids")
        .and_then(Json::as_array)
        .ok_or("no `token_ids` (is this vLLM ≥ 0.10 with return_token_ids?)".to_string())?;
    if ids.len() > max_tokens {
        return Err(format!(
            "{} token ids for a request of at most {max_tokens}",
            ids.len()
        ));
    }
    let mut token_ids = Vec::with_capacity(ids.len());
    for t in ids {
        // Never narrowed: 2^32 + 5 is not 5.
        let id = t
            .as_u64()
            .ok_or_else(|| format!("`token_ids` holds {t}, not a token id"))?;
        if id >= u64::from(vocab) {
            return Err(format!(
                "token id {id} is outside the trainer's vocabulary (0..{vocab})"
            ));
        }
        token_ids.push(id as u32);
    }
    let logprobs = choice
        .pointer("/logprobs/token_logprobs")
        .and_then(Json::as_array)
        .ok_or("no `logprobs.token_logprobs`".to_string())?
        .iter()
        .enumerate()
        .map(|(k, l)| {
            // The log-prob of an id the server sampled: finite, and at most 0.
            match l.as_f64() {
                Some(l) if l.is_finite() && (l as f32).is_finite() && l <= LOGPROB_ROUNDING => {
                    Ok(l.min(0.0) as f32)
                }
                _ => Err(format!(
                    "the log-prob of sampled token {k} is {l}, not a finite number of at most 0"
                )),
            }
        })
        .collect::<Result<Vec<f32>, String>>()?;
    if logprobs.len() != token_ids.len() {
        return Err(format!(
            "{} token ids but {} log-probs",
            token_ids.len(),
            logprobs.len()
        ));
    }
    let finish_reason = choice
        .get("finish_reason")
        .and_then(Json::as_str)
        .unwrap_or("unknown")
        .to_string();
    Ok(Sampled {
        token_ids,
        logprobs,
        finish_reason,
    })
}

/// A loaded adapter version.
struct Loaded {
    name: String,
    /// Requests of this version not yet answered.
    users: usize,
}

/// The servers of a run, the adapter versions loaded on them, and where each trajectory's
/// requests go.
pub struct Pool {
    pub settings: VllmSettings,
    servers: Vec<Arc<Server>>,
    /// Distinguishes this process's adapter names from any other run's on the same
    /// servers (a name is never reused).
    run_tag: String,
    versions: Mutex<BTreeMap<u64, Loaded>>,
    /// Seconds spent writing and loading adapters, and how many versions.
    pub load_stats: Mutex<(f64, u64)>,
    /// The error that took the last server out ([`Pool::last_fault`]).
    last_fault: Mutex<Option<String>>,
}

impl Pool {
    /// Connects to every server and checks it can serve this run: reachable, serving
    /// `model` with a context of at least `max_total_tokens`, the same base model as `lm`
    /// (one fixed prompt scored on both), and log-probs of the distribution it samples
    /// from when `temperature` is not 1 (`None`: the callers pick their temperatures, as
    /// a `[gateway]` run's agents do, so always).
    pub fn connect(
        settings: VllmSettings,
        lm: &LanguageModel,
        max_total_tokens: usize,
        temperature: Option<f32>,
    ) -> Result<Pool> {
        if settings.servers.is_empty() {
            bail!("rollout.vllm.servers is empty: list the base URL of at least one vLLM server");
        }
        std::fs::create_dir_all(&settings.adapter_dir).with_context(|| {
            format!(
                "rollout.vllm.adapter_dir: cannot create {}",
                settings.adapter_dir.display()
            )
        })?;
        let vocab = lm.model.cfg.vocab_size as u32;
        let servers: Vec<Arc<Server>> = settings
            .servers
            .iter()
            .map(|u| Arc::new(Server::new(u, settings.timeout, vocab)))
            .collect();
        for s in &servers {
            // A server started moments ago answers its first completions slowly (30 s
            // and more on two busy cores): the checks wait longer than a request in the
            // run does, so that a short timeout_s, set to notice stalls, does not turn
            // a cold server away.
            let limit = settings.timeout.max(STARTUP_TIMEOUT);
            let patient = Server::with_limit(
                &s.url,
                limit,
                format!("no answer in {} s at start-up", limit.as_secs_f64()),
                vocab,
            );
            check_server(&patient, &settings.model, lm, max_total_tokens, temperature)?;
        }
        let run_tag = format!(
            "{:x}{:x}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64 & 0xff_ffff)
                .unwrap_or(0)
        );
        Ok(Pool {
            settings,
            servers,
            run_tag,
            versions: Mutex::new(BTreeMap::new()),
            load_stats: Mutex::new((0.0, 0)),
            last_fault: Mutex::new(None),
        })
    }

    /// Completion requests sent again after a fault, over all servers, so far.
    pub fn retries(&self) -> u64 {
        self.servers.iter().map(|s| s.retries()).sum()
    }

    /// Why the last server taken out was taken out (its URL and the error), for the
    /// error that ends a run with no server left.
    pub fn last_fault(&self) -> String {
        self.last_fault
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_else(|| "no server answered".into())
    }

    pub fn servers(&self) -> &[Arc<Server>] {
        &self.servers
    }

    /// The server a new trajectory goes to: the least loaded live one.
    pub fn pick(&self) -> Option<usize> {
        self.servers
            .iter()
            .enumerate()
            .filter(|(_, s)| s.alive())
            .min_by_key(|(_, s)| s.in_flight())
            .map(|(i, _)| i)
    }

    /// Whether server `i` may take another request now.
    pub fn has_room(&self, i: usize) -> bool {
        self.servers[i].in_flight() < self.settings.max_in_flight
    }

    /// Takes server `i` out after `error`; says so once.
    pub fn mark_dead(&self, i: usize, error: &RequestError) {
        *self.last_fault.lock().unwrap_or_else(|e| e.into_inner()) = Some(error.to_string());
        if self.servers[i].alive.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                "vLLM server {} stopped answering ({error}): its trajectories continue on the others",
                self.servers[i].url
            );
        } else {
            tracing::debug!("{error}");
        }
    }

    /// The model name requests use for `mode`: the base model when adapters are off or
    /// there is none, else the adapter version `version` (its tensors from `mode`'s
    /// snapshot, or the model's live adapter), written and loaded on every live server
    /// first if it is new. Counts a user of the version until [`Pool::release`].
    pub fn acquire(&self, lm: &LanguageModel, mode: Mode, version: u64) -> Result<String> {
        if base_only(lm, mode) {
            return Ok(self.settings.model.clone());
        }
        let mut versions = self.versions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = versions.get_mut(&version) {
            v.users += 1;
            return Ok(v.name.clone());
        }
        let t0 = Instant::now();
        let name = format!("{}-rlhost-{}-v{version}", self.settings.model, self.run_tag);
        let dir = self.settings.adapter_dir.join(&name);
        peft::save_adapter_as(&lm.model, mode.adapter, &dir, Some(&self.settings.model))
            .with_context(|| format!("writing adapter version {version} for the vLLM servers"))?;
        let server_path = match &self.settings.server_adapter_dir {
            Some(d) => format!("{}/{name}", d.trim_end_matches('/')),
            None => std::fs::canonicalize(&dir)
                .unwrap_or(dir.clone())
                .display()
                .to_string(),
        };
        // A server that stops answering while the version loads is taken out as it would
        // be mid-request, and the batch goes on on the others.
        let mut last = None;
        for (i, s) in self.servers.iter().enumerate().filter(|(_, s)| s.alive()) {
            if let Err(e) = load_with_retry(s, &name, &server_path)? {
                self.mark_dead(i, &e);
                last = Some(e);
            }
        }
        if let Some(e) = last.filter(|_| !self.servers.iter().any(|s| s.alive())) {
            bail!(
                "every vLLM server has stopped answering (rollout.vllm.servers): adapter version {version} could not be loaded on any; the last: {e}"
            );
        }
        tracing::info!(
            "vLLM: loaded adapter version {version} as {name} in {:.2} s",
            t0.elapsed().as_secs_f64()
        );
        let mut stats = self.load_stats.lock().unwrap_or_else(|e| e.into_inner());
        stats.0 += t0.elapsed().as_secs_f64();
        stats.1 += 1;
        versions.insert(
            version,
            Loaded {
                name: name.clone(),
                users: 1,
            },
        );
        self.unload_old(&mut versions, version);
        Ok(name)
    }

    /// Ends a use of `version` begun by [`Pool::acquire`].
    pub fn release(&self, version: u64, mode: Mode, lm: &LanguageModel) {
        if base_only(lm, mode) {
            return;
        }
        let mut versions = self.versions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = versions.get_mut(&version) {
            v.users = v.users.saturating_sub(1);
        }
        let newest = versions.keys().next_back().copied().unwrap_or(version);
        self.unload_old(&mut versions, newest);
    }

    /// Unloads versions more than `keep_versions` behind `newest` that no request uses
    /// (unloading an adapter in use crashed servers).
    fn unload_old(&self, versions: &mut BTreeMap<u64, Loaded>, newest: u64) {
        let old: Vec<u64> = versions
            .iter()
            .filter(|(v, l)| **v + self.settings.keep_versions <= newest && l.users == 0)
            .map(|(v, _)| *v)
            .collect();
        for v in old {
            let l = versions.remove(&v).expect("listed above");
            for s in self.servers.iter().filter(|s| s.alive()) {
                if let Err(e) = s.unload_adapter(&l.name) {
                    tracing::warn!("unloading adapter {} from {}: {e}", l.name, s.url);
                }
            }
            let _ = std::fs::remove_dir_all(self.settings.adapter_dir.join(&l.name));
            tracing::info!("vLLM: unloaded adapter version {v} ({})", l.name);
        }
    }

    /// The adapter names loaded now, oldest first.
    pub fn loaded(&self) -> Vec<String> {
        let versions = self.versions.lock().unwrap_or_else(|e| e.into_inner());
        versions.values().map(|l| l.name.clone()).collect()
    }
}

/// A batch's hold on the adapter version it samples with on the servers: acquired (loaded
/// if new) when the batch begins, released when it ends however it ends.
pub struct Lease<'p> {
    pub pool: &'p Pool,
    lm: &'p LanguageModel,
    mode: Mode<'p>,
    version: u64,
    /// The model name the batch's requests use.
    pub name: String,
}

impl<'p> Lease<'p> {
    pub fn new(
        pool: &'p Pool,
        lm: &'p LanguageModel,
        mode: Mode<'p>,
        version: u64,
    ) -> Result<Self> {
        let name = pool.acquire(lm, mode, version)?;
        Ok(Lease {
            pool,
            lm,
            mode,
            version,
            name,
        })
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.pool.release(self.version, self.mode, self.lm);
    }
}

/// Whether `mode` samples the base model: adapters off, or none attached.
fn base_only(lm: &LanguageModel, mode: Mode) -> bool {
    !mode.adapters || lm.model.lora.is_none()
}

/// A run's adapters leave the servers with it: a long-lived server would otherwise keep
/// every finished run's last versions.
impl Drop for Pool {
    fn drop(&mut self) {
        let mut versions =
            std::mem::take(self.versions.get_mut().unwrap_or_else(|e| e.into_inner()));
        for l in versions.values_mut() {
            l.users = 0;
        }
        self.unload_old(&mut versions, u64::MAX - self.settings.keep_versions);
    }
}

/// Loads an adapter, retrying with back-off: a shared filesystem may show the files late.
/// `Ok(Err(e))`: the server itself failed (unreachable, or a 5xx every time): it is dead
/// to the run; `Err`: the load is refused for a reason another server would share.
fn load_with_retry(s: &Server, name: &str, path: &str) -> Result<Result<(), RequestError>> {
    let mut wait = Duration::from_millis(200);
    let mut last = None;
    for _ in 0..5 {
        match s.load_adapter(name, path) {
            Ok(()) => return Ok(Ok(())),
            Err(e) => {
                if let RequestError::Refused { message, .. } = &e
                    && (message.contains("LoRA is not enabled")
                        || message.contains("enable_lora")
                        || message.contains("not enabled"))
                {
                    bail!(
                        "{}: LoRA is not enabled ({message}); start it with --enable-lora --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (scripts/vllm.sh start does)",
                        s.url
                    );
                }
                last = Some(e);
                std::thread::sleep(wait);
                wait *= 2;
            }
        }
    }
    let e = last.expect("five tries failed");
    if e.server_fault() {
        return Ok(Err(e));
    }
    Err(anyhow!(
        "{}: loading adapter {name} from {path} failed five times: {e} (is rollout.vllm.server_adapter_dir the folder as the server sees it, and --max-lora-rank at least lora.r?)",
        s.url
    ))
}

/// The start-up checks of one server (see [`Pool::connect`]).
fn check_server(
    s: &Server,
    model: &str,
    lm: &LanguageModel,
    max_total_tokens: usize,
    temperature: Option<f32>,
) -> Result<()> {
    let start_hint = "start one with `bash scripts/vllm.sh start MODEL_DIR PORT NAME`";
    let models = s.models().map_err(|e| match e {
        RequestError::Unreachable { .. } | RequestError::TimedOut { .. } => {
            anyhow!("vLLM server {} is not reachable ({e}): {start_hint}", s.url)
        }
        e => anyhow!("vLLM server {}: {e}", s.url),
    })?;
    let Some(served) = models.iter().find(|m| m.id == model) else {
        let names: Vec<&str> = models.iter().map(|m| m.id.as_str()).collect();
        bail!(
            "vLLM server {} does not serve `{model}` (rollout.vllm.model); it serves {names:?}: set rollout.vllm.model to the --served-model-name it was started with",
            s.url
        );
    };
    if let Some(len) = served.max_model_len
        && (len as usize) < max_total_tokens
    {
        bail!(
            "vLLM server {} has a context of {len} tokens, rollout.max_total_tokens is {max_total_tokens}: start it with --max-model-len {max_total_tokens} or lower the limit",
            s.url
        );
    }
    let check =
        score_probe(s, model, lm).with_context(|| format!("checking vLLM server {}", s.url))?;
    if check.processed_gap <= SAME_MODEL_GAP {
        return Ok(());
    }
    if check.raw_gap <= SAME_MODEL_GAP {
        // Greedy runs score at T = 1, where raw log-probs are the right ones.
        match temperature {
            Some(t) if t != 1.0 && t > 0.0 => bail!(
                "vLLM server {} returns raw log-probs (before temperature): at sampling.temperature = {t} the importance ratios would be biased; start it with --logprobs-mode processed_logprobs",
                s.url
            ),
            None => bail!(
                "vLLM server {} returns raw log-probs (before temperature): a [gateway] run's agents pick their own temperatures, at which the importance ratios would be biased; start it with --logprobs-mode processed_logprobs",
                s.url
            ),
            Some(_) => {}
        }
        return Ok(());
    }
    bail!(
        "vLLM server {} serves a different base model than {}: on a fixed prompt its log-probs differ from the trainer's by {:.3} on average (at most {SAME_MODEL_GAP} is rounding); start it on the trainer's model directory",
        s.url,
        lm.dir.display(),
        check.processed_gap
    )
}

/// Mean absolute difference of log-probs on the probe below under which two models are
/// the same up to their dtypes (f32 against f32 differ by ~1e-5; bf16 by a few 1e-2; a
/// different model by nats).
const SAME_MODEL_GAP: f32 = 0.05;

/// The probe's result: mean |server − trainer| log-prob with the trainer's at the probe
/// temperature (`processed`) and at temperature 1 (`raw`).
struct Probe {
    processed_gap: f32,
    raw_gap: f32,
}

/// Samples 8 tokens of a fixed prompt at T = 0.5 with adapters off and scores them with
/// the trainer's model at T = 0.5 and at T = 1.
fn score_probe(s: &Server, model: &str, lm: &LanguageModel) -> Result<Probe> {
    const T: f32 = 0.5;
    let prompt = lm
        .tokenizer
        .encode_plain("The quick brown fox jumps over the lazy dog. 12 + 30 =")?;
    let req = TokensRequest {
        model: model.to_string(),
        prompt: prompt.clone(),
        max_tokens: 8,
        temperature: T,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 0,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
    };
    let got = s.complete(&req)?;
    if got.token_ids.is_empty() {
        bail!("the probe request returned no tokens");
    }
    let mut all = prompt.clone();
    all.extend(&got.token_ids);
    let mut cache = lm.model.new_cache();
    let logits = lm.model.forward_cached(
        &mut [&mut cache],
        &[&all[..all.len() - 1]],
        Mode::BASE,
        true,
    )?;
    let logits = logits.to_vec2::<f32>()?;
    let (mut processed, mut raw) = (0.0f32, 0.0f32);
    for (k, (&tok, &lp)) in got.token_ids.iter().zip(&got.logprobs).enumerate() {
        let row = &logits[prompt.len() - 1 + k];
        processed += (log_softmax_at(row, tok, T) - lp).abs();
        raw += (log_softmax_at(row, tok, 1.0) - lp).abs();
    }
    let n = got.token_ids.len() as f32;
    Ok(Probe {
        processed_gap: processed / n,
        raw_gap: raw / n,
    })
}

/// log softmax(row / t)[tok].
fn log_softmax_at(row: &[f32], tok: u32, t: f32) -> f32 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x / t));
    let sum: f64 = row.iter().map(|&x| ((x / t - max) as f64).exp()).sum();
    row[tok as usize] / t - max - sum.ln() as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The answer vLLM 0.32 gives (abridged from a real one), with its extra null fields.
    #[test]
    fn a_completion_is_read_leniently() {
        let v: Json = serde_json::from_str(
            r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" 42",
            "logprobs":{"text_offset":[0],"token_logprobs":[-0.25,-1e-3],"tokens":["a","b"],"top_logprobs":null},
            "finish_reason":"stop","stop_reason":"</calc>","token_ids":[17,99],"prompt_token_ids":[1,2],
            "routed_experts":null,"kv_transfer_params":null}],"usage":{"prompt_tokens":2}}"#,
        )
        .unwrap();
        let s = parse_completion(&v, 320, 8).unwrap();
        assert_eq!(s.token_ids, vec![17, 99]);
        assert_eq!(s.logprobs, vec![-0.25, -1e-3]);
        assert_eq!(s.finish_reason, "stop");
        let bad: Json = serde_json::from_str(
            r#"{"choices":[{"token_ids":[1],"logprobs":{"token_logprobs":[]}}]}"#,
        )
        .unwrap();
        assert!(
            parse_completion(&bad, 320, 8)
                .unwrap_err()
                .contains("1 token ids but 0")
        );
    }

    /// Issue 51: an answer is never narrowed or trusted. Ids past u32 (2^32 + 5 once
    /// became 5) or outside the vocabulary, log-probs that are null, too large for f32 or
    /// above 0, and more ids than asked for are refused, saying which.
    #[test]
    fn an_answer_outside_what_a_server_can_sample_is_refused() {
        let answer = |ids: &str, logps: &str| -> Json {
            serde_json::from_str(&format!(
                r#"{{"choices":[{{"token_ids":{ids},"logprobs":{{"token_logprobs":{logps}}},"finish_reason":"length"}}]}}"#
            ))
            .unwrap()
        };
        for (ids, logps, max_tokens, why) in [
            (
                "[4294967301]",
                "[-0.5]",
                8,
                "token id 4294967301 is outside the trainer's vocabulary (0..320)",
            ),
            ("[320]", "[-0.5]", 8, "token id 320 is outside"),
            ("[-1]", "[-0.5]", 8, "`token_ids` holds -1, not a token id"),
            ("[1.5]", "[-0.5]", 8, "holds 1.5"),
            (
                "[1]",
                "[null]",
                8,
                "the log-prob of sampled token 0 is null",
            ),
            ("[1, 2]", "[-0.5, 1e300]", 8, "sampled token 1 is 1e+300"),
            ("[1]", "[-1e300]", 8, "is -1e+300, not a finite"),
            (
                "[1]",
                "[0.5]",
                8,
                "is 0.5, not a finite number of at most 0",
            ),
            (
                "[1, 2, 3]",
                "[-1, -1, -1]",
                2,
                "3 token ids for a request of at most 2",
            ),
        ] {
            let err = parse_completion(&answer(ids, logps), 320, max_tokens).unwrap_err();
            assert!(err.contains(why), "{ids} {logps}: {err}");
        }
        // Rounding just above 0 is 0; exactly representable answers pass untouched.
        let ok = parse_completion(&answer("[0, 319]", "[0.00001, -3.0]"), 320, 2).unwrap();
        assert_eq!(ok.token_ids, vec![0, 319]);
        assert_eq!(ok.logprobs, vec![0.0, -3.0]);
    }

    #[test]
    fn error_bodies_give_the_servers_message() {
        assert_eq!(
            error_message(
                r#"{"error":{"message":"This model's maximum context length is 1024","type":"BadRequestError","code":400}}"#
            ),
            "This model's maximum context length is 1024"
        );
        assert_eq!(error_message(r#"{"detail":"Not Found"}"#), "Not Found");
        assert_eq!(
            error_message("Internal Server Error"),
            "Internal Server Error"
        );
    }

    #[test]
    fn log_softmax_at_a_temperature() {
        let row = [1.0f32, 2.0, 3.0];
        let z: f32 = row.iter().map(|x| (x / 0.5).exp()).sum();
        assert!((log_softmax_at(&row, 2, 0.5) - (6.0 - z.ln())).abs() < 1e-5);
    }
}
