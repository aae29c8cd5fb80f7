//! A batch's finished trajectories handed over: built, counted, and scored on the worker
//! pool by the run's reward plugins (their `model.generate` calls come back to the
//! batch's loop), or at once when the run has none.

use super::Engine;
use super::batch::{Arrival, InFlight};
use crate::plugin::model::{CallTally, ModelLink};
use crate::rollout::live::State;
use crate::rollout::trajectory::{StopReason, Trajectory};
use crate::task::Sample;
use anyhow::Result;
use std::sync::mpsc;
use std::time::Instant;

impl<'a> Engine<'a> {
    /// Hands every trajectory that finished since the last round over to be scored.
    pub(super) fn hand_over_finished(
        &self,
        b: &mut InFlight<'a>,
        samples: &[(u64, Sample)],
        version: u64,
    ) -> Result<()> {
        for t in 0..b.lives.len() {
            if let State::Done(stop) = b.lives[t].state
                && b.done[t].is_none()
            {
                self.hand_over(b, t, samples, stop, version)?;
            }
        }
        Ok(())
    }

    /// Builds trajectory `t`, which just finished, and sends it to be scored (or scores it
    /// at once when the run has no reward plugins).
    fn hand_over(
        &self,
        b: &mut InFlight<'a>,
        t: usize,
        samples: &[(u64, Sample)],
        stop: StopReason,
        version: u64,
    ) -> Result<()> {
        let l = &mut b.lives[t];
        let mut traj = l.finish(&self.lm.tokenizer, &samples[l.sample], stop, version)?;
        // A branch's tokens from before its branch point are its parent's, counted there.
        let sampled = traj.sampled_tokens() - l.inherited_sampled;
        b.stats.sampled_tokens += sampled;
        b.stats.inserted_tokens += traj.completion_tokens().len() - l.inherited - sampled;
        if let Some(bar) = &self.progress {
            bar.inc(1);
        }
        if self.rewards.fns.is_empty() {
            self.rewards.combine(&mut traj, Vec::new(), l.env_reward);
        } else {
            self.spawn_scoring(t, l.seed, &traj, b.tx.clone(), &b.tally);
            b.scoring += 1;
        }
        b.done[t] = Some(traj);
        Ok(())
    }

    /// Scores trajectory `t` (seeded `traj_seed`) on the worker pool: its rewards'
    /// `model.generate` calls come back to this batch's loop, seeded from the trajectory.
    fn spawn_scoring(
        &self,
        t: usize,
        traj_seed: u64,
        traj: &Trajectory,
        tx: mpsc::Sender<Arrival>,
        tally: &std::sync::Arc<CallTally>,
    ) {
        let fns = self.rewards.fns.clone();
        let view = traj.for_reward();
        // A link per reward: each plugin's grant counts its own calls.
        let links: Vec<ModelLink> = fns
            .iter()
            .map(|_| self.link(&tx, tally, traj_seed))
            .collect();
        self.handle.spawn(async move {
            let c0 = Instant::now();
            let mut results = Vec::with_capacity(fns.len());
            for (f, link) in fns.iter().zip(links) {
                results.push(f.score(&view, Some(link)).await);
            }
            let _ = tx.send(Arrival::Scored(t, results, c0.elapsed()));
        });
    }
}
