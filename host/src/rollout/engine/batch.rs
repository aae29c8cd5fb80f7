//! One batch while the engine samples it: the events that reach its loop (what answers
//! turns, the sampler's tokens, scores), the sink that turns the sampler's tokens into
//! events, and the batch's trajectories and figures.

use super::super::env::{Reply, TrajectorySessions};
use super::super::live::Live;
use super::super::reward::Scored;
use super::super::stats::BatchStats;
use super::super::trajectory::{Group, Trajectory};
use crate::plugin::model::{CallTally, GenerateCall};
use crate::plugin::{Fault, ForkError};
use crate::sampler::decode::Completion;
use crate::sampler::{Sink, Token};
use crate::task::Sample;
use anyhow::{Result, bail};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// What reaches the batch's loop: what answers turns, and the sampler's tokens.
pub(super) enum Arrival {
    /// Trajectory `usize`'s sessions opened (the faults of those that did not).
    Opened(usize, TrajectorySessions, Vec<Fault>),
    /// A firing or a turn answered: the trajectory's sessions back, with the reply.
    Answered(usize, TrajectorySessions, Reply),
    /// A token the sampler drew for trajectory `usize`'s request number `u64`.
    Token(usize, u64, Token),
    /// The sampler ended that request (its own stop rule, or a prefill).
    Ended(usize, u64),
    /// The sampler could not sample for it (the message says why).
    Unsampled(usize, String),
    /// A vLLM server answered: the loop steps the sampler.
    Wake,
    Scored(usize, Vec<Scored>, Duration),
    /// A plugin's `model.generate` call, within its grant.
    Generate(GenerateCall),
    /// Branch `usize`'s sessions forked from its parent's (tree rollouts), or why not,
    /// and how long the fork took.
    Forked(usize, Result<TrajectorySessions, ForkError>, Duration),
}

/// Where the sampler's tokens for a trajectory's request go: the batch's loop, as events
/// (choice `c` of the request is trajectory `first + c`).
pub(super) struct ToLoop {
    pub first: usize,
    pub request: u64,
    pub tx: mpsc::Sender<Arrival>,
}

impl Sink for ToLoop {
    fn token(&mut self, token: Token) -> bool {
        let t = self.first + token.choice;
        self.tx.send(Arrival::Token(t, self.request, token)).is_ok()
    }

    fn done(&mut self, choice: usize, _: Completion) {
        let _ = self
            .tx
            .send(Arrival::Ended(self.first + choice, self.request));
    }

    fn failed(&mut self, message: &str) {
        let _ = self
            .tx
            .send(Arrival::Unsampled(self.first, message.to_string()));
    }
}

/// One batch while it is sampled: its trajectories, the plugin answers on their way, and
/// where the time went.
pub(super) struct InFlight<'t> {
    pub lives: Vec<Live<'t>>,
    /// Each trajectory once it has finished.
    pub done: Vec<Option<Trajectory>>,
    pub stats: BatchStats,
    /// Trajectories sent to be scored, and those scored.
    pub scoring: usize,
    pub scored: usize,
    /// Where plugin calls (and the sampler's sinks) send their events, and where the loop
    /// reads them.
    pub tx: mpsc::Sender<Arrival>,
    pub rx: mpsc::Receiver<Arrival>,
    /// Tokens sampled for plugins' `model.generate` calls.
    pub asked: Arc<AtomicUsize>,
    /// The outcomes of those calls (and of the refused ones) by plugin.
    pub tally: Arc<CallTally>,
    /// Whether vLLM servers sample (a wait for them is the servers' time).
    pub remote: bool,
    /// Whether the sampler has stepped once (the first step is the prefill).
    pub prefilled: bool,
}

impl InFlight<'_> {
    /// Whether anything is left: a trajectory not handed over, a score, a request.
    pub fn unfinished(&self, pending: usize) -> bool {
        pending > 0 || self.scored < self.scoring || self.done.iter().any(Option::is_none)
    }

    /// The next event: one that has come (`None` if none has), or with `wait` the next
    /// to come within it, the wait counted as the servers' time when a request is on a
    /// server, else as the plugins'.
    pub fn next_event(&mut self, wait: Option<Duration>) -> Result<Option<Arrival>> {
        let Some(wait) = wait else {
            return Ok(self.rx.try_recv().ok());
        };
        let w = Instant::now();
        let event = match self.rx.recv_timeout(wait) {
            Ok(event) => Some(event),
            Err(mpsc::RecvTimeoutError::Timeout) => None,
            Err(mpsc::RecvTimeoutError::Disconnected) => bail!("plugin worker pool stopped"),
        };
        if self.remote && self.lives.iter().any(|l| l.ticket.is_some()) {
            self.stats.server_wait_s += w.elapsed().as_secs_f64();
        } else {
            self.stats.plugin_wait_s += w.elapsed().as_secs_f64();
        }
        Ok(event)
    }

    /// The finished trajectories by sample, and the batch's figures. A tree's
    /// trajectories are put in the order of their paths (chain, then child at each
    /// branch), which does not depend on when each branch was reached, and numbered so.
    pub fn into_groups(
        self,
        samples: &[(u64, Sample)],
        group_size: usize,
        t0: Instant,
    ) -> (Vec<Group>, BatchStats) {
        let mut groups: Vec<Group> = samples
            .iter()
            .map(|(id, _)| Group {
                sample_id: *id,
                trajectories: Vec::with_capacity(group_size),
            })
            .collect();
        let mut stats = self.stats;
        stats.trajectories = self.done.len();
        stats.asked_tokens = self.asked.load(Ordering::Relaxed);
        stats.generate_calls = self.tally.snapshot();
        stats.generate_wait_s = self.tally.wait_s();
        for (traj, l) in self.done.into_iter().zip(&self.lives) {
            groups[l.sample]
                .trajectories
                .push(traj.expect("every trajectory finished"));
        }
        for g in &mut groups {
            if g.trajectories.iter().any(|t| t.tree.is_some()) {
                g.trajectories.sort_by(|a, b| {
                    a.tree
                        .as_ref()
                        .map(|p| &p.path)
                        .cmp(&b.tree.as_ref().map(|p| &p.path))
                });
                for (index, t) in g.trajectories.iter_mut().enumerate() {
                    t.index = index;
                }
            }
        }
        stats.wall_s = t0.elapsed().as_secs_f64();
        (groups, stats)
    }
}
