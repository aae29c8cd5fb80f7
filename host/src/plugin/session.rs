//! Sessions: one trigger session or environment episode per trajectory, one dataset
//! source and one reward scorer per run.
//!
//! Every session owns its own `Store` and instance, so sessions never share memory and a
//! fault in one cannot corrupt another. A fault discards the instance; the session's next
//! call opens a fresh one with the same config and sample (a trigger's state from earlier
//! calls is lost then, which is the price of never reusing a broken instance). A plugin's
//! own error keeps the instance: it returned normally.

use super::bindings::v0_1_0::{self as v0, wit};
use super::fault::{Fault, FaultKind};
use super::plugin::{Inner, Plugin};
use super::sandbox::StoreState;
use super::types::{Component, Sample, StepResult, Trajectory};
use wasmtime::Store;
use wasmtime::component::{Instance, ResourceAny};

/// The most stop patterns a trigger may declare, and the longest one. The host matches
/// them at every decoded token, so they must stay few and short.
const MAX_STOP_PATTERNS: usize = 32;
const MAX_STOP_PATTERN_BYTES: usize = 256;
/// The most reward components one score may have.
const MAX_COMPONENTS: usize = 64;

/// One live instance and the resource a session holds in it.
struct Live<G> {
    store: Store<StoreState>,
    guest: G,
    handle: ResourceAny,
}

impl<G> Live<G> {
    /// A fresh instance, its role's exports (`load`), and the resource `open` makes.
    async fn open(
        inner: &Inner,
        seed: u64,
        call: &'static str,
        load: impl FnOnce(&mut Store<StoreState>, &Instance) -> wasmtime::Result<G>,
        open: impl AsyncFnOnce(
            &G,
            &mut Store<StoreState>,
        ) -> wasmtime::Result<Result<ResourceAny, String>>,
    ) -> Result<Live<G>, Fault> {
        let (mut store, instance) = inner.instantiate(seed, call).await?;
        let guest = load(&mut store, &instance)
            .map_err(|e| inner.fault(call, FaultKind::Incompatible, e.to_string()))?;
        let handle = inner
            .guarded(&mut store, call, async |store| open(&guest, store).await)
            .await?
            .map_err(|message| inner.guest_error(call, message))?;
        Ok(Live {
            store,
            guest,
            handle,
        })
    }

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

/// A call's result as the session's answer: a fault discards the instance; a plugin's own
/// error is counted and passed on, and keeps it.
fn settle<G, T>(
    inner: &Inner,
    live: &mut Option<Live<G>>,
    call: &'static str,
    result: Result<Result<T, String>, Fault>,
) -> Result<T, Fault> {
    match result {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(message)) => Err(inner.guest_error(call, message)),
        Err(fault) => {
            *live = None;
            Err(fault)
        }
    }
}

/// Refuses a returned value: a bad-output fault, and the instance is discarded.
fn reject<G, T>(
    inner: &Inner,
    live: &mut Option<Live<G>>,
    call: &'static str,
    message: String,
) -> Result<T, Fault> {
    *live = None;
    Err(inner.fault(call, FaultKind::BadOutput, message))
}

fn message_bytes(messages: &[wit::Message]) -> usize {
    messages
        .iter()
        .map(|m| m.role.len() + m.content.len())
        .sum()
}

/// One trajectory's trigger session.
pub struct TriggerSession {
    plugin: Plugin,
    config: String,
    sample: wit::Sample,
    seed: u64,
    live: Option<Live<v0::trigger::Guest>>,
    stop_patterns: Vec<String>,
}

impl TriggerSession {
    pub(super) async fn open(
        plugin: Plugin,
        config: &str,
        sample: &Sample,
        seed: u64,
    ) -> Result<Self, Fault> {
        let mut session = TriggerSession {
            plugin,
            config: config.to_string(),
            sample: sample.into(),
            seed,
            live: None,
            stop_patterns: Vec::new(),
        };
        session.live().await?;
        Ok(session)
    }

    /// The literal strings after which the host calls [`TriggerSession::fire`].
    pub fn stop_patterns(&self) -> &[String] {
        &self.stop_patterns
    }

    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    /// The live instance, opened if there is none (first use, or after a fault).
    async fn live(&mut self) -> Result<&mut Live<v0::trigger::Guest>, Fault> {
        if self.live.is_none() {
            let inner = &*self.plugin.0;
            let (config, sample) = (&self.config, &self.sample);
            let indices = inner
                .indices
                .trigger
                .as_ref()
                .expect("role checked on open");
            let mut live = Live::open(
                inner,
                self.seed,
                "trigger.open",
                |store, instance| indices.load(store, instance),
                async |guest, store| guest.session().call_open(store, config, sample).await,
            )
            .await?;
            let call = "trigger.stop-patterns";
            let patterns = live
                .call(inner, call, async |guest, store, handle| {
                    guest.session().call_stop_patterns(store, handle).await
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
            self.stop_patterns = patterns;
            self.live = Some(live);
        }
        Ok(self.live.as_mut().expect("opened above"))
    }

    /// Runs the tool on everything generated so far. `Ok(None)`: nothing to append.
    pub async fn fire(&mut self, text: &str) -> Result<Option<String>, Fault> {
        let inner = self.plugin.0.clone();
        let call = "trigger.fire";
        let result = self
            .live()
            .await?
            .call(&inner, call, async |guest, store, handle| {
                guest.session().call_fire(store, handle, text).await
            })
            .await;
        let output = settle(&inner, &mut self.live, call, result)?;
        match inner.too_large(output.as_ref().map_or(0, String::len)) {
            Some(message) => reject(&inner, &mut self.live, call, message),
            None => Ok(output),
        }
    }
}

/// One trajectory's environment episode.
pub struct EnvironmentEpisode {
    plugin: Plugin,
    config: String,
    sample: wit::Sample,
    seed: u64,
    live: Option<Live<v0::environment::Guest>>,
}

impl EnvironmentEpisode {
    pub(super) async fn open(
        plugin: Plugin,
        config: &str,
        sample: &Sample,
        seed: u64,
    ) -> Result<Self, Fault> {
        let mut episode = EnvironmentEpisode {
            plugin,
            config: config.to_string(),
            sample: sample.into(),
            seed,
            live: None,
        };
        episode.live().await?;
        Ok(episode)
    }

    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    async fn live(&mut self) -> Result<&mut Live<v0::environment::Guest>, Fault> {
        if self.live.is_none() {
            let inner = &*self.plugin.0;
            let (config, sample) = (&self.config, &self.sample);
            let indices = inner
                .indices
                .environment
                .as_ref()
                .expect("role checked on open");
            let live = Live::open(
                inner,
                self.seed,
                "environment.open",
                |store, instance| indices.load(store, instance),
                async |guest, store| guest.episode().call_open(store, config, sample).await,
            )
            .await?;
            self.live = Some(live);
        }
        Ok(self.live.as_mut().expect("opened above"))
    }

    /// Answers the assistant's latest turn.
    pub async fn step(&mut self, assistant: &str) -> Result<StepResult, Fault> {
        let inner = self.plugin.0.clone();
        let call = "environment.step";
        let result = self
            .live()
            .await?
            .call(&inner, call, async |guest, store, handle| {
                guest.episode().call_step(store, handle, assistant).await
            })
            .await;
        let step = settle(&inner, &mut self.live, call, result)?;
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
            inner.too_large(message_bytes(&step.messages))
        };
        match problem {
            Some(message) => reject(&inner, &mut self.live, call, message),
            None => Ok(step.into()),
        }
    }
}

/// An opened dataset.
pub struct DatasetSource {
    plugin: Plugin,
    config: String,
    seed: u64,
    live: Option<Live<v0::dataset::Guest>>,
    len: u64,
}

impl DatasetSource {
    pub(super) async fn open(plugin: Plugin, config: &str, seed: u64) -> Result<Self, Fault> {
        let mut source = DatasetSource {
            plugin,
            config: config.to_string(),
            seed,
            live: None,
            len: 0,
        };
        source.live().await?;
        Ok(source)
    }

    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    /// How many samples the dataset has (asked when the instance is opened).
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    async fn live(&mut self) -> Result<&mut Live<v0::dataset::Guest>, Fault> {
        if self.live.is_none() {
            let inner = &*self.plugin.0;
            let (config, seed) = (&self.config, self.seed);
            let indices = inner
                .indices
                .dataset
                .as_ref()
                .expect("role checked on open");
            let mut live = Live::open(
                inner,
                seed,
                "dataset.open",
                |store, instance| indices.load(store, instance),
                async |guest, store| guest.source().call_open(store, config, seed).await,
            )
            .await?;
            self.len = live
                .call(inner, "dataset.len", async |guest, store, handle| {
                    guest.source().call_len(store, handle).await
                })
                .await?;
            self.live = Some(live);
        }
        Ok(self.live.as_mut().expect("opened above"))
    }

    /// The sample at `index`, which must be below [`DatasetSource::len`].
    pub async fn get(&mut self, index: u64) -> Result<Sample, Fault> {
        let inner = self.plugin.0.clone();
        let call = "dataset.get";
        if index >= self.len {
            return Err(Fault {
                plugin: inner.id.clone(),
                call,
                kind: FaultKind::BadOutput,
                message: format!("index {index} is past the dataset's {} samples", self.len),
            });
        }
        let result = self
            .live()
            .await?
            .call(&inner, call, async |guest, store, handle| {
                guest.source().call_get(store, handle, index).await
            })
            .await;
        let sample = settle(&inner, &mut self.live, call, result)?;
        if let Some(message) =
            inner.too_large(sample.metadata.len() + message_bytes(&sample.messages))
        {
            return reject(&inner, &mut self.live, call, message);
        }
        match serde_json::from_str::<serde_json::Value>(&sample.metadata) {
            Ok(metadata @ serde_json::Value::Object(_)) => Ok(Sample {
                messages: sample.messages.into_iter().map(Into::into).collect(),
                metadata,
            }),
            _ => reject(
                &inner,
                &mut self.live,
                call,
                format!("sample {index} has metadata that is not a JSON object"),
            ),
        }
    }
}

/// An opened reward function.
pub struct RewardScorer {
    plugin: Plugin,
    config: String,
    live: Option<Live<v0::reward::Guest>>,
}

impl RewardScorer {
    pub(super) async fn open(plugin: Plugin, config: &str) -> Result<Self, Fault> {
        let mut scorer = RewardScorer {
            plugin,
            config: config.to_string(),
            live: None,
        };
        scorer.live().await?;
        Ok(scorer)
    }

    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    async fn live(&mut self) -> Result<&mut Live<v0::reward::Guest>, Fault> {
        if self.live.is_none() {
            let inner = &*self.plugin.0;
            let config = &self.config;
            let indices = inner.indices.reward.as_ref().expect("role checked on open");
            let live = Live::open(
                inner,
                inner.seed_salt,
                "reward.open",
                |store, instance| indices.load(store, instance),
                async |guest, store| guest.scorer().call_open(store, config).await,
            )
            .await?;
            self.live = Some(live);
        }
        Ok(self.live.as_mut().expect("opened above"))
    }

    /// Scores one trajectory into named components.
    pub async fn score(&mut self, trajectory: &Trajectory) -> Result<Vec<Component>, Fault> {
        let inner = self.plugin.0.clone();
        let call = "reward.score";
        let trajectory = wit::Trajectory::from(trajectory);
        let result = self
            .live()
            .await?
            .call(&inner, call, async |guest, store, handle| {
                guest.scorer().call_score(store, handle, &trajectory).await
            })
            .await;
        let components = settle(&inner, &mut self.live, call, result)?;
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
        match problem {
            Some(message) => reject(&inner, &mut self.live, call, message),
            None => Ok(components.into_iter().map(Into::into).collect()),
        }
    }
}
