//! Sessions: one trigger session or environment episode per trajectory, one dataset
//! source and one reward scorer per run.
//!
//! Every session owns its own `Store` and instance, so sessions never share memory and a
//! fault in one cannot corrupt another. A fault discards the instance; the session's next
//! call opens a fresh one with the same config and sample (a trigger's state from earlier
//! calls is lost then, which is the price of never reusing a broken instance). A plugin's
//! own error keeps the instance: it returned normally.
//!
//! The four roles share one [`Session`]; a [`Kind`] says what is particular to each (how
//! an instance is opened and what is asked of it then), and each role's calls check what
//! the plugin returned.
//!
//! A session logs the calls it made on its live instance, with a digest of each answer,
//! so that it can be forked by replaying them ([`super::fork`]). A deferred fork holds
//! its original's log and outside answers, and replays them when it is first called.

use super::bindings::{self, Exports};
use super::fault::{Fault, FaultKind};
use super::fork::{ForkError, GuestCall, Logged, Pending, digest};
use super::model::ModelLink;
use super::plugin::{Inner, Plugin};
use super::sandbox::StoreState;
use super::tape::Tape;
use super::types::{Component, FunctionSpec, Message, Role, Sample, StepResult, Transcript};
use anyhow::Result;
use std::sync::Arc;
use std::time::{Duration, Instant};
use wasmtime::Store;
use wasmtime::component::{Instance, ResourceAny};

/// The most stop patterns a trigger may declare, and the longest one. The host matches
/// them at every decoded token, so they must stay few and short.
const MAX_STOP_PATTERNS: usize = 32;
const MAX_STOP_PATTERN_BYTES: usize = 256;
/// The most reward components one score may have.
const MAX_COMPONENTS: usize = 64;

/// One trajectory's trigger session.
pub type TriggerSession = Session<bindings::Trigger>;
/// One trajectory's environment episode.
pub type EnvironmentEpisode = Session<bindings::Environment>;
/// An opened dataset.
pub type DatasetSource = Session<bindings::Dataset>;
/// An opened reward function.
pub type RewardScorer = Session<bindings::Reward>;
/// One trajectory's tools (WIT 0.2.0 on).
pub type ToolsSession = Session<bindings::Tools>;

/// What is particular to one role's sessions.
// Only the host implements and calls it, always for a concrete kind, so the futures'
// `Send` is known where it matters (the rollout engine spawns session opens and calls).
#[allow(async_fn_in_trait)]
pub trait Kind: Sized {
    const ROLE: Role;
    /// The call that opens the session's resource, as faults name it.
    const OPEN: &'static str;
    /// Whether the role's sessions can be forked, and so keep their calls and outside
    /// answers: a trajectory's (trigger, tools, environment). A dataset's or a reward's
    /// session lives as long as the run, and a log of all its calls would grow with it.
    const FORKS: bool = true;
    /// What opening takes, kept to open a fresh instance after a fault (or a fork).
    type Args: Clone;
    /// What the session asks of a fresh instance (a trigger's stop patterns, a dataset's
    /// length); a deferred fork starts with its original's.
    type Opened: Default + Clone;
    fn load(
        exports: &Exports,
        store: &mut Store<StoreState>,
        instance: &Instance,
    ) -> wasmtime::Result<Self>;
    /// The seed of each instance, from the session's.
    fn seed(inner: &Inner, seed: u64) -> u64 {
        let _ = inner;
        seed
    }
    /// Opens the session's resource in a fresh instance.
    async fn open_with(
        &self,
        store: &mut Store<StoreState>,
        args: &Self::Args,
    ) -> wasmtime::Result<Result<ResourceAny, String>>;
    async fn opened(inner: &Inner, live: &mut LiveInstance<Self>) -> Result<Self::Opened, Fault> {
        let _ = (inner, live);
        Ok(Self::Opened::default())
    }
    /// Makes a logged call again (a fork's replay) and returns the digest of what the
    /// guest answered, as [`Session`] logged it the first time.
    async fn redo(
        &self,
        store: &mut Store<StoreState>,
        handle: ResourceAny,
        call: &GuestCall,
    ) -> wasmtime::Result<u64>;
}

/// The refusal of a logged call that a role never makes (the log is the session's own,
/// so this would be a host bug, reported as the replay's fault rather than a panic).
fn not_made<R>(role: Role, call: &GuestCall) -> wasmtime::Result<R> {
    Err(wasmtime::format_err!(
        "a {role} session made a `{}` call",
        call.name()
    ))
}

/// A plugin's session of one role: the instance it lives in, opened on first use and
/// again after a fault.
pub struct Session<K: Kind> {
    plugin: Plugin,
    args: K::Args,
    seed: u64,
    live: Option<LiveInstance<K>>,
    opened: K::Opened,
    /// Where `model.generate` calls go: the engine sampling this session's trajectory.
    model: Option<ModelLink>,
    /// The calls made on the live instance since it opened, in order.
    log: Vec<Logged>,
    /// A fork's first instance: the tape of outside answers its replay is served.
    replay: Option<Arc<Tape>>,
    /// A deferred fork not called yet: what its first call replays first.
    pending: Option<Pending>,
    /// Deferred replays made and the time they took, until the caller takes them
    /// ([`Self::take_replays`]).
    replays: (usize, Duration),
}

/// One live instance and the resource a session holds in it.
pub struct LiveInstance<G> {
    store: Store<StoreState>,
    guest: G,
    handle: ResourceAny,
}

impl<G> LiveInstance<G> {
    /// Calls a method of the session's resource.
    async fn call<R>(
        &mut self,
        inner: &Inner,
        call: &'static str,
        run: impl AsyncFnOnce(&G, &mut Store<StoreState>, ResourceAny) -> wasmtime::Result<R>,
    ) -> Result<R, Fault> {
        let (guest, handle) = (&self.guest, self.handle);
        inner
            .guarded(&mut self.store, call, async |store| {
                run(guest, store, handle).await
            })
            .await
    }
}

impl<K: Kind> Session<K> {
    async fn start(plugin: &Plugin, args: K::Args, seed: u64) -> Result<Self> {
        plugin.require(K::ROLE)?;
        let mut session = Session {
            plugin: plugin.clone(),
            args,
            seed,
            live: None,
            opened: K::Opened::default(),
            model: None,
            log: Vec::new(),
            replay: None,
            pending: None,
            replays: (0, Duration::ZERO),
        };
        session.live().await?;
        Ok(session)
    }

    /// A session of the same plugin, arguments and seed with no instance yet and an empty
    /// log, which replays `pending` first when it is called: what a fork starts from. It
    /// keeps what the original was told when it opened (a trigger's stop patterns).
    pub(super) fn unopened(&self, pending: Option<Pending>) -> Session<K> {
        Session {
            plugin: self.plugin.clone(),
            args: self.args.clone(),
            seed: self.seed,
            live: None,
            opened: self.opened.clone(),
            model: self.model.clone(),
            log: Vec::new(),
            replay: None,
            pending,
            replays: (0, Duration::ZERO),
        }
    }

    /// A deferred fork's replay, while it has not been made.
    pub(super) fn pending(&self) -> Option<&Pending> {
        self.pending.as_ref()
    }

    /// Whether the session is a deferred fork that has not replayed yet (no instance).
    pub fn is_deferred(&self) -> bool {
        self.pending.is_some()
    }

    /// The deferred replays this session made since the last time this was asked, and
    /// the time they took (what a branch's first call paid for its fork).
    pub fn take_replays(&mut self) -> (usize, Duration) {
        std::mem::replace(&mut self.replays, (0, Duration::ZERO))
    }

    /// Makes a deferred fork's replay now, if it has one: opens the instance, serves it
    /// the recorded outside answers and makes the logged calls again, each checked
    /// against its digest. Any refusal leaves no instance (the next call opens a fresh
    /// one, as after a fault).
    pub(super) async fn replay_pending(&mut self) -> Result<(), ForkError> {
        let Some(pending) = self.pending.take() else {
            return Ok(());
        };
        let t0 = Instant::now();
        let plugin = self.plugin.name().to_string();
        let answers = |why| ForkError::Answers {
            plugin: plugin.clone(),
            why,
        };
        self.replay = Some(Arc::new(Tape::replaying(pending.answers)));
        self.open().await?;
        for (index, logged) in pending.log.into_iter().enumerate() {
            if self.redo(&logged).await? != logged.answer {
                self.live = None;
                return Err(ForkError::Diverged {
                    plugin,
                    index,
                    call: logged.call.name(),
                });
            }
        }
        let tape = self
            .tape()
            .expect("a replay that did not fault leaves its instance live");
        if let Err(why) = tape.finish_replay() {
            self.live = None;
            return Err(answers(why));
        }
        self.replays.0 += 1;
        self.replays.1 += t0.elapsed();
        Ok(())
    }

    /// The live instance's record of outside answers (`None` without one: after a fault,
    /// until the session's next call opens a fresh instance).
    pub(super) fn tape(&self) -> Option<&Arc<Tape>> {
        self.live.as_ref().map(|l| l.store.data().tape())
    }

    /// Opens the session's instance if it has none.
    pub(super) async fn open(&mut self) -> Result<(), Fault> {
        self.live().await.map(|_| ())
    }

    /// The calls made on the live instance since it opened (with no live instance, those
    /// of the one a fault discarded: see [`Self::tape`]).
    pub(super) fn log(&self) -> &[Logged] {
        &self.log
    }

    /// Makes `logged` again on this session's instance (opening it if needed) and logs
    /// it: the digest of what the guest answered this time. A fault discards the
    /// instance, as any call's does.
    async fn redo(&mut self, logged: &Logged) -> Result<u64, Fault> {
        let call = &logged.call;
        self.run_logged(
            call.clone(),
            async |guest, store, handle| guest.redo(store, handle, call).await,
            |answer| *answer,
        )
        .await
    }

    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    /// The `model.generate` calls made on the session's link so far.
    pub fn model_calls(&self) -> u32 {
        self.model.as_ref().map_or(0, |l| l.calls_made())
    }

    /// Sends the session's `model.generate` calls down `link` from now on (`None`: no
    /// model answers them), in this instance and every one it opens after a fault.
    pub fn set_model(&mut self, link: Option<ModelLink>) {
        if let Some(live) = &mut self.live {
            live.store.data_mut().model.link = link.clone();
        }
        self.model = link;
    }

    /// The live instance, opened if there is none (first use, or after a fault).
    async fn live(&mut self) -> Result<&mut LiveInstance<K>, Fault> {
        if self.live.is_none() {
            self.log.clear();
            let inner = &*self.plugin.0;
            let (mut store, instance) = inner
                .instantiate(
                    K::seed(inner, self.seed),
                    K::OPEN,
                    self.model.clone(),
                    self.replay
                        .take()
                        .unwrap_or_else(|| Arc::new(Tape::new(K::FORKS))),
                )
                .await?;
            let guest = K::load(&inner.exports, &mut store, &instance)
                .map_err(|e| inner.fault(K::OPEN, FaultKind::Incompatible, e.to_string()))?;
            let args = &self.args;
            let handle = inner
                .guarded(&mut store, K::OPEN, async |store| {
                    guest.open_with(store, args).await
                })
                .await?
                .map_err(|message| inner.guest_error(K::OPEN, message))?;
            let mut live = LiveInstance {
                store,
                guest,
                handle,
            };
            self.opened = K::opened(inner, &mut live).await?;
            self.live = Some(live);
        }
        Ok(self.live.as_mut().expect("opened above"))
    }

    /// Calls the session's resource, and settles the result: a fault discards the
    /// instance; a plugin's own error is counted and passed on, and keeps it.
    async fn call<T: std::fmt::Debug>(
        &mut self,
        record: GuestCall,
        run: impl AsyncFnOnce(
            &K,
            &mut Store<StoreState>,
            ResourceAny,
        ) -> wasmtime::Result<Result<T, String>>,
    ) -> Result<T, Fault> {
        let call = record.name();
        match self.logged_call(record, run, digest).await? {
            Ok(value) => Ok(value),
            Err(message) => Err(self.plugin.0.guest_error(call, message)),
        }
    }

    /// Calls the session's resource (the call `record` names) and logs `record` with the
    /// digest of what the guest returned (its own errors too: the call ran, and may have
    /// changed its state), if the role forks. A fault discards the instance, and with it
    /// the log. A deferred fork replays first; a replay that fails is this call's fault
    /// (`fork`, or the replayed call's own).
    async fn logged_call<R>(
        &mut self,
        record: GuestCall,
        run: impl AsyncFnOnce(&K, &mut Store<StoreState>, ResourceAny) -> wasmtime::Result<R>,
        digest: impl FnOnce(&R) -> u64,
    ) -> Result<R, Fault> {
        if let Err(e) = self.replay_pending().await {
            return Err(match e {
                ForkError::Fault(fault) => fault,
                other => self
                    .plugin
                    .0
                    .fault(record.name(), FaultKind::Fork, other.to_string()),
            });
        }
        self.run_logged(record, run, digest).await
    }

    /// [`Self::logged_call`] on the live instance as it is (a replay's calls, which must
    /// not start another replay).
    async fn run_logged<R>(
        &mut self,
        record: GuestCall,
        run: impl AsyncFnOnce(&K, &mut Store<StoreState>, ResourceAny) -> wasmtime::Result<R>,
        digest: impl FnOnce(&R) -> u64,
    ) -> Result<R, Fault> {
        let inner = self.plugin.0.clone();
        let result = self.live().await?.call(&inner, record.name(), run).await;
        match result {
            Ok(answer) => {
                if K::FORKS {
                    self.log.push(Logged {
                        answer: digest(&answer),
                        call: record,
                    });
                }
                Ok(answer)
            }
            Err(fault) => {
                self.live = None;
                Err(fault)
            }
        }
    }

    /// Refuses what `call` returned (`problem`, if any): a bad-output fault, and the
    /// instance is discarded.
    fn check<T>(
        &mut self,
        call: &'static str,
        value: T,
        problem: Option<String>,
    ) -> Result<T, Fault> {
        match problem {
            None => Ok(value),
            Some(message) => {
                self.live = None;
                Err(self.plugin.0.fault(call, FaultKind::BadOutput, message))
            }
        }
    }
}

fn message_bytes(messages: &[Message]) -> usize {
    messages
        .iter()
        .map(|m| m.role.len() + m.content.len())
        .sum()
}

impl Kind for bindings::Trigger {
    const ROLE: Role = Role::Trigger;
    const OPEN: &'static str = "trigger.open";
    type Args = (String, Sample);
    /// The stop patterns.
    type Opened = Vec<String>;

    fn load(
        exports: &Exports,
        store: &mut Store<StoreState>,
        instance: &Instance,
    ) -> wasmtime::Result<Self> {
        exports.trigger(store, instance)
    }

    async fn open_with(
        &self,
        store: &mut Store<StoreState>,
        (config, sample): &Self::Args,
    ) -> wasmtime::Result<Result<ResourceAny, String>> {
        self.open(store, config, sample).await
    }

    async fn redo(
        &self,
        store: &mut Store<StoreState>,
        handle: ResourceAny,
        call: &GuestCall,
    ) -> wasmtime::Result<u64> {
        match call {
            GuestCall::Fire(text) => Ok(digest(&self.fire(store, handle, text).await?)),
            other => not_made(Self::ROLE, other),
        }
    }

    async fn opened(inner: &Inner, live: &mut LiveInstance<Self>) -> Result<Vec<String>, Fault> {
        let call = "trigger.stop-patterns";
        let patterns = live
            .call(inner, call, async |guest, store, handle| {
                guest.stop_patterns(store, handle).await
            })
            .await?;
        if patterns.len() > MAX_STOP_PATTERNS
            || patterns
                .iter()
                .any(|p| p.is_empty() || p.len() > MAX_STOP_PATTERN_BYTES)
        {
            let message = format!(
                "declared {} stop patterns; at most {MAX_STOP_PATTERNS} are allowed, each 1 to {MAX_STOP_PATTERN_BYTES} bytes",
                patterns.len()
            );
            return Err(inner.fault(call, FaultKind::BadOutput, message));
        }
        Ok(patterns)
    }
}

impl TriggerSession {
    /// The literal strings after which the host calls [`TriggerSession::fire`].
    pub fn stop_patterns(&self) -> &[String] {
        &self.opened
    }

    /// Runs the tool on everything generated so far. `Ok(None)`: nothing to append.
    pub async fn fire(&mut self, text: &str) -> Result<Option<String>, Fault> {
        let call = "trigger.fire";
        let output = self
            .call(
                GuestCall::Fire(text.to_string()),
                async |guest, store, handle| guest.fire(store, handle, text).await,
            )
            .await?;
        let problem = self
            .plugin
            .0
            .too_large(output.as_ref().map_or(0, String::len));
        self.check(call, output, problem)
    }
}

impl Kind for bindings::Environment {
    const ROLE: Role = Role::Environment;
    const OPEN: &'static str = "environment.open";
    type Args = (String, Sample);
    type Opened = ();

    fn load(
        exports: &Exports,
        store: &mut Store<StoreState>,
        instance: &Instance,
    ) -> wasmtime::Result<Self> {
        exports.environment(store, instance)
    }

    async fn open_with(
        &self,
        store: &mut Store<StoreState>,
        (config, sample): &Self::Args,
    ) -> wasmtime::Result<Result<ResourceAny, String>> {
        self.open(store, config, sample).await
    }

    async fn redo(
        &self,
        store: &mut Store<StoreState>,
        handle: ResourceAny,
        call: &GuestCall,
    ) -> wasmtime::Result<u64> {
        match call {
            GuestCall::Step(assistant) => Ok(digest(&self.step(store, handle, assistant).await?)),
            other => not_made(Self::ROLE, other),
        }
    }
}

impl EnvironmentEpisode {
    /// Answers the assistant's latest turn.
    pub async fn step(&mut self, assistant: &str) -> Result<StepResult, Fault> {
        let call = "environment.step";
        let step = self
            .call(
                GuestCall::Step(assistant.to_string()),
                async |guest, store, handle| guest.step(store, handle, assistant).await,
            )
            .await?;
        let problem = if let Some(m) = step
            .messages
            .iter()
            .find(|m| m.role != "tool" && m.role != "user")
        {
            Some(format!(
                "returned a message with role `{}`; an environment may only add `tool` or `user` messages",
                m.role
            ))
        } else if let Some(reward) = step.reward.filter(|r| !r.is_finite()) {
            Some(format!(
                "returned a reward of {reward}; rewards must be finite"
            ))
        } else {
            self.plugin.0.too_large(message_bytes(&step.messages))
        };
        self.check(call, step, problem)
    }
}

impl Kind for bindings::Dataset {
    const ROLE: Role = Role::Dataset;
    const OPEN: &'static str = "dataset.open";
    const FORKS: bool = false;
    /// The config and the run's seed.
    type Args = (String, u64);
    /// The length.
    type Opened = u64;

    fn load(
        exports: &Exports,
        store: &mut Store<StoreState>,
        instance: &Instance,
    ) -> wasmtime::Result<Self> {
        exports.dataset(store, instance)
    }

    async fn open_with(
        &self,
        store: &mut Store<StoreState>,
        (config, seed): &Self::Args,
    ) -> wasmtime::Result<Result<ResourceAny, String>> {
        self.open(store, config, *seed).await
    }

    async fn redo(
        &self,
        store: &mut Store<StoreState>,
        handle: ResourceAny,
        call: &GuestCall,
    ) -> wasmtime::Result<u64> {
        match call {
            GuestCall::Get(index) => Ok(digest(&self.get(store, handle, *index).await?)),
            other => not_made(Self::ROLE, other),
        }
    }

    async fn opened(inner: &Inner, live: &mut LiveInstance<Self>) -> Result<u64, Fault> {
        live.call(inner, "dataset.len", async |guest, store, handle| {
            guest.len(store, handle).await
        })
        .await
    }
}

impl DatasetSource {
    /// How many samples the dataset has (asked when the instance is opened).
    pub fn len(&self) -> u64 {
        self.opened
    }

    pub fn is_empty(&self) -> bool {
        self.opened == 0
    }

    /// The sample at `index`, which must be below [`DatasetSource::len`].
    pub async fn get(&mut self, index: u64) -> Result<Sample, Fault> {
        let call = "dataset.get";
        if index >= self.len() {
            return Err(Fault {
                plugin: self.plugin.id().to_string(),
                call,
                kind: FaultKind::BadOutput,
                message: format!("index {index} is past the dataset's {} samples", self.len()),
            });
        }
        let raw = self
            .call(GuestCall::Get(index), async |guest, store, handle| {
                guest.get(store, handle, index).await
            })
            .await?;
        let problem = self
            .plugin
            .0
            .too_large(raw.metadata.len() + message_bytes(&raw.messages));
        let raw = self.check(call, raw, problem)?;
        let metadata = serde_json::from_str::<serde_json::Value>(&raw.metadata)
            .ok()
            .filter(serde_json::Value::is_object);
        let problem = metadata
            .is_none()
            .then(|| format!("sample {index} has metadata that is not a JSON object"));
        let metadata = self.check(call, metadata, problem)?;
        Ok(Sample {
            messages: raw.messages,
            metadata: metadata.expect("checked above"),
        })
    }
}

impl Kind for bindings::Reward {
    const ROLE: Role = Role::Reward;
    const OPEN: &'static str = "reward.open";
    const FORKS: bool = false;
    /// The config.
    type Args = String;
    type Opened = ();

    fn load(
        exports: &Exports,
        store: &mut Store<StoreState>,
        instance: &Instance,
    ) -> wasmtime::Result<Self> {
        exports.reward(store, instance)
    }

    /// A scorer has no sample to seed from: its randomness is the plugin's own.
    fn seed(inner: &Inner, _: u64) -> u64 {
        inner.seed_salt
    }

    async fn open_with(
        &self,
        store: &mut Store<StoreState>,
        config: &String,
    ) -> wasmtime::Result<Result<ResourceAny, String>> {
        self.open(store, config).await
    }

    async fn redo(
        &self,
        store: &mut Store<StoreState>,
        handle: ResourceAny,
        call: &GuestCall,
    ) -> wasmtime::Result<u64> {
        match call {
            GuestCall::Score(trajectory) => {
                Ok(digest(&self.score(store, handle, trajectory).await?))
            }
            other => not_made(Self::ROLE, other),
        }
    }
}

impl RewardScorer {
    /// Scores one trajectory into named components.
    pub async fn score(&mut self, trajectory: &Transcript) -> Result<Vec<Component>, Fault> {
        let call = "reward.score";
        // Outside a rollout each score is a trajectory of its own to the model's grant:
        // a fresh link (its calls counted from 0, seeded alike), where one is served.
        if self.model.is_none()
            && let Some(live) = &mut self.live
            && let Some(link) = self.plugin.0.standalone_link(self.plugin.0.seed_salt)
        {
            live.store.data_mut().model.link = Some(link);
        }
        let components = self
            .call(
                GuestCall::Score(trajectory.clone()),
                async |guest, store, handle| guest.score(store, handle, trajectory).await,
            )
            .await?;
        let valid_name = |name: &str| {
            !name.is_empty()
                && name.len() <= 64
                && name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
        };
        let problem = if components.len() > MAX_COMPONENTS {
            Some(format!(
                "returned {} components; at most {MAX_COMPONENTS} are allowed",
                components.len()
            ))
        } else if let Some(c) = components.iter().find(|c| !c.value.is_finite()) {
            Some(format!(
                "component `{}` is {}; reward components must be finite",
                c.name, c.value
            ))
        } else {
            components.iter().find(|c| !valid_name(&c.name)).map(|c| {
                format!(
                    "component name {:?} is not lowercase letters, digits, `_` or `-`",
                    c.name
                )
            })
        };
        self.check(call, components, problem)
    }
}

impl RewardScorer {
    /// The first line the plugin logged at `warn` or above since this was last asked (a
    /// reward's reason for the score it gave), if the instance is still live.
    pub fn take_note(&mut self) -> Option<String> {
        self.live
            .as_mut()
            .and_then(|l| l.store.data_mut().take_note())
    }
}

/// The most functions one tools plugin may offer: their schemas go into every prompt.
const MAX_FUNCTIONS: usize = 64;

impl Kind for bindings::Tools {
    const ROLE: Role = Role::Tools;
    const OPEN: &'static str = "tools.open";
    /// The config and the sample.
    type Args = (String, Sample);
    /// The functions, checked.
    type Opened = Vec<FunctionSpec>;

    fn load(
        exports: &Exports,
        store: &mut Store<StoreState>,
        instance: &Instance,
    ) -> wasmtime::Result<Self> {
        exports.tools(store, instance)
    }

    async fn open_with(
        &self,
        store: &mut Store<StoreState>,
        (config, sample): &(String, Sample),
    ) -> wasmtime::Result<Result<ResourceAny, String>> {
        self.open(store, config, sample).await
    }

    async fn redo(
        &self,
        store: &mut Store<StoreState>,
        handle: ResourceAny,
        call: &GuestCall,
    ) -> wasmtime::Result<u64> {
        match call {
            GuestCall::Invoke { name, arguments } => {
                Ok(digest(&self.call(store, handle, name, arguments).await?))
            }
            other => not_made(Self::ROLE, other),
        }
    }

    /// The functions, asked once; a list the host cannot use (names not unique or not
    /// `[A-Za-z0-9_-]`, a schema that is not JSON or not one [`super::schema`] can check)
    /// is the plugin's bad output.
    async fn opened(
        inner: &Inner,
        live: &mut LiveInstance<Self>,
    ) -> Result<Vec<FunctionSpec>, Fault> {
        let call = "tools.functions";
        let raw = live
            .call(inner, call, async |guest, store, handle| {
                guest.functions(store, handle).await
            })
            .await?;
        let bad = |message: String| inner.fault(call, super::fault::FaultKind::BadOutput, message);
        if raw.len() > MAX_FUNCTIONS {
            return Err(bad(format!(
                "listed {} functions; at most {MAX_FUNCTIONS} are allowed",
                raw.len()
            )));
        }
        let mut specs: Vec<FunctionSpec> = Vec::with_capacity(raw.len());
        for f in raw {
            let name_ok = !f.name.is_empty()
                && f.name.len() <= 64
                && f.name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
            if !name_ok {
                return Err(bad(format!(
                    "function name {:?} is not 1-64 of letters, digits, `_` or `-`",
                    f.name
                )));
            }
            if specs.iter().any(|s| s.name == f.name) {
                return Err(bad(format!("function `{}` is listed twice", f.name)));
            }
            let parameters: serde_json::Value =
                serde_json::from_str(&f.parameters).map_err(|e| {
                    bad(format!(
                        "function `{}`: its parameters are not JSON: {e}",
                        f.name
                    ))
                })?;
            if parameters.get("type").and_then(|t| t.as_str()) != Some("object") {
                return Err(bad(format!(
                    "function `{}`: its parameters must be an object schema (\"type\": \"object\")",
                    f.name
                )));
            }
            super::schema::check_schema(&parameters).map_err(|e| {
                bad(format!(
                    "function `{}`: its parameters' schema: {e}",
                    f.name
                ))
            })?;
            specs.push(FunctionSpec {
                name: f.name,
                description: f.description,
                parameters,
                stateless: f.stateless,
            });
        }
        Ok(specs)
    }
}

impl ToolsSession {
    /// The functions the session offers, as checked when it opened.
    pub fn functions(&self) -> &[FunctionSpec] {
        &self.opened
    }

    /// Runs one call. `Ok(Ok(text))`: the result; `Ok(Err(text))`: the function's own
    /// refusal of its input, for the model to read (not a fault); `Err`: the plugin's
    /// fault (trap, deadline, memory, a result too large), after which the session's next
    /// call starts a fresh instance.
    pub async fn invoke(
        &mut self,
        name: &str,
        arguments: &str,
    ) -> Result<Result<String, String>, Fault> {
        let call = "tools.call";
        let record = GuestCall::Invoke {
            name: name.to_string(),
            arguments: arguments.to_string(),
        };
        let answer = self
            .logged_call(
                record,
                async |guest, store, handle| guest.call(store, handle, name, arguments).await,
                digest,
            )
            .await?;
        let bytes = match &answer {
            Ok(text) | Err(text) => text.len(),
        };
        let problem = self.plugin.0.too_large(bytes);
        self.check(call, answer, problem)
    }
}

impl Plugin {
    /// The fault an error of opening a session stands for: the fault itself when opening
    /// faulted, else (the plugin does not fit the role's interface) an incompatibility.
    pub fn open_fault(&self, call: &'static str, e: anyhow::Error) -> Fault {
        match e.downcast::<Fault>() {
            Ok(fault) => fault,
            Err(e) => Fault {
                plugin: self.name().to_string(),
                call,
                kind: FaultKind::Incompatible,
                message: format!("{e:#}"),
            },
        }
    }

    /// Opens a trigger session for one trajectory. `seed` seeds the plugin's randomness.
    pub async fn open_trigger(
        &self,
        config: &str,
        sample: &Sample,
        seed: u64,
    ) -> Result<TriggerSession> {
        Session::start(self, (config.to_string(), sample.clone()), seed).await
    }

    /// Opens an environment episode for one trajectory.
    pub async fn open_environment(
        &self,
        config: &str,
        sample: &Sample,
        seed: u64,
    ) -> Result<EnvironmentEpisode> {
        Session::start(self, (config.to_string(), sample.clone()), seed).await
    }

    /// Opens the plugin's dataset for the run's `seed`.
    pub async fn open_dataset(&self, config: &str, seed: u64) -> Result<DatasetSource> {
        Session::start(self, (config.to_string(), seed), seed).await
    }

    /// Opens the plugin's reward function.
    pub async fn open_reward(&self, config: &str) -> Result<RewardScorer> {
        Session::start(self, config.to_string(), 0).await
    }

    /// Opens a tools session for one trajectory. `seed` seeds the plugin's randomness.
    pub async fn open_tools(
        &self,
        config: &str,
        sample: &Sample,
        seed: u64,
    ) -> Result<ToolsSession> {
        Session::start(self, (config.to_string(), sample.clone()), seed).await
    }
}
