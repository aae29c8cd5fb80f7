//! The direct side of `bench/gateway_speed.py`: the requests the bench sends through the
//! gateway, sampled by the same in-process sampler with no HTTP in between. SESSIONS
//! prompts of PROMPT_LEN fixed pseudo-random ids (the bench computes the same ids), each
//! one request of MAX_TOKENS at temperature 1 seeded `1000 + i`, all admitted at once; each
//! round prints one JSON line with its wall time and the tokens sampled.
//!
//!     gateway_direct MODEL_DIR SESSIONS PROMPT_LEN MAX_TOKENS ROUNDS VOCAB

use anyhow::{Context, Result};
use rlhost::model::placement::{DTypeChoice, DeviceChoice};
use rlhost::model::{LanguageModel, Mode, Placement};
use rlhost::sampler::decode::Completion;
use rlhost::sampler::draw::SamplingParams;
use rlhost::sampler::{Request, Sampler, Sink, Token};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// Counts the tokens sampled.
struct Count(Arc<AtomicUsize>);

impl Sink for Count {
    fn token(&mut self, _: Token) -> bool {
        self.0.fetch_add(1, Ordering::Relaxed);
        true
    }
    fn done(&mut self, _: usize, _: Completion) {}
    fn failed(&mut self, message: &str) {
        eprintln!("gateway_direct: a request failed: {message}");
        std::process::exit(1);
    }
}

fn main() -> Result<()> {
    // As the rlhost binary sets the process up (allocator, compute threads).
    rlhost::model::compute::set_up_process();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: gateway_direct MODEL_DIR SESSIONS PROMPT_LEN MAX_TOKENS ROUNDS VOCAB";
    let [dir, sessions, prompt_len, max_tokens, rounds, vocab] = &args[..] else {
        anyhow::bail!("{usage}");
    };
    let num = |s: &str| {
        s.parse::<usize>()
            .with_context(|| format!("{s:?}: {usage}"))
    };
    let (sessions, prompt_len, max_tokens, rounds, vocab) = (
        num(sessions)?,
        num(prompt_len)?,
        num(max_tokens)?,
        num(rounds)?,
        num(vocab)? as u64,
    );
    let lm = LanguageModel::open(
        &PathBuf::from(dir),
        &Placement::open(DeviceChoice::Auto, DTypeChoice::Auto)?,
    )?;
    // The bench's ids: the same formula in bench/gateway_speed.py.
    let prompt = |i: usize| -> Vec<u32> {
        (0..prompt_len)
            .map(|t| (((i * 7919 + t) as u64 * 2_654_435_761) % vocab) as u32)
            .collect()
    };
    for _ in 0..rounds {
        let tokens = Arc::new(AtomicUsize::new(0));
        let mut sampler = Sampler::new(&lm.model, &lm.tokenizer, Mode::INFERENCE);
        let t0 = Instant::now();
        for i in 0..sessions {
            // As the gateway asks for a completion: the model's end-of-turn ids stop it.
            let params = SamplingParams {
                temperature: 1.0,
                max_new_tokens: max_tokens,
                stop_token_ids: lm.eos_token_ids.clone(),
                seed: 1000 + i as u64,
                ..SamplingParams::default()
            };
            sampler.admit(
                Request::new(prompt(i), 1, params),
                Box::new(Count(tokens.clone())),
            );
        }
        while !sampler.is_empty() {
            sampler.step()?;
        }
        println!(
            "{}",
            serde_json::json!({
                "wall_s": t0.elapsed().as_secs_f64(),
                "tokens": tokens.load(Ordering::Relaxed),
            })
        );
    }
    Ok(())
}
