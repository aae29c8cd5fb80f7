//! The model's side of the gateway: on the thread that owns the model, requests queued by
//! the HTTP handlers are admitted into one [`Sampler`] and decoded together, a burst of
//! them that wakes an idle sampler gathered first. A streamed request's tokens go back on
//! its own channel as they are drawn, another's with its end. A request whose caller went
//! away (its channel closed) is dropped at the next step.
//!
//! The same loop ([`serve`]) drives the vLLM servers' side of the sampler seam
//! ([`with_sampler`], `sampler/servers.rs`): each choice is one token-in/token-out
//! completion there, replayed through the local sampler's stop rule, its tokens sent when
//! the server's answer comes (a streamed call gets them in one burst).
//!
//! In a training run the trainer calls [`pump`] between updates, with `stop` saying when
//! enough sessions have ended: requests that arrive while it updates wait in the queue
//! (or are refused with a 503 by the handlers, as the run is set).

use crate::model::{LanguageModel, Mode};
use crate::sampler::decode::Completion;
use crate::sampler::servers::Servers;
use crate::sampler::vllm::Pool;
use crate::sampler::{Request, Sampler, Sampling, Sink, Token};
use anyhow::Result;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};
use tokio::runtime::Handle;
use tokio::sync::mpsc::UnboundedSender;

/// A request and where its tokens go.
pub struct Job {
    pub request: Request,
    pub tx: UnboundedSender<Emitted>,
    /// Whether the caller wants each token as it is drawn (a streamed call); otherwise a
    /// choice's tokens come together with its end.
    pub stream: bool,
}

/// What a request's channel carries.
#[derive(Debug)]
pub enum Emitted {
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
    tx: UnboundedSender<Emitted>,
    version: u64,
    /// A call that is not streamed: its tokens, kept until their choice ends. Sent one by
    /// one, each would wake the caller's handler for nothing (64 sessions' tokens are
    /// thousands of wake-ups a second on the cores that decode).
    held: Option<Vec<Token>>,
}

impl Sink for Channel {
    fn token(&mut self, token: Token) -> bool {
        match &mut self.held {
            Some(held) => {
                held.push(token);
                !self.tx.is_closed()
            }
            None => self.tx.send(Emitted::Token(token)).is_ok(),
        }
    }

    fn done(&mut self, choice: usize, completion: Completion) {
        if let Some(held) = &mut self.held {
            for t in held.extract_if(.., |t| t.choice == choice) {
                let _ = self.tx.send(Emitted::Token(t));
            }
        }
        let _ = self.tx.send(Emitted::Done {
            choice,
            completion,
            version: self.version,
        });
    }

    fn failed(&mut self, message: &str) {
        let _ = self.tx.send(Emitted::Failed(message.to_string()));
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
                Ok(job) => {
                    admit(sampler, job, version, &mut pumped);
                    open = gather_burst(sampler, jobs, version, &mut pumped);
                }
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

/// How long an idle sampler waits for the next call of a burst, and for the whole burst.
const BURST_QUIET: Duration = Duration::from_millis(2);
const BURST_MAX: Duration = Duration::from_millis(20);

/// Admits the rest of a burst that woke an idle sampler: calls that come within
/// [`BURST_QUIET`] of each other (for at most [`BURST_MAX`]). A group's or a batch of
/// sessions' calls arrive over a few milliseconds; stepping on the first alone would
/// prefill the others one step at a time, each joining a step later and finishing a step
/// later. A lone call waits [`BURST_QUIET`] once, before its first token. False when the
/// queue's senders are all gone.
fn gather_burst<'t>(
    sampler: &mut dyn Sampling<'t>,
    jobs: &Receiver<Job>,
    version: u64,
    pumped: &mut Pumped,
) -> bool {
    let until = Instant::now() + BURST_MAX;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return true;
        }
        match jobs.recv_timeout(BURST_QUIET.min(left)) {
            Ok(job) => admit(sampler, job, version, pumped),
            Err(RecvTimeoutError::Timeout) => return true,
            Err(RecvTimeoutError::Disconnected) => return false,
        }
    }
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
            held: (!job.stream).then(Vec::new),
        }),
    );
}
