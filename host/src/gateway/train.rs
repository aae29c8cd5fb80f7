//! Training from the gateway's sessions (issue 46, point 4): a run with a `[gateway]`
//! section serves its policy while it trains. Each step, the producer pumps the agents'
//! calls through the policy it samples with until enough task groups have ended (every
//! session of a group handed out by `/rl/tasks/next`), then turns their rows into
//! trajectories (a session's reward on each of its rows; a session the agent did not
//! reward scored by the run's reward plugins on its transcript), and hands the batch to
//! the trainer as a plugin run's batch. While the producer is not sampling (the trainer
//! updating, or the queue full) calls wait in the queue, or are refused with a 503 when
//! `while_updating = "refuse"`.

use super::chat::Renderer;
use super::pump::{Job, serve, with_sampler};
use super::server;
use super::sessions::Finished;
use super::state::{Gateway, Tasks, TasksHeld};
use crate::data::Dataset;
use crate::model::{LanguageModel, Mode};
use crate::plugin::model::{CallTally, GenerateCall, ModelLink};
use crate::rollout::trajectory::{SpanKind, TokenSpan};
use crate::rollout::{BatchStats, Group, Rewards, Trajectory};
use crate::sampler::Sampling;
use crate::sampler::decode::sample_seed;
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::runtime::Handle;

/// A run's gateway, as the producer drives it.
pub struct Link {
    pub gw: Arc<Gateway>,
    jobs: Mutex<Receiver<Job>>,
    finished: Mutex<Receiver<Finished>>,
    /// Ended sessions by group, until their group is whole.
    pending: Mutex<BTreeMap<u64, Vec<Finished>>>,
    session_timeout: Duration,
    /// The vLLM servers that sample the calls (`rollout.engine = "vllm"`); none: the
    /// local model does.
    remote: Option<Arc<crate::sampler::vllm::Pool>>,
    /// `/rl/tasks/next` waits until the producer says where the data resumes.
    held: Mutex<Option<TasksHeld>>,
}

/// The gateway a training run serves, as `config/` builds it from `[gateway]`.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where it listens.
    pub addr: String,
    /// Bind beyond loopback (`gateway.public`).
    pub public: bool,
    /// The model name its answers carry.
    pub served_model_name: String,
    /// Refuse calls with a 503 while the trainer updates, instead of holding them.
    pub refuse_while_updating: bool,
    pub max_connections: usize,
    /// A session its agent never ends is closed after this long.
    pub session_timeout: Duration,
}

/// What one step took from the gateway.
pub struct Harvest {
    pub groups: Vec<Group>,
    pub stats: BatchStats,
    /// Rows left out: sampled by a policy older than `max_staleness` allows.
    pub stale_rows: usize,
    /// Sessions that timed out (never ended by their agent) in the groups taken.
    pub timed_out: usize,
}

impl Link {
    /// Serves `lm`'s policy on `settings.addr`: the routes of `rlhost serve`, tasks from
    /// `dataset`, `group_size` sessions a task; sampled by `remote`'s servers when given.
    pub fn open(
        settings: &Settings,
        lm: &LanguageModel,
        template_kwargs: serde_json::Map<String, serde_json::Value>,
        dataset: Arc<Dataset>,
        group_size: usize,
        remote: Option<Arc<crate::sampler::vllm::Pool>>,
    ) -> Result<Link> {
        let renderer = Renderer::new(lm, template_kwargs)?;
        let (jobs_tx, jobs_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let (tasks, held) = Tasks::held(dataset, group_size);
        let mut gw = Gateway::new(
            settings.served_model_name.clone(),
            renderer,
            jobs_tx,
            done_tx,
            Some(tasks),
        );
        gw.refuse_while_updating = settings.refuse_while_updating;
        gw.remote = remote.is_some();
        // Nothing samples until the producer's first step.
        gw.updating.store(true, Ordering::Release);
        let gw = Arc::new(gw);
        let key = crate::front::api_key(None)?;
        crate::front::check_exposure(
            &settings.addr,
            settings.public,
            key.is_some(),
            "gateway.addr",
            "gateway.public = true",
        )?;
        server::spawn(gw.clone(), &settings.addr, settings.max_connections, key)?;
        Ok(Link {
            gw,
            jobs: Mutex::new(jobs_rx),
            finished: Mutex::new(done_rx),
            pending: Mutex::new(BTreeMap::new()),
            session_timeout: settings.session_timeout,
            remote,
            held: Mutex::new(Some(held)),
        })
    }

    /// Hands out tasks from `cursor` on (a resumed run's: the data goes on where the
    /// checkpoint left it); until then `/rl/tasks/next` waits.
    pub fn start_tasks(&self, cursor: crate::data::Cursor) {
        if let Some(held) = self.held.lock().unwrap_or_else(|e| e.into_inner()).take() {
            held.start(cursor);
        }
    }

    /// Where a run resumed from a checkpoint taken now draws tasks again: before the
    /// earliest group handed out and not yet trained on.
    pub fn tasks_cursor(&self, handle: &Handle) -> crate::data::Cursor {
        match &self.gw.tasks {
            Some(tasks) => handle.block_on(tasks.resume_cursor()),
            None => crate::data::Cursor::default(),
        }
    }

    /// `http://ADDR/v1`.
    pub fn url(&self) -> String {
        match self.gw.addr.get() {
            Some(a) => format!("http://{a}/v1"),
            None => "(not listening)".into(),
        }
    }

    /// Serves calls with `mode` (policy `version`) until `want` task groups have ended,
    /// then returns them as trajectory groups. `give_up` (the run interrupted or over)
    /// abandons the wait.
    #[allow(clippy::too_many_arguments)]
    pub fn take(
        &self,
        lm: &LanguageModel,
        mode: Mode,
        version: u64,
        want: usize,
        max_staleness: u64,
        rewards: &Rewards,
        handle: &Handle,
        give_up: &dyn Fn() -> bool,
    ) -> Result<Harvest> {
        let t0 = Instant::now();
        self.gw.version.store(version, Ordering::Release);
        let oldest = version.saturating_sub(max_staleness);
        let mut stats = BatchStats::default();
        let (mut stale_rows, mut timed_out) = (0, 0);
        let mut groups = Vec::new();
        // Until a group has something to train on (every row of the groups that ended
        // may be stale, or their sessions timed out).
        while groups.is_empty() {
            self.gw.updating.store(false, Ordering::Release);
            let stop = || {
                self.collect();
                give_up() || self.complete() >= want
            };
            let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
            let pumped = with_sampler(lm, mode, version, self.remote.as_ref(), handle, |s| {
                serve(s, &jobs, version, &stop)
            })
            .and_then(|p| p);
            drop(jobs);
            self.gw.updating.store(true, Ordering::Release);
            let pumped = pumped?;
            if give_up() {
                return Err(crate::rollout::engine::Abandoned.into());
            }
            stats.forwards += pumped.forwards as usize;
            stats.requests += pumped.requests as usize;
            for group in self.take_complete(want) {
                let sample_id = group[0].task.id.unwrap_or(u64::MAX);
                let mut scored = Vec::new();
                for s in group {
                    if s.timed_out {
                        timed_out += 1;
                        continue;
                    }
                    for row in &s.rows {
                        if row.sampled() == 0 {
                            continue;
                        }
                        if row.versions.iter().any(|&v| v < oldest) {
                            stale_rows += 1;
                            continue;
                        }
                        // A log-prob that is not a number would turn the whole step's
                        // gradient into NaN: the row is left out, by name.
                        if let Some(bad) = non_finite(row) {
                            tracing::warn!(
                                "gateway: session {} has a sampled log-prob of {bad}; its row is left out of training",
                                s.session
                            );
                            self.gw
                                .counters
                                .non_finite_rows
                                .fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        scored.push(trajectory(&self.gw.renderer, &s, row, sample_id));
                    }
                }
                if scored.is_empty() {
                    continue;
                }
                let trajectories =
                    with_sampler(lm, mode, version, self.remote.as_ref(), handle, |s| {
                        self.score(scored, rewards, lm, version, s, handle, &mut stats)
                    })??;
                for t in &trajectories {
                    stats.sampled_tokens += t.sampled_tokens();
                    stats.prompt_tokens += t.prompt_len;
                    stats.inserted_tokens += t.logps.len() - t.sampled_tokens();
                }
                stats.trajectories += trajectories.len();
                groups.push(Group {
                    sample_id,
                    trajectories,
                });
            }
        }
        stats.wall_s = t0.elapsed().as_secs_f64();
        stats.decode_s = stats.wall_s;
        let c = &self.gw.counters;
        c.stale_rows.fetch_add(stale_rows as u64, Ordering::Relaxed);
        c.timed_out_sessions
            .fetch_add(timed_out as u64, Ordering::Relaxed);
        if stale_rows > 0 {
            tracing::warn!(
                "gateway: {stale_rows} session rows were sampled by a policy older than version {oldest} (rollout.max_staleness = {max_staleness}) and are left out"
            );
        }
        Ok(Harvest {
            groups,
            stats,
            stale_rows,
            timed_out,
        })
    }

    /// Each trajectory's reward: the one its agent reported (named parts as components, a
    /// number as `agent`), else what the run's reward plugins give its transcript (all
    /// trajectories scored at once on the worker pool). A reward plugin granted
    /// `model.generate` asks the policy (of `version`) or the base model through `sampler`,
    /// as in a plugin run: its calls are decoded together here while the scores come in.
    #[allow(clippy::too_many_arguments)]
    fn score<'t>(
        &self,
        ts: Vec<(Trajectory, Option<super::sessions::Reward>)>,
        rewards: &Rewards,
        lm: &'t LanguageModel,
        version: u64,
        sampler: &mut dyn Sampling<'t>,
        handle: &Handle,
        stats: &mut BatchStats,
    ) -> Result<Vec<Trajectory>> {
        let renderer = &self.gw.renderer;
        let (calls_tx, calls) = std::sync::mpsc::channel::<GenerateCall>();
        let tally = Arc::new(CallTally::default());
        let scoring: Vec<_> = ts
            .iter()
            .map(|(t, r)| {
                let view = t.for_reward();
                let unrewarded = r.is_none();
                let fns = rewards.fns.clone();
                // Seeded by the version, the task and the session's place in its group:
                // a repeated run asks the same.
                let seed = sample_seed(version, t.sample_id as usize, t.index);
                let links: Vec<ModelLink> = fns
                    .iter()
                    .map(|_| {
                        let tx = calls_tx.clone();
                        ModelLink::new(seed, move |call| {
                            tx.send(call)
                                .map_err(|_| "the scoring this call belonged to has ended".into())
                        })
                        .tallied(tally.clone())
                        .within(renderer.context)
                    })
                    .collect();
                handle.spawn(async move {
                    let mut results = Vec::new();
                    if unrewarded {
                        for (f, link) in fns.iter().zip(links) {
                            results.push(f.score(&view, Some(link)).await);
                        }
                    }
                    results
                })
            })
            .collect();
        drop(calls_tx);
        let asked = Arc::new(AtomicUsize::new(0));
        let lm_stop = &renderer.eos_token_ids;
        let t0 = Instant::now();
        let mut asks = 0;
        while !scoring.iter().all(|h| h.is_finished()) || sampler.pending() > 0 {
            let idle = sampler.pending() == 0 || !sampler.step()?;
            // Nothing to decode (or all of it on a server): wait a moment for the next
            // call, or a score.
            let first = if idle {
                calls.recv_timeout(Duration::from_millis(5)).ok()
            } else {
                None
            };
            for call in first.into_iter().chain(calls.try_iter()) {
                asks += 1;
                if let Some((request, sink)) =
                    crate::rollout::asks::ask(lm, &renderer.kwargs, lm_stop, call, &asked)
                {
                    sampler.admit(request, Box::new(sink));
                }
            }
        }
        let results = handle.block_on(futures_util::future::join_all(scoring));
        if asks > 0 {
            stats.asks += asks;
            stats.asked_tokens += asked.load(Ordering::Relaxed);
            // The trainer's thread did nothing but answer them meanwhile.
            stats.ask_s += t0.elapsed().as_secs_f64();
        }
        for (k, n) in tally.snapshot() {
            *stats.generate_calls.entry(k).or_default() += n;
        }
        for (k, w) in tally.wait_s() {
            *stats.generate_wait_s.entry(k).or_default() += w;
        }
        let mut out = Vec::with_capacity(ts.len());
        let mut by_config = Vec::with_capacity(ts.len());
        for ((mut t, reported), results) in ts.into_iter().zip(results) {
            let results = results.context("a reward task panicked")?;
            by_config.push(reported.is_none());
            match reported {
                Some(r) => {
                    if r.components.is_empty() {
                        t.rewards.insert("agent".into(), r.total);
                    } else {
                        t.rewards.extend(r.components);
                    }
                    t.reward = r.total;
                }
                None => rewards.combine(&mut t, results, None),
            }
            out.push(t);
        }
        // Reward models are config rewards: they score what the config's rewards scored,
        // and leave an agent's own reward as it said it.
        rewards.score_models(
            &lm.model,
            out.iter_mut()
                .zip(&by_config)
                .filter_map(|(t, &c)| c.then_some(t)),
        )?;
        Ok(out)
    }

    /// Moves ended sessions into their groups, and ends the sessions whose agent has been
    /// silent past the timeout (they count towards their group, and are not trained on).
    fn collect(&self) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let rx = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        for f in rx.try_iter() {
            pending.entry(f.task.group).or_default().push(f);
        }
        let reaped = self
            .gw
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .reap(self.session_timeout);
        for f in reaped {
            tracing::warn!(
                "gateway: session {} timed out (no call or end in {:?}): left out of training",
                f.session,
                self.session_timeout
            );
            pending.entry(f.task.group).or_default().push(f);
        }
    }

    /// Groups all of whose sessions have ended.
    fn complete(&self) -> usize {
        let pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending
            .values()
            .filter(|g| g.len() >= g[0].task.group_size)
            .count()
    }

    /// The first `want` whole groups, oldest first.
    fn take_complete(&self, want: usize) -> Vec<Vec<Finished>> {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let whole: Vec<u64> = pending
            .iter()
            .filter(|(_, g)| g.len() >= g[0].task.group_size)
            .map(|(&k, _)| k)
            .take(want)
            .collect();
        if let Some(tasks) = &self.gw.tasks {
            tasks.taken(&whole);
        }
        whole
            .into_iter()
            .filter_map(|k| pending.remove(&k))
            .collect()
    }
}

/// A sampled log-prob of `row` that is not a finite number, if any.
fn non_finite(row: &super::record::SessionRow) -> Option<f32> {
    row.logps.iter().flatten().copied().find(|l| !l.is_finite())
}

/// A session row as a trajectory: its ids and log-probs as recorded, spans by who wrote
/// each stretch (the model, or the agent's inserted turns), the session's transcript and
/// task metadata for reward plugins.
fn trajectory(
    renderer: &Renderer,
    s: &Finished,
    row: &super::record::SessionRow,
    sample_id: u64,
) -> (Trajectory, Option<super::sessions::Reward>) {
    let tok = &renderer.tokenizer;
    let completion = &row.tokens[row.prompt_len..];
    let mut spans = Vec::new();
    let mut start = 0;
    while start < row.logps.len() {
        let sampled = row.logps[start].is_some();
        let mut end = start + 1;
        while end < row.logps.len() && row.logps[end].is_some() == sampled {
            end += 1;
        }
        spans.push(TokenSpan {
            kind: if sampled {
                SpanKind::Model
            } else {
                SpanKind::Env
            },
            start,
            end,
            text: tok
                .decode(&completion[start..end], false)
                .unwrap_or_default(),
        });
        start = end;
    }
    let tool_calls = s.transcript.iter().filter(|m| m.role == "tool").count() as u32;
    let t = Trajectory {
        sample_id,
        index: s.task.index,
        version: row.versions.iter().copied().min().unwrap_or(0),
        spans,
        messages: s.transcript.clone(),
        completion: tok.decode(completion, false).unwrap_or_default(),
        metadata: s.task.sample.metadata.clone(),
        turns: row.versions.len() as u32,
        tool_calls,
        ..Trajectory::sampled(row.tokens.clone(), row.prompt_len, row.logps.clone())
    };
    (t, s.reward.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 68, point 7: a row with a sampled log-prob that is not a number is found (and
    /// left out of training, named), where it once turned a step's gradient into NaN; the
    /// inserted tokens' `None` is no such log-prob.
    #[test]
    fn a_non_finite_log_prob_is_found() {
        let row = |logps: Vec<Option<f32>>| super::super::record::SessionRow {
            tokens: vec![1; 2 + logps.len()],
            prompt_len: 2,
            logps,
            versions: vec![0],
        };
        assert_eq!(non_finite(&row(vec![Some(-0.5), None, Some(-1.0)])), None);
        assert!(
            non_finite(&row(vec![Some(-0.5), Some(f32::NAN)]))
                .unwrap()
                .is_nan()
        );
        assert_eq!(
            non_finite(&row(vec![None, Some(f32::NEG_INFINITY)])),
            Some(f32::NEG_INFINITY)
        );
    }
}
