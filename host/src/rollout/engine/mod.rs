//! The rollout engine: the trajectory state machine, group sampling with what answers
//! turns in the loop.
//!
//! For a batch of samples, each prompt is rendered with the chat template and prefilled
//! once; its G trajectories fork its KV cache. All active trajectories then decode
//! together, one packed forward per step. Each trajectory holds its sessions of what
//! answers its turns: a trigger, tools, an episode (the environment seam, `env/`, which
//! this file asks to open, fire and answer, whatever answers). Their calls run on the
//! tokio worker pool: a trajectory that waits on one leaves the batch, the others keep
//! decoding, and it rejoins with the inserted tokens pending when the answer arrives.
//!
//! What draws the tokens is the sampler seam (`sampler/local.rs`): the in-process sampler
//! or vLLM servers (`sampler/servers.rs`), behind one trait, so this file holds the
//! trajectory logic once. A trajectory asks the seam for its next part (its ids so far,
//! the rest of its turn's budget, its stop patterns), acts on each token as it comes, and
//! releases the part where its logic stops it (a tool fires, the turn ends): in process
//! its KV cache is kept, on servers its server, and the next part resumes from there.
//! A group's prompt is prefilled once and forked into its trajectories.
//!
//! Token-in/token-out: the ids in a trajectory are exactly the ids the model saw. Inserted
//! text (tool output, environment turns) is tokenized on its own and appended; the
//! history is never re-encoded, so the trainer's log-probs are over the same ids the
//! sampler's were.
//!
//! Stop patterns are matched in the incrementally decoded text, only in what the model
//! wrote since the last insertion, so a pattern inside tool output never fires. A token
//! may decode to more than the pattern (`</calc>\n`): the tool sees the text up to the
//! pattern's end, and its output follows the whole token.

use super::env::{
    Answering, EndedTurn, Environment, Opening, Read, Reply, Then, TrajectorySessions,
};
use super::live::{Live, State, new_match};
use super::render::{escaped, inserted_ids, prompt_tokens};
use super::reward::Rewards;
use super::settings::RolloutSettings;
use super::start::{self, Prompts, Start};
use super::stats::BatchStats;
use super::trajectory::{FaultRecord, Group, SpanKind, StopReason};
use super::tree::TreePlace;
use super::turns::TurnFormat;
use crate::model::bundle::LanguageModel;
use crate::model::lora::Mode;
use crate::plugin::model::{CallTally, ModelLink};
use crate::sampler::decode::sample_seed;
use crate::sampler::draw::SamplingParams;
use crate::sampler::servers::Servers;
use crate::sampler::vllm::Lease;
use crate::sampler::{Held, Request, Sampler, Sampling};
use crate::task::{Message, Sample};
use anyhow::{Context, Result, bail};
use serde_json::Value as Json;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::runtime::Handle;

mod batch;
mod branch;
mod scoring;
use batch::{Arrival, InFlight, ToLoop};

/// The error of a batch abandoned through [`Engine::set_cancel`] (or a gateway run's
/// interruption): the queue hands it to the trainer as [`super::queue::QueueError::Abandoned`],
/// which the trainer takes for the interruption it is, not a failure.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("rollouts abandoned: the run is being interrupted")]
pub struct Abandoned;

pub struct Engine<'a> {
    lm: &'a LanguageModel,
    settings: &'a RolloutSettings,
    rewards: &'a Rewards,
    /// What answers the trajectories' turns.
    env: Environment<'a>,
    handle: Handle,
    turns: Option<TurnFormat<'a>>,
    /// Counts finished trajectories of the current batch (a progress bar, or hidden).
    progress: Option<indicatif::ProgressBar>,
    /// Set when the run is being interrupted: the batch in flight is abandoned.
    cancel: Option<&'a AtomicBool>,
}

impl<'a> Engine<'a> {
    pub fn new(
        lm: &'a LanguageModel,
        settings: &'a RolloutSettings,
        rewards: &'a Rewards,
        handle: Handle,
    ) -> Result<Engine<'a>> {
        // Plugin calls run on the runtime's workers while this thread decodes: a
        // current-thread runtime would never run them.
        if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread {
            bail!("the rollout engine needs a multi-threaded tokio runtime for plugin calls");
        }
        if settings.group_size == 0 {
            bail!("rollout.group_size must be at least 1");
        }
        settings.sampling.validate()?;
        if settings.tree.is_some() {
            settings
                .env
                .forkable()
                .map_err(|why| anyhow::anyhow!("[rollout.tree]: {why}"))?;
        }
        let chat = lm.chat()?;
        let env = Environment::new(&settings.env)?;
        let continued_by = env.continued_by();
        let turns = match continued_by {
            Some(what) => Some(
                TurnFormat::new(
                    chat,
                    settings.template_kwargs.clone(),
                    settings.env.template_tools().map(<[Json]>::to_vec),
                )
                .with_context(|| {
                    format!("{what} needs a chat template that can continue a conversation")
                })?,
            ),
            None => None,
        };
        Ok(Engine {
            lm,
            settings,
            rewards,
            env,
            handle,
            turns,
            progress: None,
            cancel: None,
        })
    }

    /// Shows each batch's finished trajectories on `bar` (its length is set per batch).
    pub fn set_progress(&mut self, bar: indicatif::ProgressBar) {
        self.progress = Some(bar);
    }

    /// Abandons the batch in flight (with an error) once `flag` is set: an interrupted
    /// run does not wait for rollouts it will never train on.
    pub fn set_cancel(&mut self, flag: &'a AtomicBool) {
        self.cancel = Some(flag);
    }

    /// The prompt's token ids: the sample's messages rendered with a generation prompt.
    pub fn prompt_tokens(&self, sample: &Sample) -> Result<Vec<u32>> {
        prompt_tokens(
            self.lm,
            &self.settings.template_kwargs,
            self.settings.env.template_tools(),
            sample,
        )
    }

    /// Samples `group_size` trajectories for each sample and scores them. Trajectory `j` of
    /// sample `id` draws from a generator seeded by `(seed, id, j)` only, so its tokens do
    /// not depend on the rest of the batch (vary `seed` from batch to batch).
    pub fn run(
        &self,
        samples: &[(u64, Sample)],
        seed: u64,
        version: u64,
        mode: Mode,
    ) -> Result<(Vec<Group>, BatchStats)> {
        let t0 = Instant::now();
        if let Some(bar) = &self.progress {
            bar.reset();
            bar.set_length((samples.len() * self.starts_per_sample()) as u64);
        }
        let mut stats = BatchStats::default();
        let starts = self.starts(samples, seed, &mut stats)?;
        // Plugin sessions open on the worker pool while the prompts prefill; a trajectory
        // starts decoding once its own are open, not when all are (opening 64 Python
        // sessions takes longer than a prefill on two cores).
        let (tx, rx) = mpsc::channel::<Arrival>();
        // With vLLM servers, the adapter version this batch samples with is loaded on
        // them first (and stays loaded while the lease lives).
        let retries_before = self.settings.remote.as_ref().map_or(0, |p| p.retries());
        let lease = match &self.settings.remote {
            Some(pool) => {
                let t0 = Instant::now();
                let lease = Lease::new(pool, self.lm, mode, version)?;
                stats.adapter_load_s += t0.elapsed().as_secs_f64();
                Some(lease)
            }
            None => None,
        };
        let mut sampler: Box<dyn Sampling<'_> + '_> = match (&lease, &self.settings.remote) {
            (Some(lease), Some(pool)) => {
                let wake = tx.clone();
                let wake = Arc::new(move || {
                    let _ = wake.send(Arrival::Wake);
                }) as crate::sampler::servers::Notify;
                Box::new(
                    Servers::new(
                        pool.clone(),
                        lease.name.clone(),
                        &self.lm.tokenizer,
                        self.handle.clone(),
                    )
                    .with_notify(wake),
                )
            }
            _ => Box::new(Sampler::new(&self.lm.model, &self.lm.tokenizer, mode)),
        };
        let tally = Arc::new(CallTally::default());
        let lives = self.lives(starts, samples, seed, &tx, &tally);
        let mut batch = InFlight {
            done: (0..lives.len()).map(|_| None).collect(),
            lives,
            stats,
            scoring: 0,
            scored: 0,
            tx,
            rx,
            asked: Default::default(),
            tally,
            remote: lease.is_some(),
            prefilled: false,
        };
        self.prefill(&mut batch, sampler.as_mut(), samples, seed);
        while self.round(&mut batch, sampler.as_mut(), samples, version, t0)? {}
        if let Some(lease) = &lease {
            batch.stats.retries = (lease.pool.retries() - retries_before) as usize;
        }
        drop(sampler);
        let (mut groups, stats) = batch.into_groups(samples, self.settings.group_size, t0);
        // Reward models read whole trajectories: scored once all have finished.
        self.rewards.score_models(
            &self.lm.model,
            groups.iter_mut().flat_map(|g| g.trajectories.iter_mut()),
        )?;
        Ok((groups, stats))
    }

    /// Trajectories each sample starts with: its group, or its tree's chains (which
    /// branch into the rest as they go).
    fn starts_per_sample(&self) -> usize {
        self.settings
            .tree
            .as_ref()
            .map_or(self.settings.group_size, |t| t.chains)
    }

    /// How each trajectory starts (sample `i`'s `j`th at `i * G + j`, G the trajectories
    /// each starts with): its prompt, from its sample or from an OpenEnv server's `reset`
    /// (`start.rs`).
    fn starts(
        &self,
        samples: &[(u64, Sample)],
        seed: u64,
        stats: &mut BatchStats,
    ) -> Result<Vec<Start>> {
        let g = self.starts_per_sample();
        let p = Prompts {
            render: &|sample: &Sample| self.prompt_tokens(sample),
            limit: self.settings.limits.max_total_tokens,
        };
        match self.env.resets_first() {
            Some(remote) => start::from_resets(remote, samples, g, seed, &self.handle, &p, stats),
            None => start::from_samples(samples, g, &p, stats),
        }
    }

    /// Where the `model.generate` calls of a session of the trajectory seeded `traj_seed`
    /// go: this batch's loop, as events.
    fn link(
        &self,
        tx: &mpsc::Sender<Arrival>,
        tally: &std::sync::Arc<CallTally>,
        traj_seed: u64,
    ) -> ModelLink {
        let tx = tx.clone();
        ModelLink::new(traj_seed, move |call| {
            tx.send(Arrival::Generate(call))
                .map_err(|_| "the rollout this call belonged to has ended".to_string())
        })
        .tallied(tally.clone())
        .within(self.lm.model.cfg.max_position_embeddings)
    }

    /// Asks the sampler to prefill each distinct prompt once and fork it into its group's
    /// trajectories (with an OpenEnv `reset` prompt, trajectories of a group may differ):
    /// a request for no new tokens whose choices are held, each trajectory's own from then
    /// on (in process its forked cache, drawing from a generator seeded by `(seed, id,
    /// j)`). Each resumes once its plugin sessions are open.
    fn prefill<'m>(
        &self,
        b: &mut InFlight<'a>,
        sampler: &mut dyn Sampling<'m>,
        samples: &[(u64, Sample)],
        seed: u64,
    ) {
        let g = self.starts_per_sample();
        let mut t = 0;
        while t < b.lives.len() {
            let (i, j0) = (t / g, t % g);
            let prompt = &b.lives[t].ids.tokens;
            let run = 1 + b.lives[t + 1..(i + 1) * g]
                .iter()
                .take_while(|l| l.ids.tokens == *prompt)
                .count();
            let params = SamplingParams {
                max_new_tokens: 0,
                seed,
                ..self.settings.sampling.clone()
            };
            let request = Request {
                index: samples[i].0 as usize,
                first_choice: j0,
                hold: true,
                ..Request::new(prompt.clone(), run, params)
            };
            let sink = ToLoop {
                first: i * g,
                request: 0,
                tx: b.tx.clone(),
            };
            let ticket = sampler.admit(request, Box::new(sink));
            for (k, l) in b.lives[t..t + run].iter_mut().enumerate() {
                l.ticket = Some((ticket, j0 + k));
            }
            t += run;
        }
    }

    /// The batch's trajectories (sample `i`'s `j`th at `i * G + j`), about to be
    /// prefilled. Their sessions open on the worker pool while the prompts prefill: a
    /// trajectory starts decoding once its own are open, not when all are (opening 64
    /// Python sessions takes longer than a prefill on two cores).
    fn lives(
        &self,
        starts: Vec<Start>,
        samples: &[(u64, Sample)],
        seed: u64,
        tx: &mpsc::Sender<Arrival>,
        tally: &Arc<CallTally>,
    ) -> Vec<Live<'a>> {
        let g = self.starts_per_sample();
        let mut lives = Vec::with_capacity(starts.len());
        for (t, start) in starts.into_iter().enumerate() {
            let (i, j) = (t / g, t % g);
            let (id, sample) = &samples[i];
            // The trajectory's own seed (as `prefill` draws it): its sessions'
            // `model.generate` calls are seeded from it.
            let traj_seed = sample_seed(seed, *id as usize, j);
            let link = || self.link(tx, tally, traj_seed);
            let env = match self.env.open(sample, *id, j, seed, &link, start.episode) {
                Opening::Ready(sessions) => Some(sessions),
                Opening::Later(opening) => {
                    let tx = tx.clone();
                    self.handle.spawn(async move {
                        let (sessions, faults) = opening.await;
                        let _ = tx.send(Arrival::Opened(t, sessions, faults));
                    });
                    None
                }
            };
            let tok = &self.lm.tokenizer;
            let (messages, fault) = (start.messages, start.fault);
            let mut live = Live::new(tok, t, i, j, traj_seed, start.prompt, messages, env, fault);
            if self.settings.tree.is_some() {
                live.tree = Some(TreePlace::chain(j as u32));
            }
            lives.push(live);
        }
        lives
    }

    /// One round of the loop: takes the events that have come (plugin answers, tokens),
    /// hands finished trajectories to be scored, gives every active trajectory without
    /// a request its next one, and steps the sampler. When the sampler could do nothing
    /// (everything waits on a plugin or a server) it waits for the next event. `false`
    /// once nothing is left to sample or wait for.
    fn round<'m>(
        &self,
        b: &mut InFlight<'a>,
        sampler: &mut dyn Sampling<'m>,
        samples: &[(u64, Sample)],
        version: u64,
        t0: Instant,
    ) -> Result<bool>
    where
        'a: 'm,
    {
        self.check_cancel()?;
        while let Some(event) = b.next_event(None)? {
            self.apply(event, b, sampler)?;
        }
        self.hand_over_finished(b, samples, version)?;
        self.submit(b, sampler);
        if sampler.pending() > 0 {
            let sampling = b.lives.iter().any(|l| l.ticket.is_some());
            let (f0, base0, forwards0) = (Instant::now(), sampler.base_s(), sampler.forwards());
            let progressed = sampler.step()?;
            let took = f0.elapsed().as_secs_f64();
            b.stats.forwards += (sampler.forwards() - forwards0) as usize;
            let base = sampler.base_s() - base0;
            if !b.prefilled {
                b.prefilled = true;
                b.stats.prefill_s = t0.elapsed().as_secs_f64();
            } else if sampling {
                // The base model's forward for plugins' asks is theirs; the policy's asks
                // ride along in the trajectories' forward.
                b.stats.decode_s += took - base;
                b.stats.ask_s += base;
            } else {
                b.stats.ask_s += took;
            }
            if progressed {
                return Ok(true);
            }
        }
        if !b.unfinished(sampler.pending()) {
            return Ok(false);
        }
        // A finished trajectory gives back its sessions before the loop waits: another
        // may be waiting for its place (`rollout.openenv.max_sessions`).
        self.hand_over_finished(b, samples, version)?;
        // With requests on servers, an answer wakes the loop (`Arrival::Wake`); the timeout
        // only bounds a wait for room on a server that another batch keeps full.
        let wait = if sampler.pending() > 0 {
            Duration::from_millis(20)
        } else {
            Duration::from_secs(3600)
        };
        if let Some(event) = b.next_event(Some(wait))? {
            self.apply(event, b, sampler)?;
        }
        Ok(true)
    }

    /// Gives every active trajectory that has no request on the sampler its next one,
    /// resuming from what its last one left (its cache, its server).
    fn submit<'m>(&self, b: &mut InFlight<'a>, sampler: &mut dyn Sampling<'m>) {
        for t in 0..b.lives.len() {
            let l = &mut b.lives[t];
            if l.state != State::Active || l.ticket.is_some() {
                continue;
            }
            let request = self.request(l);
            l.requests += 1;
            l.request += 1;
            if b.remote {
                b.stats.requests += 1;
            }
            let sink = ToLoop {
                first: t,
                request: l.request,
                tx: b.tx.clone(),
            };
            let held = l.held.take().unwrap_or(Held::Server(None));
            l.ticket = Some((sampler.resume(held, request, Box::new(sink)), 0));
        }
    }

    /// The next request of an active trajectory: its ids so far, the rest of its turn's
    /// token budget, its stop patterns and ids; on a server, a seed of its own.
    fn request(&self, l: &Live) -> Request {
        let s = self.settings;
        let sp = &s.sampling;
        let budget = sp
            .max_new_tokens
            .saturating_sub(l.turn_tokens)
            .min(s.limits.max_total_tokens.saturating_sub(l.ids.tokens.len()))
            .max(1);
        let mut stop = l.patterns.clone();
        stop.extend(sp.stop_strings.iter().cloned());
        let params = SamplingParams {
            max_new_tokens: budget,
            stop_strings: stop,
            seed: l.seed,
            ..sp.clone()
        };
        Request {
            index: l.requests as usize,
            hold: true,
            ..Request::new(l.ids.tokens.clone(), 1, params)
        }
    }

    /// Stops trajectory `l`'s request where it is (its logic stopped it: a tool fired,
    /// the turn or the trajectory ended) and keeps what continues it.
    fn release<'m>(l: &mut Live, sampler: &mut dyn Sampling<'m>) {
        if let Some((ticket, choice)) = l.ticket.take() {
            l.held = sampler.release(ticket, choice);
        }
    }

    /// Fails with [`Abandoned`] once the run is being interrupted.
    fn check_cancel(&self) -> Result<()> {
        if self
            .cancel
            .as_ref()
            .is_some_and(|c| c.load(Ordering::Relaxed))
        {
            return Err(Abandoned.into());
        }
        Ok(())
    }

    /// Acts on the token `tok` just appended to an active trajectory: the same rules
    /// whichever sampler drew it.
    fn took(&self, l: &mut Live, tok: u32, tx: &mpsc::Sender<Arrival>) -> Result<()> {
        let s = self.settings;
        l.checked = l.dec.text().len();
        l.dec.push(tok)?;
        l.turn_tokens += 1;
        if s.sampling.stop_token_ids.contains(&tok) {
            return self.end_turn(l, tx, true);
        }
        if l.ids.tokens.len() >= s.limits.max_total_tokens {
            l.state = State::Done(StopReason::TotalTokens);
            return Ok(());
        }
        if let Some(end) = new_match(l.dec.text(), l.search_from(&l.patterns), &l.patterns) {
            if l.tool_calls >= s.limits.max_tool_calls {
                l.state = State::Done(StopReason::MaxToolCalls);
                return Ok(());
            }
            l.scan_from = l.dec.text().len();
            if let Some(sessions) = l.env.take() {
                let text = l.dec.text()[..end].to_string();
                match self.env.fire(sessions, text) {
                    Ok(firing) => {
                        l.state = State::Waiting;
                        self.spawn_answer(l.t, tx, firing);
                        return Ok(());
                    }
                    Err(sessions) => l.env = Some(sessions),
                }
            }
        }
        if !s.sampling.stop_strings.is_empty()
            && new_match(
                l.dec.text(),
                l.search_from(&s.sampling.stop_strings),
                &s.sampling.stop_strings,
            )
            .is_some()
        {
            return self.end_turn(l, tx, false);
        }
        if l.turn_tokens >= s.sampling.max_new_tokens {
            l.state = State::Done(StopReason::TurnTokens);
        }
        Ok(())
    }

    /// The model ended its turn: record it, and hand it to what answers it (its calls to
    /// the tools or the server, its text to the episode), or end the trajectory at a limit
    /// or where nothing answers.
    fn end_turn(
        &self,
        l: &mut Live,
        tx: &mpsc::Sender<Arrival>,
        by_stop_token: bool,
    ) -> Result<()> {
        let tokens = &l.ids.tokens[l.turn_start..];
        let content_tokens = if by_stop_token {
            &tokens[..tokens.len() - 1]
        } else {
            tokens
        };
        let content = self.lm.tokenizer.decode(content_tokens, false)?;
        l.turns += 1;
        l.turn_open = false;
        let turn = match self.env.read(&content) {
            Read::Calls(by, turn) => {
                let (message, written) = Environment::written(turn, l.turns);
                l.messages.push(message);
                // Calls past the limits are recorded, not answered.
                let lim = &self.settings.limits;
                if l.tool_calls as usize + written.len() > lim.max_tool_calls as usize {
                    l.state = State::Done(StopReason::MaxToolCalls);
                    return Ok(());
                }
                if l.turns >= lim.max_turns {
                    l.state = State::Done(StopReason::MaxTurns);
                    return Ok(());
                }
                EndedTurn::Calls(by, written)
            }
            Read::Last => {
                l.messages.push(Message::new("assistant", content));
                l.state = State::Done(StopReason::EndOfTurn);
                return Ok(());
            }
            Read::Text => {
                l.messages.push(Message::new("assistant", content.clone()));
                EndedTurn::Text(content)
            }
        };
        let sessions = l
            .env
            .take()
            .expect("an active trajectory holds its sessions");
        match self.env.answer(sessions, l.turns, turn) {
            Ok(answering) => {
                l.state = State::Waiting;
                self.spawn_answer(l.t, tx, answering);
            }
            Err(sessions) => {
                l.env = Some(sessions);
                l.state = State::Done(StopReason::EndOfTurn);
            }
        }
        Ok(())
    }

    /// Runs a firing or a turn's answer on the worker pool: the trajectory `t` waits, and
    /// the answer comes back to the loop with its sessions.
    fn spawn_answer(&self, t: usize, tx: &mpsc::Sender<Arrival>, answering: Answering) {
        let tx = tx.clone();
        self.handle.spawn(async move {
            let (sessions, reply) = answering.await;
            let _ = tx.send(Arrival::Answered(t, sessions, reply));
        });
    }

    /// Appends `new` messages after the conversation so far, rendered by the chat template
    /// (the rest of the last turn's closing text first), as tokens the model is not
    /// trained on; the model's next turn starts after them. A template that cannot
    /// continue ends the trajectory (`template_error`).
    fn continue_with(&self, l: &mut Live, new: Vec<Message>, kind: SpanKind) -> Result<()> {
        let turns = self
            .turns
            .as_ref()
            .expect("an environment or tools have a turn format");
        let last = *l.ids.tokens.last().expect("a turn was sampled");
        let ended_with = if self.settings.sampling.stop_token_ids.contains(&last) {
            self.lm.tokenizer.decode(&[last], false)?
        } else {
            String::new()
        };
        let text = match turns.continuation(
            &escaped(&self.lm.tokenizer, &l.messages),
            &escaped(&self.lm.tokenizer, &new),
            &ended_with,
        ) {
            Ok(text) => text,
            Err(e) => {
                tracing::warn!("{e:#}");
                l.state = State::Done(StopReason::TemplateError);
                return Ok(());
            }
        };
        l.messages.extend(new);
        let ids = self.lm.tokenizer.encode_escaped(&text)?;
        l.insert_ids(&self.settings.limits, ids, kind)?;
        if l.state == State::Active {
            l.turn_start = l.ids.tokens.len();
            l.turn_tokens = 0;
            l.turn_open = true;
        }
        Ok(())
    }

    /// A function's answer cut as [`Self::cut`] cuts a tool output, as text: the tool
    /// message is rendered by the chat template before it becomes tokens.
    fn cut_answer(&self, l: &mut Live, text: String) -> Result<String> {
        let tok = &self.lm.tokenizer;
        let ids = tok.encode_plain(&text)?;
        if ids.len() <= self.settings.limits.max_tool_output_tokens {
            return Ok(text);
        }
        tok.decode(&l.cut(tok, &self.settings.limits, ids)?, false)
    }

    /// Acts on an event: a plugin's answer, a token, the end of a request.
    fn apply<'m>(
        &self,
        event: Arrival,
        b: &mut InFlight<'a>,
        sampler: &mut dyn Sampling<'m>,
    ) -> Result<()>
    where
        'a: 'm,
    {
        let (lives, stats) = (&mut b.lives, &mut b.stats);
        match event {
            Arrival::Answered(t, mut sessions, reply) => {
                stats.plugin_busy_s += reply.took.as_secs_f64();
                stats.tool_busy_s += reply.took.as_secs_f64();
                let (replays, replay) = sessions.take_replays();
                stats.replays += replays;
                stats.replay_s += replay.as_secs_f64();
                let new_turn = matches!(reply.then, Then::Answers(_) | Then::Turn(_));
                let inserted = new_turn || matches!(reply.then, Then::Output(Some(_)));
                self.answered(&mut lives[t], sessions, reply)?;
                if inserted && self.branches_here(&lives[t], new_turn) {
                    self.at_branch_point(b, t);
                }
            }
            Arrival::Forked(t, forked, took) => self.forked(b, t, forked, took),
            Arrival::Token(t, request, token) => {
                let l = &mut lives[t];
                // Tokens of a request the trajectory has left (it stopped it earlier in
                // the same burst from a server) are not its.
                if l.request != request || l.state != State::Active || l.ticket.is_none() {
                    return Ok(());
                }
                l.ids.push(token.id, token.logp);
                self.took(l, token.id, &b.tx)?;
                if l.state != State::Active {
                    Self::release(l, sampler);
                }
                if l.probe.is_some() {
                    self.measure(b, t, token.logp, sampler);
                }
            }
            Arrival::Ended(t, request) => {
                let l = &mut lives[t];
                // The sampler's rule ended the part (or it was the prefill) while the
                // trajectory goes on: it resumes from here with its next request.
                if l.request == request && l.ticket.is_some() {
                    Self::release(l, sampler);
                }
            }
            Arrival::Unsampled(t, why) => {
                let (id, j) = (lives[t].sample, lives[t].index);
                bail!("sampling trajectory {j} of sample {id} (in the batch's order): {why}");
            }
            Arrival::Wake => {}
            Arrival::Generate(call) => {
                stats.asks += 1;
                let stop = &self.settings.sampling.stop_token_ids;
                let kwargs = &self.settings.template_kwargs;
                if let Some((request, sink)) =
                    super::asks::ask(self.lm, kwargs, stop, call, &b.asked)
                {
                    sampler.admit(request, Box::new(sink));
                }
            }
            Arrival::Scored(t, results, took) => {
                stats.plugin_busy_s += took.as_secs_f64();
                let traj = b.done[t].as_mut().expect("scored after finishing");
                self.rewards.combine(traj, results, lives[t].env_reward);
                b.scored += 1;
            }
            Arrival::Opened(t, sessions, faults) => {
                let l = &mut lives[t];
                l.faults.extend(faults.iter().map(FaultRecord::from));
                l.opened(sessions);
            }
        }
        Ok(())
    }

    /// A firing or a turn answered: the calls counted (whether or not the episode goes
    /// on after them), the faults and reward on record, and the answer inserted, or the
    /// trajectory ended.
    fn answered(&self, l: &mut Live, sessions: TrajectorySessions, reply: Reply) -> Result<()> {
        l.env = Some(sessions);
        l.faults.extend(reply.faults.iter().map(FaultRecord::from));
        for kind in &reply.kinds {
            *l.call_kinds.entry(kind.to_string()).or_default() += 1;
        }
        l.tool_calls += reply.kinds.len() as u32;
        if let Some(r) = reply.reward {
            *l.env_reward.get_or_insert(0.0) += r;
        }
        l.state = State::Active;
        let lim = &self.settings.limits;
        match reply.then {
            Then::Output(None) => {}
            Then::Output(Some(text)) => {
                l.tool_calls += 1;
                self.insert(l, &text, SpanKind::Tool)?;
            }
            Then::Answers(mut messages) => {
                for m in &mut messages {
                    m.content = self.cut_answer(l, std::mem::take(&mut m.content))?;
                }
                self.continue_with(l, messages, SpanKind::Tool)?;
            }
            // A text episode's turn counts as a call; the limits end it before it is read.
            Then::Turn(_) if l.turns >= lim.max_turns => {
                l.state = State::Done(StopReason::MaxTurns);
            }
            Then::Turn(_) if l.tool_calls >= lim.max_tool_calls => {
                l.state = State::Done(StopReason::MaxToolCalls);
            }
            Then::Turn(messages) => {
                l.tool_calls += 1;
                self.continue_with(l, messages, SpanKind::Env)?;
            }
            Then::Done => l.state = State::Done(StopReason::EnvDone),
            Then::Failed => l.state = State::Done(StopReason::EnvFault),
        }
        Ok(())
    }

    /// Appends inserted text as tokens the model is not trained on, within the limits.
    fn insert(&self, l: &mut Live, text: &str, kind: SpanKind) -> Result<()> {
        let (tok, lim) = (&self.lm.tokenizer, &self.settings.limits);
        let mut ids = inserted_ids(tok, text, kind)?;
        if kind == SpanKind::Tool {
            ids = l.cut(tok, lim, ids)?;
        }
        l.insert_ids(lim, ids, kind)
    }
}

#[cfg(test)]
mod tests;
