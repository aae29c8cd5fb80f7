//! The rollout engine with the real tools in the loop: the calculator and the Python code
//! tool as triggers, guess_number as an environment, the hostile plugin misbehaving.
//!
//! A random tiny model never writes `</calc>` on its own, so the fixture model is first
//! taught (a LoRA adapter fitted by a few hundred AdamW steps, in-process) to produce a
//! tool call for each test prompt and to answer after the tool's output. Everything the
//! tests check — which tokens are inserted, the loss mask, resuming from the cache, the
//! log-probs — comes from the real engine, model and plugins.

use super::{load_with, tokio_runtime};
use candle_core::{DType, Device, Tensor};
use rlhost::model::{LanguageModel, LoraConfig, Mode, Placement};
use rlhost::plugin::{Limits, Message, Sample};
use rlhost::rl::sft::{self, SftOptions, SftRow};
use rlhost::rollout::{
    Answerers, Engine, Group, RewardSpec, Rewards, RolloutLimits, RolloutSettings, SpanKind,
    StopReason, ToolSpec, Trajectory,
};
use serde_json::json;
use std::path::PathBuf;
use std::sync::OnceLock;

pub(super) fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/qwen2")
}

pub(super) fn msg(role: &str, content: &str) -> Message {
    Message {
        role: role.into(),
        content: content.into(),
        ..Default::default()
    }
}

pub(super) fn sample(prompt: &str, metadata: serde_json::Value) -> Sample {
    Sample {
        messages: vec![msg("user", prompt)],
        metadata,
    }
}

const CALC: &str = "What is 7*8?";
const CODE: &str = "Compute 6*7 in Python.";
pub(super) const GUESS: &str = "Guess my number (1-100).";
const GO: &str = "Go.";

/// The conversations the model is taught, as chat messages after each prompt. Tool
/// outputs appear as the real tools write them.
fn lessons() -> Vec<(&'static str, Vec<Message>)> {
    vec![
        (
            CALC,
            vec![msg(
                "assistant",
                "<calc>7*8</calc><result>56</result><answer>7*8</answer>",
            )],
        ),
        (
            CODE,
            vec![msg(
                "assistant",
                "```python\nprint(6*7)\n```\n<output>\n42\n</output>\n<answer>42</answer>",
            )],
        ),
        (
            GUESS,
            vec![
                msg("assistant", "50"),
                msg("user", "50 is too high. Lower."),
                msg("assistant", "25"),
                msg("user", "25 is too low. Higher."),
                msg("assistant", "37"),
            ],
        ),
        (GO, vec![msg("assistant", "<go>1</go><answer>1</answer>")]),
    ]
}

/// The qwen2 fixture with an adapter fitted to [`lessons`], shared by the tests.
pub(super) fn taught() -> &'static LanguageModel {
    static LM: OnceLock<LanguageModel> = OnceLock::new();
    LM.get_or_init(|| {
        let mut lm = LanguageModel::open(&fixture_dir(), &Placement::CPU).unwrap();
        let chat = lm.chat().unwrap();
        // Prompt and whole conversation rendered by the template; the model learns the
        // tokens after the prompt, up to the last <|im_end|>.
        let mut rows: Vec<(usize, Vec<u32>)> = Vec::new();
        for (prompt, turns) in lessons() {
            let user = [json!({"role": "user", "content": prompt})];
            let head = chat.render(&user, None, true).unwrap();
            let all: Vec<_> = user
                .iter()
                .cloned()
                .chain(
                    turns
                        .iter()
                        .map(|m| json!({"role": m.role, "content": m.content})),
                )
                .collect();
            let full = chat.render(&all, None, false).unwrap();
            let full = full.strip_suffix('\n').unwrap();
            let head_ids = lm.tokenizer.encode(&head).unwrap();
            let mut ids = head_ids.clone();
            ids.extend(lm.tokenizer.encode(&full[head.len()..]).unwrap());
            rows.push((head_ids.len(), ids));
        }
        let cfg = LoraConfig {
            r: 16,
            alpha: 32.0,
            ..LoraConfig::default()
        };
        lm.model.attach_lora(&cfg, 0).unwrap();
        fit(&lm, &rows, 400);
        lm
    })
}

/// Fits the adapter to the rows' tokens after each prompt.
fn fit(lm: &LanguageModel, rows: &[(usize, Vec<u32>)], steps: usize) {
    let rows: Vec<SftRow> = rows
        .iter()
        .map(|(prompt_len, ids)| SftRow {
            tokens: ids.clone(),
            loss_mask: (0..ids.len()).map(|i| u8::from(i >= *prompt_len)).collect(),
        })
        .collect();
    let opts = SftOptions {
        steps,
        lr: 1e-2,
        target_loss: 2e-3,
        pack_sequences: false,
    };
    let losses = sft::fit(&lm.model, &rows, &opts).unwrap();
    let last = *losses.last().unwrap();
    assert!(last < 0.05, "the lessons were not learnt: loss {last}");
}

fn settings(trigger: Option<ToolSpec>, environment: Option<ToolSpec>) -> RolloutSettings {
    settings_for(taught(), trigger, environment)
}

/// Greedy sampling of `lm`, two trajectories a prompt.
pub(super) fn settings_for(
    lm: &LanguageModel,
    trigger: Option<ToolSpec>,
    environment: Option<ToolSpec>,
) -> RolloutSettings {
    let mut sampling = rlhost::sampler::draw::defaults(lm).unwrap();
    sampling.temperature = 0.0;
    sampling.max_new_tokens = 48;
    RolloutSettings {
        group_size: 2,
        sampling,
        limits: RolloutLimits::default(),
        template_kwargs: Default::default(),
        env: Answerers {
            trigger,
            environment,
            ..Default::default()
        },
        remote: None,
        tree: None,
    }
}

pub(super) fn tool(
    rt: &tokio::runtime::Runtime,
    name: &str,
    config: &str,
    limits: Limits,
) -> ToolSpec {
    ToolSpec {
        plugin: rt.block_on(load_with(name, limits)),
        config: config.into(),
    }
}

pub(super) fn run(
    rt: &tokio::runtime::Runtime,
    settings: &RolloutSettings,
    rewards: &Rewards,
    samples: &[(u64, Sample)],
) -> Vec<Group> {
    let engine = Engine::new(taught(), settings, rewards, rt.handle().clone()).unwrap();
    engine.run(samples, 7, 0, Mode::INFERENCE).unwrap().0
}

/// The ids a fresh full forward over the final sequence predicts at each sampled
/// position (greedy), and its log-probs of the sampled tokens.
fn full_forward(lm: &LanguageModel, t: &Trajectory) -> (Vec<u32>, Vec<f32>) {
    let model = &lm.model;
    let n = t.tokens.len() - 1;
    let dev = Device::Cpu;
    let input = Tensor::new(&t.tokens[..n], &dev)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let target = Tensor::new(&t.tokens[1..], &dev)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let attn = Tensor::ones((1, n), DType::U32, &dev).unwrap();
    let pos = Tensor::arange(0u32, n as u32, &dev)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let hidden = model
        .forward_batch(&input, &attn, &pos, Mode::INFERENCE)
        .unwrap();
    let argmax = model
        .logits(&hidden)
        .unwrap()
        .argmax(2)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1::<u32>()
        .unwrap();
    let (logp, _) = model.logprobs(&hidden, &target).unwrap();
    let logp = logp.squeeze(0).unwrap().to_vec1::<f32>().unwrap();
    let from = t.prompt_len - 1;
    (argmax[from..].to_vec(), logp[from..].to_vec())
}

/// The sequence is exactly prompt + sampled and inserted ids; what a full forward over it
/// predicts is what was sampled, with the same log-probs (the cache and the inserted
/// tokens' resumption are right).
fn assert_consistent(t: &Trajectory) {
    assert_consistent_with(taught(), t);
}

fn assert_consistent_with(lm: &LanguageModel, t: &Trajectory) {
    let (argmax, logp) = full_forward(lm, t);
    let completion = t.completion_tokens();
    assert_eq!(t.logps.len(), completion.len());
    for (i, (&id, lp)) in completion.iter().zip(&t.logps).enumerate() {
        if let Some(lp) = lp {
            assert_eq!(
                argmax[i], id,
                "greedy token {i} differs from a full forward"
            );
            assert!(
                (lp - logp[i]).abs() < 1e-4,
                "token {i}: sampled log-prob {lp} vs full forward {}",
                logp[i]
            );
        }
    }
    // Spans tile the completion, and the mask is 0 exactly on inserted spans.
    let mask = t.loss_mask();
    let mut at = 0;
    for s in &t.spans {
        assert_eq!(s.start, at);
        let want = u8::from(s.kind == SpanKind::Model);
        assert!(mask[s.start..s.end].iter().all(|&m| m == want), "{s:?}");
        at = s.end;
    }
    assert_eq!(at, completion.len());
    let decoded = lm.tokenizer.decode(completion, false).unwrap();
    assert_eq!(t.completion, decoded);
}

fn inserted(t: &Trajectory) -> Vec<(SpanKind, &str)> {
    t.spans
        .iter()
        .filter(|s| s.kind != SpanKind::Model)
        .map(|s| (s.kind, s.text.as_str()))
        .collect()
}

#[test]
fn calculator_fires_mid_generation_and_decoding_resumes() {
    let rt = tokio_runtime();
    let s = settings(Some(tool(&rt, "calculator", "{}", Limits::default())), None);
    let groups = run(&rt, &s, &Rewards::none(), &[(3, sample(CALC, json!({})))]);
    let tok = &taught().tokenizer;
    for t in &groups[0].trajectories {
        assert_eq!(
            t.completion,
            "<calc>7*8</calc><result>56</result><answer>7*8</answer><|im_end|>"
        );
        assert_eq!(inserted(t), [(SpanKind::Tool, "<result>56</result>")]);
        // The tool's text went in as its own tokens, masked out.
        let span = t.spans.iter().find(|s| s.kind == SpanKind::Tool).unwrap();
        assert_eq!(
            &t.completion_tokens()[span.start..span.end],
            tok.encode("<result>56</result>").unwrap().as_slice()
        );
        assert_eq!(
            (t.stop, t.tool_calls, t.turns),
            (StopReason::EndOfTurn, 1, 1)
        );
        assert_eq!(t.messages.last().unwrap().role, "assistant");
        assert!(t.faults.is_empty());
        assert_consistent(t);
    }
}

#[test]
fn python_tool_fires_on_the_closing_fence_only() {
    let rt = tokio_runtime();
    let s = settings(
        Some(tool(&rt, "code_trigger", "{}", Limits::default())),
        None,
    );
    let groups = run(&rt, &s, &Rewards::none(), &[(0, sample(CODE, json!({})))]);
    let t = &groups[0].trajectories[0];
    assert_eq!(
        inserted(t),
        [(SpanKind::Tool, "\n<output>\n42\n</output>\n")]
    );
    assert!(
        t.completion.ends_with("<answer>42</answer><|im_end|>"),
        "{}",
        t.completion
    );
    assert_eq!(t.tool_calls, 1);
    assert_consistent(t);
}

#[test]
fn environment_episode_renders_exactly_as_the_chat_template() {
    let rt = tokio_runtime();
    let s = settings(
        None,
        Some(tool(&rt, "guess_number", "{}", Limits::default())),
    );
    let groups = run(
        &rt,
        &s,
        &Rewards::none(),
        &[(1, sample(GUESS, json!({"secret": 37})))],
    );
    let t = &groups[0].trajectories[0];
    let mut want = vec![msg("user", GUESS)];
    want.extend(lessons()[2].1.clone());
    assert_eq!(t.messages, want);
    assert_eq!((t.stop, t.turns, t.tool_calls), (StopReason::EnvDone, 3, 2));
    assert_eq!(t.rewards.get("env"), Some(&1.0));
    assert_eq!(t.reward, 1.0);
    // Prompt + completion is the template's rendering of the whole conversation (which
    // ends with the glue's newline after the final <|im_end|>).
    let lm = taught();
    let json: Vec<_> = t
        .messages
        .iter()
        .map(|m| json!({"role": m.role, "content": m.content}))
        .collect();
    let rendered = lm.chat().unwrap().render(&json, None, false).unwrap();
    let decoded = lm.tokenizer.decode(&t.tokens, false).unwrap();
    assert_eq!(format!("{decoded}\n"), rendered);
    assert!(inserted(t).iter().all(|(k, _)| *k == SpanKind::Env));
    assert_consistent(t);
}

/// Qwen3's rule for earlier thinking, written for this test: an assistant turn before the
/// last user message loses its `<think>` block when the conversation is rendered again.
const DROPS_THINKING: &str = "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}{%- for m in messages %}{%- set c = m.content %}{%- if m.role == 'assistant' and loop.index0 < ns.last and '</think>' in c %}{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{{- '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// An environment episode on a model whose template rewrites earlier turns (Qwen3's drops
/// their thinking): the episode runs, and its tokens are the history as the model saw it
/// (every `<think>` block kept), not a re-render of the conversation, which would drop
/// them. The model is the qwen2 fixture with that template, taught the episode as
/// `sft::conversation_row` writes it: the same tokens rollouts produce.
#[test]
fn an_episode_keeps_the_thinking_a_template_would_drop() {
    let dir = rlhost_tests::temp_dir("drops-thinking");
    for entry in std::fs::read_dir(fixture_dir()).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
        }
    }
    std::fs::write(dir.join("chat_template.jinja"), DROPS_THINKING).unwrap();
    let mut lm = LanguageModel::open(&dir, &Placement::CPU).unwrap();
    let episode = vec![
        msg("user", GUESS),
        msg("assistant", "<think>\nstart in the middle\n</think>\n50"),
        msg("user", "50 is too high. Lower."),
        msg("assistant", "<think>\nhalve it\n</think>\n25"),
        msg("user", "25 is too low. Higher."),
        msg("assistant", "<think>\nbetween them\n</think>\n37"),
    ];
    // The template does drop the earlier thinking when it renders the whole episode.
    let as_json: Vec<_> = episode
        .iter()
        .map(|m| json!({"role": m.role, "content": m.content}))
        .collect();
    let rerendered = lm.chat().unwrap().render(&as_json, None, false).unwrap();
    assert_eq!(rerendered.matches("<think>").count(), 1, "{rerendered}");

    let row = sft::conversation_row(&lm, &episode, &Default::default()).unwrap();
    let cfg = LoraConfig {
        r: 16,
        alpha: 32.0,
        ..LoraConfig::default()
    };
    lm.model.attach_lora(&cfg, 0).unwrap();
    let opts = SftOptions {
        steps: 400,
        lr: 1e-2,
        target_loss: 2e-3,
        pack_sequences: false,
    };
    let losses = sft::fit(&lm.model, std::slice::from_ref(&row), &opts).unwrap();
    assert!(*losses.last().unwrap() < 0.05, "not learnt: {losses:?}");

    let rt = tokio_runtime();
    let mut s = settings_for(
        &lm,
        None,
        Some(tool(&rt, "guess_number", "{}", Limits::default())),
    );
    s.group_size = 1;
    let rewards = Rewards::none();
    let engine = Engine::new(&lm, &s, &rewards, rt.handle().clone()).unwrap();
    let samples = [(1, sample(GUESS, json!({"secret": 37})))];
    let groups = engine.run(&samples, 7, 0, Mode::INFERENCE).unwrap().0;
    let t = &groups[0].trajectories[0];
    assert_eq!(t.messages, episode);
    assert_eq!((t.stop, t.turns, t.tool_calls), (StopReason::EnvDone, 3, 2));
    assert_eq!(t.rewards.get("env"), Some(&1.0));
    // Token for token what the model was taught, every thinking block in place, which no
    // rendering of the conversation gives.
    assert_eq!(t.tokens, row.tokens);
    let decoded = lm.tokenizer.decode(&t.tokens, false).unwrap();
    assert_eq!(decoded.matches("<think>").count(), 3, "{decoded}");
    assert_ne!(format!("{decoded}\n"), rerendered);
    assert!(inserted(t).iter().all(|(k, _)| *k == SpanKind::Env));
    assert_consistent_with(&lm, t);
}

#[test]
fn a_turn_limit_cuts_the_episode() {
    let rt = tokio_runtime();
    let mut s = settings(
        None,
        Some(tool(&rt, "guess_number", "{}", Limits::default())),
    );
    s.limits.max_turns = 2;
    let groups = run(
        &rt,
        &s,
        &Rewards::none(),
        &[(1, sample(GUESS, json!({"secret": 37})))],
    );
    let t = &groups[0].trajectories[0];
    assert_eq!(
        (t.stop, t.turns, t.truncated),
        (StopReason::MaxTurns, 2, true)
    );
    assert_eq!(t.rewards.get("env"), None, "no step gave a reward");
}

#[test]
fn a_hostile_trigger_yields_error_text_and_the_batch_completes() {
    let rt = tokio_runtime();
    let limits = Limits {
        timeout_ms: 300,
        memory_mib: 32,
        ..Limits::default()
    };
    for (mode, kind) in [
        ("panic", "trap"),
        ("loop", "timeout"),
        ("memory", "out-of-memory"),
    ] {
        let config = format!(r#"{{"mode": "{mode}"}}"#);
        let s = settings(Some(tool(&rt, "hostile", &config, limits.clone())), None);
        // The calculator prompt rides along: its trajectories never fire and finish
        // while the hostile calls hang or crash.
        let groups = run(
            &rt,
            &s,
            &Rewards::none(),
            &[(0, sample(GO, json!({}))), (1, sample(CALC, json!({})))],
        );
        assert_eq!(groups.len(), 2);
        for t in &groups[0].trajectories {
            let tools = inserted(t);
            assert_eq!(tools.len(), 1, "{mode}: {:?}", t.completion);
            assert!(
                tools[0].1.starts_with("<tool-error>"),
                "{mode}: {:?}",
                tools[0].1
            );
            assert_eq!(t.faults.len(), 1, "{mode}");
            assert_eq!(t.faults[0].kind, kind, "{mode}: {:?}", t.faults[0]);
            assert_eq!(t.faults[0].plugin, "hostile@0.1.0");
        }
        for t in &groups[1].trajectories {
            assert!(t.faults.is_empty() && t.tool_calls == 0, "{mode}");
        }
    }
}

#[test]
fn rewards_combine_weighted_components_and_fall_back_on_faults() {
    let rt = tokio_runtime();
    let countdown = rt.block_on(load_with("countdown", Limits::default()));
    let hostile = rt.block_on(load_with("hostile", Limits::default()));
    let rewards = rt
        .block_on(Rewards::open(
            vec![
                RewardSpec {
                    plugin: countdown,
                    config: "{}".into(),
                    weights: [("correct".to_string(), 1.0), ("format".to_string(), 0.25)]
                        .into_iter()
                        .collect(),
                    default_weight: 0.0,
                    fallback: 0.0,
                    cases: None,
                },
                RewardSpec {
                    plugin: hostile,
                    config: r#"{"mode": "nan"}"#.into(),
                    weights: Default::default(),
                    default_weight: 1.0,
                    fallback: -0.5,
                    cases: None,
                },
            ],
            1.0,
            2,
        ))
        .unwrap();
    let s = settings(Some(tool(&rt, "calculator", "{}", Limits::default())), None);
    // The taught answer 7*8 uses 7 and 8 once each and makes 56.
    let meta = json!({"numbers": [7, 8], "target": 56, "solution": "7*8"});
    let groups = run(&rt, &s, &rewards, &[(0, sample(CALC, meta))]);
    let t = &groups[0].trajectories[0];
    assert_eq!(t.rewards.get("format"), Some(&1.0), "{:?}", t.rewards);
    assert_eq!(t.rewards.get("correct"), Some(&1.0), "{:?}", t.rewards);
    // 1.0 * correct + 0.25 * format + fallback of the faulting plugin.
    assert!(
        (t.reward - (1.0 + 0.25 - 0.5)).abs() < 1e-12,
        "{}",
        t.reward
    );
    assert_eq!(t.faults.len(), 1);
    assert_eq!(t.faults[0].kind, "bad-output");
}
