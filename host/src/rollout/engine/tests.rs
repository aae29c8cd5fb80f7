//! The engine's tests: prompts against the length limit, waiting for plugin answers,
//! group sampling independent of the batch, a batch sampled from an adapter snapshot.

use super::*;
use crate::model::Placement;
use crate::model::fixtures;
use crate::rollout::settings::RolloutLimits;
use serde_json::Map;

fn settings(lm: &LanguageModel, group_size: usize) -> RolloutSettings {
    let mut sampling = crate::sampler::draw::defaults(lm).unwrap();
    sampling.temperature = 1.0;
    sampling.top_k = 0;
    sampling.top_p = 1.0;
    sampling.max_new_tokens = 10;
    RolloutSettings {
        group_size,
        sampling,
        limits: RolloutLimits::default(),
        template_kwargs: Map::new(),
        env: Default::default(),
        remote: None,
        tree: None,
    }
}

fn tokens(groups: &[Group]) -> Vec<Vec<Vec<u32>>> {
    groups
        .iter()
        .map(|g| g.trajectories.iter().map(|t| t.tokens.clone()).collect())
        .collect()
}

/// A prompt that cannot fit is refused before anything decodes, naming the sample and
/// the setting; the prompts that fit are counted.
#[test]
fn prompts_are_checked_against_the_length_limit() {
    let lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .unwrap();
    let rewards = Rewards::none();
    let mut s = settings(&lm, 1);
    let short = (1, Sample::from_prompt("Hi"));
    let long = (7, Sample::from_prompt(&"many words ".repeat(40)));
    let fits = Engine::new(&lm, &s, &rewards, rt.handle().clone())
        .unwrap()
        .prompt_tokens(&short.1)
        .unwrap()
        .len();
    s.limits.max_total_tokens = fits + 1;
    let engine = Engine::new(&lm, &s, &rewards, rt.handle().clone()).unwrap();
    let mut stats = BatchStats::default();
    assert_eq!(
        engine
            .starts(std::slice::from_ref(&short), 0, &mut stats)
            .unwrap()[0]
            .prompt
            .len(),
        fits
    );
    assert_eq!(stats.prompt_tokens, fits);
    let e = engine
        .starts(&[short, long], 0, &mut stats)
        .err()
        .expect("the long prompt is refused")
        .to_string();
    assert!(
        e.starts_with("sample 7's prompt has") && e.contains("rollout.max_total_tokens is"),
        "{e}"
    );
}

/// The decode loop takes plugin answers without waiting while it has work, and waits
/// (counting the wait as the tool's) only when asked to.
#[test]
fn a_batch_waits_for_plugin_answers_only_when_told_to() {
    let (tx, rx) = mpsc::channel::<Arrival>();
    let mut batch = InFlight {
        lives: Vec::new(),
        done: Vec::new(),
        stats: BatchStats::default(),
        scoring: 0,
        scored: 0,
        tx: tx.clone(),
        rx,
        asked: Default::default(),
        tally: Default::default(),
        remote: false,
        prefilled: false,
    };
    assert!(batch.next_event(None).unwrap().is_none());
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        let _ = tx.send(Arrival::Scored(3, Vec::new(), Duration::ZERO));
    });
    let event = batch.next_event(Some(Duration::from_secs(60))).unwrap();
    assert!(matches!(event, Some(Arrival::Scored(3, _, _))));
    assert!(
        batch.stats.plugin_wait_s >= 0.02,
        "{}",
        batch.stats.plugin_wait_s
    );
}

/// A sample's trajectories do not depend on what else is in the batch: prefilling a
/// prompt once for its group gives the same tokens as running it alone, and the
/// same seed gives the same tokens.
#[test]
fn group_sampling_is_independent_of_the_batch() {
    let lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .unwrap();
    let rewards = Rewards::none();
    let s = settings(&lm, 3);
    let engine = Engine::new(&lm, &s, &rewards, rt.handle().clone()).unwrap();
    let a = (4, Sample::from_prompt("Tell me a story."));
    let b = (9, Sample::from_prompt("What is 2+2?"));
    let (both, stats) = engine
        .run(&[a.clone(), b.clone()], 5, 0, Mode::INFERENCE)
        .unwrap();
    let (alone, _) = engine
        .run(std::slice::from_ref(&b), 5, 0, Mode::INFERENCE)
        .unwrap();
    assert_eq!(tokens(&both)[1], tokens(&alone)[0]);
    let (again, _) = engine.run(&[a.clone(), b], 5, 0, Mode::INFERENCE).unwrap();
    assert_eq!(tokens(&both), tokens(&again));
    let (other_seed, _) = engine.run(&[a], 6, 0, Mode::INFERENCE).unwrap();
    assert_ne!(tokens(&both)[0], tokens(&other_seed)[0]);
    // The group's samples differ and share the prompt.
    let g = &both[0].trajectories;
    assert_ne!(g[0].tokens, g[1].tokens);
    assert_eq!(
        g[0].tokens[..g[0].prompt_len],
        g[1].tokens[..g[1].prompt_len]
    );
    assert_eq!(stats.trajectories, 6);
    assert!(g.iter().all(|t| t.loss_mask().iter().all(|&m| m == 1)));
}

/// Issue 22: with `max_staleness > 0` AdamW wrote the adapter in place while the
/// producer decoded, so a batch labelled version v could mix v and v + 1 across
/// layers. Sampling from a snapshot gives exactly the tokens of version v, however
/// the live adapter changes meanwhile.
#[test]
fn a_batch_sampled_from_a_snapshot_is_that_version_exactly() {
    let mut lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
    lm.model
        .attach_lora(&crate::model::LoraConfig::default(), 3)
        .unwrap();
    let vars = lm.model.lora_vars();
    let shift = |by: f64| {
        for (name, v) in &vars {
            if name.ends_with("lora_B") {
                v.set(&(v.as_tensor() + by).unwrap()).unwrap();
            }
        }
    };
    shift(0.05);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .unwrap();
    let rewards = Rewards::none();
    let s = settings(&lm, 2);
    let engine = Engine::new(&lm, &s, &rewards, rt.handle().clone()).unwrap();
    let samples = [(1, Sample::from_prompt("Tell me a story."))];
    let (v0, _) = engine.run(&samples, 5, 0, Mode::INFERENCE).unwrap();
    let snapshot = lm.model.adapter_snapshot(0).unwrap();
    let from_snapshot = Mode {
        adapter: Some(&snapshot),
        ..Mode::INFERENCE
    };
    // The optimizer steps again and again while the batch is sampled.
    let done = std::sync::atomic::AtomicBool::new(false);
    let (during, _) = std::thread::scope(|scope| {
        scope.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                shift(0.01);
            }
        });
        let r = engine.run(&samples, 5, 0, from_snapshot).unwrap();
        done.store(true, Ordering::Relaxed);
        r
    });
    assert_eq!(tokens(&during), tokens(&v0));
    let logps = |g: &[Group]| g[0].trajectories[0].logps.clone();
    assert_eq!(logps(&during), logps(&v0));
    // The live adapter has moved on: sampling from it gives other tokens.
    shift(0.5);
    let (live, _) = engine.run(&samples, 5, 0, Mode::INFERENCE).unwrap();
    assert_ne!(logps(&live), logps(&v0));
}
