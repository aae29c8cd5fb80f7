//! The config's sections as the user writes them: [`RunConfig`], the whole file, and one
//! type per section (`[run]`, `[model]`, `[lora]`, `[sampling]`, `[rollout]`,
//! `[plugins.NAME]`, `[[rewards]]`, `[gateway]`, `[pairs]`, `[dpo]`, `[rm]`, `[distill]`;
//! `[train]` is in [`super::train`]), each with its defaults and the checks that need no
//! other section. Every section rejects unknown keys by name.

use super::train::TrainSection;
use crate::data::DataConfig;
use crate::model::placement::{DTypeChoice, DeviceChoice, Placement};
use crate::openenv::settings as openenv;
use crate::plugin::{Grants, Limits};
use crate::rollout::tree::TreeSettings;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The whole file.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    #[serde(default)]
    pub run: RunSection,
    pub model: ModelSection,
    #[serde(default)]
    pub lora: LoraSection,
    pub data: DataConfig,
    #[serde(default)]
    pub sampling: SamplingSection,
    #[serde(default)]
    pub rollout: RolloutSection,
    /// Plugins by the name the rest of the config uses for them.
    #[serde(default)]
    pub plugins: BTreeMap<String, PluginSection>,
    #[serde(default)]
    pub rewards: Vec<RewardSection>,
    #[serde(default)]
    pub train: TrainSection,
    /// Serve the policy behind an OpenAI-compatible API and train on the sessions of the
    /// agents that call it, in place of plugin rollouts.
    pub gateway: Option<GatewaySection>,
    /// `rlhost dpo` and `rlhost rm`: how preference pairs are read and batched.
    #[serde(default)]
    pub pairs: PairsSection,
    /// `rlhost dpo`: preference optimisation of the adapter on the pairs.
    #[serde(default)]
    pub dpo: DpoSection,
    /// `rlhost rm`: a Bradley–Terry reward model trained on the pairs.
    #[serde(default)]
    pub rm: RmSection,
    /// On-policy distillation: a teacher scores each token the run samples.
    pub distill: Option<DistillSection>,
}

/// `[pairs]`: the preference pairs of `data.path` for `rlhost dpo` and `rlhost rm` (rows
/// with a prompt, `chosen` and `rejected`; docs/src/preferences.md). Steps, learning rate
/// and its schedule, clipping, micro-batches, evaluation and checkpoints come from
/// `[train]`.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PairsSection {
    /// Pairs per optimizer step.
    #[serde(default = "pairs_per_step")]
    pub per_step: usize,
    /// The most tokens a side of a pair may have, prompt included. A longer pair is an
    /// error naming it (or is skipped with `data.on_bad_row = "skip"`): nothing is cut, as
    /// a cut reply is not the reply that was preferred.
    #[serde(default = "max_length")]
    pub max_length: usize,
    /// The column holding the preferred completion: a reply (string) or a list of messages.
    #[serde(default = "chosen_key")]
    pub chosen_key: String,
    /// The column holding the completion it was preferred to.
    #[serde(default = "rejected_key")]
    pub rejected_key: String,
    /// `rlhost rm`: the column holding each pair's margin m, how much the chosen side is
    /// preferred (the loss asks r_c − r_r to exceed it, as TRL's reward trainer does).
    #[serde(default)]
    #[schemars(example = &"margin")]
    pub margin_key: Option<String>,
}

fn pairs_per_step() -> usize {
    8
}
fn max_length() -> usize {
    1024
}
fn chosen_key() -> String {
    "chosen".into()
}
fn rejected_key() -> String {
    "rejected".into()
}

impl Default for PairsSection {
    fn default() -> Self {
        PairsSection {
            per_step: pairs_per_step(),
            max_length: max_length(),
            chosen_key: chosen_key(),
            rejected_key: rejected_key(),
            margin_key: None,
        }
    }
}

impl PairsSection {
    /// The values serde cannot check, each error naming its key.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.per_step == 0 {
            return Err("pairs.per_step must be at least 1".into());
        }
        if self.max_length < 2 {
            return Err("pairs.max_length must be at least 2 tokens".into());
        }
        if self.chosen_key == self.rejected_key {
            return Err(format!(
                "pairs.chosen_key and pairs.rejected_key are both \"{}\"",
                self.chosen_key
            ));
        }
        Ok(())
    }
}

/// `[dpo]`: the loss `rlhost dpo` trains with.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DpoSection {
    /// `sigmoid` (DPO; with `label_smoothing`, cDPO), `robust` (rDPO), `ipo` or `simpo`
    /// (reference-free, length-normalised).
    #[serde(default = "dpo_loss")]
    pub loss: crate::rl::preference::PairLoss,
    /// β: how far from the reference (the model with its adapter off) the policy may move
    /// for a given preference (TRL's default, 0.1); IPO's τ; SimPO's reward scale (its
    /// paper uses 2-10).
    #[serde(default = "dpo_beta")]
    pub beta: f64,
    /// ε: the share of pairs taken to be labelled the wrong way round (cDPO, rDPO, SimPO).
    #[serde(default)]
    pub label_smoothing: f64,
    /// SimPO's target reward margin γ (its paper's 0.5-1.6 with β 2-2.5).
    #[serde(default = "simpo_gamma")]
    pub simpo_gamma: f64,
}

fn dpo_loss() -> crate::rl::preference::PairLoss {
    crate::rl::preference::PairLoss::Sigmoid
}
fn dpo_beta() -> f64 {
    0.1
}
fn simpo_gamma() -> f64 {
    0.5
}

impl Default for DpoSection {
    fn default() -> Self {
        DpoSection {
            loss: dpo_loss(),
            beta: dpo_beta(),
            label_smoothing: 0.0,
            simpo_gamma: simpo_gamma(),
        }
    }
}

impl DpoSection {
    /// The values serde cannot check, each error naming its key.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !positive(self.beta) {
            return Err(format!("dpo.beta is {}; it must be above 0", self.beta));
        }
        let eps = self.label_smoothing;
        let top = if self.loss == crate::rl::preference::PairLoss::Robust {
            0.5
        } else {
            1.0
        };
        if !(eps.is_finite() && (0.0..top).contains(&eps)) {
            return Err(format!(
                "dpo.label_smoothing is {eps}; it must be in [0, {top}) for the {:?} loss",
                self.loss
            ));
        }
        if !self.simpo_gamma.is_finite() {
            return Err("dpo.simpo_gamma must be a finite number".into());
        }
        Ok(())
    }
}

/// `[rm]`: the reward model `rlhost rm` trains: the adapter and a score head read at a
/// conversation's last token, with the Bradley–Terry loss.
#[derive(Debug, Clone, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RmSection {
    /// TRL's `center_rewards_coefficient`: adds c·mean((r_c + r_r)²), keeping scores
    /// centred on 0 (its docs suggest 0.01).
    #[serde(default)]
    #[schemars(example = 0.01)]
    pub center_rewards_coefficient: Option<f64>,
}

impl RmSection {
    /// The values serde cannot check, each error naming its key.
    pub fn validate(&self) -> std::result::Result<(), String> {
        match self.center_rewards_coefficient {
            Some(c) if !(c.is_finite() && c >= 0.0) => Err(format!(
                "rm.center_rewards_coefficient is {c}; it must be 0 or more"
            )),
            _ => Ok(()),
        }
    }
}

/// `[distill]`: on-policy distillation (docs/src/preferences.md#on-policy-distillation).
/// The run samples as any run does; a teacher reads each trajectory, and each sampled
/// token's advantage gains −coef·(log π_student − log π_teacher), the per-token reverse KL
/// (tinker-cookbook's on-policy distillation).
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DistillSection {
    /// The teacher: a run folder (its newest checkpoint), a checkpoint or PEFT adapter
    /// folder trained on this run's model (read over the same weights: no second copy), a
    /// Hugging Face model folder with the same tokenizer and chat template (loaded on the
    /// run's device), or the run's own `model.path` (the base model, adapter off).
    #[schemars(example = "runs/multiply")]
    pub teacher: String,
    /// α: the weight of the per-token reverse KL in each token's advantage
    /// (tinker-cookbook's `kl_penalty_coef`).
    #[serde(default = "distill_coef")]
    pub coef: f64,
    /// Add the task's group advantages (from `[[rewards]]`) to the teacher's term; false:
    /// the teacher alone teaches, and the rewards are computed and reported only.
    #[serde(default)]
    pub task_reward: bool,
}

fn distill_coef() -> f64 {
    1.0
}

impl DistillSection {
    /// The values serde cannot check and the settings it cannot go with, each error
    /// naming its key.
    pub(super) fn check(&self, train: &TrainSection) -> std::result::Result<(), String> {
        if self.teacher.trim().is_empty() {
            return Err("distill.teacher is empty; name a run, adapter or model folder".into());
        }
        if !(self.coef.is_finite() && self.coef > 0.0) {
            return Err(format!("distill.coef is {}; it must be above 0", self.coef));
        }
        if train.algorithm == crate::rl::algorithms::Algorithm::Ppo {
            return Err("[distill] with train.algorithm = \"ppo\": the teacher's per-token term goes with the group advantages of \"grpo\"; drop one".into());
        }
        if train.dynamic_sampling && !self.task_reward {
            return Err("train.dynamic_sampling drops groups whose rewards are all equal, and with distill.task_reward = false the rewards do not teach; set task_reward = true or drop dynamic_sampling".into());
        }
        Ok(())
    }
}

/// `[gateway]`: the OpenAI-compatible endpoint a run trains through (docs/src/gateway.md).
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct GatewaySection {
    /// Where to listen (`127.0.0.1:0` picks a free port; the run prints the address).
    pub addr: String,
    /// The model id agents name in `model`.
    pub served_model_name: String,
    /// What a call gets while the policy is not sampling (being updated): it waits
    /// (`hold`), or is refused with a 503 and `Retry-After` (`refuse`).
    pub while_updating: WhileUpdating,
    /// Connections served at once.
    pub max_connections: usize,
    /// A session with no call or end for this long is ended and left out of training
    /// (its agent went away); its group completes without it.
    pub session_timeout_s: f64,
    /// Listen beyond loopback on purpose: an `addr` that is not 127.0.0.1 or ::1 is
    /// refused without it. Agents then need the key in RLHOST_API_KEY, when it is set.
    pub public: bool,
}

impl Default for GatewaySection {
    fn default() -> Self {
        GatewaySection {
            addr: "127.0.0.1:8000".into(),
            served_model_name: "policy".into(),
            while_updating: WhileUpdating::Hold,
            max_connections: crate::gateway::server::MAX_CONNECTIONS,
            session_timeout_s: 600.0,
            public: false,
        }
    }
}

/// `gateway.while_updating`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum WhileUpdating {
    /// Calls wait in the queue until the next version samples.
    #[default]
    Hold,
    /// Calls are refused with a 503 and `Retry-After`.
    Refuse,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RunSection {
    /// Seeds sampling, data order, LoRA initialisation and plugins.
    pub seed: u64,
    /// Where outputs go (relative to the config file's folder); default
    /// `runs/<config file name>`.
    #[schemars(example = &"runs/first-try")]
    pub out_dir: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// A Hugging Face model directory.
    pub path: PathBuf,
    /// A PEFT adapter to start from (sampling uses it; training continues it).
    #[serde(default)]
    #[schemars(example = &"runs/sft/adapter")]
    pub adapter: Option<PathBuf>,
    /// `cpu`, `cuda`, `cuda:N` or `auto` (the first GPU when this binary was built with
    /// the `cuda` feature and one can be opened, else the CPU).
    #[serde(default = "auto")]
    pub device: String,
    /// The compute dtype of the base weights and activations: `auto` (f32 on the CPU,
    /// bf16 on a GPU), `f32`, `bf16` or `f16`. The adapter and its optimizer state,
    /// softmax, log-probs and losses are f32 whatever it is.
    #[serde(default = "auto")]
    pub dtype: String,
    /// `"nf4"`: QLoRA, the frozen projections quantized to 4 bits on load in
    /// bitsandbytes' NF4 layout (a checkpoint bitsandbytes saved in NF4 is 4-bit already).
    #[serde(default)]
    #[schemars(example = &"nf4")]
    pub quantize: Option<QuantizeKind>,
    /// With `quantize = "nf4"`: quantize the absmax values too (QLoRA's double
    /// quantization; another ~0.4 bits per weight saved).
    #[serde(default = "yes")]
    pub double_quant: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum QuantizeKind {
    Nf4,
}

fn yes() -> bool {
    true
}

fn auto() -> String {
    "auto".into()
}

impl ModelSection {
    /// Opens `device` and resolves `dtype` on it (both checked when the config was read);
    /// `file` names the config in errors.
    pub fn placement(&self, file: &str) -> Result<Placement> {
        let (device, dtype) = self.choices(file)?;
        Placement::open(device, dtype)
            .with_context(|| format!("{file}: model.device = \"{}\"", self.device))
    }

    /// `device` and `dtype` parsed; an unknown value is an error naming `file`, the key
    /// and what to write.
    pub(super) fn choices(&self, file: &str) -> Result<(DeviceChoice, DTypeChoice)> {
        let device = self.device.parse().map_err(|e: String| {
            anyhow::anyhow!("{file}: model.device = \"{}\": {e}", self.device)
        })?;
        let dtype = self.dtype.parse().map_err(|e: String| {
            anyhow::anyhow!("{file}: model.dtype = \"{}\": {e}", self.dtype)
        })?;
        Ok((device, dtype))
    }
}

/// The adapter trained on top of the model (PEFT's `LoraConfig` fields).
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct LoraSection {
    /// The adapter's rank: the inner size of each `B·A` pair. Higher holds more change and
    /// costs more memory and time; 8–64 is usual.
    pub r: usize,
    /// The scaling numerator: the update is `(alpha / r) · B·A` (`alpha / √r` with
    /// `use_rslora`).
    pub alpha: f64,
    /// Dropout on the adapter's input during training (PEFT's `lora_dropout`).
    pub dropout: f64,
    /// Rank-stabilised LoRA: scale by `alpha / √r` instead of `alpha / r`, so a larger
    /// rank does not shrink the update.
    pub use_rslora: bool,
    /// The projections that get an adapter, by their checkpoint names (`q_proj`, `k_proj`,
    /// `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`).
    pub target_modules: Vec<String>,
}

impl Default for LoraSection {
    fn default() -> Self {
        let d = crate::model::LoraConfig::default();
        LoraSection {
            r: d.r,
            alpha: d.alpha,
            dropout: d.dropout,
            use_rslora: d.use_rslora,
            target_modules: d.target_modules,
        }
    }
}

impl LoraSection {
    pub fn to_config(&self) -> crate::model::LoraConfig {
        crate::model::LoraConfig {
            r: self.r,
            alpha: self.alpha,
            dropout: self.dropout,
            use_rslora: self.use_rslora,
            target_modules: self.target_modules.clone(),
        }
    }
}

/// How tokens are drawn. RL samples at temperature 1 by default (the policy itself),
/// not with the model's `generation_config.json` defaults.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SamplingSection {
    /// Divides the logits before sampling; 1 samples the policy itself (what RL needs),
    /// 0 is greedy.
    pub temperature: f32,
    /// Sample among the k most likely tokens only (0: off).
    pub top_k: usize,
    /// Nucleus sampling: the smallest set of tokens holding this much probability (1: off).
    pub top_p: f32,
    /// Drop tokens less likely than this share of the most likely one's probability (0: off).
    pub min_p: f32,
    /// Tokens per assistant turn.
    pub max_new_tokens: usize,
    /// Texts that end an assistant turn (EOS ids always do).
    pub stop: Vec<String>,
}

impl Default for SamplingSection {
    fn default() -> Self {
        SamplingSection {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            max_new_tokens: 512,
            stop: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutSection {
    /// Trajectories per prompt (G).
    pub group_size: usize,
    /// Prompts per rollout batch.
    pub prompts_per_step: usize,
    /// The trigger plugin (a name from `[plugins]`), and its configuration.
    #[schemars(example = &"calculator")]
    pub trigger: Option<String>,
    /// The trigger plugin's configuration, any TOML table; it reaches the plugin as JSON.
    pub trigger_config: serde_json::Value,
    /// The environment plugin, and its configuration.
    #[schemars(example = &"guess_number")]
    pub environment: Option<String>,
    /// The environment plugin's configuration, any TOML table.
    pub environment_config: serde_json::Value,
    /// Tools plugins (names from `[plugins]`): their functions go into the chat template's
    /// `tools`, and the calls the model writes in its own format run in them; the results
    /// come back as `tool` messages.
    #[schemars(example = &["units"])]
    pub tools: Vec<String>,
    /// Each tools plugin's configuration, by name, e.g. `{ units = { digits = 6 } }`; a
    /// plugin not named gets `{}`.
    pub tools_config: serde_json::Map<String, serde_json::Value>,
    /// How the model writes function calls: `auto` (the format the chat template's markup
    /// shows), `hermes`, `llama3_json` or `qwen3_coder`.
    pub tool_call_format: crate::rollout::env::tools::FormatSetting,
    /// Assistant turns per trajectory; the environment or the model usually ends sooner.
    pub max_turns: u32,
    /// Tool calls per trajectory (trigger firings, function calls, environment answers);
    /// a trajectory that would go beyond it stops (`stop = max_tool_calls`).
    pub max_tool_calls: u32,
    /// Tokens one tool answer may add; a longer one is cut and ends with
    /// `truncation_marker`.
    pub max_tool_output_tokens: usize,
    /// Prompt and completion tokens together; a trajectory that reaches it stops
    /// (`stop = total_tokens`, truncated).
    pub max_total_tokens: usize,
    /// Appended where a tool's answer was cut to `max_tool_output_tokens`.
    pub truncation_marker: String,
    /// Weight of the environment's summed step rewards (component `env`).
    pub env_reward_weight: f64,
    /// How many adapter versions rollouts may run ahead of the trainer (0: on-policy).
    pub max_staleness: u64,
    /// Finished batches that may wait for the trainer.
    pub queue_capacity: usize,
    /// Extra chat template variables, e.g. `{ enable_thinking = false }`.
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Scorer instances per reward plugin (trajectories are scored in parallel).
    pub reward_instances: usize,
    /// What samples the trajectories: the model in this process, or vLLM servers.
    pub engine: EngineKind,
    /// The vLLM servers, with `engine = "vllm"`.
    pub vllm: VllmSection,
    /// An OpenEnv server as the environment, in place of `environment`.
    pub openenv: Option<openenv::OpenEnvSection>,
    /// Groups sampled as trees: trajectories branch at tool results, each branch with a
    /// fork of its parent's plugin sessions; `group_size` bounds the leaves.
    pub tree: Option<TreeSection>,
}

/// `[rollout.tree]`: each prompt's group grown as a tree (`rollout/tree.rs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TreeSection {
    /// Trajectories each prompt starts with; they branch into the rest of the group.
    pub chains: usize,
    /// Where a trajectory branches: `result` (after each tool output or environment
    /// answer), `turn` (only where a new assistant turn starts) or `entropy` (after an
    /// answer whose next `entropy_window` sampled tokens have a mean surprisal of at least
    /// `entropy_threshold`: ARPO's rule).
    pub branch_at: crate::rollout::tree::BranchAt,
    /// With `branch_at = "entropy"`: tokens sampled after an answer before the rule
    /// decides; at most `sampling.max_new_tokens` (they must fit the turn).
    pub entropy_window: usize,
    /// With `branch_at = "entropy"`: the mean −log p (nats) over the window at which a
    /// trajectory branches; 0 always branches, as `result` does.
    pub entropy_threshold: f64,
    /// Children at each branch point: the trajectory that branches and `branch_factor −
    /// 1` forks of it.
    pub branch_factor: usize,
    /// Branch points on one path; the group has at most `chains · branch_factor ^
    /// max_depth` leaves, which must fit `rollout.group_size`.
    pub max_depth: usize,
    /// The advantages over each tree: `treerl` (TreeRL's global plus local, per segment),
    /// `leaf_grpo` (GRPO over each tree's leaves) or `tree_grpo` (Tree-GRPO's intra plus
    /// inter tree).
    pub advantage: crate::rollout::tree::TreeAdvantage,
    /// A segment several trajectories share: trained in each (`per_path`) or once
    /// (`once`), with the segment's advantage.
    pub shared_prefix: crate::rollout::tree::SharedPrefix,
}

impl Default for TreeSection {
    fn default() -> Self {
        TreeSection {
            chains: 2,
            branch_at: crate::rollout::tree::BranchAt::Result,
            branch_factor: 2,
            max_depth: 2,
            entropy_window: 8,
            entropy_threshold: 1.0,
            advantage: crate::rollout::tree::TreeAdvantage::Treerl,
            shared_prefix: crate::rollout::tree::SharedPrefix::PerPath,
        }
    }
}

impl TreeSection {
    /// The engine's settings, once the section is checked against `group_size`: one
    /// line naming the key when it cannot work.
    pub fn settings(
        &self,
        group_size: usize,
        max_new_tokens: usize,
    ) -> std::result::Result<TreeSettings, String> {
        if self.chains == 0 {
            return Err(
                "rollout.tree.chains = 0: each prompt needs at least one trajectory to branch from"
                    .into(),
            );
        }
        if self.branch_factor < 2 {
            return Err(format!(
                "rollout.tree.branch_factor = {}: a branch point splits a trajectory into at least 2 (itself and one fork)",
                self.branch_factor
            ));
        }
        if self.max_depth == 0 {
            return Err("rollout.tree.max_depth = 0: no trajectory could branch; remove [rollout.tree] for flat groups".into());
        }
        if self.branch_at == crate::rollout::tree::BranchAt::Entropy {
            if self.entropy_window == 0 || self.entropy_window > max_new_tokens {
                return Err(format!(
                    "rollout.tree.entropy_window = {}: the rule reads that many tokens of one turn, so it must be 1 to sampling.max_new_tokens ({max_new_tokens})",
                    self.entropy_window
                ));
            }
            if !(self.entropy_threshold.is_finite() && self.entropy_threshold >= 0.0) {
                return Err(format!(
                    "rollout.tree.entropy_threshold = {}: a mean surprisal in nats, a finite number ≥ 0",
                    self.entropy_threshold
                ));
            }
        }
        let settings = TreeSettings {
            chains: self.chains,
            branch_at: self.branch_at,
            branch_factor: self.branch_factor,
            max_depth: self.max_depth,
            entropy_window: self.entropy_window,
            entropy_threshold: self.entropy_threshold,
        };
        let leaves = settings.max_leaves();
        if leaves > group_size {
            return Err(format!(
                "rollout.tree: {} chains × branch_factor {} ^ max_depth {} = {leaves} leaves do not fit rollout.group_size = {group_size}; raise group_size to {leaves} or lower chains, branch_factor or max_depth",
                self.chains, self.branch_factor, self.max_depth
            ));
        }
        Ok(settings)
    }
}

/// `rollout.engine`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// candle, in this process, KV caches shared across a group.
    #[default]
    Local,
    /// vLLM servers, token-in/token-out (`[rollout.vllm]`).
    Vllm,
}

/// `[rollout.vllm]`: the servers that sample when `rollout.engine = "vllm"`.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct VllmSection {
    /// Base URLs, e.g. `["http://127.0.0.1:8000"]`.
    pub servers: Vec<String>,
    /// The served base model's name (vLLM's `--served-model-name`).
    pub model: String,
    /// Where rlhost writes each adapter version for the servers to load (relative to the
    /// config's folder); default: `adapters/` in the run directory.
    #[schemars(example = &"/shared/adapters")]
    pub adapter_dir: Option<PathBuf>,
    /// That folder as the servers see it, when they run elsewhere (a shared mount).
    #[schemars(example = &"/mnt/adapters")]
    pub server_adapter_dir: Option<String>,
    /// Seconds one request may take before its server is taken for dead.
    pub timeout_s: f64,
    /// Requests in flight per server.
    pub max_in_flight: usize,
}

impl Default for VllmSection {
    fn default() -> Self {
        VllmSection {
            servers: Vec::new(),
            model: "rlhost-base".into(),
            adapter_dir: None,
            server_adapter_dir: None,
            timeout_s: 120.0,
            max_in_flight: 64,
        }
    }
}

impl Default for RolloutSection {
    fn default() -> Self {
        let l = crate::rollout::RolloutLimits::default();
        RolloutSection {
            group_size: 8,
            prompts_per_step: 8,
            trigger: None,
            trigger_config: empty_object(),
            environment: None,
            environment_config: empty_object(),
            tools: Vec::new(),
            tools_config: Default::default(),
            tool_call_format: Default::default(),
            max_turns: l.max_turns,
            max_tool_calls: l.max_tool_calls,
            max_tool_output_tokens: l.max_tool_output_tokens,
            max_total_tokens: l.max_total_tokens,
            truncation_marker: l.truncation_marker,
            env_reward_weight: 1.0,
            max_staleness: 0,
            queue_capacity: 2,
            template_kwargs: Default::default(),
            reward_instances: 2,
            engine: EngineKind::Local,
            vllm: VllmSection::default(),
            openenv: None,
            tree: None,
        }
    }
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(Default::default())
}

/// `[plugins.NAME]`: a component file and its sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PluginSection {
    /// The component file (`.wasm`), relative to the config file's folder.
    pub path: PathBuf,
    /// Linear memory per instance, in MiB (default 256).
    #[schemars(example = 512)]
    pub memory_mib: Option<u64>,
    /// Wall-clock deadline per call, in milliseconds (default 5000).
    #[schemars(example = 2000)]
    pub timeout_ms: Option<u64>,
    /// Wasm instructions (roughly) per call, for a budget that does not depend on machine
    /// speed; unset: no fuel metering (it slows every call by ~30%).
    #[schemars(example = 1_000_000_000u64)]
    pub fuel: Option<u64>,
    /// Most bytes one call may return, strings and lists summed (default 1 MiB).
    #[schemars(example = 65536)]
    pub max_output_bytes: Option<usize>,
    /// Most bytes of stdout, stderr and log lines kept per call, each (default 64 KiB).
    #[schemars(example = 16384)]
    pub max_log_bytes: Option<usize>,
    /// Host directories mounted read-only: `"HOST_DIR"` (at `/data`) or
    /// `"HOST_DIR:GUEST_PATH"`.
    #[serde(default)]
    pub grant_dirs: Vec<String>,
    /// Outbound HTTP the plugin may make (`wasi:http`), in Spin's `allowed_outbound_hosts`
    /// shape: `scheme://host[:port]`, the scheme `http`, `https` or `*`, the host a name,
    /// `*.suffix`, an IP address or `*`, the port a number, `lo..hi` or `*` (omitted: the
    /// scheme's); no paths. Loopback and private addresses are reached only through an
    /// entry naming them (the address, or `localhost`). None: every request refused.
    #[serde(default)]
    #[schemars(example = vec!["https://api.example.com", "http://127.0.0.1:8080"])]
    pub allow_http: Vec<String>,
    /// Cap on each HTTP request body and each response body, in bytes (default 1 MiB).
    #[schemars(example = 4_194_304u64)]
    pub max_http_bytes: Option<u64>,
    /// HTTP requests in flight at once, the plugin's instances together (default 4).
    #[schemars(example = 8)]
    pub max_http_in_flight: Option<usize>,
    /// `model.generate`: the plugin may ask the run's model (a judge, a simulated user),
    /// within these limits; the keys left out take their defaults. None: every call
    /// refused.
    pub generate: Option<crate::plugin::model::GenerateGrant>,
}

impl PluginSection {
    pub fn limits(&self) -> Limits {
        let d = Limits::default();
        Limits {
            memory_mib: self.memory_mib.unwrap_or(d.memory_mib),
            timeout_ms: self.timeout_ms.unwrap_or(d.timeout_ms),
            fuel: self.fuel,
            max_output_bytes: self.max_output_bytes.unwrap_or(d.max_output_bytes),
            max_log_bytes: self.max_log_bytes.unwrap_or(d.max_log_bytes),
        }
    }

    /// The HTTP part of the plugin's grants (directories are resolved by the caller).
    pub fn http_grants(&self) -> Grants {
        Grants::http(
            &self.allow_http,
            self.max_http_bytes,
            self.max_http_in_flight,
        )
    }
}

/// `[[rewards]]`: one reward, a plugin or a reward model, and how its components count.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RewardSection {
    /// The reward plugin, by its name in `[plugins]` (or a built-in plugin's name). Set
    /// this or `model`.
    #[serde(default)]
    #[schemars(example = &"math_answer")]
    pub plugin: Option<String>,
    /// A reward model `rlhost rm` trained on the run's base model (its output folder, or
    /// any folder holding its adapter and score head), relative to the config's folder. It
    /// scores each finished trajectory, its tokens as sampled, in batches on the run's
    /// device, as the component `rm`. Set this or `plugin`.
    #[serde(default)]
    #[schemars(example = &"runs/rm")]
    pub model: Option<String>,
    /// The plugin's configuration, any TOML table; it reaches the plugin as JSON.
    #[serde(default = "empty_object")]
    pub config: serde_json::Value,
    /// Weight per component; components not listed get `default_weight`.
    #[serde(default)]
    pub weights: BTreeMap<String, f64>,
    /// The weight of every component `weights` does not list.
    #[serde(default = "one")]
    pub default_weight: f64,
    /// This plugin's contribution to the total when it faults.
    #[serde(default)]
    pub fallback: f64,
    /// Score case by case: the sample's metadata key holding a list of cases (e.g.
    /// `"tests"`). Each case runs in a fresh instance under the plugin's limits, so one
    /// that loops or exhausts memory fails alone; components are averaged over the cases
    /// (`all_…` ones take the minimum). Unset: one call scores the whole trajectory.
    #[serde(default)]
    #[schemars(example = &"tests")]
    pub cases: Option<String>,
}

fn one() -> f64 {
    1.0
}

impl RewardSection {
    /// A plugin that `[plugins]` names, or a model folder, and what goes with each.
    pub(super) fn check(&self, plugins: &BTreeMap<String, PluginSection>) -> Result<()> {
        match (&self.plugin, &self.model) {
            (Some(_), Some(_)) => {
                bail!(
                    "plugin and model are both set: a [[rewards]] entry is one or the other; give each its own entry"
                )
            }
            (None, None) => bail!(
                "plugin or model: a [[rewards]] entry names a reward plugin (plugin = \"NAME\") or a reward model `rlhost rm` trained (model = \"runs/rm\")"
            ),
            (Some(name), None) if !plugins.contains_key(name) => bail!(
                "plugin = \"{name}\" names no plugin; add a [plugins.{name}] section with its `path`{}",
                known(plugins)
            ),
            (Some(_), None) => Ok(()),
            (None, Some(path)) => {
                if path.is_empty() {
                    bail!("model is empty: give the folder `rlhost rm` wrote");
                }
                let plugin_only = [
                    (
                        "config",
                        self.config.as_object().is_none_or(|o| !o.is_empty()),
                    ),
                    ("cases", self.cases.is_some()),
                    ("fallback", self.fallback != 0.0),
                ];
                if let Some((key, _)) = plugin_only.iter().find(|(_, set)| *set) {
                    bail!(
                        "{key} is for reward plugins; a reward model (model = \"{path}\") takes weights and default_weight"
                    );
                }
                if let Some(name) = self.weights.keys().find(|k| k.as_str() != "rm") {
                    bail!(
                        "weights.{name}: a reward model has one component, `rm` (weights = {{ rm = 1.0 }})"
                    );
                }
                Ok(())
            }
        }
    }
}

/// The configured plugins' names, for a message about a name that is not one of them.
pub(super) fn known(plugins: &BTreeMap<String, PluginSection>) -> String {
    if plugins.is_empty() {
        String::new()
    } else {
        format!(
            " (configured: {})",
            plugins.keys().cloned().collect::<Vec<_>>().join(", ")
        )
    }
}
