//! A checked config turned into working objects: the plugins, the dataset, the tools and
//! the reward functions ([`Opened`]), then the model with its adapter and the rollout
//! settings ([`Setup`]). A built-in model is built between the two, as a step of the
//! command that needs it.
//!
//! Everything a run needs is opened here, before the first rollout, so that a wrong path,
//! a plugin without the role it is used for, or a plugin configuration it refuses stops
//! the run at once with a message naming the config key, not after an hour of training.

use super::{EngineKind, LoadedConfig, QuantizeKind};
use crate::builtin::Recipe;
use crate::data::{Dataset, PromptLimit};
use crate::model::{LanguageModel, Mode, peft};
use crate::plugin::{DirGrant, Plugin, PluginRuntime, PluginSpec, Role, RuntimeOptions, cache};
use crate::rl::distill::{Teacher, same_rendering};
use crate::rl::reward_model::Scorer;
use crate::rl::trainer::Sources;
use crate::rollout::env::openenv::Remote;
use crate::rollout::env::tools::{Catalogue, Toolbox};
use crate::rollout::render::prompt_tokens;
use crate::rollout::reward::WeightedModel;
use crate::rollout::{Answerers, RewardSpec, Rewards, RolloutLimits, RolloutSettings, ToolSpec};
use crate::sampler::draw::SamplingParams;
use crate::sampler::vllm::{Pool, VllmSettings};
use crate::task::Sample;
use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use tokio::runtime::Handle;

/// A config's plugins, tools, rewards and data, opened and checked; its model not yet
/// loaded. A `builtin:NAME` model is built (or found in the cache) from these as a step of
/// its own ([`Opened::builtin`], [`Opened::build`]) before [`Opened::with_model`].
pub struct Opened {
    pub loaded: LoadedConfig,
    /// By config name (a `--plugin` file by its own name).
    pub plugins: BTreeMap<String, Plugin>,
    pub dataset: Dataset,
    pub rewards: Rewards,
    trigger: Option<ToolSpec>,
    environment: Option<ToolSpec>,
    tools: Option<Catalogue>,
    /// An OpenEnv server as the environment, checked.
    openenv: Option<Remote>,
    /// The task's name in messages: its dataset plugin or file.
    task: String,
}

/// A config opened whole: [`Opened`] with its model loaded and the rollout settings
/// resolved.
pub struct Setup {
    pub loaded: LoadedConfig,
    pub lm: LanguageModel,
    /// By config name (a `--plugin` file by its own name).
    pub plugins: BTreeMap<String, Plugin>,
    pub dataset: std::sync::Arc<Dataset>,
    pub settings: RolloutSettings,
    pub rewards: Rewards,
    /// `[distill]`'s teacher.
    pub teacher: Option<Teacher>,
    /// The run's `[gateway]`, once [`Setup::open_gateway`] has bound it.
    pub gateway: Option<crate::gateway::train::Link>,
}

impl Opened {
    /// Opens everything the config names but the model. `extra_plugins` are `--plugin`
    /// files: each is registered under its own name (replacing a config plugin of that
    /// name) and, if it is a trigger or an environment, becomes the run's trigger or
    /// environment.
    pub fn open(
        loaded: LoadedConfig,
        extra_plugins: &[PathBuf],
        handle: &Handle,
    ) -> Result<Opened> {
        let c = &loaded.config;
        let file = loaded.path.display().to_string();
        let plugins = handle.block_on(load_plugins(&loaded, extra_plugins))?;
        let mut trigger_name = c.rollout.trigger.clone();
        let mut env_name = c.rollout.environment.clone();
        let mut tool_names = c.rollout.tools.clone();
        for path in extra_plugins {
            let (name, plugin) = plugins
                .iter()
                .find(|(_, p)| p.spec().path == *path)
                .expect("loaded above");
            if plugin.roles().contains(&Role::Trigger) {
                if trigger_name.as_ref() != Some(name) {
                    tracing::info!("--plugin {}: `{name}` is the trigger", path.display());
                }
                trigger_name = Some(name.clone());
            } else if plugin.roles().contains(&Role::Environment) {
                env_name = Some(name.clone());
            } else if plugin.roles().contains(&Role::Tools) && !tool_names.contains(name) {
                tracing::info!(
                    "--plugin {}: `{name}`'s functions are the run's tools",
                    path.display()
                );
                tool_names.push(name.clone());
            }
        }
        let role = |key: &str, name: &str, role: Role| -> Result<Plugin> {
            let plugin = plugins[name].clone();
            if !plugin.roles().contains(&role) {
                bail!(
                    "{file}: {key} = \"{name}\", but {} ({}) exports {}, not the {role} role",
                    plugin.id(),
                    plugin.spec().path.display(),
                    crate::plugin::inspect::role_list(plugin.roles())
                );
            }
            Ok(plugin)
        };
        let trigger = match &trigger_name {
            Some(name) => {
                let plugin = role("rollout.trigger", name, Role::Trigger)?;
                let config = c.rollout.trigger_config.to_string();
                // One session up front: a configuration the plugin refuses is a config
                // error now, not a fault in every trajectory later.
                handle
                    .block_on(plugin.open_trigger(&config, &Sample::from_prompt(""), 0))
                    .with_context(|| format!("{file}: rollout.trigger_config for `{name}`"))?;
                Some(ToolSpec { plugin, config })
            }
            None => None,
        };
        let environment = match &env_name {
            Some(name) => Some(ToolSpec {
                plugin: role("rollout.environment", name, Role::Environment)?,
                config: c.rollout.environment_config.to_string(),
            }),
            None => None,
        };
        let openenv = match &c.rollout.openenv {
            Some(section) => {
                if section.action.kind == super::openenv::ActionKind::Call
                    && let Some(name) = tool_names.first()
                {
                    bail!(
                        "{file}: rollout.openenv.action.kind = \"call\" sends the model's function calls to the server, and `{name}` (--plugin or rollout.tools) would run them in the sandbox; keep one"
                    );
                }
                if let Some(name) = &environment {
                    bail!(
                        "{file}: [rollout.openenv] names the environment, and so does `{}` (--plugin or rollout.environment); keep one",
                        name.plugin.name()
                    );
                }
                Some(
                    handle
                        .block_on(Remote::connect(section))
                        .with_context(|| format!("{file}: [rollout.openenv]"))?,
                )
            }
            None => None,
        };
        let tools = if tool_names.is_empty() {
            None
        } else {
            let mut specs = Vec::new();
            for (i, name) in tool_names.iter().enumerate() {
                let plugin = role(&format!("rollout.tools[{i}]"), name, Role::Tools)?;
                let config = c
                    .rollout
                    .tools_config
                    .get(name)
                    .cloned()
                    .unwrap_or_else(|| serde_json::json!({}))
                    .to_string();
                specs.push((name.clone(), ToolSpec { plugin, config }));
            }
            Some(
                handle
                    .block_on(Catalogue::open(specs))
                    .with_context(|| format!("{file}: rollout.tools"))?,
            )
        };
        let mut specs = Vec::new();
        for (i, r) in c.rewards.iter().enumerate() {
            // Reward models are opened with the model (`Opened::load`).
            let Some(plugin) = &r.plugin else { continue };
            specs.push(RewardSpec {
                plugin: role(&format!("rewards[{i}].plugin"), plugin, Role::Reward)?,
                config: r.config.to_string(),
                weights: r.weights.clone(),
                default_weight: r.default_weight,
                fallback: r.fallback,
                cases: r.cases.clone(),
            });
        }
        let rewards = handle
            .block_on(Rewards::open(
                specs,
                c.rollout.env_reward_weight,
                c.rollout.reward_instances,
            ))
            .with_context(|| format!("{file}: [[rewards]]"))?;
        let data_plugin = match &c.data.plugin {
            Some(name) => Some(role("data.plugin", name, Role::Dataset)?),
            None => None,
        };
        let dataset = handle
            .block_on(Dataset::open(
                &c.data,
                &loaded.base_dir,
                data_plugin.as_ref(),
                c.run.seed,
            ))
            .with_context(|| format!("{file}: [data]"))?;
        let task = match (&data_plugin, &c.data.path) {
            (Some(plugin), _) => plugin.name().to_string(),
            (None, Some(path)) => path.display().to_string(),
            (None, None) => "data".to_string(),
        };
        Ok(Opened {
            loaded,
            plugins,
            dataset,
            rewards,
            trigger,
            environment,
            tools,
            openenv,
            task,
        })
    }

    /// The built-in model `model.path` names (`builtin:NAME`), or `None` for a model
    /// directory.
    pub fn builtin(&self) -> Result<Option<&'static Recipe>> {
        let c = &self.loaded;
        crate::builtin::recipe(&c.config.model.path).with_context(|| {
            format!(
                "{}: model.path = \"{}\"",
                c.path.display(),
                c.config.model.path.display()
            )
        })
    }

    /// Builds `recipe`'s model for this run's task and tool (tokenizer, weights and the
    /// warm start), or finds it in the cache; its directory.
    pub fn build(&self, recipe: &Recipe, handle: &Handle, quiet: bool) -> Result<PathBuf> {
        let c = &self.loaded;
        let inputs = crate::builtin::Inputs {
            dataset: &self.dataset,
            task: &self.task,
            trigger: self.trigger.as_ref(),
            tools: self.tools.as_ref(),
            seed: c.config.run.seed,
        };
        let cache_dir = cache::default_dir()
            .context("no cache folder for the built-in model: set RLHOST_CACHE_DIR or HOME")?;
        crate::builtin::ensure(recipe, &inputs, handle, &cache_dir, quiet).with_context(|| {
            format!(
                "{}: model.path = \"{}\"",
                c.path.display(),
                c.config.model.path.display()
            )
        })
    }

    /// Loads the model (from `built`, the built-in model's directory, else from
    /// `model.path`) with its adapter and quantization, and resolves the rollout settings
    /// against its tokenizer; every prompt is checked against the length limit.
    pub fn with_model(self, built: Option<&Path>) -> Result<Setup> {
        let Opened {
            loaded,
            plugins,
            mut dataset,
            mut rewards,
            trigger,
            environment,
            tools,
            mut openenv,
            task: _,
        } = self;
        let c = &loaded.config;
        let file = loaded.path.display().to_string();
        let model_dir = match built {
            Some(dir) => dir.to_path_buf(),
            None => loaded.resolve(&c.model.path),
        };
        let at = c.model.placement(&file)?;
        let mut lm =
            LanguageModel::open(&model_dir, &at).with_context(|| format!("{file}: model.path"))?;
        if let Some(QuantizeKind::Nf4) = c.model.quantize {
            lm.model
                .quantize_nf4(c.model.double_quant)
                .with_context(|| format!("{file}: model.quantize = \"nf4\""))?;
        }
        lm.model.gradient_checkpointing = c.train.gradient_checkpointing;
        if let Some(adapter) = &c.model.adapter {
            let adapter = loaded.resolve(adapter);
            peft::load_adapter(&mut lm.model, &adapter)
                .with_context(|| format!("{file}: model.adapter {}", adapter.display()))?;
        }
        for (i, r) in c.rewards.iter().enumerate() {
            let Some(dir) = &r.model else { continue };
            let scorer = Scorer::load(
                &lm.model,
                &model_dir,
                &loaded.resolve(Path::new(dir)),
                c.train.micro_batch_tokens,
            )
            .with_context(|| format!("{file}: rewards[{i}].model = \"{dir}\""))?;
            rewards.models.push(WeightedModel {
                scorer: std::sync::Arc::new(scorer),
                weight: r
                    .weights
                    .get(crate::rollout::reward::MODEL_COMPONENT)
                    .copied()
                    .unwrap_or(r.default_weight),
            });
        }
        // A reward model and a teacher adapter are read in place of the run's adapter,
        // keyed by it, so the model needs one: where the config gives none, the fresh one
        // the trainer would attach (the same `[lora]` and seed; B = 0, so the outputs are
        // the base model's), so that `rlhost eval` and `rollout` of the base model score as
        // a run's first step does.
        if (!rewards.models.is_empty() || c.distill.is_some()) && lm.model.lora.is_none() {
            lm.model
                .attach_lora(&c.lora.to_config(), c.run.seed)
                .with_context(|| format!("{file}: [lora]"))?;
        }
        let s = &c.sampling;
        let mut sampling = crate::sampler::draw::defaults(&lm)?;
        sampling.temperature = s.temperature;
        sampling.top_k = s.top_k;
        sampling.top_p = s.top_p;
        sampling.min_p = s.min_p;
        sampling.max_new_tokens = s.max_new_tokens;
        sampling.stop_strings = s.stop.clone();
        sampling.seed = c.run.seed;
        sampling
            .validate()
            .with_context(|| format!("{file}: [sampling]"))?;
        let r = &c.rollout;
        let max_total_tokens =
            within_context(r.max_total_tokens, &lm).map_err(|e| anyhow::anyhow!("{file}: {e}"))?;
        // A grant's prompts are bounded by the model's context (the engine's links cap
        // them): one that asks for more than the model can read is told so once.
        let context = lm.model.cfg.max_position_embeddings;
        for (name, p) in &plugins {
            if let Some(g) = &p.spec().grants.generate
                && g.max_prompt_tokens as usize > context
                && g.max_prompt_tokens
                    != crate::plugin::model::GenerateGrant::default().max_prompt_tokens
            {
                tracing::warn!(
                    "{file}: plugins.{name}.generate.max_prompt_tokens is {}, over the model's context of {context} tokens: its prompts are capped at {context}",
                    g.max_prompt_tokens
                );
            }
        }
        let remote = match r.engine {
            EngineKind::Local => None,
            EngineKind::Vllm => Some(std::sync::Arc::new(
                vllm_pool(&loaded, &lm, &sampling, max_total_tokens)
                    .with_context(|| format!("{file}: [rollout.vllm]"))?,
            )),
        };
        let tools = match tools {
            Some(catalogue) => Some(std::sync::Arc::new(
                Toolbox::new(catalogue, r.tool_call_format, lm.chat()?)
                    .with_context(|| format!("{file}: rollout.tools"))?,
            )),
            None => None,
        };
        if let Some(remote) = openenv.as_mut().filter(|r| !r.functions.is_empty()) {
            let key = || format!("{file}: rollout.openenv.action.kind = \"call\"");
            let format = crate::rollout::env::tools::call_format(r.tool_call_format, lm.chat()?)
                .with_context(key)?;
            crate::rollout::env::tools::renders_tools(lm.chat()?, &remote.template_tools)
                .with_context(key)?;
            remote.set_format(format);
        }
        let settings = RolloutSettings {
            group_size: r.group_size,
            sampling,
            limits: RolloutLimits {
                max_turns: r.max_turns,
                max_tool_calls: r.max_tool_calls,
                max_tool_output_tokens: r.max_tool_output_tokens,
                max_total_tokens,
                truncation_marker: r.truncation_marker.clone(),
            },
            template_kwargs: r.template_kwargs.clone(),
            env: Answerers {
                trigger,
                environment,
                tools,
                openenv: openenv.map(std::sync::Arc::new),
            },
            remote,
            tree: match &r.tree {
                Some(t) => Some(
                    t.settings(r.group_size, c.sampling.max_new_tokens)
                        .map_err(|e| anyhow::anyhow!("{file}: {e}"))?,
                ),
                None => None,
            },
        };
        if settings.tree.is_some() {
            settings
                .env
                .forkable()
                .map_err(|e| anyhow::anyhow!("{file}: [rollout.tree]: {e}"))?;
        }
        let teacher = match &c.distill {
            Some(d) => Some(
                open_teacher(&loaded, &lm, &model_dir, &at, &settings, &d.teacher)
                    .with_context(|| format!("{file}: distill.teacher = \"{}\"", d.teacher))?,
            ),
            None => None,
        };
        // Every prompt is checked against the length limit now, not when it is drawn.
        let kwargs = &settings.template_kwargs;
        dataset
            .check_prompts(&PromptLimit {
                max_tokens: max_total_tokens.saturating_sub(1),
                max_token_bytes: lm.tokenizer.max_token_bytes(),
                count: &|sample| {
                    Ok(prompt_tokens(&lm, kwargs, settings.env.template_tools(), sample)?.len())
                },
                on_bad_row: c.data.on_bad_row,
            })
            .with_context(|| format!("{file}: [data]"))?;
        Ok(Setup {
            loaded,
            lm,
            plugins,
            dataset: std::sync::Arc::new(dataset),
            settings,
            rewards,
            teacher,
            gateway: None,
        })
    }
}

impl Setup {
    /// How rollouts run the model: with the adapter when there is one.
    pub fn mode(&self) -> Mode<'static> {
        Mode::INFERENCE
    }

    /// Binds and serves the run's `[gateway]` (when it has one); returns its URL.
    pub fn open_gateway(&mut self) -> Result<Option<String>> {
        let Some(section) = &self.loaded.config.gateway else {
            return Ok(None);
        };
        let gateway = crate::gateway::train::Settings {
            addr: section.addr.clone(),
            public: section.public,
            served_model_name: section.served_model_name.clone(),
            refuse_while_updating: section.while_updating == super::WhileUpdating::Refuse,
            max_connections: section.max_connections,
            session_timeout: std::time::Duration::from_secs_f64(section.session_timeout_s),
        };
        let link = crate::gateway::train::Link::open(
            &gateway,
            &self.lm,
            self.settings.template_kwargs.clone(),
            self.dataset.clone(),
            self.settings.group_size,
            self.settings.remote.clone(),
        )
        .with_context(|| format!("{}: [gateway]", self.loaded.path.display()))?;
        let url = link.url();
        self.gateway = Some(link);
        Ok(Some(url))
    }

    /// The model to train, and what the trainer samples from beside it.
    pub fn train_parts(&mut self) -> (&mut LanguageModel, Sources<'_>) {
        let sources = Sources {
            dataset: &self.dataset,
            settings: &self.settings,
            rewards: &self.rewards,
            gateway: self.gateway.as_ref(),
            teacher: self.teacher.as_ref(),
        };
        (&mut self.lm, sources)
    }
}

/// `[distill]`'s teacher for the student `lm` (loaded from `model_dir`): a second model
/// must read the student's ids as the same tokens and render conversations to the same
/// ids with its chat template, checked on a few probe conversations in this run's
/// template settings and tools.
fn open_teacher(
    loaded: &LoadedConfig,
    lm: &LanguageModel,
    model_dir: &Path,
    at: &crate::model::Placement,
    settings: &RolloutSettings,
    spec: &str,
) -> Result<Teacher> {
    let c = &loaded.config;
    let model_spec = c.model.path.display().to_string();
    if spec.starts_with(crate::builtin::SCHEME) && spec != model_spec {
        bail!(
            "a built-in model is built for its run's task with a tokenizer of its own, so only the run's own model ({model_spec}) can teach as {spec}; give a model folder, or a run or adapter folder trained on this run's model"
        );
    }
    let teacher = Teacher::open(
        spec,
        &loaded.resolve(Path::new(spec)),
        lm,
        model_dir,
        &model_spec,
        at,
    )?;
    if let Some(other) = teacher.own_model() {
        use crate::task::Message;
        let probes = [
            (
                "a user turn",
                vec![Message::new("user", "What is 12 * 34?")],
            ),
            (
                "a system and a user turn",
                vec![
                    Message::new("system", "Answer briefly."),
                    Message::new("user", "Name a prime."),
                ],
            ),
            (
                "a conversation with an assistant turn",
                vec![
                    Message::new("user", "Hi."),
                    Message::new("assistant", "Hello."),
                    Message::new("user", "Count to 3."),
                ],
            ),
        ];
        let kwargs = &settings.template_kwargs;
        let tools = settings.env.template_tools();
        for (what, messages) in probes {
            let sample = Sample {
                messages,
                metadata: serde_json::Value::Null,
            };
            let ids = prompt_tokens(lm, kwargs, tools, &sample)?;
            let theirs = prompt_tokens(other, kwargs, tools, &sample)
                .with_context(|| format!("the teacher cannot render {what}"))?;
            same_rendering(what, lm, &ids, &theirs)?;
        }
    }
    Ok(teacher)
}

/// Loads `[plugins.*]` and the `--plugin` files.
async fn load_plugins(
    loaded: &LoadedConfig,
    extra: &[PathBuf],
) -> Result<BTreeMap<String, Plugin>> {
    let c = &loaded.config;
    let fuel = c.plugins.values().any(|p| p.fuel.is_some());
    let runtime = PluginRuntime::new(&RuntimeOptions {
        fuel,
        cache_dir: cache::default_dir(),
        ..RuntimeOptions::default()
    })?;
    let mut plugins = BTreeMap::new();
    for (name, section) in &c.plugins {
        crate::plugin::net::HttpGrants::parse(&section.allow_http)
            .map_err(|e| anyhow::anyhow!("{}: plugins.{name}.{e}", loaded.path.display()))?;
        if let Some(grant) = &section.generate {
            grant.check().map_err(|e| {
                anyhow::anyhow!("{}: plugins.{name}.generate: {e}", loaded.path.display())
            })?;
        }
        let mut grants = section.http_grants();
        grants.generate = section.generate.clone();
        for g in &section.grant_dirs {
            let mut grant = DirGrant::from_str(g).map_err(|e| {
                anyhow::anyhow!("{}: plugins.{name}.grant_dirs: {e}", loaded.path.display())
            })?;
            grant.host = loaded.resolve(&grant.host);
            grants.read_only_dirs.push(grant);
        }
        let spec = PluginSpec {
            path: loaded.resolve(&section.path),
            limits: section.limits(),
            grants,
        };
        let plugin = runtime
            .load(spec)
            .await
            .with_context(|| format!("{}: plugins.{name}.path", loaded.path.display()))?;
        plugins.insert(name.clone(), plugin);
    }
    for path in extra {
        let probe = runtime
            .load(PluginSpec {
                path: path.clone(),
                limits: Default::default(),
                grants: Default::default(),
            })
            .await
            .with_context(|| format!("--plugin {}", path.display()))?;
        let name = probe.name().to_string();
        // A config section of the same name keeps its sandbox settings.
        let plugin = match c.plugins.get(&name) {
            Some(section) => runtime
                .load(PluginSpec {
                    path: path.clone(),
                    limits: section.limits(),
                    grants: plugins
                        .get(&name)
                        .map(|p: &Plugin| p.spec().grants.clone())
                        .unwrap_or_default(),
                })
                .await
                .with_context(|| format!("--plugin {}", path.display()))?,
            None => probe,
        };
        plugins.insert(name, plugin);
    }
    Ok(plugins)
}

/// `rollout.max_total_tokens` bounded by the model's context (`max_position_embeddings`):
/// a limit past it is refused, naming the key, since a trajectory's buffers (its prompt,
/// KV cache, attention mask) are sized by the limit, and nothing else stops a prompt of
/// millions of tokens (issue 51: 100,000,000 with 2 MB prompts aborted the process on a
/// 70 TB allocation). Left at its default (4096), the limit is the context of a model
/// with a shorter one.
fn within_context(limit: usize, lm: &LanguageModel) -> Result<usize, String> {
    let context = lm.model.cfg.max_position_embeddings;
    if limit <= context {
        Ok(limit)
    } else if limit == RolloutLimits::default().max_total_tokens {
        Ok(context)
    } else {
        Err(format!(
            "rollout.max_total_tokens is {limit}, over the model's context of {context} tokens (max_position_embeddings in {}): set it to at most {context}",
            lm.dir.join("config.json").display()
        ))
    }
}

/// Connects to the vLLM servers of `[rollout.vllm]` and checks them against `lm`.
fn vllm_pool(
    loaded: &LoadedConfig,
    lm: &LanguageModel,
    sampling: &SamplingParams,
    max_total_tokens: usize,
) -> Result<Pool> {
    let c = &loaded.config;
    let v = &c.rollout.vllm;
    let adapter_dir = match &v.adapter_dir {
        Some(d) => loaded.resolve(d),
        None => out_dir(loaded).join("vllm-adapters"),
    };
    let settings = VllmSettings {
        servers: v.servers.clone(),
        model: v.model.clone(),
        adapter_dir,
        server_adapter_dir: v.server_adapter_dir.clone(),
        timeout: std::time::Duration::from_secs_f64(v.timeout_s),
        max_in_flight: v.max_in_flight,
        keep_versions: c.rollout.max_staleness + 2,
    };
    // A gateway run's agents pick their own temperatures.
    let temperature = c.gateway.is_none().then_some(sampling.temperature);
    Pool::connect(settings, lm, max_total_tokens, temperature)
}

/// The run's output folder: `run.out_dir`, or `runs/<config name>` beside the config.
pub fn out_dir(loaded: &LoadedConfig) -> PathBuf {
    match &loaded.config.run.out_dir {
        Some(dir) => loaded.resolve(dir),
        None => {
            let stem = loaded
                .path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "run".into());
            loaded.base_dir.join("runs").join(stem)
        }
    }
}

/// `path` shown relative to the current directory when it is inside it.
pub fn display(path: &Path) -> String {
    std::env::current_dir()
        .ok()
        .and_then(|cwd| path.strip_prefix(cwd).ok().map(Path::to_path_buf))
        .unwrap_or_else(|| path.to_path_buf())
        .display()
        .to_string()
}
