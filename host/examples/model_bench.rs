//! Worker for `bench/model_speed.py` (not a test): one measurement per process, so that
//! the driver can read each one's peak RSS. Prints one JSON line.
//!
//! ```text
//! model_bench decode    --model DIR --batch B [--prompt-len 32] [--new 64] [--quantize nf4]
//!                       [--temperature 0] [--logprob-check SEQUENCES] [--adapter-rank R]
//!                       [--live-adapter 1]
//! model_bench train     --model DIR [--batch 4] [--seq 256] [--rank 16] [--steps 2] [--quantize nf4]
//!                       [--checkpointing 1]
//! model_bench update    --model DIR [--rows 16] [--min-len 100] [--max-len 400] [--rank 16]
//!                       [--rounds 5] [--micro-batch-tokens 4096]
//! model_bench dpo       --model DIR [--pairs 4] [--prompt-len 128] [--reply-len 128] [--rank 16]
//!                       [--steps 2]
//! model_bench bandwidth [--mib 1024] [--threads 2]
//! model_bench ops       --device cuda --dtype bf16 [--batch 8] [--seq 1024] [--iters 20]
//! model_bench graph     --model DIR --device cuda --dtype bf16 [--batch 64] [--prompt-len 128]
//!                       [--at 64] [--iters 50] [--adapter-rank 16]
//! ```
//!
//! `decode` and `train` also take `--device cpu|cuda|cuda:N` (default cpu) and `--dtype
//! f32|bf16|f16` (default f32); on a GPU every timing waits for the device to finish.
//! With `RLHOST_PROFILE=1` the time of each compute entry point goes to stderr at the end
//! (see `rlhost::model::profile`).

use anyhow::{Context, Result, bail};
use candle_core::{DType, Tensor};
use rlhost::model::placement::{DTypeChoice, DeviceChoice, Placement};
use rlhost::model::{LoraConfig, Mode, Model};
use rlhost::rl::optim::{Accumulator, AdamW, AdamWConfig, clip_grad_norm};
use rlhost::sampler::decode::{Sequence, advance, draw, draw_ahead, goes_ahead};
use rlhost::sampler::draw::SamplingParams;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

fn main() -> Result<()> {
    rlhost::model::compute::set_up_process();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args
        .first()
        .context("usage: model_bench decode|train|bandwidth ...")?
        .clone();
    let mut opts = HashMap::new();
    for pair in args[1..].chunks(2) {
        let key = pair[0].trim_start_matches("--").to_string();
        let value = pair
            .get(1)
            .with_context(|| format!("--{key} needs a value"))?
            .clone();
        opts.insert(key, value);
    }
    let num = |k: &str, default: usize| -> Result<usize> {
        opts.get(k)
            .map_or(Ok(default), |v| v.parse().with_context(|| format!("--{k}")))
    };
    let nf4 = match opts.get("quantize").map(String::as_str) {
        None => false,
        Some("nf4") => true,
        Some(other) => bail!("--quantize {other}: only nf4"),
    };
    let checkpointing = num("checkpointing", 0)? != 0;
    let choice = |k: &str, default: &str| opts.get(k).map_or(default, String::as_str).to_string();
    let device: DeviceChoice = choice("device", "cpu")
        .parse()
        .map_err(anyhow::Error::msg)?;
    let dtype: DTypeChoice = choice("dtype", "f32").parse().map_err(anyhow::Error::msg)?;
    let at = Placement::open(device, dtype)?;
    let load = |dir: &Path| -> Result<Model> {
        let mut model = Model::load(dir, &at)?;
        if nf4 {
            model.quantize_nf4(true)?;
        }
        model.gradient_checkpointing = checkpointing;
        Ok(model)
    };
    match mode.as_str() {
        "decode" => decode(
            load(&PathBuf::from(opts.get("model").context("--model")?))?,
            weight_bytes(&PathBuf::from(opts.get("model").context("--model")?))?,
            (num("batch", 1)?, num("prompt-len", 32)?, num("new", 64)?),
            opts.get("temperature")
                .map_or(Ok(0.0), |v| v.parse::<f32>())
                .context("--temperature")?,
            num("logprob-check", 0)?,
            (num("adapter-rank", 0)?, num("live-adapter", 0)? == 1),
        ),
        "train" => train(
            load(&PathBuf::from(opts.get("model").context("--model")?))?,
            num("batch", 4)?,
            num("seq", 256)?,
            num("rank", 16)?,
            num("steps", 2)?,
        ),
        "update" => update_layouts(
            load(&PathBuf::from(opts.get("model").context("--model")?))?,
            num("rows", 16)?,
            (num("min-len", 100)?, num("max-len", 400)?),
            num("rank", 16)?,
            num("rounds", 5)?,
            num("micro-batch-tokens", 4096)?,
        ),
        "dpo" => dpo(
            load(&PathBuf::from(opts.get("model").context("--model")?))?,
            num("pairs", 4)?,
            (num("prompt-len", 128)?, num("reply-len", 128)?),
            num("rank", 16)?,
            num("steps", 2)?,
        ),
        "bandwidth" => bandwidth(num("mib", 1024)?, num("threads", 2)?),
        #[cfg(feature = "cuda")]
        "ops" => ops(&at, num("batch", 8)?, num("seq", 1024)?, num("iters", 20)?),
        #[cfg(feature = "cuda")]
        "graph" => graph(
            load(&PathBuf::from(opts.get("model").context("--model")?))?,
            (num("batch", 64)?, num("prompt-len", 128)?, num("at", 64)?),
            num("iters", 50)?,
            num("adapter-rank", 16)?,
        ),
        other => bail!("unknown mode {other}"),
    }?;
    if let Some(table) = rlhost::model::profile::report() {
        eprintln!("{table}");
    }
    Ok(())
}

/// A rank-`rank` adapter (alpha 2·rank) on every projection, as the PyTorch peers attach
/// theirs.
fn attach_lora(model: &mut Model, rank: usize) -> Result<()> {
    model.attach_lora(
        &LoraConfig {
            r: rank,
            alpha: 2.0 * rank as f64,
            ..LoraConfig::default()
        },
        0,
    )
}

/// [`attach_lora`] with B small and non-zero, so that the adapter takes part in the
/// arithmetic of sampling (a fresh adapter's B is zero).
fn attach_sampled_lora(model: &mut Model, rank: usize) -> Result<()> {
    attach_lora(model, rank)?;
    for (name, var) in model.lora_vars() {
        if name.ends_with("lora_B") {
            var.set(&(var.ones_like()? * 1e-3)?)?;
        }
    }
    Ok(())
}

/// Token ids from a fixed linear congruential sequence (the model is random anyway).
fn ids(n: usize, vocab: usize, salt: u64) -> Vec<u32> {
    let mut s = 0x2545F4914F6CDD1Du64 ^ salt;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Decoding of `new` tokens (greedy, or sampled at `temperature`) after a `prompt_len`
/// prompt for `batch` sequences, timed like transformers' `generate` (prefill included).
/// Also reported: the prefill's time (the first forward, every prompt in it), the mean
/// time of a decode step after it (forward, draw, the tokens appended), with `check` > 0
/// the sampled log-probs' distance from the trainer's on that many sequences
/// ([`logprob_gap`], after the timing), and on a GPU what
/// a step must read: the weights, and the keys and values each sequence attends to, on
/// average over the run (`bench/gpu_speed.py` divides them by the device's bandwidth: the
/// step's floor). With `adapter_rank` > 0 every projection carries an adapter of that
/// rank (B non-zero), sampled as the rollout engine samples it, from a frozen copy of
/// one version (its casts and joined pairs made once), or with `live` from the live
/// adapter, as every sampling forward read it before issue 64.
fn decode(
    mut model: Model,
    weight_bytes: u64,
    (batch, prompt_len, new): (usize, usize, usize),
    temperature: f32,
    check: usize,
    (adapter_rank, live): (usize, bool),
) -> Result<()> {
    if adapter_rank > 0 {
        attach_sampled_lora(&mut model, adapter_rank)?;
    }
    let set = (adapter_rank > 0 && !live)
        .then(|| model.adapter_snapshot(0))
        .transpose()?;
    let mode = Mode {
        adapter: set.as_ref(),
        ..Mode::INFERENCE
    };
    let vocab = model.cfg.vocab_size.min(500);
    let params = SamplingParams {
        temperature,
        max_new_tokens: new,
        ..SamplingParams::default()
    };
    let run = |new: usize| -> Result<(f64, f64, Vec<Sequence>)> {
        let mut seqs: Vec<Sequence> = (0..batch)
            .map(|i| Sequence::new(&model, ids(prompt_len, vocab, i as u64), 0))
            .collect();
        let t = Instant::now();
        let mut prefill = 0.0;
        for step in 0..new {
            let mut all = seqs.iter_mut().collect::<Vec<_>>();
            advance(&model, &mut all, mode)?;
            if step == 0 {
                model.device().synchronize()?;
                prefill = t.elapsed().as_secs_f64();
            }
            // One batched draw where the logits stay on a GPU, with the next step queued
            // behind it, as the rollout engine does (`RLHOST_DECODE_AHEAD=off`: waiting for
            // each step's tokens first).
            if goes_ahead(model.device()) {
                draw_ahead(&model, &mut all, &params, mode)?;
            } else {
                draw(&mut all, &params)?;
            }
            for s in seqs.iter_mut() {
                s.sample_next(&params)?;
            }
        }
        model.device().synchronize()?;
        Ok((t.elapsed().as_secs_f64(), prefill, seqs))
    };
    run(2)?; // warm-up: page in the weights, spin up the thread pool
    reset_peak_rss();
    let (secs, prefill, seqs) = run(new)?;
    // The peak of the timed run, before the check below adds its own.
    let peak_rss = peak_rss_gb();
    let gap = (check > 0)
        .then(|| logprob_gap(&model, &seqs[..seqs.len().min(check)]))
        .transpose()?;
    let step_ms = (secs - prefill) / new as f64 * 1e3;
    let mut line = serde_json::json!({"impl": "rlhost", "mode": "decode", "batch": batch,
        "new_tokens": new, "placement": model.placement().describe(),
        "seconds": secs, "tokens_per_s": (batch * new) as f64 / secs,
        "prefill_s": prefill, "decode_step_ms": step_ms, "adapter_rank": adapter_rank,
        "live_adapter": live,
        "phase_peak_rss_gb": peak_rss});
    if let Some((max, mean)) = gap {
        line["logprob_gap_max"] = max.into();
        line["logprob_gap_mean"] = mean.into();
    }
    if !model.device().is_cpu() {
        let c = &model.cfg;
        let elem = model.dtype().size_in_bytes() as u64;
        // Mean positions a sequence attends to over the run's steps.
        let seen = prompt_len as u64 + (new as u64).div_ceil(2);
        let kv = c.num_hidden_layers as u64
            * 2
            * (c.num_key_value_heads * c.head_dim) as u64
            * elem
            * batch as u64
            * seen;
        line["weights_gb"] = (weight_bytes as f64 / 1e9).into();
        line["kv_gb_per_step"] = (kv as f64 / 1e9).into();
    }
    println!("{line}");
    Ok(())
}

/// How far the sampled tokens' log-probs are from the trainer's: each sequence's tokens
/// again through the batch forward (the path the RL update takes), `(max, mean)` of
/// |sampled − recomputed| over the sampled tokens. The sampler's attention, prefill and
/// draw are checked end to end this way on the model being timed.
fn logprob_gap(model: &Model, seqs: &[Sequence]) -> Result<(f64, f64)> {
    let dev = model.device();
    let (mut worst, mut sum, mut n) = (0f64, 0f64, 0usize);
    for s in seqs {
        let t = s.tokens.len();
        let ids = Tensor::new(s.tokens.as_slice(), dev)?.unsqueeze(0)?;
        let pos = Tensor::arange(0u32, t as u32, dev)?.unsqueeze(0)?;
        let h = model.forward_batch(&ids, &ids.ones_like()?, &pos, Mode::INFERENCE)?;
        let (logp, _) = model.logprobs(&h.narrow(1, 0, t - 1)?, &ids.narrow(1, 1, t - 1)?)?;
        let logp = logp.squeeze(0)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        for (k, lp) in s.logprobs.iter().enumerate() {
            if let Some(lp) = lp {
                let gap = (lp - logp[s.prompt_len + k - 1]).abs() as f64;
                worst = worst.max(gap);
                sum += gap;
                n += 1;
            }
        }
    }
    Ok((worst, sum / n.max(1) as f64))
}

/// Bytes of the model's weight files (`*.safetensors`): what a decode step reads of the
/// weights, the model being stored in the dtype it runs in.
fn weight_bytes(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            total += std::fs::metadata(&path)?.len();
        }
    }
    Ok(total)
}

/// LoRA training steps on `batch × seq` tokens: forward with adapters, mean negative
/// log-likelihood of the next token, backward, gradient clipping, AdamW. Reports the mean of the timed steps
/// after one warm-up step.
fn train(mut model: Model, batch: usize, seq: usize, rank: usize, steps: usize) -> Result<()> {
    let dev = model.device().clone();
    attach_lora(&mut model, rank)?;
    // The trainer's own optimizer (rlhost::rl::optim), clipped at 1.0 as the trainer's
    // default and the PyTorch peer are.
    let mut opt = AdamW::new(model.lora_vars(), AdamWConfig::default())?;
    let vocab = model.cfg.vocab_size.min(500);
    let data = ids(batch * seq, vocab, 7);
    let input = Tensor::from_vec(data, (batch, seq), &dev)?;
    let mask = Tensor::ones((batch, seq), DType::U32, &dev)?;
    let pos = Tensor::arange(0u32, seq as u32, &dev)?
        .unsqueeze(0)?
        .repeat((batch, 1))?;
    let mode = Mode::TRAIN;
    let mut times = Vec::new();
    // The measured phase's own peak: loading (an f32 checkpoint, quantized after) is not
    // part of a step.
    reset_peak_rss();
    let start_rss = rss_gb();
    for step in 0..steps + 1 {
        let t = Instant::now();
        let hidden = model.forward_batch(&input, &mask, &pos, mode)?;
        dev.synchronize()?;
        let t_fwd = t.elapsed().as_secs_f64();
        let rss_fwd = rss_gb();
        let (logp, _) = model.logprobs(
            &hidden.narrow(1, 0, seq - 1)?,
            &input.narrow(1, 1, seq - 1)?,
        )?;
        let loss = logp.mean_all()?.neg()?;
        dev.synchronize()?;
        let t_logp = t.elapsed().as_secs_f64();
        let grads = loss.backward()?;
        dev.synchronize()?;
        let t_bwd = t.elapsed().as_secs_f64();
        eprintln!(
            "  forward {t_fwd:.2} s, log-probs {:.2} s, backward {:.2} s; RSS after the forward {rss_fwd:.2} GB, peak so far {:.2} GB",
            t_logp - t_fwd,
            t_bwd - t_logp,
            peak_rss_gb()
        );
        let missing = model.missing_grads(&grads);
        if !missing.is_empty() {
            bail!("no gradient for {missing:?}");
        }
        let mut acc = Accumulator::new(opt.params().len());
        acc.add(opt.params(), &grads)?;
        drop(grads);
        let mut summed = acc.take(opt.params())?;
        clip_grad_norm(&mut summed, 1.0)?;
        opt.update(&summed, 1e-4)?;
        drop(summed);
        dev.synchronize()?;
        if step > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
        eprintln!(
            "step {step}: loss {:.4}, {:.2} s",
            loss.to_scalar::<f32>()?,
            t.elapsed().as_secs_f64()
        );
    }
    let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
    println!(
        "{}",
        serde_json::json!({"impl": "rlhost", "mode": "train", "batch": batch, "seq": seq, "rank": rank,
            "placement": model.placement().describe(),
            "step_seconds": mean, "steps": times, "phase_peak_rss_gb": peak_rss_gb(),
            "start_rss_gb": start_rss})
    );
    Ok(())
}

/// One DPO step ([`rlhost::rl::dpo::Dpo::step`], the sigmoid loss, β 0.1): `pairs` pairs
/// whose chosen and rejected replies are `reply` tokens after a shared `prompt`-token
/// prompt, every pair in one optimizer step, the reference log-probs from the model with
/// its adapter off. `bench/dpo_speed.py` runs TRL's `DPOTrainer` with PEFT on the same
/// shape beside it.
fn dpo(
    mut model: Model,
    pairs: usize,
    (prompt, reply): (usize, usize),
    rank: usize,
    steps: usize,
) -> Result<()> {
    use rlhost::rl::dpo::{Dpo, PairRows, PairSchedule};
    use rlhost::rl::preference::{PairLoss, PairLossSettings};
    use rlhost::rl::sft::SftRow;
    attach_lora(&mut model, rank)?;
    let vocab = model.cfg.vocab_size.min(500);
    let side = |p: &[u32], salt: u64| -> SftRow {
        let tokens = [p, &ids(reply, vocab, salt)].concat();
        let loss_mask = (0..tokens.len()).map(|i| u8::from(i >= prompt)).collect();
        SftRow { tokens, loss_mask }
    };
    let rows: Vec<PairRows> = (0..pairs)
        .map(|i| {
            let p = ids(prompt, vocab, 100 + i as u64);
            PairRows {
                chosen: side(&p, 200 + i as u64),
                rejected: side(&p, 300 + i as u64),
                margin: None,
            }
        })
        .collect();
    let loss = PairLossSettings {
        loss: PairLoss::Sigmoid,
        beta: 0.1,
        label_smoothing: 0.0,
        simpo_gamma: 0.5,
    };
    let schedule = PairSchedule {
        steps: steps as u64 + 1,
        pairs_per_step: pairs,
        lr: 1e-4,
        warmup_steps: 0,
        min_lr_ratio: 1.0,
        weight_decay: 0.0,
        max_grad_norm: 1.0,
        micro_batch_tokens: 2 * pairs * (prompt + reply),
        pack_sequences: false,
        seed: 0,
        shuffle: false,
    };
    let mut trainer = Dpo::new(&model, loss, schedule)?;
    let dev = model.device().clone();
    reset_peak_rss();
    let start_rss = rss_gb();
    let mut times = Vec::new();
    for step in 0..steps + 1 {
        let t = Instant::now();
        let record = trainer.step(&rows)?;
        dev.synchronize()?;
        if step > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
        eprintln!(
            "step {step}: loss {:.4}, {:.2} s",
            record.train.loss,
            t.elapsed().as_secs_f64()
        );
    }
    let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
    println!(
        "{}",
        serde_json::json!({"impl": "rlhost", "mode": "dpo", "pairs": pairs, "prompt": prompt,
            "reply": reply, "rank": rank, "step_seconds": mean, "steps": times,
            "phase_peak_rss_gb": peak_rss_gb(), "start_rss_gb": start_rss})
    );
    Ok(())
}

/// The RL update ([`rlhost::rl::update::update`], GRPO's defaults, one optimizer step)
/// on `rows` trajectories whose lengths spread evenly over `min..=max` tokens (the first
/// quarter prompt), with the rows packed into lanes and padded one a lane, alternating
/// for `rounds` rounds after a warm-up of each: each layout's median and their ratio.
/// Both layouts train the same rows with the same advantages (the adapter moves a step
/// a round either way).
fn update_layouts(
    mut model: Model,
    rows: usize,
    (min, max): (usize, usize),
    rank: usize,
    rounds: usize,
    micro_batch_tokens: usize,
) -> Result<()> {
    use rlhost::rl::algorithms::{Aggregation, KlEstimator, RolloutCorrection};
    use rlhost::rl::update::{OldLogps, Row, StepInputs, UpdateConfig, update};
    use rlhost::rollout::Trajectory;
    if min < 2 || max < min {
        bail!("--min-len {min} --max-len {max}: lengths of at least 2, min <= max");
    }
    attach_lora(&mut model, rank)?;
    let mut opt = AdamW::new(model.lora_vars(), AdamWConfig::default())?;
    let vocab = model.cfg.vocab_size.min(500);
    let lens: Vec<usize> = (0..rows)
        .map(|i| min + (max - min) * i / (rows - 1).max(1))
        .collect();
    let trajectories: Vec<Trajectory> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let prompt_len = (n / 4).max(1);
            Trajectory {
                sample_id: i as u64,
                ..Trajectory::sampled(
                    ids(n, vocab, i as u64),
                    prompt_len,
                    vec![Some(-1.0); n - prompt_len],
                )
            }
        })
        .collect();
    let batch: Vec<Row> = trajectories
        .iter()
        .enumerate()
        .map(|(i, t)| Row {
            trajectory: t,
            advantage: if i % 2 == 0 { 1.0 } else { -1.0 },
            token_advantages: &[],
            stale: false,
            trained_from: 0,
        })
        .collect();
    let cfg = |pack: bool| UpdateConfig {
        clip_low: 0.2,
        clip_high: 0.28,
        aggregation: Aggregation::TokenMean,
        norm_constant: 0.0,
        kl_coef: 0.0,
        kl_estimator: KlEstimator::K3,
        reward_kl_estimator: KlEstimator::K1,
        temperature: 1.0,
        tis_cap: 2.0,
        rollout_correction: RolloutCorrection::None,
        max_grad_norm: 1.0,
        micro_batch_tokens,
        pack_sequences: pack,
        mini_batches: 1,
        epochs: 1,
        old_logps: OldLogps::Recompute,
        ppo: None,
        progress: None,
    };
    let dev = model.device().clone();
    let mut run = |pack: bool| -> Result<(f64, usize)> {
        let t = Instant::now();
        let inputs = StepInputs {
            lr: 1e-5,
            seed: 0,
            dropout: None,
        };
        let stats = update(&model, None, &mut opt, &batch, &cfg(pack), &inputs)?;
        dev.synchronize()?;
        Ok((t.elapsed().as_secs_f64(), stats.micro_batches))
    };
    run(true)?;
    run(false)?;
    reset_peak_rss();
    let (mut packed, mut padded) = (Vec::new(), Vec::new());
    let mut micro = (0, 0);
    for round in 0..rounds {
        // Alternating which goes first, so that neither always follows the other.
        let order = if round % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for pack in order {
            let (secs, m) = run(pack)?;
            eprintln!("round {round}: packed {pack}: {secs:.3} s, {m} micro-batches");
            if pack {
                packed.push(secs);
                micro.0 = m;
            } else {
                padded.push(secs);
                micro.1 = m;
            }
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (p, q) = (median(&mut packed), median(&mut padded));
    // What each layout feeds the model (lanes × width summed over its micro-batches),
    // beside the real tokens.
    let real: usize = lens.iter().map(|n| n - 1).sum();
    let sized: Vec<(usize, usize)> = lens.iter().map(|n| n - 1).enumerate().collect();
    let fed = |pack: bool| -> usize {
        rlhost::rl::packing::micro_batches(&sized, pack, micro_batch_tokens)
            .iter()
            .map(|m| m.lanes * m.width)
            .sum()
    };
    println!(
        "{}",
        serde_json::json!({"impl": "rlhost", "mode": "update", "rows": rows,
            "lengths": [min, max], "rank": rank, "micro_batch_tokens": micro_batch_tokens,
            "placement": model.placement().describe(), "real_tokens": real,
            "packed_tokens": fed(true), "padded_tokens": fed(false),
            "packed_seconds": p, "padded_seconds": q, "padded_over_packed": q / p,
            "packed_micro_batches": micro.0, "padded_micro_batches": micro.1,
            "rounds": rounds, "phase_peak_rss_gb": peak_rss_gb()})
    );
    Ok(())
}

/// Whether a CUDA graph of the decode step pays (issue 64 item 4): `batch` sequences of
/// `prompt_len` tokens are prefilled and decode `at` steps eagerly, so that they sit in
/// the pool as a rollout's do; then one decode step as the rollout engine runs it (the
/// forward on token ids already on the device, with a rank-`adapter_rank` adapter read
/// from a frozen copy, and the fused draw at T = 1) runs `iters` times eagerly and is
/// replayed `iters` times from a graph, each time at the same position (the step's keys
/// and values written over). Prints both step times, their ratio, the largest difference
/// of the replay's logits from the eager step's and whether their draws agree; a capture
/// that fails prints its error in the line instead.
#[cfg(feature = "cuda")]
fn graph(
    mut model: Model,
    (batch, prompt_len, at): (usize, usize, usize),
    iters: usize,
    adapter_rank: usize,
) -> Result<()> {
    use rlhost::model::KvCache;
    use rlhost::model::kernels::graph;
    use rlhost::sampler::device_draw::draw_table;
    if adapter_rank > 0 {
        attach_sampled_lora(&mut model, adapter_rank)?;
    }
    let set = (adapter_rank > 0)
        .then(|| model.adapter_snapshot(0))
        .transpose()?;
    let mode = Mode {
        adapter: set.as_ref(),
        ..Mode::INFERENCE
    };
    let dev = model.device().clone();
    let vocab = model.cfg.vocab_size.min(500) as u32;
    let mut caches: Vec<KvCache> = (0..batch).map(|_| model.new_cache()).collect();
    {
        let prompts: Vec<Vec<u32>> = (0..batch)
            .map(|i| ids(prompt_len, vocab as usize, i as u64))
            .collect();
        let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
        let toks: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        model.forward_cached(&mut refs, &toks, mode, false)?;
        for step in 0..at {
            let next: Vec<[u32; 1]> = (0..batch)
                .map(|i| [(i as u32 * 31 + step as u32 * 7) % vocab])
                .collect();
            let toks: Vec<&[u32]> = next.iter().map(|t| &t[..]).collect();
            model.forward_cached(&mut refs, &toks, mode, false)?;
        }
    }
    let params = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::default()
    };
    let u: Vec<f32> = (0..batch)
        .map(|i| (i as f32 + 0.5) / batch as f32)
        .collect();
    let next = Tensor::from_vec((0..batch as u32).map(|i| i % vocab).collect(), batch, &dev)?;
    let step = |caches: &mut [KvCache]| -> candle_core::Result<(Tensor, Tensor)> {
        let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
        let logits = model.forward_cached_ids(&mut refs, &next, mode)?;
        let table = draw_table(&logits, &u, &params)?;
        Ok((logits, table))
    };
    let forget = |caches: &mut [KvCache]| -> Result<()> {
        for c in caches.iter_mut() {
            c.forget_last()?;
        }
        Ok(())
    };
    // Eager, as the engine runs it (no upload cache).
    step(&mut caches)?;
    forget(&mut caches)?;
    dev.synchronize()?;
    let t = Instant::now();
    for _ in 0..iters {
        step(&mut caches)?;
        forget(&mut caches)?;
    }
    dev.synchronize()?;
    let eager_ms = t.elapsed().as_secs_f64() / iters as f64 * 1e3;
    let mut line = serde_json::json!({"impl": "rlhost", "mode": "graph", "batch": batch,
        "position": prompt_len + at, "adapter_rank": adapter_rank,
        "placement": model.placement().describe(), "eager_step_ms": eager_ms});
    // Once more under the upload cache, which fills it; then the same step captured.
    let _cache = graph::upload_cache(&dev)?;
    let (logits, table) = step(&mut caches)?;
    let (logits, table) = (logits.to_vec2::<f32>()?, table.to_vec2::<f32>()?);
    forget(&mut caches)?;
    let logits_out = Tensor::zeros((batch, logits[0].len()), DType::F32, &dev)?;
    let table_out = Tensor::zeros((batch, 3), DType::F32, &dev)?;
    let captured = graph::capture(&dev, || {
        let (l, t) = step(&mut caches)?;
        logits_out.slice_set(&l, 0, 0)?;
        table_out.slice_set(&t, 0, 0)
    });
    forget(&mut caches)?;
    let g = match captured {
        Ok(g) => g,
        Err(e) => {
            line["capture_error"] = format!("{e}").into();
            println!("{line}");
            return Ok(());
        }
    };
    g.upload()?;
    g.replay()?;
    let (replayed, drawn) = (logits_out.to_vec2::<f32>()?, table_out.to_vec2::<f32>()?);
    let diff = logits
        .iter()
        .flatten()
        .zip(replayed.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    dev.synchronize()?;
    let t = Instant::now();
    for _ in 0..iters {
        g.replay()?;
    }
    dev.synchronize()?;
    let graph_ms = t.elapsed().as_secs_f64() / iters as f64 * 1e3;
    line["graph_step_ms"] = graph_ms.into();
    line["eager_over_graph"] = (eager_ms / graph_ms).into();
    line["logits_max_diff"] = diff.into();
    line["draws_equal"] = (drawn == table).into();
    println!("{line}");
    Ok(())
}

/// Times of single ops on the GPU at the 1.5B shape (12 query / 2 kv heads of 128, hidden
/// 1536, intermediate 8960) on `batch × seq` tokens, each the mean of `iters` runs between
/// device synchronisations: attention forward and forward + backward (the flash kernels
/// and the cuBLAS form), one LoRA projection forward + backward, and what candle's
/// backward adds per gradient edge (a zeros tensor and an add).
#[cfg(feature = "cuda")]
fn ops(at: &Placement, batch: usize, seq: usize, iters: usize) -> Result<()> {
    use candle_core::Var;
    use rlhost::model::kernels::{attention, flash};
    let dev = at.device.clone();
    let dt = at.dtype;
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        f()?;
        dev.synchronize()?;
        let t = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        dev.synchronize()?;
        Ok(t.elapsed().as_secs_f64() / iters as f64 * 1e3)
    };
    let rand = |shape: &[usize]| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1.0, shape, &dev)?.to_dtype(dt)?)
    };
    let (g, r, d) = (2, 6, 128);
    let q = Var::from_tensor(&rand(&[batch, g, r * seq, d])?)?;
    let k = Var::from_tensor(&rand(&[batch, g, seq, d])?)?;
    let v = Var::from_tensor(&rand(&[batch, g, seq, d])?)?;
    let am = Tensor::ones((batch, seq), DType::U32, &dev)?;
    let mask = rlhost::model::decoder::batch_mask(&am)?;
    let ids = rlhost::model::decoder::sequence_ids(&am)?;
    let scale = 1.0 / (d as f64).sqrt();
    let mut rows = Vec::new();
    // (q, k, v, the additive mask, the sequence ids it was made from, scale): the flash
    // kernels read the ids, the cuBLAS form the mask.
    type Attn = fn(&Tensor, &Tensor, &Tensor, &Tensor, &Tensor, f64) -> candle_core::Result<Tensor>;
    let variants: [(&str, Attn); 3] = [
        ("flash, 16 queries a backward step", |q, k, v, _, ids, s| {
            flash::attention_tuned(q, k, v, ids, s, 16)
        }),
        ("flash, 32 queries a backward step", |q, k, v, _, ids, s| {
            flash::attention_tuned(q, k, v, ids, s, 32)
        }),
        ("cublas", |q, k, v, m, _, s| {
            attention::cublas_attention(q, k, v, m, s)
        }),
    ];
    for (name, f) in variants {
        let (qt, kt, vt) = (q.detach(), k.detach(), v.detach());
        let fwd = time(&mut || {
            f(&qt, &kt, &vt, &mask, &ids, scale)?;
            Ok(())
        })?;
        let both = time(&mut || {
            let out = f(
                q.as_tensor(),
                k.as_tensor(),
                v.as_tensor(),
                &mask,
                &ids,
                scale,
            )?;
            out.sum_all()?.backward()?;
            Ok(())
        })?;
        rows.push(
            serde_json::json!({"op": format!("attention ({name})"), "forward_ms": fwd,
            "forward_backward_ms": both}),
        );
    }
    let x = Var::from_tensor(&rand(&[batch * seq, 1536])?)?;
    let w = rand(&[8960, 1536])?;
    let a = Var::from_tensor(&Tensor::randn(0f32, 0.02, (16, 1536), &dev)?)?;
    let b = Var::from_tensor(&Tensor::randn(0f32, 0.02, (8960, 16), &dev)?)?;
    let lora = |x: &Tensor| -> candle_core::Result<Tensor> {
        rlhost::model::kernels::lora::lora_linear(x, &w, None, a.as_tensor(), b.as_tensor(), 2.0)
    };
    let fwd = time(&mut || {
        lora(&x.detach())?;
        Ok(())
    })?;
    let both = time(&mut || {
        lora(x.as_tensor())?.sum_all()?.backward()?;
        Ok(())
    })?;
    rows.push(
        serde_json::json!({"op": "LoRA projection 1536→8960 r16", "forward_ms": fwd,
        "forward_backward_ms": both}),
    );
    let big = rand(&[batch * seq, 8960])?;
    let edge = time(&mut || {
        big.zeros_like()?.add(&big)?;
        Ok(())
    })?;
    rows.push(
        serde_json::json!({"op": "a gradient edge: zeros + add, [tokens, 8960]",
        "forward_ms": edge}),
    );
    for row in &rows {
        println!("{row}");
    }
    Ok(())
}

/// Resets the process's peak RSS (`VmHWM`) to its current RSS (Linux: `clear_refs` 5).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// The peak RSS since the last reset, in GB (`VmHWM` of `/proc/self/status`; 0 where
/// there is none).
fn peak_rss_gb() -> f64 {
    status_gb("VmHWM:")
}

/// The RSS now, in GB.
fn rss_gb() -> f64 {
    status_gb("VmRSS:")
}

/// A `kB` field of `/proc/self/status` in GB (0 where there is none).
fn status_gb(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb * 1024.0 / 1e9)
}

/// Memory read bandwidth: `threads` threads each summing its share of a large buffer.
fn bandwidth(mib: usize, threads: usize) -> Result<()> {
    let n = mib * 1024 * 1024 / 4;
    let data: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let chunk = n.div_ceil(threads);
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let total: f64 = std::thread::scope(|s| {
            let hs: Vec<_> = data
                .chunks(chunk)
                .map(|c| {
                    s.spawn(move || {
                        // Eight accumulators so the adds do not serialise on one register.
                        let mut acc = [0f32; 8];
                        for w in c.chunks_exact(8) {
                            for k in 0..8 {
                                acc[k] += w[k];
                            }
                        }
                        acc.iter().map(|&x| x as f64).sum::<f64>()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(total);
        best = best.max((n * 4) as f64 / secs / 1e9);
    }
    println!(
        "{}",
        serde_json::json!({"mode": "bandwidth", "threads": threads, "mib": mib, "gb_per_s": best})
    );
    Ok(())
}
