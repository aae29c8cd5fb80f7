//! A local Tinker: the Tinker training API (Thinking Machines' `forward_backward`,
//! `optim_step`, `save_weights_for_sampler`, `sample`) served by rlhost, so that scripts
//! written against the official `tinker` SDK run their own loop on one's own machine.
//! Many training clients share one loaded base model, each with its own LoRA adapter and
//! AdamW state ([`adapter`]).
//!
//! `rlhost serve --tinker` starts it ([`serve`]); the wire is the SDK's (JSON, and
//! protobuf for forward/backward and sampling: [`proto`], [`wire`]; a forward/backward's
//! datums decoded and checked by [`datum`]); operations are
//! futures the SDK polls ([`futures`]), run in each client's order ([`gate`]) on the
//! model's thread ([`worker`]).

pub mod adapter;
pub mod datum;
pub mod futures;
pub mod gate;
pub mod losses;
pub mod paths;
pub mod prompt;
pub mod proto;
pub mod replies;
pub mod sample_request;
pub mod server;
pub mod snapshots;
pub mod wire;
pub mod worker;

use crate::model::LanguageModel;
use crate::sampler::kv_budget;
use anyhow::{Context, Result};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

/// A running server: its address and the model's thread to wait on.
pub struct Serving {
    pub addr: SocketAddr,
    pub tinker: Arc<server::Tinker>,
    pub worker: std::thread::JoinHandle<()>,
}

/// Where and how the server listens, and how it seeds the clients that bring no seed.
pub struct Listen<'a> {
    pub addr: &'a str,
    pub max_connections: usize,
    /// Every route but health needs it (`--api-key`).
    pub key: Option<String>,
    /// A session silent this long is ended ([`server::Tinker::end_silent`]).
    pub session_timeout: std::time::Duration,
    /// MiB of keys and values sampling may hold at once (`--kv-budget-mib`; `None`:
    /// [`crate::sampler::kv_budget::default_mib`]).
    pub kv_budget_mib: Option<u64>,
    /// The first seed of the training clients created without one (`--seed`;
    /// [`server::Tinker::with_seed`]).
    pub seed: Option<u64>,
}

/// Serves the Tinker API on `addr` with `lm` as the base model named `name` (also accepted
/// under the names in `also` and its directory's path), checkpoints under `root`.
pub fn serve(
    mut lm: LanguageModel,
    name: String,
    also: Vec<String>,
    root: PathBuf,
    listen: Listen,
) -> Result<Serving> {
    let Listen {
        addr,
        max_connections,
        key,
        session_timeout,
        kv_budget_mib,
        seed,
    } = listen;
    lm.sample_tokens_only();
    adapter::attach_host(&mut lm.model)?;
    std::fs::create_dir_all(&root)
        .with_context(|| format!("cannot create the checkpoint directory {}", root.display()))?;
    let root = root
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", root.display()))?;
    let dir = lm.dir.canonicalize().unwrap_or_else(|_| lm.dir.clone());
    let base = sample_request::Base {
        name: name.clone(),
        aliases: also
            .into_iter()
            .chain(std::iter::once(dir.display().to_string()))
            .collect(),
        arch: format!("{:?}", lm.model.cfg.arch).to_lowercase(),
        tokenizer_dir: dir.display().to_string(),
        // The tokenizer's ids: the head's padding rows past it are never sampled.
        vocab: lm.model.vocab(),
        context: lm.model.cfg.max_position_embeddings,
        eos: lm.eos_token_ids.clone(),
    };
    let futures = Arc::new(futures::Futures::default());
    let (tx, rx) = std::sync::mpsc::channel();
    let tinker = Arc::new(server::Tinker::new(base, futures.clone(), root, tx).with_seed(seed));
    let app = {
        let t = tinker.clone();
        Box::new(move || server::router(t))
    };
    let policy = crate::front::Policy::new(
        "tinker server",
        max_connections,
        server::MAX_BODY,
        &["/api/v1/healthz"],
        replies::refuse,
    )
    .with_key(key);
    let addr = crate::front::spawn(addr, policy, app)?;
    // Operations held for a turn that never came are let go on a timer, and sessions
    // whose client went silent are ended on the same one.
    {
        let t = Arc::downgrade(&tinker);
        std::thread::Builder::new()
            .name("rlhost-tinker-gate".into())
            .spawn(move || {
                while let Some(t) = t.upgrade() {
                    t.release_late();
                    t.end_silent(session_timeout);
                    drop(t);
                    std::thread::sleep(std::time::Duration::from_secs(1));
                }
            })
            .context("cannot start the gate's thread")?;
    }
    let worker = std::thread::Builder::new()
        .name("rlhost-tinker-model".into())
        .spawn(move || {
            let mib = kv_budget_mib.unwrap_or_else(|| kv_budget::default_mib(&lm.model));
            let kv = kv_budget::KvBudget::new(&lm.model, mib);
            worker::Worker::new(lm, name, futures, kv).run(&rx)
        })
        .context("cannot start the model's thread")?;
    Ok(Serving {
        addr,
        tinker,
        worker,
    })
}
