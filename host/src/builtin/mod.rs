//! rlhost's self-made models, for runs with nothing downloaded: `model.path =
//! "builtin:multiply"` (the calculator demo) and `"builtin:code"` (the Python code tool's
//! task). [`crate::config::builtin`] holds the built-in runs that use them.
//!
//! Built once per (recipe, dataset, seed) and cached as an ordinary Hugging Face model
//! directory under the cache folder:
//! 1. a byte-level BPE tokenizer (digits split one by one, so that numbers can be copied
//!    digit by digit) trained with the `tokenizers` crate on the task's conversations;
//! 2. a small Qwen2-architecture model with seeded random weights;
//! 3. a supervised warm start on synthetic traces from the run's own training samples
//!    ([`traces`]): some write the task's reference call for the run's tool (the real
//!    trigger plugin writes the tool output) and copy its result, the rest skip the tool
//!    and guess. The warm start knows no tool's syntax, and is imperfect on purpose — the
//!    model calls the tool only sometimes — so that RL has room to teach it that the tool
//!    is what makes answers right.
//! 4. with the recipe's [`Bar`], a probe on unseen problems: a model that does not write its
//!    calls and copy the tool's output well enough trains another round, or starts again
//!    from other random weights; one that never does is refused, never handed to RL.
//!
//! The warm start trains a full-rank LoRA on the frozen random base and merges it in, so
//! the directory is a plain model that RL then adapts with a fresh adapter.

mod traces;

use crate::data::{Cursor, Dataset};
use crate::model::chat::ChatTemplate;
use crate::model::{LanguageModel, LoraConfig, Mode, Placement, peft};
use crate::rl::sft::{SftRow, SftSchedule, train};
use crate::rng::SplitMix64;
use crate::rollout::ToolSpec;
use crate::rollout::env::tools::{Catalogue, FormatSetting, Toolbox};
use crate::rollout::turns::TurnFormat;
use crate::sampler::draw::SamplingParams;
use crate::sampler::generate;
use anyhow::{Context, Result, bail};
use candle_core::{DType, Device, Tensor};
use serde_json::json;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tokio::runtime::Handle;
use traces::Trace;
pub use traces::{answered_style, calls_functions};

pub const SCHEME: &str = "builtin:";

/// ChatML with no default system prompt (every token costs on a tiny model), and functions
/// in the Hermes format of Qwen2.5's template: a `<tools>` block in the system turn, calls
/// as `<tool_call>{"name": …, "arguments": …}</tool_call>`, results as `<tool_response>`
/// blocks in a user turn. Where Qwen2.5 writes each function's JSON schema and four lines
/// of instructions, this one writes its signature (`convert(value, from, to)`) and one
/// line: the units functions' schemas took ~450 of a prompt's ~540 tokens, and a 2-layer
/// model that saw them wrote none of 100 unseen calls exactly after its warm start. Without functions it renders each message as
/// `<|im_start|>ROLE\nCONTENT<|im_end|>\n`, as the first built-in models' template did.
const CHAT_TEMPLATE: &str = concat!(
    "{%- set ns = namespace(skip=false) %}",
    "{%- if tools %}{{- '<|im_start|>system\\n' }}",
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- set ns.skip = true %}{%- endif %}",
    "{{- '# Tools\\n<tools>' }}",
    "{%- for tool in tools %}{%- set f = tool.function if tool.function is defined else tool %}",
    "{{- '\\n' + f.name + '(' + (f.parameters.properties.keys() | join(', ')) + ')' }}{%- endfor %}",
    "{{- '\\n</tools>\\nCall a function as <tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}",
    "{%- endif %}",
    "{%- for message in messages %}",
    "{%- if loop.first and ns.skip %}",
    "{%- elif message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant' }}",
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}",
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}",
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}",
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}",
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}",
    "{%- elif message.role == 'tool' %}",
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}",
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}",
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}",
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
    "{%- endif %}{%- endfor %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
);

/// How a built-in model is made.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Recipe {
    pub name: &'static str,
    /// Bumped whenever the recipe changes, so that old caches are not reused.
    pub version: u32,
    pub vocab_size: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate: usize,
    /// Warm-start conversations, and the share of them that use the tool.
    pub sft_examples: usize,
    pub tool_share: f64,
    /// Copy drills added to the warm start's conversations (see [`traces::drills`]). Left
    /// out of the cache key when 0, so that recipes without them keep their models.
    #[serde(skip_serializing_if = "is_zero")]
    pub copy_drills: usize,
    /// Whether the digits of the guesses (the traces that skip the tool) are left out of
    /// the loss, their form (`<answer>`, units, separators) still trained. Left out of the
    /// cache key when false.
    #[serde(skip_serializing_if = "is_false")]
    pub untrained_guess_digits: bool,
    pub sft_epochs: usize,
    pub sft_lr: f64,
    pub sft_batch: usize,
    /// What the warm-started model must do on unseen problems before RL gets it (trained
    /// further until it does, refused if it never does); `None`: one pass of `sft_epochs`,
    /// whatever it reaches (the tests' small recipes).
    pub bar: Option<Bar>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// A warm start's bar, on the probe's unseen problems, greedy: the share of reference
/// calls written exactly (once the model has chosen to call) and of tool outputs copied
/// into the answer.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Bar {
    pub calls: f64,
    pub copies: f64,
    /// Rounds of `sft_epochs` one set of random weights may take to reach it; a round
    /// after which neither rate rose by 5 points ends them sooner.
    pub max_rounds: usize,
    /// Sets of random weights tried (each from a seed derived from the run's).
    pub max_inits: usize,
}

/// What a warm-started model must do before RL gets it. Measured on the multiply task over
/// run seeds 1-10 (issue 63), a model's outcome under GRPO followed these two rates: every
/// seed whose warm start wrote ≥ 88 of 100 calls and copied ≥ 77 outputs went from ~0% to
/// 75-90% held-out accuracy in 40 steps, and every one below (calls 0-65) ended at 0-34%:
/// its calls asked the calculator the wrong product, so no answer was right and the
/// reward's only signal was the format. RL cannot teach copying from a reward that never
/// comes. Copies are asked of 75%, not more: many sets of weights stall at 71-78 whatever
/// the rounds, copying 4-digit products a digit off (`7656` as `7765`: they learnt to
/// copy by position from the 5-digit products, ~82% of the task), and RL took such models
/// (75-77 copies) from 0% to 70-82%. With this bar, seeds 1-10 all went from 0-1% to
/// 70-90% (`bench/seed_sweep.py`, the book's benchmarks).
pub const BAR: Bar = Bar {
    calls: 0.9,
    copies: 0.75,
    max_rounds: 4,
    max_inits: 4,
};

pub const MULTIPLY: Recipe = Recipe {
    name: "multiply",
    version: 3,
    vocab_size: 384,
    hidden: 128,
    layers: 4,
    heads: 4,
    kv_heads: 2,
    intermediate: 384,
    sft_examples: 2000,
    tool_share: 0.4,
    copy_drills: 0,
    untrained_guess_digits: false,
    sft_epochs: 3,
    sft_lr: 3e-3,
    sft_batch: 32,
    bar: Some(BAR),
};

/// The code task's bar (issue 63). Its calls and copies were measured under GRPO over run
/// seeds 1-5 and 7 (calls written exactly / outputs copied of 100, then held-out accuracy
/// after 60 steps): 83-90 / 100 went from 0-3% to 85-86%, and every model below 80 copies
/// (6-67 / 18-50) ended at 0-17%. Its copies fail after the first digit (`532` answered
/// `566`, `747` as `775`: the copying circuit did not form), and whether it forms depends
/// on the random weights more than on the data: seed 3's four sets of weights, all on the
/// same conversations, copied 34, 30, 39, then 100. One round a set of weights: the
/// copies jump in or stay out, and more rounds of a set that stayed out did not bring
/// them (seed 2's three sets of weights, two rounds each, 32-38). With copy drills, a set
/// passed on 6 of the 16 tries measured (seeds 1 and 2 at their first, seeds 5 and 7 at
/// their second, seeds 3 and 4 at their fourth; seed 6's first two failed): twelve sets
/// leave a seed about one chance in 280 of failing every one (eight, one in 40).
pub const CODE_BAR: Bar = Bar {
    calls: 0.75,
    copies: 0.8,
    max_rounds: 1,
    max_inits: 12,
};

/// The Python code tool's task: longer prompts (seven problem families) and calls of a few
/// lines, so a larger vocabulary and more warm-start conversations. What limits it is
/// copying: the problem's numbers into the call and the tool's output into the answer,
/// digit for digit. Measured on 100 unseen problems (seed 7, all seven families), calls
/// written exactly / outputs copied: 4 layers and 4000 conversations (625 steps) 17 / —;
/// 4 layers and 8000 (1250 steps, 9 min) 53 / ~35% sampled; **2 layers and 16000 (2500
/// steps, 9 min) 90 / 100**: two layers are enough for the copying heads and learn them
/// far sooner (loss 0.47 vs 0.95 at step 275), at half the cost per step. A batch of 16
/// learnt no copying at all, nor did a learning rate of 6e-3 by step 300.
pub const CODE: Recipe = Recipe {
    name: "code",
    version: 5,
    vocab_size: 512,
    hidden: 128,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    intermediate: 384,
    sft_examples: 16000,
    tool_share: 0.4,
    copy_drills: 4000,
    untrained_guess_digits: true,
    sft_epochs: 5,
    sft_lr: 3e-3,
    sft_batch: 32,
    // Copy drills (issue 63, `traces::drills`: 2000 answer and 2000 call drills). Without
    // them, and without a bar, 2 of 6 seeds learnt (1-5 and 7: seed 4 83 / 100 then 86%,
    // seed 7 90 / 100 then 85%; the others 6-67 / 18-50 then 0-17%). Drills alone: seed 1
    // 91 / 100 then 4% -> 93%, seed 2 77 / 100 then 3% -> 83%, but seed 3 67 / 34 then
    // 0% -> 17% and seed 7 54 / 20 then 3% -> 11%. Drills with the bar: seed 7's second
    // weights 90 / 100 then 9% -> 85%, seed 3's fourth 81 / 100 then 1% -> 87%, seed 5's
    // second 87 / 100 then 1% -> 86%. Since v5 the guesses' digits are untrained (as the
    // units recipe's): seed 6, whose first two sets of weights had failed the bar (62 / 81,
    // 60 / 30), passed on its first at 83 / 100, then 2% -> 84%;
    // seed 3, which had needed four, at 82 / 100, then 3% -> 87%.
    bar: Some(CODE_BAR),
};

/// The units task's bar (issue 63). Its copies fail on repeated digits and fractions'
/// denominators (`655.32` copied as `6555.3`, `43/11` as `43/14`), and they rise through
/// the round rather than jump in as the code task's do (seed 4: 32 copies at step 500,
/// 52 at 1,250, 67 at 2,000, 79 at the end); RL took that model (98 calls, 79 copies)
/// from 1% to 70%, where the models below it measured (27-34 copies) learnt 0-5 points.
pub const UNITS_BAR: Bar = Bar {
    calls: 0.75,
    copies: 0.75,
    max_rounds: 1,
    max_inits: 12,
};

/// The `units` functions' task (conversions, dates, fractions, called in the Hermes
/// format): the calls copy the problem's numbers, units and dates, as the code task's do.
/// Measured (seed 7), unseen calls written exactly after the warm start: with the
/// functions' JSON schemas in every prompt (536–655 tokens), 0 of 100; with tokenizer
/// merges across words taking the schemas in (54 tokens, but the units and operators the
/// prompt and the call share became different tokens), 35 (12,000 conversations, 3
/// epochs) and 7 (24,000, 5 epochs); **with signatures in the template (100 tokens) and
/// the code task's 16,000 conversations × 5 epochs, 100 of 100, and 91 outputs copied**
/// (warm start 375 s on 2 cores).
pub const UNITS: Recipe = Recipe {
    name: "units",
    version: 6,
    vocab_size: 512,
    hidden: 128,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    intermediate: 384,
    sft_examples: 16000,
    tool_share: 0.4,
    copy_drills: 4000,
    untrained_guess_digits: true,
    sft_epochs: 5,
    sft_lr: 3e-3,
    sft_batch: 32,
    // Drills, untrained guess digits and a bar (issue 63). Without them, swept over seeds
    // 1-7, the outcome followed the probe as the code task's did: seeds 4 and 5 (68 / 34
    // and 31 / 27) learnt 0-5 points, seeds 3, 6 and 7 (73 / 95, 35 / 99, 100 / 91) 53,
    // 36 and 94. Seed 4's first weights with drills alone: 63 / 67; with drills and the
    // guesses' digits untrained: 98 / 79, then 1% -> 70%. With all three, on their first
    // weights: seed 5 100 / 99, then 7% -> 99%; seed 6 100 / 96, then 0% -> 98%.
    bar: Some(UNITS_BAR),
};

/// The recipe a `builtin:NAME` path names, if it is one.
pub fn recipe(path: &Path) -> Result<Option<&'static Recipe>> {
    let Some(name) = path.to_str().and_then(|p| p.strip_prefix(SCHEME)) else {
        return Ok(None);
    };
    match name {
        "multiply" => Ok(Some(&MULTIPLY)),
        "code" => Ok(Some(&CODE)),
        "units" => Ok(Some(&UNITS)),
        other => {
            bail!(
                "unknown built-in model `{SCHEME}{other}`; built-in models: {SCHEME}multiply, {SCHEME}code, {SCHEME}units"
            )
        }
    }
}

/// What a built-in model is warm-started on: the task's first training samples, with the
/// run's tool writing the tool output.
pub struct Inputs<'a> {
    pub dataset: &'a Dataset,
    /// The task's name for messages (its dataset plugin or file).
    pub task: &'a str,
    pub trigger: Option<&'a ToolSpec>,
    /// The run's functions (`rollout.tools`), when its tool is those instead of a trigger.
    pub tools: Option<&'a Catalogue>,
    pub seed: u64,
}

/// The built model's directory under `cache_dir/models`, building it first if the cache
/// has none.
pub fn ensure(
    recipe: &Recipe,
    inputs: &Inputs,
    handle: &Handle,
    cache_dir: &Path,
    quiet: bool,
) -> Result<PathBuf> {
    let seed = inputs.seed;
    if inputs.trigger.is_none() && inputs.tools.is_none() {
        bail!(
            "{SCHEME}{} is warm-started on tool-use traces: set rollout.trigger or rollout.tools (or pass --plugin TOOL.wasm); a run against an OpenEnv server takes a model folder (one a run with rollout.tools built: it prints where)",
            recipe.name
        );
    }
    // With functions, traces render them with the built-in template and answer calls
    // through the real tools, as rollouts will.
    let chat = ChatTemplate::from_str(CHAT_TEMPLATE, None, Some(traces::END_OF_TURN))?;
    let toolbox = match inputs.tools {
        Some(catalogue) => Some(Toolbox::new(
            catalogue.clone(),
            FormatSetting::Hermes,
            &chat,
        )?),
        None => None,
    };
    let turns = match &toolbox {
        Some(t) => Some(TurnFormat::new(
            &chat,
            Default::default(),
            Some(t.template_tools.clone()),
        )?),
        None => None,
    };
    let tool = match (&toolbox, &turns, inputs.trigger) {
        (Some(toolbox), Some(turns), _) => traces::Tool::Functions(toolbox, &chat, turns),
        (_, _, Some(trigger)) => traces::Tool::Trigger(trigger),
        _ => unreachable!("a trigger or functions"),
    };
    // The probe decides whether the warm start is done ([`warm_start`]); without a bar it
    // only informs the person watching, and a quiet build skips it.
    let probe_examples = if recipe.bar.is_none() && quiet {
        0
    } else {
        PROBE_EXAMPLES
    };
    let mut samples = handle.block_on(
        inputs
            .dataset
            .next_batch(&mut Cursor::default(), recipe.sft_examples + probe_examples),
    )?;
    let probe_samples = samples.split_off(recipe.sft_examples.min(samples.len()));
    let mut key = Sha256::new();
    key.update(serde_json::to_vec(recipe)?);
    key.update(seed.to_le_bytes());
    match &tool {
        traces::Tool::Trigger(trigger) => key.update(trigger.plugin.sha256().as_bytes()),
        traces::Tool::Functions(toolbox, _, _) => {
            for p in &toolbox.plugins {
                key.update(p.plugin.sha256().as_bytes());
            }
        }
    }
    for (id, s) in samples.iter().take(16) {
        key.update(id.to_le_bytes());
        key.update(serde_json::to_vec(s)?);
    }
    let key = hex::encode(&key.finalize()[..6]);
    let root = cache_dir.join("models");
    let dir = root.join(format!("{}-v{}-{key}", recipe.name, recipe.version));
    if dir.join("model.safetensors").is_file() {
        // Where it is, for serving it elsewhere (a vLLM server started on this folder).
        if !quiet {
            eprintln!("built-in model {SCHEME}{}: {}", recipe.name, dir.display());
        }
        return Ok(dir);
    }
    if !quiet {
        eprintln!(
            "building the built-in model {SCHEME}{} into {} (once)",
            recipe.name,
            dir.display()
        );
    }
    let tmp = root.join(format!(".tmp-{}-{key}-{}", recipe.name, std::process::id()));
    let base = tmp.join("base");
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    let source = traces::Source {
        task: inputs.task,
        tool,
    };
    let mut traces = traces::write(&source, &samples, recipe.tool_share, seed, handle)?;
    let drills = traces::drills(&traces, recipe.copy_drills, seed);
    traces.extend(drills);
    let probe = if probe_samples.is_empty() {
        Vec::new()
    } else {
        traces::write(&source, &probe_samples, 1.0, seed, handle)?
    };
    write_tokenizer(recipe, &traces, &base)?;
    write_model(recipe, &base, seed)?;
    let merged = tmp.join("model");
    warm_start(recipe, &base, &merged, &traces, &probe, seed, quiet)?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::rename(&merged, &dir)
        .with_context(|| format!("moving the model to {}", dir.display()))?;
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(dir)
}

fn render(trace: &Trace) -> String {
    let mut text = trace.prompt.clone();
    text.push_str(&trace.before);
    text.push_str(trace.tool.as_deref().unwrap_or(""));
    text.push_str(&trace.after);
    text.push_str("<|im_end|>\n");
    text
}

fn write_tokenizer(recipe: &Recipe, traces: &[Trace], dir: &Path) -> Result<()> {
    use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::digits::Digits;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::{AddedToken, PreTokenizerWrapper, TokenizerBuilder};
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(recipe.vocab_size)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(
            specials
                .iter()
                .map(|s| AddedToken::from(s.to_string(), true))
                .collect(),
        )
        .build();
    let pre = Sequence::new(vec![
        PreTokenizerWrapper::Digits(Digits::new(true)),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
    ]);
    let mut tokenizer = TokenizerBuilder::<
        BPE,
        tokenizers::NormalizerWrapper,
        Sequence,
        tokenizers::PostProcessorWrapper,
        ByteLevel,
    >::new()
    .with_model(BPE::default())
    .with_pre_tokenizer(Some(pre))
    .with_decoder(Some(ByteLevel::default()))
    .build()
    .map_err(|e| anyhow::anyhow!("building the tokenizer: {e}"))?;
    // Special tokens are matched before the BPE sees the text: keep them out of its merges.
    let corpus: Vec<String> = traces
        .iter()
        .map(|t| {
            render(t)
                .replace("<|im_start|>", "\n")
                .replace("<|im_end|>", "\n")
        })
        .collect();
    tokenizer
        .train(&mut trainer, corpus.iter())
        .map_err(|e| anyhow::anyhow!("training the tokenizer: {e}"))?;
    let mut tokenizer: tokenizers::Tokenizer = tokenizer.into();
    tokenizer.add_special_tokens(
        &specials
            .iter()
            .map(|s| AddedToken::from(s.to_string(), true))
            .collect::<Vec<_>>(),
    );
    tokenizer
        .save(dir.join("tokenizer.json"), false)
        .map_err(|e| anyhow::anyhow!("saving the tokenizer: {e}"))?;
    let id = |t: &str| tokenizer.token_to_id(t).context("special token missing");
    let (eot, im_end) = (id("<|endoftext|>")?, id("<|im_end|>")?);
    let write = |name: &str, v: serde_json::Value| -> Result<()> {
        peft::write_atomic(
            &dir.join(name),
            serde_json::to_string_pretty(&v)?.as_bytes(),
        )
    };
    write(
        "tokenizer_config.json",
        json!({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 1024, "tokenizer_class": "PreTrainedTokenizerFast"}),
    )?;
    write(
        "generation_config.json",
        json!({"eos_token_id": [im_end, eot], "pad_token_id": eot}),
    )?;
    peft::write_atomic(&dir.join("chat_template.jinja"), CHAT_TEMPLATE.as_bytes())
}

fn write_model(recipe: &Recipe, dir: &Path, seed: u64) -> Result<()> {
    let tok = crate::model::tokenizer::Tokenizer::from_dir(dir)?;
    // Room for the whole tokenizer, rounded up to a multiple of 64 as HF models do.
    let vocab = tok.vocab_size().div_ceil(64) * 64;
    let (h, d) = (recipe.hidden, recipe.hidden / recipe.heads);
    let config = json!({
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": h,
        "intermediate_size": recipe.intermediate,
        "num_hidden_layers": recipe.layers,
        "num_attention_heads": recipe.heads,
        "num_key_value_heads": recipe.kv_heads,
        "head_dim": d,
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": false,
        "vocab_size": vocab,
        "use_sliding_window": false,
        "sliding_window": null,
        "torch_dtype": "float32",
        "eos_token_id": tok.token_to_id("<|im_end|>"),
    });
    peft::write_atomic(
        &dir.join("config.json"),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;
    let mut rng = SplitMix64::from_state(seed ^ 0x6d6f_64656c);
    let mut normal = |shape: &[usize], std: f32| -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let mut v = Vec::with_capacity(n);
        while v.len() < n {
            // Box–Muller on two draws.
            let mut u = [0f64; 2];
            for x in &mut u {
                *x = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            }
            let r = (-2.0 * u[0].max(1e-300).ln()).sqrt();
            v.push((r * (2.0 * std::f64::consts::PI * u[1]).cos()) as f32 * std);
            v.push((r * (2.0 * std::f64::consts::PI * u[1]).sin()) as f32 * std);
        }
        v.truncate(n);
        Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
    };
    let std = 0.02;
    let (nh, nkv, inter) = (recipe.heads, recipe.kv_heads, recipe.intermediate);
    let mut t: HashMap<String, Tensor> = HashMap::new();
    t.insert(
        "model.embed_tokens.weight".into(),
        normal(&[vocab, h], std)?,
    );
    // The output projection stays frozen (only adapters train), and the final RMSNorm fixes
    // the hidden state's norm at ~sqrt(h): rows of norm ~2 let logits span ~±20, enough
    // for confident predictions (at std 0.02 they would span ±2.5 and the loss could not
    // fall below ~4 nats).
    t.insert(
        "lm_head.weight".into(),
        normal(&[vocab, h], 2.0 / (h as f32).sqrt())?,
    );
    t.insert(
        "model.norm.weight".into(),
        Tensor::ones(h, DType::F32, &Device::Cpu)?,
    );
    for i in 0..recipe.layers {
        let p = format!("model.layers.{i}");
        for (name, shape) in [
            ("self_attn.q_proj", [nh * d, h]),
            ("self_attn.k_proj", [nkv * d, h]),
            ("self_attn.v_proj", [nkv * d, h]),
            ("self_attn.o_proj", [h, nh * d]),
            ("mlp.gate_proj", [inter, h]),
            ("mlp.up_proj", [inter, h]),
            ("mlp.down_proj", [h, inter]),
        ] {
            t.insert(format!("{p}.{name}.weight"), normal(&shape, std)?);
        }
        for (name, n) in [
            ("self_attn.q_proj", nh * d),
            ("self_attn.k_proj", nkv * d),
            ("self_attn.v_proj", nkv * d),
        ] {
            t.insert(
                format!("{p}.{name}.bias"),
                Tensor::zeros(n, DType::F32, &Device::Cpu)?,
            );
        }
        for name in ["input_layernorm", "post_attention_layernorm"] {
            t.insert(
                format!("{p}.{name}.weight"),
                Tensor::ones(h, DType::F32, &Device::Cpu)?,
            );
        }
    }
    candle_core::safetensors::save(&t, dir.join("model.safetensors"))?;
    Ok(())
}

/// Samples after the warm start's own on which the warm-started model is probed.
const PROBE_EXAMPLES: usize = 100;

/// Steps of the warm start between two probes of a round.
const PROBE_EVERY: u64 = 250;

/// SFT of a full-rank adapter on the traces, merged into the base. With a [`Bar`], in
/// rounds of the recipe's epochs until `probe` (tool traces of samples not trained on)
/// shows that the model writes its calls and copies the tool's output as the bar asks; a
/// model whose rates stall below it is made again from other random weights (see
/// [`Bar`]). Every choice is derived from `seed`, so a seed always builds the same model.
fn warm_start(
    recipe: &Recipe,
    base: &Path,
    out: &Path,
    traces: &[Trace],
    probe: &[Trace],
    seed: u64,
    quiet: bool,
) -> Result<()> {
    let tokenizer = crate::model::tokenizer::Tokenizer::from_dir(base)?;
    let eos = tokenizer
        .token_to_id("<|im_end|>")
        .context("the built-in tokenizer has no <|im_end|>")?;
    let mut rows = Vec::with_capacity(traces.len());
    let mut prompt_tokens = 0;
    for t in traces {
        let (row, prompt_len) = sft_row(recipe, &tokenizer, eos, t)?;
        prompt_tokens += prompt_len;
        rows.push(row);
    }
    let lora = LoraConfig {
        r: recipe.hidden,
        alpha: recipe.hidden as f64,
        ..LoraConfig::default()
    };
    let t0 = std::time::Instant::now();
    let (inits, rounds) = recipe
        .bar
        .map_or((1, 1), |b| (b.max_inits.max(1), b.max_rounds.max(1)));
    let mut best = (0, 0, 0);
    for init in 0..inits {
        // The first weights are the seed's own (what a seed built before the bar existed,
        // when it passes); later ones come from seeds derived from it.
        let weights_seed = if init == 0 {
            seed
        } else {
            SplitMix64::from_state(seed ^ 0x7765_6967_6874 ^ init as u64).next_u64()
        };
        if init > 0 {
            write_model(recipe, base, weights_seed)?;
        }
        let mut lm = LanguageModel::open(base, &Placement::CPU)?;
        lm.model.attach_lora(&lora, weights_seed)?;
        let mut first_loss = f32::NAN;
        let mut before: Option<(usize, usize)> = None;
        for round in 0..rounds {
            // Each round is the recipe's schedule again (warm-up, cosine decay) with its
            // own shuffles: a restart.
            let schedule = SftSchedule {
                epochs: recipe.sft_epochs,
                batch_rows: recipe.sft_batch,
                lr: recipe.sft_lr,
                warmup_steps: 10,
                max_grad_norm: 1.0,
                micro_batch_tokens: 8192,
                // The padded layout the built-in models were made and measured with
                // (packing gives the same update to rounding, and rounding moves a short
                // run's outcome).
                pack_sequences: false,
                seed: weights_seed.wrapping_add(round as u64),
            };
            let label = match (inits, rounds) {
                (1, 1) => String::new(),
                _ => format!("weights {} round {}: ", init + 1, round + 1),
            };
            let bar = crate::progress::enabled(quiet).then(|| {
                crate::progress::bar(
                    0,
                    "  warm start {bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
                )
            });
            // The probe every `PROBE_EVERY` steps as well (1-2 s, greedy on 100 problems):
            // what the person watching wants to know is whether calls and copies rise.
            let mut probed_at = String::new();
            let losses = train(&lm.model, &rows, &schedule, |step, total, loss| {
                if step % PROBE_EVERY == 0 && step < total && !probe.is_empty() {
                    let (probed, calls, copies) = copies(&lm, probe)?;
                    probed_at = format!(
                        "  probe at step {step}: calls {calls}, copies {copies} of {probed}"
                    );
                    if bar.is_none() && !quiet {
                        eprintln!(
                            "  warm start: {label}step {step}/{total}: calls {calls}, copies {copies} of {probed}"
                        );
                    }
                }
                match &bar {
                    Some(bar) => {
                        bar.set_length(total);
                        bar.set_position(step);
                        bar.set_message(format!("{label}loss {loss:.4}{probed_at}"));
                    }
                    None if !quiet && (step % 25 == 0 || step == total) => eprintln!(
                        "  warm start: {label}step {step}/{total}  loss {loss:.4}  {:.0} s",
                        t0.elapsed().as_secs_f64()
                    ),
                    None => {}
                }
                Ok(())
            })?;
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
            if round == 0 {
                first_loss = losses.first().copied().unwrap_or(f32::NAN);
            }
            if !quiet {
                eprintln!(
                    "  warm start: {label}{} conversations ({:.0}% with the tool, prompts of {:.0} tokens on average), loss {:.3} -> {:.3} in {:.0} s",
                    rows.len(),
                    100.0 * traces.iter().filter(|t| t.tool.is_some()).count() as f64
                        / traces.len().max(1) as f64,
                    prompt_tokens as f64 / traces.len().max(1) as f64,
                    first_loss,
                    losses.last().copied().unwrap_or(f32::NAN),
                    t0.elapsed().as_secs_f64()
                );
            }
            // A quiet build without a bar has no probe to run (see `ensure`).
            if probe.is_empty() {
                return peft::export_merged(&lm.model, base, out, DType::F32);
            }
            let (probed, calls, copies) = copies(&lm, probe)?;
            if calls + copies > best.1 + best.2 {
                best = (probed, calls, copies);
            }
            // Without a bar the probe only informs the person watching.
            let (passed, stalled) = match recipe.bar {
                Some(bar) => (
                    bar.passes(probed, calls, copies),
                    before.is_some_and(|b| bar.stalled(probed, b, (calls, copies))),
                ),
                None => (true, false),
            };
            before = Some((calls, copies));
            if !quiet {
                let next = recipe.bar.map_or(String::new(), |bar| {
                    bar.verdict(passed, stalled, round + 1 == rounds, init + 1 < inits)
                });
                eprintln!(
                    "  warm start, {label}on {probed} unseen problems (greedy): writes the reference tool call exactly for {calls} (once it has chosen to call), copies the tool's output into the answer for {copies}{next}"
                );
            }
            if passed {
                return peft::export_merged(&lm.model, base, out, DType::F32);
            }
            if stalled {
                break;
            }
        }
    }
    let (probed, calls, copies) = best;
    let bar = recipe.bar.unwrap_or(BAR);
    bail!(
        "the built-in model's warm start (seed {seed}) did not learn the tool's format: from {inits} sets of random weights, the best writes the reference call exactly for {calls} and copies the tool's output for {copies} of {probed} unseen problems (it needs {:.0}% and {:.0}%), and RL cannot teach copying from a reward that never comes; try another run.seed",
        100.0 * bar.calls,
        100.0 * bar.copies,
    )
}

/// A trace as the warm start trains on it, and the length of its prompt: the model's text
/// before the tool and after it, each learnt or not as the trace says, the tool's output
/// never.
fn sft_row(
    recipe: &Recipe,
    tokenizer: &crate::model::tokenizer::Tokenizer,
    eos: u32,
    t: &Trace,
) -> Result<(SftRow, usize)> {
    let p = Pieces::encode(tokenizer, t)?;
    let prompt_len = p.prompt.len();
    let mut mask = vec![0u8; prompt_len];
    let answer = u8::from(t.learn_answer);
    let call = u8::from(t.learn_call);
    if recipe.untrained_guess_digits && t.tool.is_none() {
        // A guess's digits are noise no model can predict; trained on, they teach the
        // answer to write random digits, which competes with copying the tool's output.
        // Its form (`<answer>`, units, separators) is still learnt, and with it the
        // choice to answer without the tool.
        mask.extend(p.call.iter().map(|&id| {
            let digit = tokenizer
                .id_to_token(id)
                .is_some_and(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()));
            if digit { 0 } else { call }
        }));
    } else {
        mask.extend(std::iter::repeat_n(call, p.call.len()));
    }
    for (ids, learn) in [(&p.tool, 0), (&p.after, answer)] {
        mask.extend(std::iter::repeat_n(learn, ids.len()));
    }
    mask.push(answer);
    let mut tokens = p.prompt;
    tokens.extend(p.call.into_iter().chain(p.tool).chain(p.after));
    tokens.push(eos);
    let row = SftRow {
        tokens,
        loss_mask: mask,
    };
    Ok((row, prompt_len))
}

impl Bar {
    /// Whether a probe's counts reach the bar. A task whose traces hold no call to probe
    /// passes (nothing to copy).
    fn passes(&self, probed: usize, calls: usize, copies: usize) -> bool {
        let n = probed as f64;
        probed == 0 || (calls as f64 >= self.calls * n && copies as f64 >= self.copies * n)
    }

    /// Whether a round left the counts below the bar where the round before had them:
    /// neither rose by [`Bar::STALL`] of the probe.
    fn stalled(&self, probed: usize, before: (usize, usize), now: (usize, usize)) -> bool {
        let rise = |a: usize, b: usize| b.saturating_sub(a) as f64;
        let step = Self::STALL * probed as f64;
        rise(before.0, now.0) < step && rise(before.1, now.1) < step
    }

    /// The least rise of a round that is still going somewhere.
    const STALL: f64 = 0.05;

    /// What a round's probe line adds after the counts: nothing when they pass, else the
    /// bar and what the warm start does next.
    fn verdict(&self, passed: bool, stalled: bool, last_round: bool, more_weights: bool) -> String {
        if passed {
            return String::new();
        }
        let below = format!(
            "; below the bar ({:.0}% and {:.0}%)",
            100.0 * self.calls,
            100.0 * self.copies
        );
        let rising = if stalled { ", no longer rising" } else { "" };
        let next = match (stalled || last_round, more_weights) {
            (false, _) => ": training another round",
            (true, true) => ": starting again from other random weights",
            (true, false) => "",
        };
        format!("{below}{rising}{next}")
    }
}

/// A trace's token ids, part by part, each part encoded on its own as the warm start
/// trains on them.
struct Pieces {
    prompt: Vec<u32>,
    /// The model's text before the tool: its call, or the whole guess.
    call: Vec<u32>,
    tool: Vec<u32>,
    after: Vec<u32>,
}

impl Pieces {
    fn encode(tok: &crate::model::tokenizer::Tokenizer, t: &Trace) -> Result<Pieces> {
        Ok(Pieces {
            prompt: tok.encode(&t.prompt)?,
            call: tok.encode(&t.before)?,
            tool: tok.encode(t.tool.as_deref().unwrap_or(""))?,
            after: tok.encode(&t.after)?,
        })
    }
}

/// How well the model does a tool trace's two copying jobs, on `probe`'s traces, greedy:
/// how many traces were probed, how many calls it writes token for token once it has
/// chosen to call (copying the problem into the call), and how many answers given the call
/// and the tool's output (copying the output into the answer). That is what a warm start is for, and neither the
/// training loss (the guesses' random digits weigh on it) nor sampling (which mostly
/// skips the tool) can say how well it does.
fn copies(lm: &LanguageModel, probe: &[Trace]) -> Result<(usize, usize, usize)> {
    let (mut call_heads, mut calls) = (Vec::new(), Vec::new());
    let (mut answer_heads, mut answers) = (Vec::new(), Vec::new());
    for t in probe {
        let p = Pieces::encode(&lm.tokenizer, t)?;
        // The call's tokens up to the first that tells it from an answer (`<calc>` and
        // `<answer>` may share their first token): the choice to call is not probed.
        let shared = p
            .call
            .iter()
            .zip(&p.after)
            .take_while(|(a, b)| a == b)
            .count();
        if shared >= p.call.len() {
            continue;
        }
        let mut head = p.prompt.clone();
        head.extend(&p.call[..=shared]);
        call_heads.push(head);
        calls.push(p.call[shared + 1..].to_vec());
        let mut head = p.prompt;
        head.extend(&p.call);
        head.extend(p.tool);
        answer_heads.push(head);
        answers.push(p.after);
    }
    if calls.is_empty() {
        return Ok((0, 0, 0));
    }
    Ok((
        calls.len(),
        exact(lm, &call_heads, &calls)?,
        exact(lm, &answer_heads, &answers)?,
    ))
}

/// How many of `prompts` the model continues greedily with the matching `wants`.
fn exact(lm: &LanguageModel, prompts: &[Vec<u32>], wants: &[Vec<u32>]) -> Result<usize> {
    let params = SamplingParams {
        temperature: 0.0,
        max_new_tokens: wants.iter().map(Vec::len).max().unwrap_or(0).max(1),
        ..SamplingParams::default()
    };
    let out = generate(
        &lm.model,
        &lm.tokenizer,
        prompts,
        1,
        &params,
        Mode::INFERENCE,
    )?;
    let mut n = 0;
    for (completion, want) in out.iter().zip(wants) {
        let got = &completion[0].tokens;
        if got.starts_with(want) {
            n += 1;
        } else {
            tracing::debug!(
                "warm-start probe: wanted {:?}, got {:?}",
                lm.tokenizer.decode(want, false)?,
                completion[0].text
            );
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bar_passes_on_both_rates_and_stalls_when_neither_rises() {
        // Rates measured on multiply seeds (issue 63): seed 7 passes at once, seed 5's
        // copies stalled at 77-78 (4-digit products copied a digit off), seed 3's calls
        // at 0.
        assert!(BAR.passes(100, 100, 83));
        assert!(BAR.passes(100, 100, 77));
        assert!(!BAR.passes(100, 100, 72));
        assert!(!BAR.passes(100, 89, 95));
        assert!(BAR.passes(0, 0, 0), "nothing to probe: nothing to copy");
        assert!(BAR.stalled(100, (100, 77), (100, 78)));
        assert!(BAR.stalled(100, (0, 0), (0, 0)));
        assert!(!BAR.stalled(100, (65, 52), (93, 65)));
        assert!(
            !BAR.stalled(100, (100, 62), (100, 72)),
            "copies still rising"
        );
    }

    /// With `untrained_guess_digits`, a guess's digits leave the loss and its form stays;
    /// a tool trace's answer is learnt whole either way.
    #[test]
    fn a_guess_is_learnt_without_its_digits_when_the_recipe_says_so() {
        let trace = |tool: Option<&str>, before: &str, after: &str| Trace {
            prompt: "<|im_start|>user\nConvert 12 km to mi.<|im_end|>\n<|im_start|>assistant\n"
                .into(),
            before: before.into(),
            tool: tool.map(str::to_string),
            after: after.into(),
            learn_call: true,
            learn_answer: true,
        };
        let traces = [
            trace(None, "<answer>7.45645 mi</answer>", ""),
            trace(
                Some("7.45645 mi"),
                "<calc>12 km</calc>",
                "<answer>7.45645 mi</answer>",
            ),
        ];
        let (guess, called) = (&traces[0], &traces[1]);
        let dir = std::env::temp_dir().join(format!("rlhost-guess-mask-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_tokenizer(&UNITS, &traces, &dir).unwrap();
        let tok = crate::model::tokenizer::Tokenizer::from_dir(&dir).unwrap();
        let eos = tok.token_to_id("<|im_end|>").unwrap();
        let learnt = |recipe: &Recipe, t: &Trace| {
            let (row, prompt_len) = sft_row(recipe, &tok, eos, t).unwrap();
            let ids = &row.tokens[prompt_len..row.tokens.len() - 1];
            let mask = &row.loss_mask[prompt_len..row.tokens.len() - 1];
            let text = |keep: u8| {
                let kept: Vec<u32> = ids
                    .iter()
                    .zip(mask)
                    .filter(|(_, m)| **m == keep)
                    .map(|(id, _)| *id)
                    .collect();
                tok.decode(&kept, false).unwrap()
            };
            (text(1), text(0), *row.loss_mask.last().unwrap())
        };
        let masked = Recipe {
            untrained_guess_digits: true,
            ..UNITS
        };
        let whole = Recipe {
            untrained_guess_digits: false,
            ..UNITS
        };
        assert_eq!(
            learnt(&masked, guess),
            ("<answer>. mi</answer>".into(), "745645".into(), 1),
            "the guess's form learnt, its digits not, its end learnt"
        );
        assert_eq!(
            learnt(&whole, guess),
            ("<answer>7.45645 mi</answer>".into(), String::new(), 1)
        );
        let (kept, dropped, _) = learnt(&masked, called);
        assert_eq!(kept, "<calc>12 km</calc><answer>7.45645 mi</answer>");
        assert_eq!(
            dropped, "7.45645 mi",
            "only the tool's output is out of the loss"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
