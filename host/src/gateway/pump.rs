//! The model's side of the gateway: on the thread that owns the model, requests queued by
//! the HTTP handlers are admitted into one [`Sampler`] and decoded together, each token
//! sent back on the request's own channel as it is drawn. A request whose caller went
//! away (its channel closed) is dropped at the next step.
//!
//! In a training run the trainer calls [`pump`] between updates, with `stop` saying when
//! enough sessions have ended: requests that arrive while it updates wait in the queue
//! (or are refused with a 503 by the handlers, as the run is set).

use crate::model::generate::Completion;
use crate::model::sampler::{Request, Sampler, Sink, Token};
use crate::model::{LanguageModel, Mode};
use anyhow::Result;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;
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

/// Serves queued requests with `lm` (policy `version`) until `stop` says so and nothing
/// is being sampled, or the queue's senders are all gone. A model error fails the
/// requests in flight (their callers get an error) and serving goes on.
pub fn pump(
    lm: &LanguageModel,
    mode: Mode,
    jobs: &Receiver<Job>,
    version: u64,
    stop: &dyn Fn() -> bool,
) -> Result<Pumped> {
    let mut sampler = Sampler::new(&lm.model, &lm.tokenizer, mode);
    let mut pumped = Pumped::default();
    loop {
        let stopping = stop();
        if sampler.is_empty() {
            if stopping {
                break;
            }
            // Idle: wait for a request, looking at `stop` now and then.
            match jobs.recv_timeout(Duration::from_millis(50)) {
                Ok(job) => admit(&mut sampler, job, version, &mut pumped),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        // Everything queued joins this step (a stopping pump admits nothing new: those
        // wait for the next version).
        while !stopping && let Ok(job) = jobs.try_recv() {
            admit(&mut sampler, job, version, &mut pumped);
        }
        if let Err(e) = sampler.step() {
            tracing::error!("gateway: a decode step failed: {e:#}");
        }
    }
    pumped.forwards = sampler.forwards;
    Ok(pumped)
}

fn admit<'t>(sampler: &mut Sampler<'t>, job: Job, version: u64, pumped: &mut Pumped) {
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
