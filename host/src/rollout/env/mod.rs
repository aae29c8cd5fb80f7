//! The environment seam: what answers a trajectory's turns.
//!
//! The engine (`rollout/engine/`) keeps a trajectory's state machine: it samples, finds
//! where a tool fires or a turn ends, inserts what comes back and counts. What answers is
//! asked here, the same three ways whatever answers:
//! - [`Environment::open`]: a trajectory's [`TrajectorySessions`], opened on the worker pool;
//! - [`Environment::fire`]: a trigger's stop pattern matched mid-turn;
//! - [`Environment::read`] then [`Environment::answer`]: the model's turn ended; its
//!   function calls, or its text, answered.
//!
//! Each answer comes back as a [`Reply`] with the sessions (a call runs on the pool with
//! them and hands them back): what to insert, how each call went, the faults, the reward,
//! and whether the episode goes on. The engine does one thing with every reply, so the
//! call bookkeeping (calls counted, by kind, faults on record) is written once.
//!
//! What answers:
//! - [`plugin`]: trigger plugins (their output inserted where their pattern matched) and
//!   environment plugins (each turn answered with the environment's messages);
//! - [`tools`]: function calling (`rollout.tools`), each call answered by a `tool` message;
//! - [`openenv`]: an OpenEnv server (`[rollout.openenv]`), a turn sent as a text action or
//!   its calls as call actions.
//!
//! A trajectory may hold a trigger, tools and one episode (plugin or server) at once: the
//! config refuses two episodes. A turn's calls go to the tools first; a turn without calls
//! goes to the episode.

pub mod openenv;
pub mod plugin;
mod reply;
pub mod tools;

use super::tool_calls;
use crate::openenv::settings::ForkBy;
use crate::plugin::model::ModelLink;
use crate::plugin::{Fault, ForkError, ToolsSession, TriggerSession};
use crate::sampler::decode::sample_seed;
use crate::task::{Message, Sample};
use anyhow::{Result, bail};
use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use openenv::{EpisodeForkError, Remote, RemoteEpisode};
use plugin::AnyEpisode;
pub use reply::{Reply, Then};
use serde_json::Value as Json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tools::{ToolSpec, Toolbox, Written};

/// What answers a run's turns, as `config/` built it (part of the engine's
/// `RolloutSettings`). Any of them may be there at once but two episodes (an environment
/// plugin and a server), which the config refuses.
#[derive(Clone, Default)]
pub struct Answerers {
    pub trigger: Option<ToolSpec>,
    pub environment: Option<ToolSpec>,
    /// Functions the model calls in its own format (`rollout.tools`).
    pub tools: Option<Arc<Toolbox>>,
    /// An OpenEnv server as the environment (`[rollout.openenv]`), in place of
    /// `environment`.
    pub openenv: Option<Arc<Remote>>,
}

impl Answerers {
    /// The chat template's `tools`: the tools plugins' functions, or those of an OpenEnv
    /// server whose actions are calls.
    pub fn template_tools(&self) -> Option<&[Json]> {
        match (&self.tools, &self.openenv) {
            (Some(t), _) => Some(&t.template_tools),
            (None, Some(r)) if !r.functions.is_empty() => Some(&r.template_tools),
            _ => None,
        }
    }

    /// Whether every session of a trajectory can be forked (tree rollouts), and if not
    /// the one line that says why: every plugin's session can, an OpenEnv server's
    /// episode only by replay (`rollout.openenv.fork = "replay"`).
    pub fn forkable(&self) -> Result<(), String> {
        match &self.openenv {
            Some(r) if r.section.fork != ForkBy::Replay => Err(openenv::UNFORKABLE.into()),
            _ => Ok(()),
        }
    }
}

/// What answers the turns of a run's trajectories: the run's answerers, read once.
pub struct Environment<'a> {
    s: &'a Answerers,
}

/// One trajectory's sessions: its trigger's, its episode (a plugin's or a server's) and
/// one per tools plugin with a stateful function. A call takes them to the worker pool
/// and its [`Reply`] brings them back.
pub struct TrajectorySessions {
    /// Boxed, as the episode is: a session is a few hundred bytes, and the sessions move
    /// to the pool and back with every call.
    trigger: Option<Box<TriggerSession>>,
    episode: Option<Box<AnyEpisode>>,
    /// `None` for plugins without a stateful function, or whose session failed to open
    /// (their calls are answered as the tool's failure).
    tools: Vec<Option<ToolsSession>>,
    /// The sample, with tools: stateless calls open fresh instances with it.
    sample: Option<Arc<Sample>>,
    /// The trajectory's seed: stateless calls are seeded from it and the turn.
    seed: u64,
}

impl TrajectorySessions {
    /// The trigger's stop patterns (none without a trigger session).
    pub fn stop_patterns(&self) -> &[String] {
        self.trigger.as_ref().map_or(&[], |t| t.stop_patterns())
    }

    /// The `model.generate` calls made on the trajectory's link so far (its sessions
    /// share one).
    fn model_calls(&self) -> u32 {
        let episode = match self.episode.as_deref() {
            Some(AnyEpisode::Plugin(e)) => e.model_calls(),
            _ => 0,
        };
        let trigger = self.trigger.as_ref().map_or(0, |t| t.model_calls());
        let tools = self.tools.iter().flatten().map(|t| t.model_calls());
        tools.fold(trigger.max(episode), u32::max)
    }

    /// Sessions for a branch of this trajectory (a tree rollout): each session forked
    /// ([`crate::plugin::fork`]), so the branch goes on from this state and its calls
    /// change only its own; stateless calls seeded from `seed`, the branch's; its
    /// sessions' `model.generate` calls on `link`. A plugin's session is forked deferred:
    /// the branch's first call to it replays (most branches after a tool's output never
    /// call it again); a server's episode is replayed here, where the run allows it
    /// ([`Answerers::forkable`] refuses such a run before it starts otherwise).
    pub async fn fork(
        &mut self,
        seed: u64,
        link: ModelLink,
    ) -> Result<TrajectorySessions, ForkError> {
        // The branch's calls count on from the trajectory's so far (one link for all its
        // sessions), against the same per-trajectory grant.
        let made = self.model_calls();
        let link = link.continuing(made);
        let trigger = match &mut self.trigger {
            Some(t) => {
                let mut fork = t.fork_deferred()?;
                fork.set_model(Some(link.clone()));
                Some(Box::new(fork))
            }
            None => None,
        };
        let episode = match self.episode.as_deref_mut() {
            Some(AnyEpisode::Plugin(e)) => {
                let mut fork = e.fork_deferred()?;
                fork.set_model(Some(link.clone()));
                Some(Box::new(AnyEpisode::Plugin(fork)))
            }
            Some(AnyEpisode::Remote(e)) => match e.fork().await {
                Ok(fork) => Some(Box::new(AnyEpisode::Remote(fork))),
                Err(EpisodeForkError::Fault(fault)) => return Err(ForkError::Fault(fault)),
                Err(other) => {
                    return Err(ForkError::Elsewhere {
                        by: e.source(),
                        why: other.to_string(),
                    });
                }
            },
            None => None,
        };
        let mut tools = Vec::with_capacity(self.tools.len());
        for session in &self.tools {
            tools.push(match session {
                Some(t) => {
                    let mut fork = t.fork_deferred()?;
                    fork.set_model(Some(link.clone()));
                    Some(fork)
                }
                None => None,
            });
        }
        Ok(TrajectorySessions {
            trigger,
            episode,
            tools,
            sample: self.sample.clone(),
            seed,
        })
    }

    /// The deferred forks' replays these sessions made since this was last asked, and the
    /// time they took (inside the calls that made them).
    pub fn take_replays(&mut self) -> (usize, Duration) {
        let mut total = (0, Duration::ZERO);
        let mut add = |(n, t): (usize, Duration)| {
            total.0 += n;
            total.1 += t;
        };
        if let Some(t) = &mut self.trigger {
            add(t.take_replays());
        }
        if let Some(AnyEpisode::Plugin(e)) = self.episode.as_deref_mut() {
            add(e.take_replays());
        }
        for t in self.tools.iter_mut().flatten() {
            add(t.take_replays());
        }
        total
    }
}

/// A trajectory's sessions: open at once (it has none to open, or only a server session
/// opened with its prompt), or opening on the worker pool.
pub enum Opening {
    Ready(TrajectorySessions),
    /// The sessions once all have opened (or failed to: the faults, and the trajectory
    /// goes on without them).
    Later(BoxFuture<'static, (TrajectorySessions, Vec<Fault>)>),
}

/// What answers a turn's function calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum By {
    /// The run's tools plugins (`rollout.tools`).
    Tools,
    /// The OpenEnv server, as call actions.
    Server,
}

/// What the model's finished turn is, for what answers it.
pub enum Read {
    /// Function calls (numbered by [`Environment::written`]), and what answers them.
    Calls(By, tool_calls::Turn),
    /// The last turn: a server whose actions are calls got none (the final answer).
    Last,
    /// Text for the episode, if the trajectory has one.
    Text,
}

/// A finished turn, for [`Environment::answer`].
pub enum EndedTurn {
    Calls(By, Vec<Written>),
    Text(String),
}

/// A call on the worker pool: the sessions back with its reply, timed.
pub type Answering = BoxFuture<'static, (TrajectorySessions, Reply)>;

fn timed(work: impl Future<Output = (TrajectorySessions, Reply)> + Send + 'static) -> Answering {
    async move {
        let c0 = Instant::now();
        let (sessions, mut reply) = work.await;
        reply.took = c0.elapsed();
        (sessions, reply)
    }
    .boxed()
}

/// A session that opened, or the fault of one that did not.
enum Opened {
    Trigger(Result<TriggerSession, Fault>),
    Episode(Result<AnyEpisode, Fault>),
    Tools(usize, Result<ToolsSession, Fault>),
}

impl<'a> Environment<'a> {
    /// Checks what the settings combine: a server whose actions are calls needs the call
    /// format the run's template writes.
    pub fn new(s: &'a Answerers) -> Result<Environment<'a>> {
        if let Some(r) = &s.openenv
            && !r.functions.is_empty()
            && r.format.is_none()
        {
            bail!("the OpenEnv server's functions need a call format (Remote::set_format)");
        }
        Ok(Environment { s })
    }

    /// What continues a conversation after the model's turn (named for messages), if
    /// anything does: such a run needs a template that renders turn by turn.
    pub fn continued_by(&self) -> Option<String> {
        let s = self.s;
        match (&s.environment, &s.tools, &s.openenv) {
            (Some(env), _, _) => Some(format!("environment `{}`", env.plugin.name())),
            (None, _, Some(r)) => Some(format!("the OpenEnv server at {}", r.url)),
            (None, Some(_), None) => Some("rollout.tools".to_string()),
            (None, None, None) => None,
        }
    }

    /// The OpenEnv server whose `reset` gives each trajectory its prompt: its sessions
    /// open before the batch samples (`openenv::reset_all`), not in [`Self::open`].
    pub fn resets_first(&self) -> Option<&Arc<Remote>> {
        self.s.openenv.as_ref().filter(|r| r.prompt_from_reset())
    }

    /// Opens trajectory `j` of sample `id`'s sessions for the batch seeded `seed`: a
    /// trigger's, an environment plugin's or a server's episode (`opened`, when its reset
    /// gave the prompt), a tools plugin's. Each gets a model link from `link`, for its
    /// `model.generate` calls.
    pub fn open(
        &self,
        sample: &Sample,
        id: u64,
        j: usize,
        seed: u64,
        link: &dyn Fn() -> ModelLink,
        opened: Option<RemoteEpisode>,
    ) -> Opening {
        let s = self.s;
        let plugin_seed = sample_seed(seed ^ 0x706c_7567, id as usize, j);
        let tools_seed = sample_seed(seed ^ 0x746f_6f6c, id as usize, j);
        let n_tools = s.tools.as_ref().map_or(0, |t| t.plugins.len());
        let sessions = TrajectorySessions {
            trigger: None,
            episode: opened.map(|e| Box::new(AnyEpisode::Remote(e))),
            tools: (0..n_tools).map(|_| None).collect(),
            sample: s.tools.as_ref().map(|_| Arc::new(sample.clone())),
            seed: sample_seed(seed, id as usize, j),
        };
        let mut opening: Vec<BoxFuture<'static, Opened>> = Vec::new();
        if let Some(spec) = &s.trigger {
            let open = plugin::open_trigger(spec.clone(), sample.clone(), plugin_seed, link());
            opening.push(open.map(Opened::Trigger).boxed());
        }
        if let Some(spec) = &s.environment {
            let open = plugin::open_environment(spec.clone(), sample.clone(), plugin_seed, link());
            opening.push(
                open.map(|r| Opened::Episode(r.map(AnyEpisode::Plugin)))
                    .boxed(),
            );
        }
        if sessions.episode.is_none()
            && let Some(remote) = s.openenv.as_ref().filter(|r| !r.prompt_from_reset())
        {
            let (remote, metadata) = (remote.clone(), sample.metadata.clone());
            let episode_id = openenv::episode_id(seed, id, j);
            opening.push(
                async move {
                    let r = RemoteEpisode::open(remote, id, episode_id, &metadata, None).await;
                    Opened::Episode(r.map(|(e, _)| AnyEpisode::Remote(e)))
                }
                .boxed(),
            );
        }
        if let Some(toolbox) = &s.tools {
            for (p, spec) in toolbox.plugins.iter().enumerate() {
                if toolbox.needs_session(p) {
                    let open = tools::open(spec.clone(), sample.clone(), tools_seed, link());
                    opening.push(open.map(move |r| Opened::Tools(p, r)).boxed());
                }
            }
        }
        if opening.is_empty() {
            return Opening::Ready(sessions);
        }
        Opening::Later(
            async move {
                let mut sessions = sessions;
                let mut faults = Vec::new();
                // Each trajectory's opening is one task on the pool; its sessions open
                // together within it.
                for opened in futures_util::future::join_all(opening).await {
                    match opened {
                        Opened::Trigger(Ok(t)) => sessions.trigger = Some(Box::new(t)),
                        Opened::Episode(Ok(e)) => sessions.episode = Some(Box::new(e)),
                        Opened::Tools(p, Ok(t)) => sessions.tools[p] = Some(t),
                        // Without its trigger the trajectory runs without the tool, without
                        // its episode as a single turn, and a tools plugin's calls are
                        // answered as the tool's failure; the fault is on record.
                        Opened::Trigger(Err(f))
                        | Opened::Episode(Err(f))
                        | Opened::Tools(_, Err(f)) => faults.push(f),
                    }
                }
                (sessions, faults)
            }
            .boxed(),
        )
    }

    /// The trigger fires on `text` (the model's text up to its pattern's end); `None`
    /// when the trajectory has no trigger session (it failed to open): nothing fires.
    pub fn fire(
        &self,
        mut sessions: TrajectorySessions,
        text: String,
    ) -> Result<Answering, TrajectorySessions> {
        let Some(mut trigger) = sessions.trigger.take() else {
            return Err(sessions);
        };
        Ok(timed(async move {
            let reply = plugin::fire(&mut trigger, &text).await;
            sessions.trigger = Some(trigger);
            (sessions, reply)
        }))
    }

    /// What the model's finished turn (`content`) is: calls for the tools, calls for a
    /// server whose actions are calls (or, without any, the last turn), or text.
    pub fn read(&self, content: &str) -> Read {
        if let Some(toolbox) = &self.s.tools {
            let turn = toolbox.read(content);
            if !turn.calls.is_empty() {
                return Read::Calls(By::Tools, turn);
            }
        }
        if let Some(remote) = self.calls_to_server() {
            let format = remote.format.expect("checked in Environment::new");
            let turn = tool_calls::parse(format, content, &remote.functions);
            return if turn.calls.is_empty() {
                Read::Last
            } else {
                Read::Calls(By::Server, turn)
            };
        }
        Read::Text
    }

    /// The server whose actions are function calls, if the run has one.
    fn calls_to_server(&self) -> Option<&Arc<Remote>> {
        self.s.openenv.as_ref().filter(|r| !r.functions.is_empty())
    }

    /// A turn's calls numbered (`call_<turn>_<k>`, as the trajectory's `turn`th turn
    /// wrote them) and the assistant message that records them.
    pub fn written(turn: tool_calls::Turn, turn_number: u32) -> (Message, Vec<Written>) {
        let written: Vec<Written> = turn
            .calls
            .into_iter()
            .enumerate()
            .map(|(k, call)| Written {
                id: format!("call_{turn_number}_{k}"),
                call,
            })
            .collect();
        (tools::assistant_message(turn.content, &written), written)
    }

    /// Answers the trajectory's `turn_number`th turn: its calls (by the tools or the server),
    /// or its text (the episode's). `Err` gives the sessions back when nothing answers
    /// (no episode, or the server's session did not open: its fault is on record), and
    /// the trajectory ends with its turn.
    pub fn answer(
        &self,
        mut sessions: TrajectorySessions,
        turn_number: u32,
        turn: EndedTurn,
    ) -> Result<Answering, TrajectorySessions> {
        match turn {
            EndedTurn::Calls(By::Tools, written) => {
                let toolbox: Arc<Toolbox> = self
                    .s
                    .tools
                    .clone()
                    .expect("tools calls are read only with tools");
                let sample = sessions
                    .sample
                    .clone()
                    .expect("a trajectory with tools keeps its sample");
                let seed = sessions.seed ^ u64::from(turn_number).wrapping_mul(0x6361_6c6c);
                Ok(timed(async move {
                    let taken = std::mem::take(&mut sessions.tools);
                    let (back, answers, faults) =
                        tools::run(&toolbox, taken, &sample, seed, &written).await;
                    sessions.tools = back;
                    let reply = Reply {
                        kinds: answers.iter().map(|a| a.kind).collect(),
                        faults,
                        ..Reply::new(Then::Answers(tools::tool_messages(&answers)))
                    };
                    (sessions, reply)
                }))
            }
            EndedTurn::Calls(By::Server, written) => {
                let Some(episode) = sessions.episode.take() else {
                    return Err(sessions);
                };
                // A server's calls come with a server's episode: the config refuses a
                // plugin environment beside `[rollout.openenv]`.
                let mut remote = match *episode {
                    AnyEpisode::Remote(remote) => remote,
                    plugin => {
                        sessions.episode = Some(Box::new(plugin));
                        return Err(sessions);
                    }
                };
                Ok(timed(async move {
                    let r = remote.step_calls(&written).await;
                    sessions.episode = Some(Box::new(AnyEpisode::Remote(remote)));
                    (sessions, Reply::stepped(r, true))
                }))
            }
            EndedTurn::Text(text) => {
                let Some(mut episode) = sessions.episode.take() else {
                    return Err(sessions);
                };
                Ok(timed(async move {
                    let r = match episode.as_mut() {
                        AnyEpisode::Plugin(e) => e.step(&text).await,
                        AnyEpisode::Remote(e) => e.step_text(&text).await,
                    };
                    sessions.episode = Some(episode);
                    (sessions, Reply::stepped(r.map(|s| (s, Vec::new())), false))
                }))
            }
        }
    }
}
