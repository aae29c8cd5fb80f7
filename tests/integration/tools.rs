//! Native function calling in the rollout engine, with the real `units` tools plugin
//! (Python, WIT 0.2.0): the functions in the prompt through the chat template's `tools`,
//! the calls read as the model writes them (Hermes), run in the sandbox, answered as
//! `tool` messages token-exactly with the template, malformed calls answered with errors
//! and counted by kind.
//!
//! A random tiny model writes no calls, so the qwen2 fixture is first taught (a LoRA
//! adapter fitted in-process, as the rollout tests do) to write the test's calls after
//! the test's prompts, with the tool messages the real plugin returns in its context.

use super::{load, tokio_runtime};
use rlhost::model::{LanguageModel, LoraConfig, Mode, Placement};
use rlhost::plugin::{Message, Sample};
use rlhost::rl::sft::{self, SftOptions, SftRow};
use rlhost::rollout::env::tools::{self, Catalogue, FormatSetting, Toolbox, Written};
use rlhost::rollout::tool_calls::CallFormat;
use rlhost::rollout::turns::TurnFormat;
use rlhost::rollout::{
    Answerers, Engine, Rewards, RolloutLimits, RolloutSettings, SpanKind, StopReason, ToolSpec,
    Trajectory,
};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/qwen2")
}

const CONVERT: &str = "How far is 5 mi in km, and what date is 30 days after 2024-01-31?";
const BREAK: &str = "Break the tools.";

/// The model's first turn for each prompt.
fn first_turn(prompt: &str) -> &'static str {
    match prompt {
        CONVERT => {
            "<tool_call>\n{\"name\": \"convert\", \"arguments\": {\"value\": 5, \"from\": \"mi\", \"to\": \"km\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add_days\", \"arguments\": {\"date\": \"2024-01-31\", \"days\": 30}}\n</tool_call>"
        }
        // Arguments failing the schema, an unknown function, JSON that does not parse.
        _ => {
            "<tool_call>\n{\"name\": \"convert\", \"arguments\": {\"value\": \"five\", \"from\": \"mi\", \"to\": \"km\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"teleport\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"convert\", \"arguments\": {\"value\": 1,}}\n</tool_call>"
        }
    }
}

fn last_turn(prompt: &str) -> &'static str {
    match prompt {
        CONVERT => "<answer>8.04672 km, 2024-03-01</answer>",
        _ => "<answer>none</answer>",
    }
}

struct Setup {
    rt: tokio::runtime::Runtime,
    lm: LanguageModel,
    toolbox: Arc<Toolbox>,
}

fn user(prompt: &str) -> Sample {
    Sample::from_prompt(prompt)
}

/// The units plugin as the run's tools, the fixture's template, and the fixture model
/// taught each prompt's two turns around the real tool messages.
fn setup() -> &'static Setup {
    static SETUP: OnceLock<Setup> = OnceLock::new();
    SETUP.get_or_init(|| {
        let rt = tokio_runtime();
        let units = ToolSpec {
            plugin: rt.block_on(load("units")),
            config: "{}".into(),
        };
        let catalogue = rt
            .block_on(Catalogue::open(vec![("units".into(), units)]))
            .unwrap();
        let mut lm = LanguageModel::open(&fixture_dir(), &Placement::CPU).unwrap();
        // The fixture declares a context of 1,024 tokens (the countdown configs' limit
        // checks use it); the units functions' schemas make prompts of ~1,200, which the
        // sampler refuses past the declared context. Its rotary model reads them as well:
        // this test's copy declares the longer context the rollouts need.
        lm.model.cfg.max_position_embeddings = 4096;
        let toolbox =
            Arc::new(Toolbox::new(catalogue, FormatSetting::Auto, lm.chat().unwrap()).unwrap());
        assert_eq!(toolbox.format, CallFormat::Hermes);
        let mut rows = Vec::new();
        for prompt in [CONVERT, BREAK] {
            let sample = user(prompt);
            let messages = conversation(&rt, &toolbox, &sample);
            // What the model writes (a malformed call is in its text, not in the
            // message's calls), the tool messages as the template continues with them.
            let (head, rest) = {
                let chat = lm.chat().unwrap();
                let tools = Some(toolbox.template_tools.clone());
                let turns = TurnFormat::new(chat, Default::default(), tools.clone()).unwrap();
                let head = chat
                    .render(&to_json(&sample.messages), tools.as_deref(), true)
                    .unwrap();
                let n = messages.len();
                let cont = turns
                    .continuation(&messages[..2], &messages[2..n - 1], "<|im_end|>")
                    .unwrap();
                let rest = format!(
                    "{}<|im_end|>{cont}{}<|im_end|>",
                    first_turn(prompt),
                    last_turn(prompt)
                );
                (head, rest)
            };
            let head_ids = lm.tokenizer.encode(&head).unwrap();
            let mut ids = head_ids.clone();
            ids.extend(lm.tokenizer.encode(&rest).unwrap());
            rows.push(SftRow {
                loss_mask: (0..ids.len())
                    .map(|i| u8::from(i >= head_ids.len()))
                    .collect(),
                tokens: ids,
            });
        }
        lm.model
            .attach_lora(
                &LoraConfig {
                    r: 16,
                    alpha: 32.0,
                    ..LoraConfig::default()
                },
                0,
            )
            .unwrap();
        let opts = SftOptions {
            steps: 400,
            lr: 1e-2,
            target_loss: 2e-3,
            pack_sequences: false,
        };
        let losses = sft::fit(&lm.model, &rows, &opts).unwrap();
        assert!(*losses.last().unwrap() < 0.05, "not learnt: {losses:?}");
        Setup { rt, lm, toolbox }
    })
}

fn to_json(messages: &[Message]) -> Vec<Value> {
    messages
        .iter()
        .map(|m| serde_json::to_value(m).unwrap())
        .collect()
}

/// The whole conversation the model is taught for `sample`: its first turn's calls, the
/// tool messages the real plugin answers them with, its last turn.
fn conversation(rt: &tokio::runtime::Runtime, toolbox: &Toolbox, sample: &Sample) -> Vec<Message> {
    let prompt = &sample.messages[0].content;
    let turn = toolbox.read(first_turn(prompt));
    let written: Vec<Written> = turn
        .calls
        .into_iter()
        .enumerate()
        .map(|(k, call)| Written {
            id: format!("call_1_{k}"),
            call,
        })
        .collect();
    let sessions = vec![None];
    let (_, answers, _) = rt.block_on(tools::run(toolbox, sessions, sample, 0, &written));
    let mut messages = sample.messages.clone();
    messages.push(tools::assistant_message(turn.content, &written));
    messages.extend(tools::tool_messages(&answers));
    messages.push(Message::new("assistant", last_turn(prompt)));
    messages
}

fn settings(toolbox: &Arc<Toolbox>, lm: &LanguageModel) -> RolloutSettings {
    let mut sampling = rlhost::sampler::draw::defaults(lm).unwrap();
    sampling.temperature = 0.0;
    sampling.max_new_tokens = 160;
    RolloutSettings {
        group_size: 1,
        sampling,
        limits: RolloutLimits {
            max_total_tokens: 2048,
            ..RolloutLimits::default()
        },
        template_kwargs: Default::default(),
        env: Answerers {
            tools: Some(toolbox.clone()),
            ..Default::default()
        },
        remote: None,
        tree: None,
    }
}

/// The one trajectory `settings` sample for `prompt`, greedy.
fn roll(s: &Setup, settings: &RolloutSettings, prompt: &str) -> Trajectory {
    let rewards = Rewards::none();
    let engine = Engine::new(&s.lm, settings, &rewards, s.rt.handle().clone()).unwrap();
    let mut groups = engine
        .run(&[(0, user(prompt))], 7, 0, Mode::INFERENCE)
        .unwrap()
        .0;
    groups.remove(0).trajectories.remove(0)
}

#[test]
fn calls_run_in_the_sandbox_and_come_back_as_tool_messages_token_exactly() {
    let s = setup();
    let settings = settings(&s.toolbox, &s.lm);
    let t = &roll(s, &settings, CONVERT);
    assert_eq!(t.stop, StopReason::EndOfTurn, "{:#?}", t.messages);
    assert!(t.faults.is_empty(), "{:?}", t.faults);
    assert_eq!(t.call_kinds, BTreeMap::from([("ok".to_string(), 2)]));
    assert_eq!((t.turns, t.tool_calls), (2, 2));
    // The conversation, as the rewards see it: the calls with the ids the host gave them,
    // the real plugin's answers as tool messages, then the answer.
    let m = &t.messages;
    assert_eq!(m.len(), 5, "{m:#?}");
    let calls: Vec<(&str, &str, String)> = m[1]
        .tool_calls
        .iter()
        .map(|c| (c.id.as_str(), c.function.name.as_str(), c.arguments_text()))
        .collect();
    assert_eq!(
        calls,
        [
            (
                "call_1_0",
                "convert",
                r#"{"value":5,"from":"mi","to":"km"}"#.to_string()
            ),
            (
                "call_1_1",
                "add_days",
                r#"{"date":"2024-01-31","days":30}"#.to_string()
            ),
        ]
    );
    assert_eq!(
        (
            m[2].role.as_str(),
            m[2].content.as_str(),
            m[2].tool_call_id.as_deref()
        ),
        ("tool", "8.04672 km", Some("call_1_0"))
    );
    assert_eq!(
        (m[3].content.as_str(), m[3].tool_call_id.as_deref()),
        ("2024-03-01", Some("call_1_1"))
    );
    assert_eq!(m[4].content, last_turn(CONVERT));
    // Token-exact: the ids are the template's rendering of that conversation, and the
    // tool messages are inserted (no log-probs, not trained on).
    let chat = s.lm.chat().unwrap();
    let rendered = chat
        .render(&to_json(m), Some(&s.toolbox.template_tools), false)
        .unwrap();
    assert_eq!(
        s.lm.tokenizer.decode(&t.tokens, false).unwrap(),
        rendered.strip_suffix('\n').unwrap()
    );
    let tool_spans: Vec<_> = t
        .spans
        .iter()
        .filter(|sp| sp.kind == SpanKind::Tool)
        .collect();
    assert_eq!(tool_spans.len(), 1);
    assert!(
        tool_spans[0]
            .text
            .contains("<tool_response>\n8.04672 km\n</tool_response>")
    );
    let mask = t.loss_mask();
    for sp in &tool_spans {
        assert!(mask[sp.start..sp.end].iter().all(|&b| b == 0));
    }
    assert!(mask.contains(&1));
}

#[test]
fn malformed_calls_are_answered_with_errors_and_counted_by_kind() {
    let s = setup();
    let settings = settings(&s.toolbox, &s.lm);
    let t = &roll(s, &settings, BREAK);
    assert_eq!(
        t.call_kinds,
        BTreeMap::from([
            ("bad_json".to_string(), 1),
            ("invalid_arguments".to_string(), 1),
            ("unknown_function".to_string(), 1),
        ]),
        "{:#?}",
        t.messages
    );
    assert!(
        t.faults.is_empty(),
        "a malformed call is not the plugin's fault"
    );
    let answers: Vec<&str> = t
        .messages
        .iter()
        .filter(|m| m.role == "tool")
        .map(|m| m.content.as_str())
        .collect();
    assert_eq!(answers.len(), 3);
    assert!(
        answers.iter().all(|a| a.starts_with("error: ")),
        "{answers:?}"
    );
    assert!(answers[1].contains("teleport"), "{answers:?}");
    // The assistant message keeps the calls that could be read (the bad JSON is not one).
    let names: Vec<&str> = t.messages[1]
        .tool_calls
        .iter()
        .map(|c| c.function.name.as_str())
        .collect();
    assert_eq!(names, ["convert", "teleport"]);
    // The model read the errors and went on to its answer.
    assert_eq!(t.messages.last().unwrap().content, last_turn(BREAK));
    assert_eq!(t.stop, StopReason::EndOfTurn);
}

#[test]
fn the_tool_call_limit_ends_a_trajectory_before_its_calls_run() {
    let s = setup();
    let mut settings = settings(&s.toolbox, &s.lm);
    settings.limits.max_tool_calls = 1;
    let t = &roll(s, &settings, CONVERT);
    assert_eq!(t.stop, StopReason::MaxToolCalls);
    assert!(t.call_kinds.is_empty() && t.tool_calls == 0);
    assert!(t.messages.iter().all(|m| m.role != "tool"));
}

#[test]
fn a_run_config_with_tools_is_checked() {
    let rt = tokio_runtime();
    let units = || ToolSpec {
        plugin: rt.block_on(load("units")),
        config: "{}".into(),
    };
    // Two plugins offering the same function names.
    let err = rt
        .block_on(Catalogue::open(vec![
            ("a".into(), units()),
            ("b".into(), units()),
        ]))
        .err()
        .unwrap();
    assert!(
        format!("{err:#}").contains("`a` and `b` both offer a function `convert`"),
        "{err:#}"
    );
    // A configuration the plugin refuses is an error when the run opens.
    let bad = ToolSpec {
        config: r#"{"digits": 3}"#.into(),
        ..units()
    };
    let err = rt
        .block_on(Catalogue::open(vec![("units".into(), bad)]))
        .err()
        .unwrap();
    assert!(
        format!("{err:#}").contains("rollout.tools_config.units"),
        "{err:#}"
    );
    // Not a tools plugin.
    let calc = ToolSpec {
        plugin: rt.block_on(load("calculator")),
        config: "{}".into(),
    };
    let err = rt
        .block_on(Catalogue::open(vec![("calculator".into(), calc)]))
        .err()
        .unwrap();
    assert!(format!("{err:#}").contains("not the tools role"), "{err:#}");
    // A template that ignores `tools`: the model would never see the functions.
    let catalogue = rt
        .block_on(Catalogue::open(vec![("units".into(), units())]))
        .unwrap();
    let plain = rlhost::model::chat::ChatTemplate::from_str(
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        None,
        None,
    )
    .unwrap();
    let err = Toolbox::new(catalogue.clone(), FormatSetting::Hermes, &plain)
        .err()
        .unwrap();
    assert!(
        format!("{err:#}").contains("does not render `tools`"),
        "{err:#}"
    );
    let err = Toolbox::new(catalogue, FormatSetting::Auto, &plain)
        .err()
        .unwrap();
    assert!(
        format!("{err:#}").contains("set rollout.tool_call_format"),
        "{err:#}"
    );
}

/// The hostile plugin's functions: `count` (stateful) runs in the trajectory's session in
/// the order written, across turns; `misbehave` (stateless) runs each call in a fresh
/// instance, and its loop, memory bomb and panic are faults of their own calls only.
#[test]
fn stateful_calls_keep_order_and_session_and_faults_stay_in_their_call() {
    let rt = tokio_runtime();
    let limits = rlhost::plugin::Limits {
        timeout_ms: 300,
        memory_mib: 64,
        ..Default::default()
    };
    let hostile = ToolSpec {
        plugin: rt.block_on(super::load_with("hostile", limits)),
        config: "{}".into(),
    };
    let catalogue = rt
        .block_on(Catalogue::open(vec![("hostile".into(), hostile)]))
        .unwrap();
    let chat = rlhost::model::chat::ChatTemplate::from_dir(&fixture_dir()).unwrap();
    let toolbox = Toolbox::new(catalogue, FormatSetting::Auto, &chat).unwrap();
    assert!(toolbox.needs_session(0));
    let sample = user("go");
    let session = rt
        .block_on(toolbox.plugins[0].plugin.open_tools("{}", &sample, 0))
        .unwrap();
    let call = |name: &str, args: &str| {
        format!("<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {args}}}\n</tool_call>")
    };
    let text = [
        call("count", "{}"),
        call("misbehave", r#"{"mode": "loop"}"#),
        call("count", "{}"),
        call("misbehave", r#"{"mode": "memory"}"#),
        call("misbehave", r#"{"mode": "panic"}"#),
        call("count", "{}"),
        call("misbehave", r#"{"mode": "echo"}"#),
    ]
    .join("\n");
    let written = |text: &str| -> Vec<Written> {
        toolbox
            .read(text)
            .calls
            .into_iter()
            .enumerate()
            .map(|(k, call)| Written {
                id: format!("call_1_{k}"),
                call,
            })
            .collect()
    };
    let t0 = std::time::Instant::now();
    let (sessions, answers, faults) = rt.block_on(tools::run(
        &toolbox,
        vec![Some(session)],
        &sample,
        0,
        &written(&text),
    ));
    let got: Vec<(&str, &str)> = answers.iter().map(|a| (a.kind, a.text.as_str())).collect();
    assert_eq!(got[0], ("ok", "1"));
    assert_eq!(got[2], ("ok", "2"));
    assert_eq!(got[5], ("ok", "3"));
    assert_eq!(got[6], ("ok", r#"{"mode":"echo"}"#));
    for (i, kind) in [(1, "timeout"), (3, "out-of-memory"), (4, "trap")] {
        assert_eq!(
            got[i],
            ("fault", format!("error: the tool failed ({kind})").as_str())
        );
    }
    let kinds: Vec<String> = faults.iter().map(|f| f.kind.to_string()).collect();
    assert_eq!(kinds.len(), 3, "{kinds:?}");
    // The stateless calls ran at once: one deadline, not the sum of them.
    assert!(t0.elapsed().as_secs_f64() < 3.0, "{:?}", t0.elapsed());
    // The next turn's calls find the same session, its count going on.
    let (sessions, answers, _) = rt.block_on(tools::run(
        &toolbox,
        sessions,
        &sample,
        0,
        &written(&call("count", "{}")),
    ));
    assert_eq!(answers[0].text, "4");
    assert!(sessions[0].is_some());
}

/// The command line names the config and the key for each mistake, in one line.
#[test]
fn tools_config_mistakes_are_one_line_each() {
    let dir = rlhost_tests::temp_dir("tools-config");
    let units = rlhost_tests::plugin("units").display().to_string();
    let calc = rlhost_tests::plugin("calculator").display().to_string();
    let model = fixture_dir().display().to_string();
    let cases = [
        (
            format!(
                "tools = [\"a\", \"b\"]\n[plugins.a]\npath = {units:?}\n[plugins.b]\npath = {units:?}"
            ),
            "rollout.tools: `a` and `b` both offer a function `convert`",
        ),
        (
            format!("tools = [\"calculator\"]\n[plugins.calculator]\npath = {calc:?}"),
            "rollout.tools[0] = \"calculator\", but calculator@",
        ),
        (
            format!(
                "tools = [\"units\"]\ntools_config = {{ units = {{ digits = 3 }} }}\n[plugins.units]\npath = {units:?}"
            ),
            "rollout.tools: rollout.tools_config.units: ",
        ),
        (
            format!(
                "tools = [\"units\"]\ntools_config = {{ other = {{}} }}\n[plugins.units]\npath = {units:?}"
            ),
            "rollout.tools_config.other: `other` is not in rollout.tools",
        ),
        (
            "tools = [\"units\"]".to_string(),
            "rollout.tools[0] = \"units\" names no plugin",
        ),
    ];
    for (i, (rollout, want)) in cases.iter().enumerate() {
        // [rollout] keys first, then the plugin sections the case adds.
        let (keys, plugins) = rollout
            .split_once("\n[")
            .map_or((rollout.as_str(), String::new()), |(k, p)| {
                (k, format!("[{p}"))
            });
        let config = dir.join(format!("c{i}.toml"));
        std::fs::write(
            &config,
            format!("[model]\npath = {model:?}\n[data]\npath = \"none.jsonl\"\n[rollout]\n{keys}\n{plugins}\n"),
        )
        .unwrap();
        let err = rlhost_tests::TestCommand::new(&["rollout", "--config"])
            .arg(&config)
            .arg("--out")
            .arg(dir.join("r.jsonl"))
            .fails();
        assert!(err.contains(want), "case {i}: {err}");
        assert!(
            err.contains(&config.display().to_string()),
            "case {i}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "case {i}: {err}");
    }
}
