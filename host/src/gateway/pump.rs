//! The model's side of the gateway: on the thread that owns the model, requests queued by
//! the HTTP handlers are admitted into one [`Sampler`] and decoded together, each token
//! sent back on the request's own channel as it is drawn. A request whose caller went
//! away (its channel closed) is dropped at the next step.
//!
//! The same loop ([`serve`]) drives the vLLM servers' side of the sampler seam
//! ([`with_sampler`], `rollout/servers.rs`): each choice is one token-in/token-out
//! completion there, replayed through the local sampler's stop rule, its tokens sent when
//! the server's answer comes (a streamed call gets them in one burst).
//!
//! In a training run the trainer calls [`pump`] between updates, with `stop` saying when
//! enough sessions have ended: requests that arrive while it updates wait in the queue
//! (or are refused with a 503 by the handlers, as the run is set).

use crate::model::generate::Completion;
use crate::model::sampler::{Request, Sampler, Sampling, Sink, Token};
use crate::model::{LanguageModel, Mode};
use crate::rollout::servers::Servers;
use crate::rollout::vllm::Pool;
use anyhow::Result;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::Duration;
use tokio::runtime::Handle;
use tokio::sync::mpsc::UnboundedSender;

/// A request and where its tokens go.
pub struct Job {
    pub request: Request,
    pub tx: UnboundedSender<Event>,
}

/// What a request's channel carries.
#[derive(Debug)]
pub enum Event {
    Token(Token),
    /// A choice ended, sampled by the policy of `version`.
    Done {
        choice: usize,
        completion: Completion,
        version: u64,
    },
    /// Nothing more comes: the request failed (the message says why).
    Failed(String),
}

struct Channel {
    tx: UnboundedSender<Event>,
    version: u64,
}

impl Sink for Channel {
    fn token(&mut self, token: Token) -> bool {
        self.tx.send(Event::Token(token)).is_ok()
    }

    fn done(&mut self, choice: usize, completion: Completion) {
        let _ = self.tx.send(Event::Done {
            choice,
            completion,
            version: self.version,
        });
    }

    fn failed(&mut self, message: &str) {
        let _ = self.tx.send(Event::Failed(message.to_string()));
    }
}

/// What [`pump`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pumped {
    pub requests: u64,
    pub forwards: u64,
}

/// Serves queued requests with `lm` (policy `version`) in process until `stop` says so and
/// nothing is being sampled, or the queue's senders are all gone. A model error fails the
/// requests in flight (their callers get an error) and serving goes on.
pub fn pump(
    lm: &LanguageModel,
    mode: Mode,
    jobs: &Receiver<Job>,
    version: u64,
    stop: &dyn Fn() -> bool,
) -> Result<Pumped> {
    serve(
        &mut Sampler::new(&lm.model, &lm.tokenizer, mode),
        jobs,
        version,
        stop,
    )
}

/// Runs `f` with the sampler a run samples with: in process with `mode`, or, given
/// `remote`, on its vLLM servers with `mode`'s adapter as version `version` (written and
/// loaded on every server first, and held while `f` runs). With no server left the calls
/// fail, and so does the run (as a plugin run on vLLM does).
pub fn with_sampler<'t, R>(
    lm: &'t LanguageModel,
    mode: Mode<'t>,
    version: u64,
    remote: Option<&Arc<Pool>>,
    handle: &Handle,
    f: impl FnOnce(&mut dyn Sampling<'t>) -> R,
) -> Result<R> {
    match remote {
        None => Ok(f(&mut Sampler::new(&lm.model, &lm.tokenizer, mode))),
        Some(pool) => {
            let model = pool.acquire(lm, mode, version)?;
            let mut servers = Servers::new(pool.clone(), model, &lm.tokenizer, handle.clone());
            let r = f(&mut servers);
            drop(servers);
            pool.release(version, mode, lm);
            Ok(r)
        }
    }
}

/// The one loop over the sampler seam: queued calls join the sampler as they come (a
/// stopping pump admits nothing new: those wait for the next version), and it steps until
/// `stop` says so and nothing is being sampled.
pub fn serve<'t>(
    sampler: &mut dyn Sampling<'t>,
    jobs: &Receiver<Job>,
    version: u64,
    stop: &dyn Fn() -> bool,
) -> Result<Pumped> {
    let mut pumped = Pumped::default();
    let mut open = true;
    loop {
        let stopping = stop();
        if sampler.pending() == 0 {
            if stopping || !open {
                break;
            }
            // Idle: wait for a request, looking at `stop` now and then.
            match jobs.recv_timeout(Duration::from_millis(50)) {
                Ok(job) => admit(sampler, job, version, &mut pumped),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => open = false,
            }
        }
        // Everything queued joins this step.
        while open && !stopping {
            match jobs.try_recv() {
                Ok(job) => admit(sampler, job, version, &mut pumped),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => open = false,
            }
        }
        if !sampler.step()? {
            // Every call is on a server: its answer (or a new call) comes in a moment.
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    pumped.forwards = sampler.forwards();
    Ok(pumped)
}

fn admit<'t>(sampler: &mut dyn Sampling<'t>, job: Job, version: u64, pumped: &mut Pumped) {
    if job.tx.is_closed() {
        return;
    }
    pumped.requests += 1;
    sampler.admit(
        job.request,
        Box::new(Channel {
            tx: job.tx,
            version,
        }),
    );
}
