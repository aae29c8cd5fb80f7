//! `rlhost generate`: sample from a model directory (optionally with an adapter), raw or
//! through the chat template, showing per-token log-probs on request.

use crate::model::placement::{DTypeChoice, DeviceChoice, Placement};
use crate::model::{LanguageModel, Mode, peft};
use crate::sampler::decode::Finish;
use crate::sampler::generate;
use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// A Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// A PEFT LoRA adapter directory to apply.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// `cpu`, `cuda`, `cuda:N` or `auto` (a GPU when this binary has CUDA and one opens).
    #[arg(long, default_value = "auto")]
    device: DeviceChoice,
    /// Compute dtype: `auto` (f32 on the CPU, bf16 on a GPU), `f32`, `bf16` or `f16`.
    #[arg(long, default_value = "auto")]
    dtype: DTypeChoice,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message (with --chat).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// The prompt text. Without --chat it is encoded as transformers' `tokenizer(text)`
    /// does, with the tokenizer's post-processor (Llama 3's `<|begin_of_text|>`).
    #[arg(long)]
    prompt: String,
    /// Samples to draw (they share the prompt's prefill).
    #[arg(long, short = 'n', default_value_t = 1)]
    num_samples: usize,
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Sampling temperature (default: generation_config.json, else 1); 0 is greedy.
    #[arg(long)]
    temperature: Option<f32>,
    /// Greedy decoding (same as --temperature 0).
    #[arg(long, conflicts_with = "temperature")]
    greedy: bool,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long)]
    min_p: Option<f32>,
    /// Stop when this text appears (repeatable). EOS ids always stop.
    #[arg(long)]
    stop: Vec<String>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Show each generated token with its log-prob.
    #[arg(long)]
    logprobs: bool,
    /// Print one JSON object per sample.
    #[arg(long)]
    json: bool,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let at = Placement::open(args.device, args.dtype).context("--device")?;
    let mut lm = LanguageModel::open(&args.model, &at)?;
    lm.sample_tokens_only();
    if let Some(adapter) = &args.adapter {
        peft::load_adapter(&mut lm.model, adapter)
            .with_context(|| format!("loading adapter {}", adapter.display()))?;
    }
    let text = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(json!({"role": "system", "content": system}));
        }
        messages.push(json!({"role": "user", "content": args.prompt}));
        lm.chat()?.render(&messages, None, true)?
    } else {
        args.prompt.clone()
    };
    // A raw prompt goes through the tokenizer's post-processor (Llama 3's
    // `<|begin_of_text|>`), as `tokenizer(text)` does; a chat template writes its own.
    let prompt = if args.chat {
        lm.tokenizer.encode(&text)?
    } else {
        lm.tokenizer.encode_raw_prompt(&text)?
    };
    if prompt.is_empty() {
        anyhow::bail!("the prompt encodes to no tokens");
    }
    let mut params = crate::sampler::draw::defaults(&lm)?;
    params.max_new_tokens = args.max_new_tokens;
    params.seed = args.seed;
    params.stop_strings = args.stop.clone();
    if args.greedy {
        params.temperature = 0.0;
    }
    if let Some(t) = args.temperature {
        params.temperature = t;
    }
    if let Some(k) = args.top_k {
        params.top_k = k;
    }
    if let Some(p) = args.top_p {
        params.top_p = p;
    }
    if let Some(p) = args.min_p {
        params.min_p = p;
    }
    let started = std::time::Instant::now();
    let out = generate(
        &lm.model,
        &lm.tokenizer,
        std::slice::from_ref(&prompt),
        args.num_samples.max(1),
        &params,
        Mode::INFERENCE,
    )?;
    let secs = started.elapsed().as_secs_f64();
    let total: usize = out[0].iter().map(|c| c.tokens.len()).sum();
    for (i, c) in out[0].iter().enumerate() {
        let finish = match &c.finish {
            Finish::StopToken(t) => format!("stop token {t}"),
            Finish::StopString(s) => format!("stop string {s:?}"),
            Finish::Length => "length".to_string(),
        };
        if args.json {
            let tokens: Vec<_> = c
                .tokens
                .iter()
                .zip(&c.logprobs)
                .map(|(t, lp)| json!({"id": t, "token": lm.tokenizer.id_to_token(*t), "logprob": lp}))
                .collect();
            let mut obj = json!({"sample": i, "text": c.text, "finish": finish, "prompt_tokens": prompt.len()});
            if args.logprobs {
                obj["tokens"] = tokens.into();
            } else {
                obj["token_ids"] = c.tokens.clone().into();
            }
            println!("{obj}");
            continue;
        }
        if args.num_samples > 1 {
            println!("--- sample {i} ({finish}, {} tokens)", c.tokens.len());
        }
        println!("{}", c.text);
        if args.logprobs {
            println!("{:>6}  {:>9}  token", "id", "logprob");
            for (t, lp) in c.tokens.iter().zip(&c.logprobs) {
                let piece = lm.tokenizer.decode(&[*t], false).unwrap_or_default();
                println!("{t:>6}  {lp:>9.4}  {piece:?}");
            }
        }
        if args.num_samples <= 1 && !args.json {
            eprintln!(
                "[{finish}; {} prompt + {} new tokens]",
                prompt.len(),
                c.tokens.len()
            );
        }
    }
    eprintln!(
        "[{total} tokens in {secs:.2} s: {:.1} tokens/s]",
        total as f64 / secs.max(1e-9)
    );
    Ok(())
}
