//! The Tinker API's work run inside rlhost directly, for `bench/tinker_speed.py` to set
//! against the same work through the API: a `forward_backward` (cross-entropy) and an
//! `optim_step` on a fresh adapter, and sampling, with the same code the server runs
//! (`rlhost::tinker::worker::forward_backward`, the adapter's step, the sampler with the
//! adapter on each request), on the same model and workload; and the same sampling through
//! `generate` with the adapter as the mode's. Prints one JSON object of per-round seconds.
//!
//! ```sh
//! cargo run --release --example tinker_direct -- MODEL_DIR ROWS LEN RANK ROUNDS SAMPLES SAMPLE_TOKENS
//! ```

use anyhow::{Context, Result};
use rlhost::model::placement::{DTypeChoice, DeviceChoice};
use rlhost::model::{LanguageModel, Mode, Placement};
use rlhost::rl::optim::AdamWConfig;
use rlhost::sampler::decode::Completion;
use rlhost::sampler::draw::SamplingParams;
use rlhost::sampler::generate;
use rlhost::sampler::{Request, Sampler, Sink, Token};
use rlhost::tinker::adapter::{Adapter, attach_host, lora_config};
use rlhost::tinker::losses::Loss;
use rlhost::tinker::worker::{CheckedDatum, forward_backward};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// Counts finished requests.
struct Count(Arc<AtomicUsize>);

impl Sink for Count {
    fn token(&mut self, _: Token) -> bool {
        true
    }
    fn done(&mut self, _: usize, _: Completion) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    fn failed(&mut self, message: &str) {
        eprintln!("a request failed: {message}");
    }
}

fn main() -> Result<()> {
    // As the rlhost binary sets the process up (allocator, compute threads).
    rlhost::model::compute::set_up_process();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: tinker_direct MODEL_DIR ROWS LEN RANK ROUNDS SAMPLES SAMPLE_TOKENS";
    let [dir, rows, len, rank, rounds, samples, sample_tokens] = &args[..] else {
        anyhow::bail!("{usage}");
    };
    let num = |s: &str| {
        s.parse::<usize>()
            .with_context(|| format!("{s:?}: {usage}"))
    };
    let (rows, len, rank, rounds, samples, sample_tokens) = (
        num(rows)?,
        num(len)?,
        num(rank)?,
        num(rounds)?,
        num(samples)?,
        num(sample_tokens)?,
    );
    let mut lm = LanguageModel::open(
        &PathBuf::from(dir),
        &Placement::open(DeviceChoice::Auto, DTypeChoice::Auto)?,
    )?;
    attach_host(&mut lm.model)?;
    let vocab = lm.tokenizer.vocab_size() as u32;
    // The bench's workload: fixed pseudo-random ids (the timings do not depend on them).
    let id = |i: usize| ((i as u64 * 2_654_435_761) % vocab as u64) as u32;
    let data: Vec<CheckedDatum> = (0..rows)
        .map(|r| {
            let seq: Vec<u32> = (0..=len).map(|t| id(r * 7919 + t)).collect();
            CheckedDatum {
                tokens: seq[..len].to_vec(),
                targets: seq[1..].to_vec(),
                inputs: HashMap::from([("weights".to_string(), vec![1.0; len])]),
            }
        })
        .collect();
    let mut adapter = Adapter::fresh(&lm.model, lora_config(rank, true, true, false)?, false, 0)?;
    let adam = AdamWConfig {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-12,
        weight_decay: 0.0,
    };
    let mut step_s = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        forward_backward(&lm, &mut adapter, &data, Loss::CrossEntropy, false)?;
        adapter.step(1e-4, adam, 0.0)?;
        step_s.push(t.elapsed().as_secs_f64());
    }
    let snapshot = adapter.snapshot(&lm.model, 1)?;
    let prompts: Vec<Vec<u32>> = (0..samples)
        .map(|p| (0..16).map(|t| id(p * 104_729 + t)).collect())
        .collect();
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: sample_tokens,
        seed: 1,
        ..SamplingParams::default()
    };
    // As the server samples: every prompt a request carrying the adapter, one sampler.
    let snapshot = Arc::new(snapshot);
    let mut sample_s = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        let mut sampler = Sampler::new(&lm.model, &lm.tokenizer, Mode::INFERENCE);
        let done = Arc::new(AtomicUsize::new(0));
        for p in &prompts {
            let request = Request {
                adapter: Some(snapshot.clone()),
                ..Request::new(p.clone(), 1, params.clone())
            };
            sampler.admit(request, Box::new(Count(done.clone())));
        }
        while !sampler.is_empty() {
            sampler.step()?;
        }
        anyhow::ensure!(
            done.load(Ordering::Relaxed) == prompts.len(),
            "a request failed"
        );
        sample_s.push(t.elapsed().as_secs_f64());
    }
    // The same sampling through `generate` with the adapter as the mode's (the trainer's
    // rollouts with a snapshot), for comparison.
    let mode = Mode {
        adapter: Some(&snapshot),
        ..Mode::INFERENCE
    };
    let mut generate_s = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        generate(&lm.model, &lm.tokenizer, &prompts, 1, &params, mode)?;
        generate_s.push(t.elapsed().as_secs_f64());
    }
    println!(
        "{}",
        serde_json::json!({"step_s": step_s, "sample_s": sample_s, "generate_s": generate_s})
    );
    Ok(())
}
