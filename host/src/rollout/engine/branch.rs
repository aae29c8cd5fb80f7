//! Tree rollouts' branch points (`rollout/tree.rs`): a trajectory just answered splits
//! into the tree's branch factor. It goes on as child 0; each other child is a copy of
//! it (ids, text, counts, conversation) on a copy-on-write fork of its KV cache, drawing
//! from its own seed, with its plugin sessions forked on the worker pool. The trajectory
//! that branches waits for the forks, since they are made from its sessions, and then
//! every branch decodes with the rest of the batch.

use super::super::env::TrajectorySessions;
use super::super::live::{Live, State};
use super::super::trajectory::{FaultRecord, StopReason};
use super::super::tree::BranchAt;
use super::Engine;
use super::batch::{Arrival, InFlight};
use crate::plugin::ForkError;
use crate::sampler::Held;
use crate::sampler::decode::sample_seed;
use std::time::{Duration, Instant};

impl<'a> Engine<'a> {
    /// Whether trajectory `l`, just answered (`new_turn`: the answer ends its turn and a
    /// new one starts), branches now: it goes on, the tree branches at such answers, and
    /// its path has branched fewer than `max_depth` times.
    pub(super) fn branches_here(&self, l: &Live, new_turn: bool) -> bool {
        let Some(tree) = &self.settings.tree else {
            return false;
        };
        l.state == State::Active
            && (tree.branch_at == BranchAt::Result || new_turn)
            && l.tree.as_ref().is_some_and(|p| p.depth() < tree.max_depth)
    }

    /// Splits trajectory `t` at its current end: it becomes child 0, and children
    /// 1..k are added to the batch, each waiting for its sessions' fork.
    pub(super) fn branch(&self, b: &mut InFlight<'a>, t: usize) {
        let tree = self
            .settings
            .tree
            .as_ref()
            .expect("branches only in tree rollouts");
        let l = &mut b.lives[t];
        let at = l.ids.tokens.len() - l.ids.prompt_len;
        let place = l
            .tree
            .clone()
            .expect("a tree rollout's trajectory has a place");
        let mut sessions = l
            .env
            .take()
            .expect("an answered trajectory holds its sessions");
        let sample = l.sample;
        let in_group = b.lives.iter().filter(|l| l.sample == sample).count();
        let mut children = Vec::with_capacity(tree.branch_factor - 1);
        for c in 1..tree.branch_factor {
            let child = place.branched(c as u32, at);
            // A branch's seed follows from its parent's and its place, never from when
            // the branch point was reached.
            let parent = &mut b.lives[t];
            let seed = sample_seed(parent.seed, child.depth(), c);
            let held = match &mut parent.held {
                Some(Held::Sequence(seq)) => Some(Held::Sequence(Box::new(seq.fork(seed)))),
                Some(Held::Server(server)) => Some(Held::Server(*server)),
                None => None,
            };
            let new_t = b.lives.len();
            let live = b.lives[t].branch(new_t, in_group + c - 1, child, seed, held);
            b.lives.push(live);
            b.done.push(None);
            children.push((new_t, seed, self.link(&b.tx, &b.tally, seed)));
        }
        let l = &mut b.lives[t];
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
                            ForkError::Diverged { plugin, .. } => plugin.clone(),
                            _ => String::new(),
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
