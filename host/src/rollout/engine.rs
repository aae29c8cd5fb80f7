//! The rollout engine: group sampling with triggers and environments in the loop.
//!
//! For a batch of samples, each prompt is rendered with the chat template and prefilled
//! once; its G trajectories fork its KV cache. All active trajectories then decode
//! together, one packed forward per step. Each trajectory owns one trigger session and/or
//! one environment episode. Plugin calls run on the tokio worker pool: a trajectory that
//! waits on one leaves the batch, the others keep decoding, and it rejoins with the
//! inserted tokens pending when the answer arrives.
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

use super::render::{escaped, inserted_ids, prompt_tokens};
use super::reward::{Rewards, Scored};
use super::tools::{self, Answer, ToolSpec, Toolbox, Written};
use super::trajectory::{FaultRecord, Group, Span, SpanKind, StopReason, Trajectory};
use super::turns::TurnFormat;
use crate::model::bundle::LanguageModel;
use crate::model::lora::Mode;
use crate::model::tokenizer::IncrementalDecoder;
use crate::plugin::model::{CallTally, GenerateCall, ModelLink};
use crate::plugin::{EnvironmentEpisode, Fault, StepResult, ToolsSession, TriggerSession};
use crate::rollout::openenv::{Remote, RemoteEpisode};
use crate::sampler::decode::{Completion, sample_seed};
use crate::sampler::draw::SamplingParams;
use crate::sampler::servers::Servers;
use crate::sampler::vllm::Pool;
use crate::sampler::{Held, Request, Sampler, Sampling, Sink, Ticket, Token};
use crate::task::{Message, Sample};
use anyhow::{Context, Result, bail};
use serde_json::{Map, Value as Json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::runtime::Handle;

/// The error of a batch abandoned through [`Engine::set_cancel`] (or a gateway run's
/// interruption): the queue hands it to the trainer as [`super::queue::QueueError::Abandoned`],
/// which the trainer takes for the interruption it is, not a failure.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("rollouts abandoned: the run is being interrupted")]
pub struct Abandoned;

/// Per-trajectory limits.
#[derive(Debug, Clone)]
pub struct RolloutLimits {
    /// Assistant turns (with an environment); the episode is cut after this many.
    pub max_turns: u32,
    /// Tool outputs and environment answers inserted.
    pub max_tool_calls: u32,
    /// Tokens of one tool output; longer output is cut and `truncation_marker` appended.
    pub max_tool_output_tokens: usize,
    /// Prompt plus completion.
    pub max_total_tokens: usize,
    pub truncation_marker: String,
}

impl Default for RolloutLimits {
    fn default() -> Self {
        RolloutLimits {
            max_turns: 8,
            max_tool_calls: 8,
            max_tool_output_tokens: 256,
            max_total_tokens: 4096,
            truncation_marker: "…[truncated]".into(),
        }
    }
}

/// What the engine needs besides the model.
#[derive(Clone)]
pub struct RolloutSettings {
    pub group_size: usize,
    /// `max_new_tokens` is per assistant turn; stop tokens and strings end a turn.
    pub sampling: SamplingParams,
    pub limits: RolloutLimits,
    /// Extra chat template variables, e.g. `enable_thinking = false`.
    pub template_kwargs: Map<String, Json>,
    pub trigger: Option<ToolSpec>,
    pub environment: Option<ToolSpec>,
    /// Functions the model calls in its own format (`rollout.tools`).
    pub tools: Option<std::sync::Arc<Toolbox>>,
    /// vLLM servers that sample in place of the local model (`rollout.engine = "vllm"`).
    pub remote: Option<std::sync::Arc<Pool>>,
    /// An OpenEnv server as the environment (`[rollout.openenv]`), in place of
    /// `environment`.
    pub openenv: Option<std::sync::Arc<Remote>>,
}

impl RolloutSettings {
    /// The chat template's `tools`: the tools plugins' functions, or those of an OpenEnv
    /// server whose actions are calls.
    pub fn template_tools(&self) -> Option<&[Json]> {
        match (&self.tools, &self.openenv) {
            (Some(t), _) => Some(&t.template_tools),
            (None, Some(r)) if !r.functions.is_empty() => Some(&r.template_tools),
            _ => None,
        }
    }
}

/// A trajectory's environment: a plugin's episode in the sandbox, or a session on an
/// OpenEnv server.
enum Episode {
    Plugin(EnvironmentEpisode),
    Remote(RemoteEpisode),
}

/// How a trajectory starts: its prompt as messages and ids, and with an OpenEnv `reset`
/// prompt its session (or the fault that left it without one).
struct Start {
    messages: Vec<Message>,
    prompt: Vec<u32>,
    episode: Option<Episode>,
    fault: Option<FaultRecord>,
}

/// The `episode_id` an OpenEnv session of trajectory `j` of sample `id` is reset with.
fn episode_id(seed: u64, id: u64, j: usize) -> String {
    format!("rlhost-{seed:016x}-{id}-{j}")
}

/// Where a batch's time went.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct BatchStats {
    pub wall_s: f64,
    pub prefill_s: f64,
    /// Time in packed forwards after the prefill.
    pub decode_s: f64,
    /// Time the decoder sat idle because every live trajectory waited on a plugin.
    pub plugin_wait_s: f64,
    /// Sum of the durations of all plugin calls (they overlap decoding and each other).
    pub plugin_busy_s: f64,
    /// The part of it spent in tool and environment calls (trigger firings, function
    /// calls, environment steps: not scoring), an OpenEnv server's included.
    pub tool_busy_s: f64,
    pub prompt_tokens: usize,
    pub sampled_tokens: usize,
    pub inserted_tokens: usize,
    pub forwards: usize,
    pub trajectories: usize,
    /// With vLLM servers: completion requests, and the time the loop sat idle waiting
    /// for their answers (plugin calls overlapping them are not counted there).
    pub requests: usize,
    pub server_wait_s: f64,
    /// With vLLM servers: requests sent again after a fault the server may get over (a
    /// 5xx, a reset connection, a malformed answer).
    pub retries: usize,
    /// With vLLM servers: writing the batch's adapter version and loading it on every
    /// server (0 when it was loaded already).
    pub adapter_load_s: f64,
    /// Plugins' `model.generate` calls this batch took (within their grants; some may
    /// still fail, e.g. a prompt longer than the model's context), and the tokens sampled
    /// for them (never part of a trajectory).
    pub asks: usize,
    pub asked_tokens: usize,
    /// Decoding time spent on them alone (local engine): the base model's forwards, and
    /// every step in which only asks decoded. Policy asks that share a forward with the
    /// trajectories add to it only a few rows, not counted here.
    pub ask_s: f64,
    /// Plugins' `model.generate` calls of this batch's trajectories (their sessions and
    /// their scoring) by outcome, `plugin/answered|refused|failed`.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub generate_calls: std::collections::BTreeMap<String, u64>,
    /// Seconds each plugin's calls waited for their answers, summed (they overlap).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub generate_wait_s: std::collections::BTreeMap<String, f64>,
}

impl BatchStats {
    /// Adds another batch's figures (for totals over several batches).
    pub fn add(&mut self, s: &BatchStats) {
        self.wall_s += s.wall_s;
        self.prefill_s += s.prefill_s;
        self.decode_s += s.decode_s;
        self.plugin_wait_s += s.plugin_wait_s;
        self.plugin_busy_s += s.plugin_busy_s;
        self.tool_busy_s += s.tool_busy_s;
        self.prompt_tokens += s.prompt_tokens;
        self.sampled_tokens += s.sampled_tokens;
        self.inserted_tokens += s.inserted_tokens;
        self.forwards += s.forwards;
        self.trajectories += s.trajectories;
        self.requests += s.requests;
        self.retries += s.retries;
        self.server_wait_s += s.server_wait_s;
        self.adapter_load_s += s.adapter_load_s;
        self.asks += s.asks;
        self.asked_tokens += s.asked_tokens;
        self.ask_s += s.ask_s;
        for (k, n) in &s.generate_calls {
            *self.generate_calls.entry(k.clone()).or_default() += n;
        }
        for (k, w) in &s.generate_wait_s {
            *self.generate_wait_s.entry(k.clone()).or_default() += w;
        }
    }
}

pub struct Engine<'a> {
    lm: &'a LanguageModel,
    settings: &'a RolloutSettings,
    rewards: &'a Rewards,
    handle: Handle,
    turns: Option<TurnFormat<'a>>,
    /// Counts finished trajectories of the current batch (a progress bar, or hidden).
    progress: Option<indicatif::ProgressBar>,
    /// Set when the run is being interrupted: the batch in flight is abandoned.
    cancel: Option<&'a AtomicBool>,
}

/// What reaches the batch's loop: plugin answers, and the sampler's tokens.
enum Event {
    TriggerOpened(usize, Result<TriggerSession, Fault>),
    EpisodeOpened(usize, Result<Episode, Fault>),
    Fired(
        usize,
        TriggerSession,
        Result<Option<String>, Fault>,
        Duration,
    ),
    /// An environment's answer to a turn, with how each of the turn's function calls
    /// went when it sent them as actions (none when the turn itself was the action).
    Stepped(
        usize,
        Episode,
        Result<(StepResult, Vec<&'static str>), Fault>,
        Duration,
    ),
    ToolsOpened(usize, usize, Result<ToolsSession, Fault>),
    /// A token the sampler drew for trajectory `usize`'s request number `u64`.
    Token(usize, u64, Token),
    /// The sampler ended that request (its own stop rule, or a prefill).
    Ended(usize, u64),
    /// The sampler could not sample for it (the message says why).
    Unsampled(usize, String),
    /// A vLLM server answered: the loop steps the sampler.
    Wake,
    /// A turn's function calls answered: the trajectory's sessions back, the answers in
    /// the calls' order, the faults.
    Called(
        usize,
        Vec<Option<ToolsSession>>,
        Vec<Answer>,
        Vec<Fault>,
        Duration,
    ),
    Scored(usize, Vec<Scored>, Duration),
    /// A plugin's `model.generate` call, within its grant.
    Generate(GenerateCall),
}

/// Where the sampler's tokens for a trajectory's request go: the batch's loop, as events
/// (choice `c` of the request is trajectory `first + c`).
struct ToLoop {
    first: usize,
    request: u64,
    tx: mpsc::Sender<Event>,
}

impl Sink for ToLoop {
    fn token(&mut self, token: Token) -> bool {
        let t = self.first + token.choice;
        self.tx.send(Event::Token(t, self.request, token)).is_ok()
    }

    fn done(&mut self, choice: usize, _: Completion) {
        let _ = self
            .tx
            .send(Event::Ended(self.first + choice, self.request));
    }

    fn failed(&mut self, message: &str) {
        let _ = self
            .tx
            .send(Event::Unsampled(self.first, message.to_string()));
    }
}

/// A trajectory's ids: the prompt, then sampled and inserted ones, with the sampling
/// log-prob of each sampled one (`None`: inserted).
struct Ids {
    tokens: Vec<u32>,
    prompt_len: usize,
    logps: Vec<Option<f32>>,
}

impl Ids {
    fn new(prompt: Vec<u32>) -> Ids {
        Ids {
            prompt_len: prompt.len(),
            tokens: prompt,
            logps: Vec::new(),
        }
    }

    fn push(&mut self, token: u32, logp: f32) {
        self.tokens.push(token);
        self.logps.push(Some(logp));
    }

    fn append(&mut self, ids: &[u32]) {
        self.tokens.extend_from_slice(ids);
        self.logps.extend(ids.iter().map(|_| None));
    }

    fn completion(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Its plugin sessions (this many) are still opening; it joins the decode once they
    /// are open, while the trajectories whose sessions are open already decode.
    Opening(u8),
    /// Sampling: it has a request on the sampler, or gets one at the next round.
    Active,
    /// A plugin call of its is in flight.
    Waiting,
    Done(StopReason),
}

/// One trajectory while it is being sampled.
struct Live<'t> {
    sample: usize,
    index: usize,
    ids: Ids,
    /// Its request on the sampler and the choice it is there (none while it waits, or
    /// between two parts), and what continues it meanwhile (its KV cache, its server).
    ticket: Option<(Ticket, usize)>,
    held: Option<Held>,
    /// Numbers its requests (0 is its group's prefill): tokens of an earlier one that
    /// are still on their way are not its.
    request: u64,
    dec: IncrementalDecoder<'t>,
    state: State,
    trigger: Option<TriggerSession>,
    patterns: Vec<String>,
    episode: Option<Episode>,
    /// One tools session per plugin of `rollout.tools` with a stateful function (`None`
    /// for the others, while a call runs, or where it failed to open).
    tools: Vec<Option<ToolsSession>>,
    call_kinds: std::collections::BTreeMap<String, u32>,
    /// The sample, with tools: stateless calls open fresh instances with it.
    sample_data: Option<Sample>,
    /// Byte offset in the decoded text where a stop pattern may start: the end of the
    /// last insertion (patterns inside inserted text never fire).
    scan_from: usize,
    /// Index in `ids.tokens` where the current assistant turn began.
    turn_start: usize,
    turn_tokens: usize,
    /// Whether the model is inside an assistant turn not yet recorded in `messages`.
    turn_open: bool,
    /// Length of the decoded text before the last sampled token: what was searched for
    /// stop patterns already.
    checked: usize,
    /// Inserted spans, in completion token indices; model spans are the gaps.
    inserted: Vec<(SpanKind, usize, usize)>,
    messages: Vec<Message>,
    turns: u32,
    tool_calls: u32,
    tool_truncations: u32,
    faults: Vec<FaultRecord>,
    env_reward: Option<f64>,
    /// The trajectory's seed and the sampling requests it made so far (a request to a
    /// server is seeded by both; in process it draws from its own generator throughout).
    seed: u64,
    requests: u64,
}

impl Live<'_> {
    /// One of its sessions has opened (or failed to): once all have, it decodes.
    fn opened(&mut self) {
        self.state = match self.state {
            State::Opening(n) if n > 1 => State::Opening(n - 1),
            State::Opening(_) => State::Active,
            other => other,
        };
    }
}

/// One batch while it is sampled: its trajectories, the plugin answers on their way, and
/// where the time went.
struct Batch<'t> {
    lives: Vec<Live<'t>>,
    /// Each trajectory once it has finished.
    done: Vec<Option<Trajectory>>,
    stats: BatchStats,
    /// Trajectories sent to be scored, and those scored.
    scoring: usize,
    scored: usize,
    /// Where plugin calls (and the sampler's sinks) send their events, and where the loop
    /// reads them.
    tx: mpsc::Sender<Event>,
    rx: mpsc::Receiver<Event>,
    /// Tokens sampled for plugins' `model.generate` calls.
    asked: Arc<AtomicUsize>,
    /// The outcomes of those calls (and of the refused ones) by plugin.
    tally: std::sync::Arc<CallTally>,
    /// Whether vLLM servers sample (a wait for them is the servers' time).
    remote: bool,
    /// Whether the sampler has stepped once (the first step is the prefill).
    prefilled: bool,
}

impl Batch<'_> {
    /// Whether anything is left: a trajectory not handed over, a score, a request.
    fn unfinished(&self, pending: usize) -> bool {
        pending > 0 || self.scored < self.scoring || self.done.iter().any(Option::is_none)
    }

    /// The next event: one that has come (`None` if none has), or with `wait` the next
    /// to come within it, the wait counted as the servers' time when a request is on a
    /// server, else as the plugins'.
    fn next_event(&mut self, wait: Option<Duration>) -> Result<Option<Event>> {
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

    /// The finished trajectories by sample, and the batch's figures.
    fn into_groups(
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
        for (t, traj) in self.done.into_iter().enumerate() {
            groups[t / group_size]
                .trajectories
                .push(traj.expect("every trajectory finished"));
        }
        stats.wall_s = t0.elapsed().as_secs_f64();
        (groups, stats)
    }
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
        let chat = lm.chat()?;
        let continued_by = match (&settings.environment, &settings.tools, &settings.openenv) {
            (Some(env), _, _) => Some(format!("environment `{}`", env.plugin.name())),
            (None, _, Some(r)) => Some(format!("the OpenEnv server at {}", r.url)),
            (None, Some(_), None) => Some("rollout.tools".to_string()),
            (None, None, None) => None,
        };
        if let Some(r) = &settings.openenv
            && !r.functions.is_empty()
            && r.format.is_none()
        {
            bail!("the OpenEnv server's functions need a call format (Remote::set_format)");
        }
        let turns = match continued_by {
            Some(what) => Some(
                TurnFormat::new(
                    chat,
                    settings.template_kwargs.clone(),
                    settings.template_tools().map(<[Json]>::to_vec),
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
            self.settings.template_tools(),
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
            bar.set_length((samples.len() * self.settings.group_size) as u64);
        }
        let mut stats = BatchStats::default();
        let starts = self.starts(samples, seed, &mut stats)?;
        // Plugin sessions open on the worker pool while the prompts prefill; a trajectory
        // starts decoding once its own are open, not when all are (opening 64 Python
        // sessions takes longer than a prefill on two cores).
        let (tx, rx) = mpsc::channel::<Event>();
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
                    let _ = wake.send(Event::Wake);
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
        let tally = std::sync::Arc::new(CallTally::default());
        let opening = self.open_sessions(samples, seed, &tx, &tally);
        let lives = self.lives(starts, samples, seed, opening);
        let mut batch = Batch {
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

    /// Each sample's prompt tokens, checked against the length limit.
    fn prompts(&self, samples: &[(u64, Sample)], stats: &mut BatchStats) -> Result<Vec<Vec<u32>>> {
        let limit = self.settings.limits.max_total_tokens;
        let mut prompts = Vec::with_capacity(samples.len());
        for (id, sample) in samples {
            let p = self
                .prompt_tokens(sample)
                .with_context(|| format!("rendering the prompt of sample {id}"))?;
            if p.is_empty() {
                bail!("sample {id} renders to an empty prompt");
            }
            if p.len() >= limit {
                bail!(
                    "sample {id}'s prompt has {} tokens, rollout.max_total_tokens is {limit}: raise the limit or shorten the prompt",
                    p.len()
                );
            }
            stats.prompt_tokens += p.len();
            prompts.push(p);
        }
        Ok(prompts)
    }

    /// How each trajectory starts (sample `i`'s `j`th at `i * G + j`): its prompt. With an
    /// OpenEnv server whose `reset` gives the prompt, every trajectory's session opens
    /// here first, all at once: its prompt is the reset observation's messages (after the
    /// sample's with `prompt = "append"`). A session that fails to open, or whose observation would not fit
    /// `max_total_tokens`, is a fault, and that trajectory starts from the sample alone.
    fn starts(
        &self,
        samples: &[(u64, Sample)],
        seed: u64,
        stats: &mut BatchStats,
    ) -> Result<Vec<Start>> {
        let g = self.settings.group_size;
        let remote = self
            .settings
            .openenv
            .as_ref()
            .filter(|r| r.prompt_from_reset());
        let Some(remote) = remote else {
            let prompts = self.prompts(samples, stats)?;
            return Ok(samples
                .iter()
                .zip(prompts)
                .flat_map(|((_, sample), prompt)| {
                    (0..g).map(move |_| Start {
                        messages: sample.messages.clone(),
                        prompt: prompt.clone(),
                        episode: None,
                        fault: None,
                    })
                })
                .collect());
        };
        if samples.len() * g > remote.max_sessions() {
            bail!(
                "rollout.openenv.prompt = \"reset\" opens every session of a batch before it samples: this batch has {} trajectories, rollout.openenv.max_sessions is {}; raise it (and the server's own cap) or lower rollout.prompts_per_step",
                samples.len() * g,
                remote.max_sessions()
            );
        }
        // All the batch's places at once: a held-out evaluation opening beside it could
        // otherwise hold part of what each needs.
        let mut places = self.handle.block_on(remote.places(samples.len() * g));
        let opening: Vec<_> = samples
            .iter()
            .flat_map(|(id, sample)| (0..g).map(move |j| (*id, sample, j)))
            .map(|(id, sample, j)| {
                let (remote, metadata) = (remote.clone(), sample.metadata.clone());
                let place = places.split(1).expect("one place per trajectory");
                self.handle.spawn(async move {
                    let id_text = episode_id(seed, id, j);
                    RemoteEpisode::open(remote, id, id_text, &metadata, Some(place)).await
                })
            })
            .collect();
        let opened = self
            .handle
            .block_on(futures_util::future::join_all(opening));
        let limit = self.settings.limits.max_total_tokens;
        // Where a session fails, its trajectory starts from the sample alone: its
        // messages, or (with `prompt = "reset"` they are often none) an empty user turn.
        let alone_prompts = if remote.prompt_keeps_sample() {
            // Counted where a trajectory starts from one, not here.
            self.prompts(samples, &mut BatchStats::default())?
        } else {
            Vec::new()
        };
        let mut starts: Vec<Start> = Vec::with_capacity(opened.len());
        for (t, result) in opened.into_iter().enumerate() {
            let (i, sample) = (t / g, &samples[t / g].1);
            let alone = |fault: Option<Fault>| -> Result<Start> {
                let (messages, prompt) = match alone_prompts.get(i) {
                    Some(p) => (sample.messages.clone(), p.clone()),
                    None => {
                        let mut messages = sample.messages.clone();
                        if messages.is_empty() {
                            messages.push(Message::new("user", ""));
                        }
                        let alone = Sample {
                            messages: messages.clone(),
                            metadata: sample.metadata.clone(),
                        };
                        let p = self.prompt_tokens(&alone).with_context(|| {
                            format!("rendering the prompt of sample {}", samples[i].0)
                        })?;
                        if p.len() >= limit {
                            bail!(
                                "sample {}'s prompt has {} tokens, rollout.max_total_tokens is {limit}",
                                samples[i].0,
                                p.len()
                            );
                        }
                        (messages, p)
                    }
                };
                Ok(Start {
                    messages,
                    prompt,
                    episode: None,
                    fault: fault.as_ref().map(FaultRecord::from),
                })
            };
            let (episode, reset) = match result.context("an OpenEnv reset task panicked")? {
                Ok(opened) => opened,
                Err(fault) => {
                    starts.push(alone(Some(fault))?);
                    continue;
                }
            };
            let mut messages = if remote.prompt_keeps_sample() {
                sample.messages.clone()
            } else {
                Vec::new()
            };
            messages.extend(reset);
            // The group's sessions usually answer alike: render once.
            let same = starts
                .last()
                .filter(|s| t % g != 0 && s.messages == messages)
                .map(|s| s.prompt.clone());
            let fresh = same.is_none();
            let rendered = match same {
                Some(p) => Ok(p),
                None => self
                    .prompt_tokens(&Sample {
                        messages: messages.clone(),
                        metadata: sample.metadata.clone(),
                    })
                    .map_err(|e| format!("the chat template cannot render the reset observation's prompt: {e:#}"))
                    .and_then(|p| {
                        if p.is_empty() {
                            Err("the reset observation renders to an empty prompt".into())
                        } else if p.len() >= limit {
                            Err(format!(
                                "the reset observation makes a prompt of {} tokens, past rollout.max_total_tokens ({limit})",
                                p.len()
                            ))
                        } else {
                            Ok(p)
                        }
                    }),
            };
            // What the server sent must not stop the run: the episode is a fault.
            let prompt = match rendered {
                Ok(p) => p,
                Err(message) => {
                    starts.push(alone(Some(Fault {
                        plugin: format!("openenv:{}", remote.url),
                        call: "openenv.reset",
                        kind: crate::plugin::FaultKind::BadOutput,
                        message,
                    }))?);
                    continue;
                }
            };
            if fresh {
                stats.prompt_tokens += prompt.len();
            }
            starts.push(Start {
                messages,
                prompt,
                episode: Some(Episode::Remote(episode)),
                fault: None,
            });
        }
        // The prompts of trajectories that start from their sample alone.
        stats.prompt_tokens += starts
            .iter()
            .filter(|s| s.episode.is_none())
            .map(|s| s.prompt.len())
            .sum::<usize>();
        Ok(starts)
    }

    /// Starts opening every trajectory's trigger session and environment episode on the
    /// worker pool (each answers on `tx`); how many each trajectory waits for.
    fn open_sessions(
        &self,
        samples: &[(u64, Sample)],
        seed: u64,
        tx: &mpsc::Sender<Event>,
        tally: &std::sync::Arc<CallTally>,
    ) -> u8 {
        let s = self.settings;
        let g = s.group_size;
        for (i, (id, sample)) in samples.iter().enumerate() {
            for j in 0..g {
                let t = i * g + j;
                let plugin_seed = sample_seed(seed ^ 0x706c_7567, *id as usize, j);
                // The trajectory's own seed (as `prefill` draws it): its sessions'
                // `model.generate` calls are seeded from it.
                let traj_seed = sample_seed(seed, *id as usize, j);
                if let Some(spec) = &s.trigger {
                    let (spec, sample, tx) = (spec.clone(), sample.clone(), tx.clone());
                    let link = self.link(&tx, tally, traj_seed);
                    self.handle.spawn(async move {
                        let r = spec
                            .plugin
                            .open_trigger(&spec.config, &sample, plugin_seed)
                            .await
                            .map(|mut s| {
                                s.set_model(Some(link));
                                s
                            })
                            .map_err(|e| spec.plugin.open_fault("trigger.open", e));
                        let _ = tx.send(Event::TriggerOpened(t, r));
                    });
                }
                if let Some(spec) = &s.environment {
                    let (spec, sample, tx) = (spec.clone(), sample.clone(), tx.clone());
                    let link = self.link(&tx, tally, traj_seed);
                    self.handle.spawn(async move {
                        let r = spec
                            .plugin
                            .open_environment(&spec.config, &sample, plugin_seed)
                            .await
                            .map(|mut s| {
                                s.set_model(Some(link));
                                s
                            })
                            .map_err(|e| spec.plugin.open_fault("environment.open", e));
                        let _ = tx.send(Event::EpisodeOpened(t, r.map(Episode::Plugin)));
                    });
                }
                if let Some(remote) = s.openenv.as_ref().filter(|r| !r.prompt_from_reset()) {
                    let (remote, metadata, tx) =
                        (remote.clone(), sample.metadata.clone(), tx.clone());
                    let (id, episode) = (*id, episode_id(seed, *id, j));
                    self.handle.spawn(async move {
                        let r = RemoteEpisode::open(remote, id, episode, &metadata, None).await;
                        let _ =
                            tx.send(Event::EpisodeOpened(t, r.map(|(e, _)| Episode::Remote(e))));
                    });
                }
            }
        }
        if let Some(toolbox) = &s.tools {
            for (i, (id, sample)) in samples.iter().enumerate() {
                for j in 0..g {
                    let t = i * g + j;
                    let plugin_seed = sample_seed(seed ^ 0x746f_6f6c, *id as usize, j);
                    let traj_seed = sample_seed(seed, *id as usize, j);
                    for (p, spec) in toolbox.plugins.iter().enumerate() {
                        if !toolbox.needs_session(p) {
                            continue;
                        }
                        let (spec, sample, tx) = (spec.clone(), sample.clone(), tx.clone());
                        let link = self.link(&tx, tally, traj_seed);
                        self.handle.spawn(async move {
                            let r = spec
                                .plugin
                                .open_tools(&spec.config, &sample, plugin_seed)
                                .await
                                .map(|mut s| {
                                    s.set_model(Some(link));
                                    s
                                })
                                .map_err(|e| spec.plugin.open_fault("tools.open", e));
                            let _ = tx.send(Event::ToolsOpened(t, p, r));
                        });
                    }
                }
            }
        }
        let tools = s.tools.as_ref().map_or(0, |t| {
            (0..t.plugins.len()).filter(|&p| t.needs_session(p)).count()
        });
        let remote = s.openenv.as_ref().is_some_and(|r| !r.prompt_from_reset());
        u8::try_from(
            usize::from(s.trigger.is_some())
                + usize::from(s.environment.is_some())
                + usize::from(remote)
                + tools,
        )
        .expect("fewer than 255 plugins per trajectory")
    }

    /// Where the `model.generate` calls of a session of the trajectory seeded `traj_seed`
    /// go: this batch's loop, as events.
    fn link(
        &self,
        tx: &mpsc::Sender<Event>,
        tally: &std::sync::Arc<CallTally>,
        traj_seed: u64,
    ) -> ModelLink {
        let tx = tx.clone();
        ModelLink::new(traj_seed, move |call| {
            tx.send(Event::Generate(call))
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
        b: &mut Batch<'a>,
        sampler: &mut dyn Sampling<'m>,
        samples: &[(u64, Sample)],
        seed: u64,
    ) {
        let g = self.settings.group_size;
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
    /// prefilled; each waits for `opening` plugin sessions before it samples.
    fn lives(
        &self,
        starts: Vec<Start>,
        samples: &[(u64, Sample)],
        seed: u64,
        opening: u8,
    ) -> Vec<Live<'a>> {
        let g = self.settings.group_size;
        let mut lives = Vec::with_capacity(starts.len());
        for (t, start) in starts.into_iter().enumerate() {
            let (i, j) = (t / g, t % g);
            let traj_seed = sample_seed(seed, samples[i].0 as usize, j);
            lives.push(self.live(i, j, traj_seed, opening, samples, start));
        }
        lives
    }

    /// Trajectory `j` of sample `i`, about to decode after its prompt.
    fn live(
        &self,
        i: usize,
        j: usize,
        seed: u64,
        opening: u8,
        samples: &[(u64, Sample)],
        start: Start,
    ) -> Live<'a> {
        let first = start.prompt.len();
        Live {
            sample: i,
            index: j,
            ids: Ids::new(start.prompt),
            ticket: None,
            held: None,
            request: 0,
            dec: IncrementalDecoder::new(&self.lm.tokenizer, false),
            state: if opening > 0 {
                State::Opening(opening)
            } else {
                State::Active
            },
            trigger: None,
            patterns: Vec::new(),
            episode: start.episode,
            tools: (0..self.settings.tools.as_ref().map_or(0, |t| t.plugins.len()))
                .map(|_| None)
                .collect(),
            call_kinds: Default::default(),
            sample_data: self.settings.tools.as_ref().map(|_| samples[i].1.clone()),
            scan_from: 0,
            turn_start: first,
            turn_tokens: 0,
            turn_open: true,
            checked: 0,
            inserted: Vec::new(),
            messages: start.messages,
            turns: 0,
            tool_calls: 0,
            tool_truncations: 0,
            faults: start.fault.into_iter().collect(),
            env_reward: None,
            seed,
            requests: 0,
        }
    }

    /// One round of the loop: takes the events that have come (plugin answers, tokens),
    /// hands finished trajectories to be scored, gives every active trajectory without
    /// a request its next one, and steps the sampler. When the sampler could do nothing
    /// (everything waits on a plugin or a server) it waits for the next event. `false`
    /// once nothing is left to sample or wait for.
    fn round<'m>(
        &self,
        b: &mut Batch<'a>,
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
        // With requests on servers, an answer wakes the loop (`Event::Wake`); the timeout
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
    fn submit<'m>(&self, b: &mut Batch<'a>, sampler: &mut dyn Sampling<'m>) {
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

    /// Hands every trajectory that finished since the last round over to be scored.
    fn hand_over_finished(
        &self,
        b: &mut Batch<'a>,
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
        b: &mut Batch<'a>,
        t: usize,
        samples: &[(u64, Sample)],
        stop: StopReason,
        version: u64,
    ) -> Result<()> {
        let l = &mut b.lives[t];
        let mut traj = self.finish(l, samples, stop, version)?;
        b.stats.sampled_tokens += traj.sampled_tokens();
        b.stats.inserted_tokens += traj.completion_tokens().len() - traj.sampled_tokens();
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

    /// Acts on the token `tok` just appended to an active trajectory: the same rules
    /// whichever sampler drew it.
    fn took(&self, l: &mut Live, tok: u32, tx: &mpsc::Sender<Event>) -> Result<()> {
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
        if let Some(end) = new_match(l.dec.text(), search_from(l, &l.patterns), &l.patterns) {
            if l.tool_calls >= s.limits.max_tool_calls {
                l.state = State::Done(StopReason::MaxToolCalls);
                return Ok(());
            }
            l.scan_from = l.dec.text().len();
            if let Some(mut session) = l.trigger.take() {
                let text = l.dec.text()[..end].to_string();
                let (t, tx) = (self.index_of(l), tx.clone());
                l.state = State::Waiting;
                self.handle.spawn(async move {
                    let c0 = Instant::now();
                    let r = session.fire(&text).await;
                    let _ = tx.send(Event::Fired(t, session, r, c0.elapsed()));
                });
                return Ok(());
            }
        }
        if !s.sampling.stop_strings.is_empty()
            && new_match(
                l.dec.text(),
                search_from(l, &s.sampling.stop_strings),
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

    fn index_of(&self, l: &Live) -> usize {
        l.sample * self.settings.group_size + l.index
    }

    /// The model ended its turn: record it, and hand it to the environment if there is one.
    fn end_turn(&self, l: &mut Live, tx: &mpsc::Sender<Event>, by_stop_token: bool) -> Result<()> {
        let tokens = &l.ids.tokens[l.turn_start..];
        let content_tokens = if by_stop_token {
            &tokens[..tokens.len() - 1]
        } else {
            tokens
        };
        let content = self.lm.tokenizer.decode(content_tokens, false)?;
        l.turns += 1;
        l.turn_open = false;
        if let Some(toolbox) = &self.settings.tools {
            let turn = toolbox.read(&content);
            if !turn.calls.is_empty() {
                return self.call_tools(l, tx, toolbox, turn);
            }
        }
        if let Some(remote) = self
            .settings
            .openenv
            .as_ref()
            .filter(|r| !r.functions.is_empty())
        {
            return self.call_remote(l, tx, remote, content);
        }
        l.messages.push(Message {
            role: "assistant".into(),
            content: content.clone(),
            ..Default::default()
        });
        match l.episode.take() {
            Some(mut episode) => {
                let (t, tx) = (self.index_of(l), tx.clone());
                l.state = State::Waiting;
                self.handle.spawn(async move {
                    let c0 = Instant::now();
                    let r = match &mut episode {
                        Episode::Plugin(e) => e.step(&content).await,
                        Episode::Remote(e) => e.step_text(&content).await,
                    };
                    let r = r.map(|step| (step, Vec::new()));
                    let _ = tx.send(Event::Stepped(t, episode, r, c0.elapsed()));
                });
            }
            None => l.state = State::Done(StopReason::EndOfTurn),
        }
        Ok(())
    }

    /// A turn for an OpenEnv server whose actions are function calls: the calls it wrote
    /// go to the server as actions (the trajectory waits), a turn without one is the
    /// final answer, and the limits end the trajectory as they do for `rollout.tools`.
    fn call_remote(
        &self,
        l: &mut Live,
        tx: &mpsc::Sender<Event>,
        remote: &Remote,
        content: String,
    ) -> Result<()> {
        let format = remote.format.expect("checked in Engine::new");
        let turn = super::tool_calls::parse(format, &content, &remote.functions);
        if turn.calls.is_empty() {
            l.messages.push(Message::new("assistant", content));
            l.state = State::Done(StopReason::EndOfTurn);
            return Ok(());
        }
        let Some(written) = self.record_calls(l, turn) else {
            return Ok(());
        };
        // An OpenEnv run's episodes are the server's (a plugin environment is refused
        // beside `[rollout.openenv]`); none when its session did not open (the fault is on
        // record): nothing to answer.
        let Some(Episode::Remote(mut episode)) = l.episode.take() else {
            l.state = State::Done(StopReason::EndOfTurn);
            return Ok(());
        };
        let (t, tx) = (self.index_of(l), tx.clone());
        l.state = State::Waiting;
        self.handle.spawn(async move {
            let c0 = Instant::now();
            let r = episode.step_calls(&written).await;
            let _ = tx.send(Event::Stepped(t, Episode::Remote(episode), r, c0.elapsed()));
        });
        Ok(())
    }

    /// The model ended a turn with function calls: record them and run them on the
    /// worker pool (the trajectory waits), or end the trajectory at a limit.
    fn call_tools(
        &self,
        l: &mut Live,
        tx: &mpsc::Sender<Event>,
        toolbox: &std::sync::Arc<Toolbox>,
        turn: super::tool_calls::Turn,
    ) -> Result<()> {
        let Some(written) = self.record_calls(l, turn) else {
            return Ok(());
        };
        let sessions = std::mem::take(&mut l.tools);
        let (t, tx) = (self.index_of(l), tx.clone());
        let toolbox = toolbox.clone();
        let sample = l
            .sample_data
            .clone()
            .expect("a trajectory with tools keeps its sample");
        let seed = l.seed ^ u64::from(l.turns).wrapping_mul(0x6361_6c6c);
        l.state = State::Waiting;
        self.handle.spawn(async move {
            let c0 = Instant::now();
            let (sessions, answers, faults) =
                tools::run(&toolbox, sessions, &sample, seed, &written).await;
            let _ = tx.send(Event::Called(t, sessions, answers, faults, c0.elapsed()));
        });
        Ok(())
    }

    /// The calls of a turn that wrote some, numbered and recorded as the assistant's
    /// message; `None` when they pass `max_tool_calls` or the turn is the last
    /// `max_turns` allows (the trajectory ends there, the calls unanswered).
    fn record_calls(&self, l: &mut Live, turn: super::tool_calls::Turn) -> Option<Vec<Written>> {
        let written: Vec<Written> = turn
            .calls
            .into_iter()
            .enumerate()
            .map(|(k, call)| Written {
                id: format!("call_{}_{k}", l.turns),
                call,
            })
            .collect();
        l.messages
            .push(tools::assistant_message(turn.content, &written));
        let lim = &self.settings.limits;
        if l.tool_calls as usize + written.len() > lim.max_tool_calls as usize {
            l.state = State::Done(StopReason::MaxToolCalls);
            return None;
        }
        if l.turns >= lim.max_turns {
            l.state = State::Done(StopReason::MaxTurns);
            return None;
        }
        Some(written)
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
        self.insert_ids(l, ids, kind)?;
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
        tok.decode(&self.cut(l, ids)?, false)
    }

    /// Acts on an event: a plugin's answer, a token, the end of a request.
    fn apply<'m>(
        &self,
        event: Event,
        b: &mut Batch<'a>,
        sampler: &mut dyn Sampling<'m>,
    ) -> Result<()>
    where
        'a: 'm,
    {
        let (lives, stats) = (&mut b.lives, &mut b.stats);
        match event {
            Event::Fired(t, session, result, took) => {
                stats.plugin_busy_s += took.as_secs_f64();
                stats.tool_busy_s += took.as_secs_f64();
                let l = &mut lives[t];
                l.trigger = Some(session);
                l.state = State::Active;
                let text = match result {
                    Ok(Some(text)) => text,
                    Ok(None) => return Ok(()),
                    Err(fault) => {
                        l.faults.push(FaultRecord::from(&fault));
                        fault.tool_error_text()
                    }
                };
                l.tool_calls += 1;
                self.insert(l, &text, SpanKind::Tool)?;
            }
            Event::Stepped(t, episode, result, took) => {
                stats.plugin_busy_s += took.as_secs_f64();
                stats.tool_busy_s += took.as_secs_f64();
                let l = &mut lives[t];
                l.episode = Some(episode);
                let (step, kinds) = match result {
                    Ok(answered) => answered,
                    Err(fault) => {
                        l.faults.push(FaultRecord::from(&fault));
                        // A turn of calls sent to the server: the call it failed on.
                        if self
                            .settings
                            .openenv
                            .as_ref()
                            .is_some_and(|r| !r.functions.is_empty())
                        {
                            *l.call_kinds.entry("fault".into()).or_default() += 1;
                            l.tool_calls += 1;
                        }
                        l.state = State::Done(StopReason::EnvFault);
                        return Ok(());
                    }
                };
                for kind in &kinds {
                    *l.call_kinds.entry(kind.to_string()).or_default() += 1;
                }
                // Calls count whether or not the episode goes on after them.
                let calls = kinds.len() as u32;
                l.tool_calls += calls;
                if let Some(r) = step.reward {
                    *l.env_reward.get_or_insert(0.0) += r;
                }
                // A turn of calls met the limits before it was sent.
                l.state = if step.done {
                    State::Done(StopReason::EnvDone)
                } else if calls == 0 && l.turns >= self.settings.limits.max_turns {
                    State::Done(StopReason::MaxTurns)
                } else if calls == 0 && l.tool_calls >= self.settings.limits.max_tool_calls {
                    State::Done(StopReason::MaxToolCalls)
                } else {
                    State::Active
                };
                if l.state != State::Active {
                    return Ok(());
                }
                if calls == 0 {
                    l.tool_calls += 1;
                    self.continue_with(l, step.messages, SpanKind::Env)?;
                } else {
                    let mut messages = step.messages;
                    for m in &mut messages {
                        m.content = self.cut_answer(l, std::mem::take(&mut m.content))?;
                    }
                    self.continue_with(l, messages, SpanKind::Tool)?;
                }
            }
            Event::Called(t, sessions, answers, faults, took) => {
                stats.plugin_busy_s += took.as_secs_f64();
                stats.tool_busy_s += took.as_secs_f64();
                let l = &mut lives[t];
                l.tools = sessions;
                l.faults.extend(faults.iter().map(FaultRecord::from));
                l.state = State::Active;
                for a in &answers {
                    *l.call_kinds.entry(a.kind.to_string()).or_default() += 1;
                }
                l.tool_calls += answers.len() as u32;
                let mut messages = tools::tool_messages(&answers);
                for m in &mut messages {
                    m.content = self.cut_answer(l, std::mem::take(&mut m.content))?;
                }
                self.continue_with(l, messages, SpanKind::Tool)?;
            }
            Event::Token(t, request, token) => {
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
            }
            Event::Ended(t, request) => {
                let l = &mut lives[t];
                // The sampler's rule ended the part (or it was the prefill) while the
                // trajectory goes on: it resumes from here with its next request.
                if l.request == request && l.ticket.is_some() {
                    Self::release(l, sampler);
                }
            }
            Event::Unsampled(t, why) => {
                let (id, j) = (lives[t].sample, lives[t].index);
                bail!("sampling trajectory {j} of sample {id} (in the batch's order): {why}");
            }
            Event::Wake => {}
            Event::Generate(call) => {
                stats.asks += 1;
                let stop = &self.settings.sampling.stop_token_ids;
                let kwargs = &self.settings.template_kwargs;
                if let Some((request, sink)) =
                    super::asks::ask(self.lm, kwargs, stop, call, &b.asked)
                {
                    sampler.admit(request, Box::new(sink));
                }
            }
            Event::Scored(t, results, took) => {
                stats.plugin_busy_s += took.as_secs_f64();
                let traj = b.done[t].as_mut().expect("scored after finishing");
                self.rewards.combine(traj, results, lives[t].env_reward);
                b.scored += 1;
            }
            Event::TriggerOpened(t, result) => {
                let l = &mut lives[t];
                match result {
                    Ok(session) => {
                        l.patterns = session.stop_patterns().to_vec();
                        l.trigger = Some(session);
                    }
                    // Without its session the trajectory runs without the tool; the fault
                    // is on record.
                    Err(f) => l.faults.push(FaultRecord::from(&f)),
                }
                l.opened();
            }
            Event::ToolsOpened(t, p, result) => {
                let l = &mut lives[t];
                match result {
                    Ok(session) => l.tools[p] = Some(session),
                    // Its calls are answered as the tool's failure; the fault is on record.
                    Err(f) => l.faults.push(FaultRecord::from(&f)),
                }
                l.opened();
            }
            Event::EpisodeOpened(t, result) => {
                let l = &mut lives[t];
                match result {
                    Ok(episode) => l.episode = Some(episode),
                    // Without its episode the trajectory runs as a single turn.
                    Err(f) => l.faults.push(FaultRecord::from(&f)),
                }
                l.opened();
            }
        }
        Ok(())
    }

    /// Appends inserted text as tokens the model is not trained on, within the limits.
    fn insert(&self, l: &mut Live, text: &str, kind: SpanKind) -> Result<()> {
        let tok = &self.lm.tokenizer;
        let mut ids = inserted_ids(tok, text, kind)?;
        if kind == SpanKind::Tool {
            ids = self.cut(l, ids)?;
        }
        self.insert_ids(l, ids, kind)
    }

    /// A tool output's ids cut to `rollout.max_tool_output_tokens`, the truncation
    /// marker's ids last, when longer (counted on the trajectory).
    fn cut(&self, l: &mut Live, mut ids: Vec<u32>) -> Result<Vec<u32>> {
        let lim = &self.settings.limits;
        if ids.len() > lim.max_tool_output_tokens {
            let marker = self.lm.tokenizer.encode(&lim.truncation_marker)?;
            ids.truncate(lim.max_tool_output_tokens.saturating_sub(marker.len()));
            ids.extend(marker);
            l.tool_truncations += 1;
        }
        Ok(ids)
    }

    /// Appends inserted ids (not trained on), as many as fit the length limit.
    fn insert_ids(&self, l: &mut Live, mut ids: Vec<u32>, kind: SpanKind) -> Result<()> {
        let lim = &self.settings.limits;
        let room = lim.max_total_tokens.saturating_sub(l.ids.tokens.len());
        if ids.len() >= room {
            // No room left to answer: keep what fits and end here.
            ids.truncate(room);
            l.state = State::Done(StopReason::TotalTokens);
        }
        let start = l.ids.tokens.len() - l.ids.prompt_len;
        l.ids.append(&ids);
        for &id in &ids {
            l.dec.push(id)?;
        }
        l.inserted.push((kind, start, start + ids.len()));
        l.scan_from = l.dec.text().len();
        Ok(())
    }

    /// The finished trajectory, with its sessions released.
    fn finish(
        &self,
        l: &mut Live,
        samples: &[(u64, Sample)],
        stop: StopReason,
        version: u64,
    ) -> Result<Trajectory> {
        l.trigger = None;
        l.episode = None;
        l.tools.clear();
        l.dec.flush()?;
        let tok = &self.lm.tokenizer;
        // A turn cut off by a limit is still the model's text: it goes in the messages.
        if l.turn_open {
            l.turn_open = false;
            let content = tok.decode(&l.ids.tokens[l.turn_start..], false)?;
            l.messages.push(Message {
                role: "assistant".into(),
                content,
                ..Default::default()
            });
            l.turns += 1;
        }
        let completion = l.ids.completion().to_vec();
        let mut spans = Vec::new();
        let mut at = 0;
        let push = |kind, start: usize, end: usize, spans: &mut Vec<Span>| -> Result<()> {
            if end > start {
                spans.push(Span {
                    kind,
                    start,
                    end,
                    text: tok.decode(&completion[start..end], false)?,
                });
            }
            Ok(())
        };
        for &(kind, start, end) in &l.inserted {
            push(SpanKind::Model, at, start, &mut spans)?;
            push(kind, start, end, &mut spans)?;
            at = end;
        }
        push(SpanKind::Model, at, completion.len(), &mut spans)?;
        let (id, sample) = &samples[l.sample];
        // Frees the KV cache now, not when the batch ends.
        l.held = None;
        let ids = std::mem::replace(&mut l.ids, Ids::new(Vec::new()));
        Ok(Trajectory {
            sample_id: *id,
            index: l.index,
            version,
            prompt_len: ids.prompt_len,
            tokens: ids.tokens,
            logps: ids.logps,
            spans,
            messages: std::mem::take(&mut l.messages),
            completion: l.dec.text().to_string(),
            metadata: sample.metadata.clone(),
            turns: l.turns,
            tool_calls: l.tool_calls,
            tool_truncations: l.tool_truncations,
            call_kinds: std::mem::take(&mut l.call_kinds),
            stop,
            truncated: stop.truncated(),
            faults: std::mem::take(&mut l.faults),
            notes: Default::default(),
            rewards: Default::default(),
            reward: 0.0,
        })
    }

    /// Scores trajectory `t` (seeded `traj_seed`) on the worker pool: its rewards'
    /// `model.generate` calls come back to this batch's loop, seeded from the trajectory.
    fn spawn_scoring(
        &self,
        t: usize,
        traj_seed: u64,
        traj: &Trajectory,
        tx: mpsc::Sender<Event>,
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
            let _ = tx.send(Event::Scored(t, results, c0.elapsed()));
        });
    }
}

/// A batch's hold on the adapter version it samples with on the vLLM servers: loaded
/// (if new) when it begins, released when the batch ends however it ends.
struct Lease<'p> {
    pool: &'p Pool,
    lm: &'p LanguageModel,
    mode: Mode<'p>,
    version: u64,
    /// The model name the batch's requests use.
    name: String,
}

impl<'p> Lease<'p> {
    fn new(pool: &'p Pool, lm: &'p LanguageModel, mode: Mode<'p>, version: u64) -> Result<Self> {
        let name = pool.acquire(lm, mode, version)?;
        Ok(Lease {
            pool,
            lm,
            mode,
            version,
            name,
        })
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.pool.release(self.version, self.mode, self.lm);
    }
}

/// Where a search for `patterns` must start so that it sees every occurrence ending in
/// the last token's text and nothing before the last insertion: an occurrence that ended
/// earlier was found by an earlier search. Searching only this tail keeps matching
/// proportional to the new text, not to the turn.
fn search_from(l: &Live, patterns: &[String]) -> usize {
    let longest = patterns.iter().map(String::len).max().unwrap_or(0);
    let text = l.dec.text();
    let mut from = l
        .checked
        .saturating_sub(longest.saturating_sub(1))
        .max(l.scan_from);
    while from < text.len() && !text.is_char_boundary(from) {
        from -= 1;
    }
    from.max(l.scan_from).min(text.len())
}

/// The end (byte offset) of the first pattern occurrence that starts at or after `from`,
/// if any. The text before the last token was checked already, and after a match
/// `from` moves past it, so a pattern matches once. (`rlhost plugin call` cuts an
/// author's text with it, as a rollout would.)
pub fn new_match(text: &str, from: usize, patterns: &[String]) -> Option<usize> {
    let hay = text.get(from..)?;
    patterns
        .iter()
        .filter_map(|p| hay.find(p.as_str()).map(|at| from + at + p.len()))
        .min()
}

/// A session that could not be opened, as a fault (opening errors other than the
/// plugin's own are host-side: an incompatible plugin).
#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Placement;
    use crate::model::fixtures;

    fn settings(lm: &LanguageModel, group_size: usize) -> RolloutSettings {
        let mut sampling = lm.default_sampling().unwrap();
        sampling.temperature = 1.0;
        sampling.top_k = 0;
        sampling.top_p = 1.0;
        sampling.max_new_tokens = 10;
        RolloutSettings {
            group_size,
            sampling,
            limits: RolloutLimits::default(),
            template_kwargs: Map::new(),
            trigger: None,
            environment: None,
            tools: None,
            remote: None,
            openenv: None,
        }
    }

    fn tokens(groups: &[Group]) -> Vec<Vec<Vec<u32>>> {
        groups
            .iter()
            .map(|g| g.trajectories.iter().map(|t| t.tokens.clone()).collect())
            .collect()
    }

    /// A prompt that cannot fit is refused before anything decodes, naming the sample and
    /// the setting; the prompts that fit are counted.
    #[test]
    fn prompts_are_checked_against_the_length_limit() {
        let lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        let rewards = Rewards::none();
        let mut s = settings(&lm, 1);
        let short = (1, Sample::from_prompt("Hi"));
        let long = (7, Sample::from_prompt(&"many words ".repeat(40)));
        let fits = Engine::new(&lm, &s, &rewards, rt.handle().clone())
            .unwrap()
            .prompt_tokens(&short.1)
            .unwrap()
            .len();
        s.limits.max_total_tokens = fits + 1;
        let engine = Engine::new(&lm, &s, &rewards, rt.handle().clone()).unwrap();
        let mut stats = BatchStats::default();
        assert_eq!(
            engine
                .prompts(std::slice::from_ref(&short), &mut stats)
                .unwrap()[0]
                .len(),
            fits
        );
        assert_eq!(stats.prompt_tokens, fits);
        let e = engine
            .prompts(&[short, long], &mut stats)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("sample 7's prompt has") && e.contains("rollout.max_total_tokens is"),
            "{e}"
        );
    }

    /// The decode loop takes plugin answers without waiting while it has work, and waits
    /// (counting the wait as the tool's) only when asked to.
    #[test]
    fn a_batch_waits_for_plugin_answers_only_when_told_to() {
        let (tx, rx) = mpsc::channel::<Event>();
        let mut batch = Batch {
            lives: Vec::new(),
            done: Vec::new(),
            stats: BatchStats::default(),
            scoring: 0,
            scored: 0,
            tx: tx.clone(),
            rx,
            asked: Default::default(),
            tally: Default::default(),
            remote: false,
            prefilled: false,
        };
        assert!(batch.next_event(None).unwrap().is_none());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            let _ = tx.send(Event::Scored(3, Vec::new(), Duration::ZERO));
        });
        let event = batch.next_event(Some(Duration::from_secs(60))).unwrap();
        assert!(matches!(event, Some(Event::Scored(3, _, _))));
        assert!(
            batch.stats.plugin_wait_s >= 0.02,
            "{}",
            batch.stats.plugin_wait_s
        );
    }

    /// A sample's trajectories do not depend on what else is in the batch: prefilling a
    /// prompt once for its group gives the same tokens as running it alone, and the
    /// same seed gives the same tokens.
    #[test]
    fn group_sampling_is_independent_of_the_batch() {
        let lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        let rewards = Rewards::none();
        let s = settings(&lm, 3);
        let engine = Engine::new(&lm, &s, &rewards, rt.handle().clone()).unwrap();
        let a = (4, Sample::from_prompt("Tell me a story."));
        let b = (9, Sample::from_prompt("What is 2+2?"));
        let (both, stats) = engine
            .run(&[a.clone(), b.clone()], 5, 0, Mode::INFERENCE)
            .unwrap();
        let (alone, _) = engine
            .run(std::slice::from_ref(&b), 5, 0, Mode::INFERENCE)
            .unwrap();
        assert_eq!(tokens(&both)[1], tokens(&alone)[0]);
        let (again, _) = engine.run(&[a.clone(), b], 5, 0, Mode::INFERENCE).unwrap();
        assert_eq!(tokens(&both), tokens(&again));
        let (other_seed, _) = engine.run(&[a], 6, 0, Mode::INFERENCE).unwrap();
        assert_ne!(tokens(&both)[0], tokens(&other_seed)[0]);
        // The group's samples differ and share the prompt.
        let g = &both[0].trajectories;
        assert_ne!(g[0].tokens, g[1].tokens);
        assert_eq!(
            g[0].tokens[..g[0].prompt_len],
            g[1].tokens[..g[1].prompt_len]
        );
        assert_eq!(stats.trajectories, 6);
        assert!(g.iter().all(|t| t.loss_mask().iter().all(|&m| m == 1)));
    }

    /// Issue 22: with `max_staleness > 0` AdamW wrote the adapter in place while the
    /// producer decoded, so a batch labelled version v could mix v and v + 1 across
    /// layers. Sampling from a snapshot gives exactly the tokens of version v, however
    /// the live adapter changes meanwhile.
    #[test]
    fn a_batch_sampled_from_a_snapshot_is_that_version_exactly() {
        use crate::model::lora::AdapterSnapshot;
        let mut lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
        lm.model
            .attach_lora(&crate::model::LoraConfig::default(), 3)
            .unwrap();
        let vars = lm.model.lora_vars();
        let shift = |by: f64| {
            for (name, v) in &vars {
                if name.ends_with("lora_B") {
                    v.set(&(v.as_tensor() + by).unwrap()).unwrap();
                }
            }
        };
        shift(0.05);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        let rewards = Rewards::none();
        let s = settings(&lm, 2);
        let engine = Engine::new(&lm, &s, &rewards, rt.handle().clone()).unwrap();
        let samples = [(1, Sample::from_prompt("Tell me a story."))];
        let (v0, _) = engine.run(&samples, 5, 0, Mode::INFERENCE).unwrap();
        let snapshot = AdapterSnapshot::take(&lm.model, 0).unwrap();
        let from_snapshot = Mode {
            adapter: Some(&snapshot),
            ..Mode::INFERENCE
        };
        // The optimizer steps again and again while the batch is sampled.
        let done = std::sync::atomic::AtomicBool::new(false);
        let (during, _) = std::thread::scope(|scope| {
            scope.spawn(|| {
                while !done.load(Ordering::Relaxed) {
                    shift(0.01);
                }
            });
            let r = engine.run(&samples, 5, 0, from_snapshot).unwrap();
            done.store(true, Ordering::Relaxed);
            r
        });
        assert_eq!(tokens(&during), tokens(&v0));
        let logps = |g: &[Group]| g[0].trajectories[0].logps.clone();
        assert_eq!(logps(&during), logps(&v0));
        // The live adapter has moved on: sampling from it gives other tokens.
        shift(0.5);
        let (live, _) = engine.run(&samples, 5, 0, Mode::INFERENCE).unwrap();
        assert_ne!(logps(&live), logps(&v0));
    }

    #[test]
    fn stop_patterns_match_once_and_only_in_new_text() {
        let p = vec!["</calc>".to_string()];
        assert_eq!(new_match("a</calc>b", 0, &p), Some(8));
        assert_eq!(new_match("a</calc>b", 8, &p), None);
        assert_eq!(new_match("x</calc>", 2, &p), None, "starts before `from`");
        assert_eq!(
            new_match("héllo", 2, &["l".into()]),
            None,
            "not a char boundary"
        );
    }
}
