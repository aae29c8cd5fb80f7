//! Generated bindings, one module per released WIT version of `rlhost:plugin`, and the
//! one place that picks among them (as Zed's extension host does): the rest of the
//! plugin platform calls a role through the enums here, in the host's own types, and
//! never names a version.
//!
//! A released version is frozen. Supporting a new one means adding its folder under
//! `wit/`, a module here, its name to [`SUPPORTED`], and a variant to each enum below;
//! older modules stay so that old plugins keep loading.

pub mod v0_1_0;
pub mod v0_2_0;

use super::sandbox::StoreState;
use super::types::{Component, Message, PluginInfo, Role, Sample, StepResult, Transcript};
use wasmtime::Store;
use wasmtime::component::{Instance, InstancePre, Linker, ResourceAny};

/// The `rlhost:plugin` versions this host loads, newest first.
pub const SUPPORTED: &[&str] = &["0.2.0", "0.1.0"];

/// The WIT package every plugin interface belongs to.
pub const PACKAGE: &str = "rlhost:plugin";

/// What a guest call returns: a trap or host error outside, the plugin's own `err(...)`
/// inside.
type Call<T> = wasmtime::Result<Result<T, String>>;

/// Offers plugins the host functions of every supported version.
pub(super) fn add_to_linker(linker: &mut Linker<StoreState>) -> wasmtime::Result<()> {
    v0_1_0::add_to_linker(linker)?;
    v0_2_0::add_to_linker(linker)
}

/// A plugin's exports, looked up once per plugin for the version it was built against.
pub enum Exports {
    V0_1_0(v0_1_0::Exports),
    V0_2_0(v0_2_0::Exports),
}

impl Exports {
    /// The export indices of `roles` (and `about`) in the component behind `pre`, which
    /// imports `rlhost:plugin@wit_version` (one of [`SUPPORTED`], checked when inspected).
    pub fn new(
        pre: &InstancePre<StoreState>,
        wit_version: &str,
        roles: &[Role],
    ) -> wasmtime::Result<Exports> {
        match wit_version {
            "0.1.0" => Ok(Exports::V0_1_0(v0_1_0::Exports::new(pre, roles)?)),
            "0.2.0" => Ok(Exports::V0_2_0(v0_2_0::Exports::new(pre, roles)?)),
            other => Err(wasmtime::format_err!(
                "rlhost:plugin@{other} is not supported by this host (it supports {})",
                SUPPORTED.join(", ")
            )),
        }
    }

    pub fn about(
        &self,
        store: &mut Store<StoreState>,
        instance: &Instance,
    ) -> wasmtime::Result<About> {
        match self {
            Exports::V0_1_0(e) => e.about.load(store, instance).map(About::V0_1_0),
            Exports::V0_2_0(e) => e.about.load(store, instance).map(About::V0_2_0),
        }
    }

    pub fn trigger(
        &self,
        store: &mut Store<StoreState>,
        instance: &Instance,
    ) -> wasmtime::Result<Trigger> {
        match self {
            Exports::V0_1_0(e) => Ok(Trigger::V0_1_0(
                v0_1_0::Exports::role(&e.trigger, "trigger")?.load(store, instance)?,
            )),
            Exports::V0_2_0(e) => Ok(Trigger::V0_2_0(
                v0_1_0::Exports::role(&e.trigger, "trigger")?.load(store, instance)?,
            )),
        }
    }

    pub fn environment(
        &self,
        store: &mut Store<StoreState>,
        instance: &Instance,
    ) -> wasmtime::Result<Environment> {
        match self {
            Exports::V0_1_0(e) => Ok(Environment::V0_1_0(
                v0_1_0::Exports::role(&e.environment, "environment")?.load(store, instance)?,
            )),
            Exports::V0_2_0(e) => Ok(Environment::V0_2_0(
                v0_1_0::Exports::role(&e.environment, "environment")?.load(store, instance)?,
            )),
        }
    }

    pub fn dataset(
        &self,
        store: &mut Store<StoreState>,
        instance: &Instance,
    ) -> wasmtime::Result<Dataset> {
        match self {
            Exports::V0_1_0(e) => Ok(Dataset::V0_1_0(
                v0_1_0::Exports::role(&e.dataset, "dataset")?.load(store, instance)?,
            )),
            Exports::V0_2_0(e) => Ok(Dataset::V0_2_0(
                v0_1_0::Exports::role(&e.dataset, "dataset")?.load(store, instance)?,
            )),
        }
    }

    pub fn tools(
        &self,
        store: &mut Store<StoreState>,
        instance: &Instance,
    ) -> wasmtime::Result<Tools> {
        match self {
            Exports::V0_1_0(_) => Err(wasmtime::format_err!(
                "rlhost:plugin@0.1.0 has no tools role; rebuild the plugin against wit/v0.2.0"
            )),
            Exports::V0_2_0(e) => Ok(Tools::V0_2_0(
                v0_1_0::Exports::role(&e.tools, "tools")?.load(store, instance)?,
            )),
        }
    }

    pub fn reward(
        &self,
        store: &mut Store<StoreState>,
        instance: &Instance,
    ) -> wasmtime::Result<Reward> {
        match self {
            Exports::V0_1_0(e) => Ok(Reward::V0_1_0(
                v0_1_0::Exports::role(&e.reward, "reward")?.load(store, instance)?,
            )),
            Exports::V0_2_0(e) => Ok(Reward::V0_2_0(
                v0_1_0::Exports::role(&e.reward, "reward")?.load(store, instance)?,
            )),
        }
    }
}

/// A function as a tools plugin listed it, its schema still the JSON text it sent.
pub struct RawFunction {
    pub name: String,
    pub description: String,
    pub parameters: String,
    pub stateless: bool,
}

/// One instance's `tools` interface (0.2.0 on).
pub enum Tools {
    V0_2_0(v0_2_0::tools::Guest),
}

impl Tools {
    /// A session for one trajectory of `sample`.
    pub async fn open(
        &self,
        store: &mut Store<StoreState>,
        config: &str,
        sample: &Sample,
    ) -> Call<ResourceAny> {
        match self {
            Tools::V0_2_0(g) => g.session().call_open(store, config, &sample.into()).await,
        }
    }

    pub async fn functions(
        &self,
        store: &mut Store<StoreState>,
        session: ResourceAny,
    ) -> wasmtime::Result<Vec<RawFunction>> {
        match self {
            Tools::V0_2_0(g) => Ok(g
                .session()
                .call_functions(store, session)
                .await?
                .into_iter()
                .map(|f| RawFunction {
                    name: f.name,
                    description: f.description,
                    parameters: f.parameters,
                    stateless: f.stateless,
                })
                .collect()),
        }
    }

    pub async fn call(
        &self,
        store: &mut Store<StoreState>,
        session: ResourceAny,
        name: &str,
        arguments: &str,
    ) -> Call<String> {
        match self {
            Tools::V0_2_0(g) => g.session().call_call(store, session, name, arguments).await,
        }
    }
}

/// One instance's `about` interface.
pub enum About {
    V0_1_0(v0_1_0::about::Guest),
    V0_2_0(v0_2_0::about::Guest),
}

impl About {
    pub async fn info(&self, store: &mut Store<StoreState>) -> wasmtime::Result<PluginInfo> {
        match self {
            About::V0_1_0(g) => Ok(g.call_info(store).await?.into()),
            About::V0_2_0(g) => Ok(g.call_info(store).await?.into()),
        }
    }
}

/// One instance's `trigger` interface.
pub enum Trigger {
    V0_1_0(v0_1_0::trigger::Guest),
    V0_2_0(v0_2_0::trigger::Guest),
}

impl Trigger {
    /// A session for one trajectory of `sample`.
    pub async fn open(
        &self,
        store: &mut Store<StoreState>,
        config: &str,
        sample: &Sample,
    ) -> Call<ResourceAny> {
        match self {
            Trigger::V0_1_0(g) => g.session().call_open(store, config, &sample.into()).await,
            Trigger::V0_2_0(g) => g.session().call_open(store, config, &sample.into()).await,
        }
    }

    pub async fn stop_patterns(
        &self,
        store: &mut Store<StoreState>,
        session: ResourceAny,
    ) -> wasmtime::Result<Vec<String>> {
        match self {
            Trigger::V0_1_0(g) => g.session().call_stop_patterns(store, session).await,
            Trigger::V0_2_0(g) => g.session().call_stop_patterns(store, session).await,
        }
    }

    pub async fn fire(
        &self,
        store: &mut Store<StoreState>,
        session: ResourceAny,
        text: &str,
    ) -> Call<Option<String>> {
        match self {
            Trigger::V0_1_0(g) => g.session().call_fire(store, session, text).await,
            Trigger::V0_2_0(g) => g.session().call_fire(store, session, text).await,
        }
    }
}

/// One instance's `environment` interface.
pub enum Environment {
    V0_1_0(v0_1_0::environment::Guest),
    V0_2_0(v0_2_0::environment::Guest),
}

impl Environment {
    /// An episode for one trajectory of `sample`.
    pub async fn open(
        &self,
        store: &mut Store<StoreState>,
        config: &str,
        sample: &Sample,
    ) -> Call<ResourceAny> {
        match self {
            Environment::V0_1_0(g) => g.episode().call_open(store, config, &sample.into()).await,
            Environment::V0_2_0(g) => g.episode().call_open(store, config, &sample.into()).await,
        }
    }

    pub async fn step(
        &self,
        store: &mut Store<StoreState>,
        episode: ResourceAny,
        assistant: &str,
    ) -> Call<StepResult> {
        match self {
            Environment::V0_1_0(g) => Ok(g
                .episode()
                .call_step(store, episode, assistant)
                .await?
                .map(Into::into)),
            Environment::V0_2_0(g) => Ok(g
                .episode()
                .call_step(store, episode, assistant)
                .await?
                .map(Into::into)),
        }
    }
}

/// A sample as a dataset plugin returned it: its metadata still the JSON text it sent.
#[derive(Debug)]
pub struct RawSample {
    pub messages: Vec<Message>,
    pub metadata: String,
}

/// One instance's `dataset` interface.
pub enum Dataset {
    V0_1_0(v0_1_0::dataset::Guest),
    V0_2_0(v0_2_0::dataset::Guest),
}

impl Dataset {
    /// The dataset in the order `seed` gives it.
    pub async fn open(
        &self,
        store: &mut Store<StoreState>,
        config: &str,
        seed: u64,
    ) -> Call<ResourceAny> {
        match self {
            Dataset::V0_1_0(g) => g.source().call_open(store, config, seed).await,
            Dataset::V0_2_0(g) => g.source().call_open(store, config, seed).await,
        }
    }

    pub async fn len(
        &self,
        store: &mut Store<StoreState>,
        source: ResourceAny,
    ) -> wasmtime::Result<u64> {
        match self {
            Dataset::V0_1_0(g) => g.source().call_len(store, source).await,
            Dataset::V0_2_0(g) => g.source().call_len(store, source).await,
        }
    }

    pub async fn get(
        &self,
        store: &mut Store<StoreState>,
        source: ResourceAny,
        index: u64,
    ) -> Call<RawSample> {
        match self {
            Dataset::V0_1_0(g) => {
                Ok(g.source()
                    .call_get(store, source, index)
                    .await?
                    .map(|s| RawSample {
                        messages: s.messages.into_iter().map(Into::into).collect(),
                        metadata: s.metadata,
                    }))
            }
            Dataset::V0_2_0(g) => {
                Ok(g.source()
                    .call_get(store, source, index)
                    .await?
                    .map(|s| RawSample {
                        messages: s.messages.into_iter().map(Into::into).collect(),
                        metadata: s.metadata,
                    }))
            }
        }
    }
}

/// One instance's `reward` interface.
pub enum Reward {
    V0_1_0(v0_1_0::reward::Guest),
    V0_2_0(v0_2_0::reward::Guest),
}

impl Reward {
    pub async fn open(&self, store: &mut Store<StoreState>, config: &str) -> Call<ResourceAny> {
        match self {
            Reward::V0_1_0(g) => g.scorer().call_open(store, config).await,
            Reward::V0_2_0(g) => g.scorer().call_open(store, config).await,
        }
    }

    pub async fn score(
        &self,
        store: &mut Store<StoreState>,
        scorer: ResourceAny,
        trajectory: &Transcript,
    ) -> Call<Vec<Component>> {
        match self {
            Reward::V0_1_0(g) => Ok(g
                .scorer()
                .call_score(store, scorer, &trajectory.into())
                .await?
                .map(|cs| cs.into_iter().map(Into::into).collect())),
            Reward::V0_2_0(g) => Ok(g
                .scorer()
                .call_score(store, scorer, &trajectory.into())
                .await?
                .map(|cs| cs.into_iter().map(Into::into).collect())),
        }
    }
}
