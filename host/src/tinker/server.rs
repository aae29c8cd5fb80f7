//! The Tinker API's HTTP side (`/api/v1/...`, as the official SDK 0.38 calls it): sessions,
//! training clients, sampling sessions and the futures the SDK polls. Handlers check what
//! they are sent and hand the work to the model's thread ([`super::worker`]); a request
//! the API cannot take answers 4xx with `{"detail": …}` (the SDK raises `BadRequestError`
//! or `NotFoundError` with it), and a problem in an accepted operation's data settles its
//! future as failed (`RequestFailedError`, category `user`), naming the datum and field.

use super::datum;
use super::futures::{Futures, Settled, Waited};
use super::gate::Gate;
use super::paths::{check_name, parse_path};
use super::proto;
use super::replies::{
    Refused, client_config, empty, healthz, not_found, ok, parse, refuse, telemetry, wrong_method,
};
use super::sample_request::{Base, MAX_SAMPLES, sample_job};
use super::wire;
use super::worker::{SamplerWeights, Work};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a `retrieve_future` poll is held before answering "try again" (the SDK's read
/// timeout for it is 45 s). `RLHOST_TINKER_POLL_MS` shortens it (the tests do, to see
/// futures outlive several polls).
pub const POLL: Duration = Duration::from_secs(20);

fn poll() -> Duration {
    static POLL_TIME: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *POLL_TIME.get_or_init(|| {
        std::env::var("RLHOST_TINKER_POLL_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis)
            .unwrap_or(POLL)
    })
}

/// The largest request body read: a forward/backward of 256 datums of 8,192 tokens with
/// two float inputs each is 24 MiB.
pub const MAX_BODY: usize = 64 << 20;
/// Sampled sequences waiting or decoding at once, all clients together: past it an
/// `asample` is refused with 429 (the SDK retries it) rather than queued without bound.
pub const MAX_IN_FLIGHT: usize = 4096;
/// Training clients held at once (each holds its adapter and AdamW state: ~0.9 MB at rank
/// 8 on the built-in model, ~1.8 GB at rank 128 on the 1.5B shape). A session's clients
/// are freed when it finishes.
pub const MAX_MODELS: usize = 64;

struct ModelInfo {
    session: String,
    rank: usize,
}

struct SamplerInfo {
    weights: SamplerWeights,
    model_path: Option<String>,
}

/// A session's state: ended or not, and when its client last showed it was there (a
/// heartbeat, or a call that names the session).
struct SessionBook {
    done: bool,
    seen: std::time::Instant,
}

#[derive(Default)]
struct Books {
    sessions: HashMap<String, SessionBook>,
    models: HashMap<String, ModelInfo>,
    samplers: HashMap<String, SamplerInfo>,
    gate: Gate<Work>,
}

pub struct Tinker {
    pub base: Base,
    /// Sampled sequences asked for and not yet answered, all clients together.
    in_flight: Arc<std::sync::atomic::AtomicUsize>,
    pub futures: Arc<Futures>,
    /// Where checkpoints go: `<root>/<model id>/<weights|sampler_weights>/<name>/`.
    pub root: PathBuf,
    work: Mutex<Sender<Work>>,
    books: Mutex<Books>,
    /// The next seed for a training client created without one (`serve --tinker --seed`);
    /// `None`: drawn at random, as the hosted service does.
    next_seed: Option<std::sync::atomic::AtomicU64>,
}

impl Tinker {
    pub fn new(base: Base, futures: Arc<Futures>, root: PathBuf, work: Sender<Work>) -> Tinker {
        Tinker {
            base,
            in_flight: Arc::default(),
            futures,
            root,
            work: Mutex::new(work),
            books: Mutex::default(),
            next_seed: None,
        }
    }

    /// Training clients created without a seed take `seed`, `seed + 1`, … in the order
    /// they are created, so that a script that leaves the seed out runs the same each time.
    pub fn with_seed(mut self, seed: Option<u64>) -> Tinker {
        self.next_seed = seed.map(std::sync::atomic::AtomicU64::new);
        self
    }

    /// The seed of a training client created without one.
    fn unseeded(&self) -> u64 {
        match &self.next_seed {
            Some(next) => next.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            None => rand::random(),
        }
    }

    fn send(&self, works: Vec<Work>) {
        let tx = self.work.lock().expect("work lock");
        for w in works {
            if tx.send(w).is_err() {
                tracing::error!("tinker: the model's thread has stopped");
            }
        }
    }

    /// Passes on `work` for `model` in its turn. What the gate lets go is sent before its
    /// lock is released: two handlers of one client cannot send out of order.
    fn submit(&self, model: &str, seq: Option<i64>, work: Work) {
        let mut books = self.books.lock().expect("books lock");
        let ready = books.gate.submit(model, seq, work, Instant::now());
        self.send(ready);
    }

    /// Releases operations that waited past the gate's grace for a turn that never came.
    pub fn release_late(&self) {
        let mut books = self.books.lock().expect("books lock");
        let now = Instant::now();
        for m in books.gate.waiting() {
            let ready = books.gate.release(&m, now);
            self.send(ready);
        }
    }

    /// The directory a `tinker://<model>/<kind>/<name>` path names.
    pub fn checkpoint_dir(&self, path: &str) -> Result<PathBuf, String> {
        let (model, kind, name) = parse_path(path)?;
        Ok(self.root.join(model).join(kind).join(name))
    }
}

pub fn router(t: Arc<Tinker>) -> Router {
    Router::new()
        .route("/api/v1/client/config", post(client_config))
        .route("/api/v1/client/dynamic_config", post(empty))
        .route("/api/v1/healthz", get(healthz))
        .route("/api/v1/get_server_capabilities", get(capabilities))
        .route("/api/v1/create_session", post(create_session))
        .route("/api/v1/session_heartbeat", post(heartbeat))
        .route("/api/v1/telemetry", post(telemetry))
        .route("/api/v1/sessions/{id}/finish", post(finish_session))
        .route("/api/v1/create_model", post(create_model))
        .route("/api/v1/get_info", post(get_info))
        .route("/api/v1/forward_backward", post(forward_backward))
        .route("/api/v1/optim_step", post(optim_step))
        .route("/api/v1/save_weights", post(save_weights))
        .route("/api/v1/save_weights_for_sampler", post(save_for_sampler))
        .route("/api/v1/load_weights", post(load_weights))
        .route(
            "/api/v1/create_sampling_session",
            post(create_sampling_session),
        )
        .route("/api/v1/samplers/{id}", get(sampler_info))
        .route("/api/v1/asample", post(asample))
        .route("/api/v1/retrieve_future", post(retrieve_future))
        .fallback(not_found)
        .method_not_allowed_fallback(wrong_method)
        // The front has read the body within MAX_BODY already (axum's own default was a
        // silent 2 MiB).
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(t)
}

async fn capabilities(State(t): State<Arc<Tinker>>) -> Response {
    ok(json!({"supported_models": [{
        "model_name": t.base.name,
        "max_context_length": t.base.context,
        "trainable": true,
        "sampleable": true,
    }]}))
}

/// 96 random bits: a session id is the prefix of its models' and samplers' ids, which are
/// all a client needs to reach them.
fn new_session_id() -> String {
    format!("sess-{:024x}", rand::random::<u128>() >> 32)
}

async fn create_session(State(t): State<Arc<Tinker>>, body: Bytes) -> Response {
    if let Err(r) = parse::<wire::CreateSession>(&body, "create_session") {
        return *r;
    }
    let id = new_session_id();
    t.books.lock().expect("books lock").sessions.insert(
        id.clone(),
        SessionBook {
            done: false,
            seen: std::time::Instant::now(),
        },
    );
    ok(json!({"type": "create_session", "session_id": id}))
}

async fn heartbeat(State(t): State<Arc<Tinker>>, body: Bytes) -> Response {
    let s: wire::SessionRef = match parse(&body, "session_heartbeat") {
        Ok(s) => s,
        Err(r) => return *r,
    };
    // 410 ends the SDK's heartbeat loop: the session is over (or from before a restart).
    match t
        .books
        .lock()
        .expect("books lock")
        .sessions
        .get_mut(&s.session_id)
    {
        Some(b) if !b.done => {
            b.seen = std::time::Instant::now();
            ok(json!({"type": "session_heartbeat"}))
        }
        _ => refuse(
            StatusCode::GONE,
            format!("session {:?} has ended", s.session_id),
        ),
    }
}

async fn finish_session(State(t): State<Arc<Tinker>>, Path(id): Path<String>) -> Response {
    t.end_sessions(&[id]);
    ok(json!({}))
}

impl Tinker {
    /// Ends `ids`: their training clients are closed, and their adapters and optimizer
    /// state freed on the model's thread; their checkpoints stay on disk.
    fn end_sessions(&self, ids: &[String]) {
        let model_ids: Vec<String> = {
            let mut books = self.books.lock().expect("books lock");
            for id in ids {
                if let Some(b) = books.sessions.get_mut(id) {
                    b.done = true;
                }
            }
            let models: Vec<String> = books
                .models
                .iter()
                .filter(|(_, m)| ids.contains(&m.session))
                .map(|(k, _)| k.clone())
                .collect();
            for m in &models {
                books.models.remove(m);
                books.gate.close(m);
            }
            models
        };
        if !model_ids.is_empty() {
            self.send(vec![Work::Unload { model_ids }]);
        }
    }

    /// Ends the open sessions whose client has not shown itself (a heartbeat, which the
    /// SDK sends every 10 s, or a call naming the session) for `timeout`: a client that
    /// went away held its adapters for good. Returns how many were ended.
    pub fn end_silent(&self, timeout: std::time::Duration) -> usize {
        let silent: Vec<String> = self
            .books
            .lock()
            .expect("books lock")
            .sessions
            .iter()
            .filter(|(_, b)| !b.done && b.seen.elapsed() > timeout)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &silent {
            tracing::warn!(
                "tinker: ended session {id}: no heartbeat or call for {:.0} s (--session-timeout)",
                timeout.as_secs_f64()
            );
        }
        self.end_sessions(&silent);
        silent.len()
    }
}

/// Checks the session is open; the refusal otherwise.
fn open_session(t: &Tinker, id: &str) -> Result<(), Refused> {
    match t.books.lock().expect("books lock").sessions.get_mut(id) {
        Some(b) if !b.done => {
            b.seen = std::time::Instant::now();
            Ok(())
        }
        Some(_) => Err(Box::new(refuse(
            StatusCode::BAD_REQUEST,
            format!("session {id:?} has ended"),
        ))),
        None => Err(Box::new(refuse(
            StatusCode::NOT_FOUND,
            format!(
                "unknown session {id:?} (create_session first; sessions do not outlive a server restart)"
            ),
        ))),
    }
}

fn check_base(t: &Tinker, name: &str) -> Result<(), Refused> {
    if name == t.base.name || t.base.aliases.iter().any(|a| a == name) {
        Ok(())
    } else {
        Err(Box::new(refuse(
            StatusCode::BAD_REQUEST,
            format!(
                "base model {name:?} is not served here: this server serves {:?} (the run config's model.path; \
                 one base model per server, with any number of adapters on it)",
                t.base.name
            ),
        )))
    }
}

/// Refuses a new training client when [`MAX_MODELS`] are held.
fn room_for_model(books: &Books) -> Result<(), Refused> {
    if books.models.len() >= MAX_MODELS {
        return Err(Box::new(refuse(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "the server holds {MAX_MODELS} training clients, its most: end a session \
                 (its clients are freed) and try again"
            ),
        )));
    }
    Ok(())
}

fn future(request: &str, model_id: Option<&str>) -> Response {
    ok(json!({"request_id": request, "model_id": model_id}))
}

async fn create_model(State(t): State<Arc<Tinker>>, body: Bytes) -> Response {
    let req: wire::CreateModel = match parse(&body, "create_model") {
        Ok(r) => r,
        Err(r) => return *r,
    };
    if let Err(r) = open_session(&t, &req.session_id).and_then(|_| check_base(&t, &req.base_model))
    {
        return *r;
    }
    if let Some(o) = &req.optimizer_config
        && o.kind != "adamw"
    {
        return refuse(
            StatusCode::BAD_REQUEST,
            format!(
                "optimizer {:?} is not one rlhost runs (it runs adamw)",
                o.kind
            ),
        );
    }
    let Some(lora) = req.lora_config else {
        return refuse(
            StatusCode::BAD_REQUEST,
            "create_model without lora_config: rlhost trains LoRA adapters only (full fine-tuning is not served)",
        );
    };
    let cfg = match super::adapter::lora_config(
        lora.rank,
        lora.train_attn,
        lora.train_mlp,
        lora.train_unembed,
    ) {
        Ok(c) => c,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, format!("lora_config: {e:#}")),
    };
    let model_id = format!("{}:train:{}", req.session_id, req.model_seq_id);
    {
        let mut books = t.books.lock().expect("books lock");
        if let Err(r) = room_for_model(&books) {
            return *r;
        }
        if books.models.contains_key(&model_id) {
            drop(books);
            return refuse(
                StatusCode::BAD_REQUEST,
                format!(
                    "model_seq_id {} of this session is taken ({model_id})",
                    req.model_seq_id
                ),
            );
        }
        books.models.insert(
            model_id.clone(),
            ModelInfo {
                session: req.session_id.clone(),
                rank: lora.rank,
            },
        );
        books.gate.open(&model_id, 1);
    }
    let request = open_creating(&t, &model_id);
    let seed = lora.seed.unwrap_or_else(|| t.unseeded());
    t.submit(
        &model_id,
        None,
        Work::Create {
            request: request.clone(),
            model_id: model_id.clone(),
            lora: cfg,
            head: lora.train_unembed,
            seed,
        },
    );
    future(&request, Some(&model_id))
}

async fn get_info(State(t): State<Arc<Tinker>>, body: Bytes) -> Response {
    let req: wire::ModelRef = match parse(&body, "get_info") {
        Ok(r) => r,
        Err(r) => return *r,
    };
    let rank = match t
        .books
        .lock()
        .expect("books lock")
        .models
        .get(&req.model_id)
    {
        Some(m) => m.rank,
        None => return unknown_model(&req.model_id),
    };
    ok(json!({
        "type": "get_info",
        "model_id": req.model_id,
        "model_data": {
            "arch": t.base.arch,
            "model_name": t.base.name,
            "tokenizer_id": t.base.tokenizer_dir,
        },
        "optimizer_config": {"type": "adamw"},
        "is_lora": true,
        "lora_rank": rank,
        "model_name": t.base.name,
    }))
}

fn unknown_model(id: &str) -> Response {
    refuse(
        StatusCode::NOT_FOUND,
        format!(
            "unknown model_id {id:?}: create_model (or create_training_client_from_state) first"
        ),
    )
}

fn known_model(t: &Tinker, id: &str) -> Result<(), Refused> {
    if t.books.lock().expect("books lock").models.contains_key(id) {
        Ok(())
    } else {
        Err(Box::new(unknown_model(id)))
    }
}

async fn forward_backward(
    State(t): State<Arc<Tinker>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(enc) = headers.get(header::CONTENT_ENCODING)
        && enc.as_bytes() != b"identity"
    {
        return refuse(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!(
                "forward_backward bodies must not be compressed (Content-Encoding {:?}); this server's client config says so",
                String::from_utf8_lossy(enc.as_bytes())
            ),
        );
    }
    let req = match proto::forward_backward(&body) {
        Ok(r) => r,
        Err(e) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                format!("forward_backward: the body is not a ForwardBackwardRequest protobuf: {e}"),
            );
        }
    };
    if let Err(r) = known_model(&t, &req.model_id) {
        return *r;
    }
    let request = t.futures.open();
    let work = match datum::loss_of(&req).and_then(|loss| {
        Ok((
            loss,
            datum::checked(&req, loss, t.base.vocab, t.base.context)?,
        ))
    }) {
        Ok((loss, rows)) => Work::ForwardBackward {
            request: request.clone(),
            model_id: req.model_id.clone(),
            rows,
            loss,
            forward_only: req.forward_only,
        },
        Err(message) => Work::Fail {
            request: request.clone(),
            message,
        },
    };
    t.submit(&req.model_id, Some(req.seq_id as i64), work);
    future(&request, Some(&req.model_id))
}

async fn optim_step(State(t): State<Arc<Tinker>>, body: Bytes) -> Response {
    let req: wire::OptimStep = match parse(&body, "optim_step") {
        Ok(r) => r,
        Err(r) => return *r,
    };
    if let Err(r) = known_model(&t, &req.model_id) {
        return *r;
    }
    let request = t.futures.open();
    let work = match (&req.adam_params, &req.optimizer_params) {
        (Some(a), None) if a.check().is_ok() => Work::Optim {
            request: request.clone(),
            model_id: req.model_id.clone(),
            lr: a.learning_rate,
            adam: crate::rl::optim::AdamWConfig {
                beta1: a.beta1,
                beta2: a.beta2,
                eps: a.eps,
                weight_decay: a.weight_decay,
            },
            clip: a.grad_clip_norm,
        },
        (Some(a), None) => Work::Fail {
            request: request.clone(),
            message: a.check().expect_err("checked above"),
        },
        (_, Some(p)) => Work::Fail {
            request: request.clone(),
            message: format!(
                "optimizer_params {}: rlhost runs AdamW only (send adam_params)",
                p.get("type").and_then(Value::as_str).unwrap_or("?")
            ),
        },
        (None, None) => Work::Fail {
            request: request.clone(),
            message: "optim_step without adam_params".into(),
        },
    };
    t.submit(&req.model_id, req.seq_id, work);
    future(&request, Some(&req.model_id))
}

async fn save_weights(State(t): State<Arc<Tinker>>, body: Bytes) -> Response {
    save(t, body, false).await
}

async fn save_for_sampler(State(t): State<Arc<Tinker>>, body: Bytes) -> Response {
    save(t, body, true).await
}

/// `save_weights` (adapter and optimizer, to resume) and `save_weights_for_sampler`
/// (adapter, to sample from; or, with no name, a sampling session on a snapshot).
async fn save(t: Arc<Tinker>, body: Bytes, for_sampler: bool) -> Response {
    let what = if for_sampler {
        "save_weights_for_sampler"
    } else {
        "save_weights"
    };
    let req: wire::SaveWeights = match parse(&body, what) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    if let Err(r) = known_model(&t, &req.model_id) {
        return *r;
    }
    let request = t.futures.open();
    let kind = if for_sampler {
        "sampler_weights"
    } else {
        "weights"
    };
    let work = match (&req.path, req.sampling_session_seq_id) {
        (Some(name), _) => match check_name(name) {
            Ok(()) => {
                let path = format!("tinker://{}/{kind}/{name}", req.model_id);
                let dir = t.root.join(&req.model_id).join(kind).join(name);
                Work::Save {
                    request: request.clone(),
                    model_id: req.model_id.clone(),
                    dir: Some(dir),
                    optimizer: !for_sampler,
                    key: for_sampler.then(|| path.clone()),
                    answer: json!({"path": path, "type": what}),
                }
            }
            Err(e) => Work::Fail {
                request: request.clone(),
                message: format!("{what} name: {e}"),
            },
        },
        (None, Some(n)) if for_sampler => {
            // save_weights_and_get_sampling_client: a snapshot in memory, a sampling
            // session on it.
            let session = req
                .model_id
                .split(':')
                .next()
                .unwrap_or_default()
                .to_string();
            let sampler = format!("{session}:sample:{n}");
            let key = format!("{}#{sampler}", req.model_id);
            t.books.lock().expect("books lock").samplers.insert(
                sampler.clone(),
                SamplerInfo {
                    weights: SamplerWeights::Saved {
                        key: key.clone(),
                        dir: None,
                    },
                    model_path: None,
                },
            );
            Work::Save {
                request: request.clone(),
                model_id: req.model_id.clone(),
                dir: None,
                optimizer: false,
                key: Some(key),
                answer: json!({"path": null, "sampling_session_id": sampler, "type": what}),
            }
        }
        _ => Work::Fail {
            request: request.clone(),
            message: format!("{what} needs a `path` (the checkpoint's name)"),
        },
    };
    t.submit(&req.model_id, req.seq_id, work);
    future(&request, Some(&req.model_id))
}

async fn load_weights(State(t): State<Arc<Tinker>>, body: Bytes) -> Response {
    let req: wire::LoadWeights = match parse(&body, "load_weights") {
        Ok(r) => r,
        Err(r) => return *r,
    };
    let dir = match t.checkpoint_dir(&req.path) {
        Ok(d) => d,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, format!("load_weights: {e}")),
    };
    if !dir.is_dir() {
        return refuse(
            StatusCode::NOT_FOUND,
            format!(
                "load_weights: no checkpoint at {} ({})",
                req.path,
                dir.display()
            ),
        );
    }
    match (&req.model_id, &req.session_id, req.model_seq_id) {
        (Some(model_id), _, _) => {
            if let Err(r) = known_model(&t, model_id) {
                return *r;
            }
            let request = t.futures.open();
            t.submit(
                model_id,
                req.seq_id,
                Work::Load {
                    request: request.clone(),
                    model_id: model_id.clone(),
                    dir,
                    optimizer: req.optimizer,
                    create: false,
                },
            );
            future(&request, Some(model_id))
        }
        (None, Some(session), Some(seq)) => {
            if let Err(r) = open_session(&t, session) {
                return *r;
            }
            let rank = match crate::model::peft::read_config_with_head(&dir) {
                Ok((c, _)) => c.r,
                Err(e) => return refuse(StatusCode::BAD_REQUEST, format!("load_weights: {e:#}")),
            };
            // The SDK names the new client itself: `<session>:train:<model_seq_id>`.
            let model_id = format!("{session}:train:{seq}");
            {
                let mut books = t.books.lock().expect("books lock");
                if let Err(r) = room_for_model(&books) {
                    return *r;
                }
                books.models.insert(
                    model_id.clone(),
                    ModelInfo {
                        session: session.clone(),
                        rank,
                    },
                );
                books.gate.open(&model_id, 1);
            }
            let request = open_creating(&t, &model_id);
            t.submit(
                &model_id,
                None,
                Work::Load {
                    request: request.clone(),
                    model_id: model_id.clone(),
                    dir,
                    optimizer: req.optimizer,
                    create: true,
                },
            );
            future(&request, Some(&model_id))
        }
        _ => refuse(
            StatusCode::BAD_REQUEST,
            "load_weights needs model_id, or session_id and model_seq_id",
        ),
    }
}

/// Opens the future of an operation that creates `model_id`: if it fails, the model
/// leaves the books before the failure can be read, so that `get_info` does not report a
/// client that never came to be.
fn open_creating(t: &Arc<Tinker>, model_id: &str) -> String {
    let (t, model_id) = (t.clone(), model_id.to_string());
    t.clone().futures.open_then(move |outcome| {
        if matches!(outcome, Settled::Failed { .. }) {
            let mut books = t.books.lock().expect("books lock");
            books.models.remove(&model_id);
            books.gate.close(&model_id);
        }
    })
}

async fn create_sampling_session(State(t): State<Arc<Tinker>>, body: Bytes) -> Response {
    let req: wire::CreateSamplingSession = match parse(&body, "create_sampling_session") {
        Ok(r) => r,
        Err(r) => return *r,
    };
    if let Err(r) = open_session(&t, &req.session_id) {
        return *r;
    }
    let weights = match (&req.model_path, &req.base_model) {
        (Some(path), _) => {
            let dir = match t.checkpoint_dir(path) {
                Ok(d) => d,
                Err(e) => return refuse(StatusCode::BAD_REQUEST, format!("model_path: {e}")),
            };
            SamplerWeights::Saved {
                key: path.clone(),
                dir: Some(dir),
            }
        }
        (None, Some(base)) => {
            if let Err(r) = check_base(&t, base) {
                return *r;
            }
            SamplerWeights::Base
        }
        (None, None) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                "create_sampling_session needs model_path or base_model",
            );
        }
    };
    let id = format!("{}:sample:{}", req.session_id, req.sampling_session_seq_id);
    t.books.lock().expect("books lock").samplers.insert(
        id.clone(),
        SamplerInfo {
            weights,
            model_path: req.model_path.clone(),
        },
    );
    ok(json!({"type": "create_sampling_session", "sampling_session_id": id}))
}

async fn sampler_info(State(t): State<Arc<Tinker>>, Path(id): Path<String>) -> Response {
    match t.books.lock().expect("books lock").samplers.get(&id) {
        Some(s) => ok(json!({
            "sampler_id": id,
            "base_model": t.base.name,
            "model_path": s.model_path,
        })),
        None => refuse(
            StatusCode::NOT_FOUND,
            format!("unknown sampling session {id:?}"),
        ),
    }
}

async fn asample(State(t): State<Arc<Tinker>>, body: Bytes) -> Response {
    let req: wire::Sample = match parse(&body, "asample") {
        Ok(r) => r,
        Err(r) => return *r,
    };
    let weights = match (&req.sampling_session_id, &req.model_path, &req.base_model) {
        (Some(id), _, _) => match t.books.lock().expect("books lock").samplers.get(id) {
            Some(s) => s.weights.clone(),
            None => {
                return refuse(
                    StatusCode::NOT_FOUND,
                    format!("unknown sampling session {id:?} (create_sampling_client first)"),
                );
            }
        },
        (None, Some(path), _) => match t.checkpoint_dir(path) {
            Ok(dir) => SamplerWeights::Saved {
                key: path.clone(),
                dir: Some(dir),
            },
            Err(e) => return refuse(StatusCode::BAD_REQUEST, format!("model_path: {e}")),
        },
        (None, None, Some(base)) => match check_base(&t, base) {
            Ok(()) => SamplerWeights::Base,
            Err(r) => return *r,
        },
        (None, None, None) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                "asample needs sampling_session_id, model_path or base_model",
            );
        }
    };
    if req.num_samples == 0 || req.num_samples > MAX_SAMPLES {
        return refuse(
            StatusCode::BAD_REQUEST,
            format!(
                "num_samples must be 1 to {MAX_SAMPLES}, got {}",
                req.num_samples
            ),
        );
    }
    use std::sync::atomic::Ordering;
    let n = req.num_samples;
    if t.in_flight.fetch_add(n, Ordering::AcqRel) + n > MAX_IN_FLIGHT {
        t.in_flight.fetch_sub(n, Ordering::AcqRel);
        return refuse(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "the server is sampling {MAX_IN_FLIGHT} sequences, its most: try again shortly"
            ),
        );
    }
    // Counted out when the request is settled, before its samples can be read.
    let request = {
        let t = t.clone();
        t.clone()
            .futures
            .open_then(move |_| _ = t.in_flight.fetch_sub(n, Ordering::AcqRel))
    };
    let ids: Vec<String> = (0..req.num_samples)
        .map(|j| format!("{request}:seq{j}"))
        .collect();
    let work = match sample_job(&req, &request, weights, &t.base) {
        Ok(job) => Work::Sample(job),
        Err(message) => Work::Fail {
            request: request.clone(),
            message,
        },
    };
    t.send(vec![work]);
    ok(json!({"request_id": request, "sample_sequence_ids": ids}))
}

async fn retrieve_future(State(t): State<Arc<Tinker>>, body: Bytes) -> Response {
    let req: wire::RetrieveFuture = match parse(&body, "retrieve_future") {
        Ok(r) => r,
        Err(r) => return *r,
    };
    match t.futures.wait(&req.request_id, poll()).await {
        Ok(outcome) => match &*outcome {
            Settled::Json(v) => ok(v.clone()),
            Settled::Proto(bytes) => (
                [(header::CONTENT_TYPE, "application/x-protobuf")],
                bytes.clone(),
            )
                .into_response(),
            Settled::Failed { message, category } => ok(json!(wire::Failed {
                error: message.clone(),
                category,
            })),
        },
        // 408 with a try_again body: the SDK polls again at once, without a warning.
        Err(Waited::Pending) => (
            StatusCode::REQUEST_TIMEOUT,
            axum::Json(
                json!({"type": "try_again", "request_id": req.request_id, "queue_state": "active"}),
            ),
        )
            .into_response(),
        Err(Waited::Unknown) => refuse(
            StatusCode::NOT_FOUND,
            format!(
                "unknown request_id {:?} (results are kept {} minutes)",
                req.request_id,
                super::futures::KEEP.as_secs() / 60
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `serve --tinker --seed N`: clients that bring no seed take N, N + 1, … in the
    /// order they are created; without it each draws its own.
    #[test]
    fn clients_without_a_seed_take_the_servers_in_turn() {
        let make = || {
            let (tx, _rx) = std::sync::mpsc::channel();
            Tinker::new(Base::for_tests(), Arc::default(), std::env::temp_dir(), tx)
        };
        let seeded = make().with_seed(Some(5));
        assert_eq!(
            [seeded.unseeded(), seeded.unseeded(), seeded.unseeded()],
            [5, 6, 7]
        );
        let drawn = make();
        assert_ne!(drawn.unseeded(), drawn.unseeded());
    }

    /// Issue 68: a session whose client went silent (no heartbeat, no call) past the
    /// timeout is ended and its training clients unloaded; a live one is kept, and a call
    /// naming a session counts as a sign of life.
    #[test]
    fn silent_sessions_are_ended_and_their_adapters_freed() {
        let (tx, rx) = std::sync::mpsc::channel();
        let t = Tinker::new(Base::for_tests(), Arc::default(), std::env::temp_dir(), tx);
        let long_ago = std::time::Instant::now() - std::time::Duration::from_secs(120);
        {
            let mut books = t.books.lock().unwrap();
            for (id, seen) in [("sess-gone", long_ago), ("sess-live", long_ago)] {
                books
                    .sessions
                    .insert(id.into(), SessionBook { done: false, seen });
                books.models.insert(
                    format!("{id}:train:0"),
                    ModelInfo {
                        session: id.into(),
                        rank: 8,
                    },
                );
            }
        }
        // A call naming the live session refreshes it.
        assert!(open_session(&t, "sess-live").is_ok());
        assert_eq!(t.end_silent(std::time::Duration::from_secs(60)), 1);
        let books = t.books.lock().unwrap();
        assert!(books.sessions["sess-gone"].done && !books.sessions["sess-live"].done);
        assert_eq!(
            books.models.keys().collect::<Vec<_>>(),
            ["sess-live:train:0"]
        );
        drop(books);
        match rx.try_recv() {
            Ok(Work::Unload { model_ids }) => assert_eq!(model_ids, ["sess-gone:train:0"]),
            _ => panic!("no unload"),
        }
        assert!(open_session(&t, "sess-gone").is_err());
    }

    /// Issue 68, point 13: AdamW's settings outside where it is defined are refused by
    /// name; a NaN, which the SDK sends as `null`, too.
    #[test]
    fn adam_settings_are_checked_by_name() {
        let adam = |v: Value| -> wire::AdamParams { serde_json::from_value(v).unwrap() };
        assert!(adam(json!({"learning_rate": 1e-4})).check().is_ok());
        for (v, name) in [
            (json!({"learning_rate": 1e30}), "learning_rate"),
            (json!({"learning_rate": null}), "learning_rate"),
            (json!({"learning_rate": 1e-4, "beta1": 1.0}), "beta1"),
            (json!({"learning_rate": 1e-4, "beta2": 1.5}), "beta2"),
            (json!({"learning_rate": 1e-4, "eps": 0.0}), "eps"),
            (json!({"learning_rate": 1e-4, "eps": -1.0}), "eps"),
            (json!({"learning_rate": 1e-4, "eps": null}), "eps"),
            (
                json!({"learning_rate": 1e-4, "weight_decay": -1e6}),
                "weight_decay",
            ),
            (
                json!({"learning_rate": 1e-4, "grad_clip_norm": -1.0}),
                "grad_clip_norm",
            ),
        ] {
            let e = adam(v.clone()).check().unwrap_err();
            assert!(
                e.starts_with(&format!("adam_params.{name} must be")),
                "{v}: {e}"
            );
        }
    }

    /// Issue 68, point 3: a rank without bound was allocated (killed for memory) or
    /// overflowed (a panic that ended the server with status 0).
    #[test]
    fn the_lora_rank_is_bounded() {
        for rank in [0, 129, 1_000_000, usize::MAX] {
            let e = super::super::adapter::lora_config(rank, true, true, false).unwrap_err();
            assert!(
                e.to_string().contains("rank must be 1 to 128"),
                "{rank}: {e}"
            );
        }
        assert!(super::super::adapter::lora_config(128, true, true, false).is_ok());
    }

    /// Issue 68, point 9: request and session ids are 96 random bits, not a counter that
    /// let a second client read the first one's model id.
    #[test]
    fn ids_are_not_guessable() {
        let f = Futures::default();
        let (a, b) = (f.open(), f.open());
        assert_ne!(a, b);
        for id in [&a, &b] {
            let hex = id.strip_prefix("req-").unwrap();
            assert_eq!(hex.len(), 24, "{id}");
            assert!(hex.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
        }
        assert_eq!(new_session_id().len(), "sess-".len() + 24);
    }
}
