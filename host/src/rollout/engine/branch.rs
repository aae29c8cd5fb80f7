//! Tree rollouts' branch points (`rollout/tree.rs`): a trajectory just answered splits
//! into the tree's branch factor (with the entropy rule, once the tokens it samples next
//! say it is unsure, from where it was when answered). It goes on as child 0; each other
//! child is a copy of it (ids, text, counts, conversation) on a copy-on-write fork of its
//! KV cache, drawing from its own seed, with its plugin sessions forked on the worker
//! pool. The trajectory that branches waits for the forks, since they are made from its
//! sessions, and then every branch decodes with the rest of the batch.

use super::super::env::TrajectorySessions;
use super::super::live::{Live, Probe, State};
use super::super::trajectory::{FaultRecord, StopReason};
use super::super::tree::BranchAt;
use super::Engine;
use super::batch::{Arrival, InFlight};
use crate::plugin::ForkError;
use crate::sampler::decode::sample_seed;
use crate::sampler::{Held, Sampling};
use std::time::{Duration, Instant};

impl<'a> Engine<'a> {
    /// Whether trajectory `l`, just answered (`new_turn`: the answer ends its turn and a
    /// new one starts), may branch here: it goes on, the tree branches at such answers,
    /// and its path has branched fewer than `max_depth` times. With the entropy rule the
    /// branch point is only measured from here ([`Self::measure`]).
    pub(super) fn branches_here(&self, l: &Live, new_turn: bool) -> bool {
        let Some(tree) = &self.settings.tree else {
            return false;
        };
        l.state == State::Active
            && (tree.branch_at != BranchAt::Turn || new_turn)
            && l.tree.as_ref().is_some_and(|p| p.depth() < tree.max_depth)
    }

    /// At a branch point: branches now, or with the entropy rule keeps the trajectory as
    /// it is here (its cache forked) to branch from once the next tokens are measured.
    pub(super) fn at_branch_point(&self, b: &mut InFlight<'a>, t: usize) {
        let tree = self
            .settings
            .tree
            .as_ref()
            .expect("branches only in tree rollouts");
        if tree.branch_at != BranchAt::Entropy {
            return self.branch(b, t, None);
        }
        let l = &mut b.lives[t];
        let at = l.ids.tokens.len() - l.ids.prompt_len;
        let place = l
            .tree
            .clone()
            .expect("a tree rollout's trajectory has a place");
        // The copy's generator is never drawn from: each branch forks it with its own.
        let held = fork_held(&mut l.held, l.seed);
        let there = l.branch(t, l.index, place, l.seed, held);
        l.probe = Some(Box::new(Probe {
            at,
            there,
            tokens: 0,
            surprisal: 0.0,
        }));
    }

    /// Counts a token trajectory `t` sampled after a branch point under measurement (its
    /// log-prob `logp`); once the window is full, branches there if its mean surprisal
    /// reaches the threshold. A call or the turn's end before the window is full ends the
    /// measurement without a branch: its sessions have moved on from the branch point.
    pub(super) fn measure<'m>(
        &self,
        b: &mut InFlight<'a>,
        t: usize,
        logp: f32,
        sampler: &mut dyn Sampling<'m>,
    ) where
        'a: 'm,
    {
        let tree = self
            .settings
            .tree
            .as_ref()
            .expect("probes only in tree rollouts");
        let l = &mut b.lives[t];
        if l.state != State::Active {
            l.probe = None;
            return;
        }
        let Some(probe) = l.probe.as_mut() else {
            return;
        };
        probe.tokens += 1;
        probe.surprisal -= logp as f64;
        if probe.tokens < tree.entropy_window {
            return;
        }
        let probe = l.probe.take().expect("measured above");
        b.stats.branch_probes += 1;
        if probe.surprisal / probe.tokens as f64 >= tree.entropy_threshold {
            // Its request stops where it is (its cache kept), as at a tool's firing, while
            // its sessions are forked; it resumes once they are back.
            Self::release(l, sampler);
            self.branch(b, t, Some(probe));
        }
    }

    /// Splits trajectory `t` at a branch point: its current end, or `probe`'s (then the
    /// branches are copies of it as it was there): it becomes child 0, and children
    /// 1..k are added to the batch, each waiting for its sessions' fork.
    fn branch(&self, b: &mut InFlight<'a>, t: usize, probe: Option<Box<Probe<'a>>>) {
        let tree = self
            .settings
            .tree
            .as_ref()
            .expect("branches only in tree rollouts");
        let l = &b.lives[t];
        let place = l
            .tree
            .clone()
            .expect("a tree rollout's trajectory has a place");
        let (at, mut there) = match probe {
            Some(p) => (p.at, Some(p.there)),
            None => (l.ids.tokens.len() - l.ids.prompt_len, None),
        };
        let sample = l.sample;
        let in_group = b.lives.iter().filter(|l| l.sample == sample).count();
        let mut children = Vec::with_capacity(tree.branch_factor - 1);
        for c in 1..tree.branch_factor {
            let child = place.branched(c as u32, at);
            let new_t = b.lives.len();
            let source = match there.as_mut() {
                Some(there) => there,
                None => &mut b.lives[t],
            };
            // A branch's seed follows from its parent's and its place, never from when
            // the branch point was reached.
            let seed = sample_seed(source.seed, child.depth(), c);
            let held = fork_held(&mut source.held, seed);
            let live = source.branch(new_t, in_group + c - 1, child, seed, held);
            b.lives.push(live);
            b.done.push(None);
            children.push((new_t, seed, self.link(&b.tx, &b.tally, seed)));
        }
        let l = &mut b.lives[t];
        let mut sessions = l
            .env
            .take()
            .expect("a trajectory at a branch point holds its sessions");
        l.tree = Some(place.branched(0, at));
        l.state = State::Opening;
        b.stats.branch_points += 1;
        if let Some(bar) = &self.progress {
            bar.inc_length(children.len() as u64);
        }
        let tx = b.tx.clone();
        self.handle.spawn(async move {
            for (child, seed, link) in children {
                let f0 = Instant::now();
                let forked = sessions.fork(seed, link).await;
                let _ = tx.send(Arrival::Forked(child, forked, f0.elapsed()));
            }
            let _ = tx.send(Arrival::Opened(t, sessions, Vec::new()));
        });
    }

    /// Branch `t`'s sessions came back forked: it decodes from now on. A fork that failed
    /// (a plugin that faulted or answered otherwise in the replay) ends the branch where
    /// it is, with the fault on its record, as an environment's fault ends a trajectory.
    pub(super) fn forked(
        &self,
        b: &mut InFlight<'a>,
        t: usize,
        forked: Result<TrajectorySessions, ForkError>,
        took: Duration,
    ) {
        b.stats.forks += 1;
        b.stats.fork_s += took.as_secs_f64();
        let l = &mut b.lives[t];
        match forked {
            Ok(sessions) => l.opened(sessions),
            Err(e) => {
                b.stats.fork_failures += 1;
                tracing::debug!("a branch's sessions could not be forked: {e}");
                l.faults.push(match &e {
                    ForkError::Fault(fault) => FaultRecord::from(fault),
                    other => FaultRecord {
                        plugin: match other {
                            ForkError::Diverged { plugin, .. }
                            | ForkError::Answers { plugin, .. } => plugin.clone(),
                            ForkError::Elsewhere { by, .. } => by.clone(),
                            ForkError::Refused(_) | ForkError::Fault(_) => String::new(),
                        },
                        call: "fork".into(),
                        kind: "fork".into(),
                        message: other.to_string(),
                    },
                });
                l.state = State::Done(StopReason::EnvFault);
            }
        }
    }
}

/// What continues a branch: a copy-on-write fork of the cache in process (drawing from
/// `seed`), the same server's cached prefix on vLLM servers.
fn fork_held(held: &mut Option<Held>, seed: u64) -> Option<Held> {
    match held {
        Some(Held::Sequence(seq)) => Some(Held::Sequence(Box::new(seq.fork(seed)))),
        Some(Held::Server(server)) => Some(Held::Server(*server)),
        None => None,
    }
}
