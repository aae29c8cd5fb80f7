//! Native function calling meets the trainer: the units task's answers are what the real
//! `units` functions return, a small built-in model warm-started on the task (its
//! template renders the functions as Qwen2.5's does) learns by GRPO to call them (their
//! answers, `tool` messages, are never trained on), malformed calls are counted, and
//! `--plugin units.wasm` alone picks the run.

use super::{load, tokio_runtime};
use rlhost::builtin::{Inputs, Recipe, UNITS, ensure};
use rlhost::data::{DataConfig, Dataset};
use rlhost::model::chat::ChatTemplate;
use rlhost::plugin::Sample;
use rlhost::rollout::ToolSpec;
use rlhost::rollout::env::tools::{self, Catalogue, FormatSetting, Toolbox, Written};
use rlhost_tests::{TestCommand, plugin, temp_dir};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn units(rt: &tokio::runtime::Runtime) -> Catalogue {
    let spec = ToolSpec {
        plugin: rt.block_on(load("units")),
        config: "{}".into(),
    };
    rt.block_on(Catalogue::open(vec![("units".into(), spec)]))
        .unwrap()
}

/// Every kind of problem: its reference call, read as the model would write it and run
/// by the real plugin, answers exactly the sample's `answer` (the task computes it in Rust,
/// the plugin in Python: conversions' six significant digits, dates, reduced fractions).
#[test]
fn the_units_tasks_answers_are_what_the_units_functions_return() {
    let rt = tokio_runtime();
    let task = rt.block_on(load("units_task"));
    let chat = ChatTemplate::from_str("{{ tools }}<tool_call>", None, None).unwrap();
    let toolbox = Toolbox::new(units(&rt), FormatSetting::Hermes, &chat).unwrap();
    let mut data = rt.block_on(task.open_dataset("{}", 3)).unwrap();
    let mut kinds = std::collections::BTreeSet::new();
    for i in 0..150 {
        let sample: Sample = rt.block_on(data.get(i)).unwrap();
        let meta = &sample.metadata;
        kinds.insert(meta["kind"].as_str().unwrap().to_string());
        let call = meta["reference"]["tool_calls"]["hermes"].as_str().unwrap();
        let written: Vec<Written> = toolbox
            .read(call)
            .calls
            .into_iter()
            .map(|call| Written {
                id: "call_1_0".into(),
                call,
            })
            .collect();
        assert_eq!(written.len(), 1, "{call}");
        let (_, answers, faults) =
            rt.block_on(tools::run(&toolbox, vec![None], &sample, 0, &written));
        assert!(faults.is_empty(), "{faults:?}");
        assert_eq!(
            (answers[0].kind, answers[0].text.as_str()),
            ("ok", meta["answer"].as_str().unwrap()),
            "{call}"
        );
        assert_eq!(
            meta["reference"]["answer"].as_str().unwrap(),
            format!("<answer>{}</answer>", meta["answer"].as_str().unwrap())
        );
    }
    assert_eq!(kinds.len(), 3, "{kinds:?}");
}

/// A small `builtin:units` model warm-started on `add_days` problems, in a private cache.
pub(super) fn small_units_model() -> &'static PathBuf {
    static MODEL: OnceLock<PathBuf> = OnceLock::new();
    MODEL.get_or_init(|| build_small_units_model(&temp_dir("units-model")))
}

fn build_small_units_model(dir: &Path) -> PathBuf {
    let rt = tokio_runtime();
    let task = rt.block_on(load("units_task"));
    let cfg = DataConfig {
        plugin: Some("units_task".into()),
        plugin_config: serde_json::json!({"kinds": ["add_days"]}),
        eval_size: Some(0),
        ..DataConfig::default()
    };
    let dataset = rt
        .block_on(Dataset::open(&cfg, Path::new("."), Some(&task), 1))
        .unwrap();
    let catalogue = units(&rt);
    // The real recipe's shape on a tenth of its conversations: a smaller model wrote no
    // well-formed call to reward (64 wide on 384 conversations: every call `bad_json` or
    // `unclosed`).
    let recipe = Recipe {
        sft_examples: 1536,
        sft_epochs: 4,
        sft_batch: 16,
        // One pass, no bar, no copy drills and the guesses trained whole: this small
        // model's outcomes were measured so.
        bar: None,
        copy_drills: 0,
        untrained_guess_digits: false,
        ..UNITS
    };
    let inputs = Inputs {
        dataset: &dataset,
        task: "units_task",
        trigger: None,
        tools: Some(&catalogue),
        seed: 1,
    };
    ensure(&recipe, &inputs, rt.handle(), &dir.join("cache"), true).unwrap()
}

/// The learning rate of the two tests that train [`small_units_model`] to call (here and
/// through OpenEnv). At 0.004, over `run.seed` 1-16 (release build), seeds 4 and 7 fell
/// short of 0.8 calls: this 2-layer, 128-wide model's LoRA moves by Adam's step, about lr
/// on every coordinate whatever its gradient, and after two updates at 0.004 the adapter
/// was 6.5% of the base weights' norm (12.5% in a layer-0 projection), enough for the
/// calls' JSON to come apart in one step (issue 63's one-step collapse, seed 3 with a
/// format reward: 15 well-formed calls of 25, then none of 29). At 0.002 all 16 seeds passed.
pub(super) const LEARN_LR: f64 = 0.002;

/// Ten GRPO steps rewarding function calls alone (a sign error drives the rate down,
/// calls that never run leave it at zero): calls rise, every call the trained model
/// makes is counted by kind, and the functions' answers are never trained on.
#[test]
fn the_units_functions_are_learned_and_their_answers_never_trained_on() {
    let dir = temp_dir("units-learn");
    let model = small_units_model();
    let config = format!(
        r#"
[run]
seed = 5
[model]
path = {model:?}
[data]
plugin = "units_task"
plugin_config = {{ kinds = ["add_days"] }}
eval_size = 0
[sampling]
max_new_tokens = 48
[rollout]
group_size = 8
prompts_per_step = 4
tools = ["units"]
max_total_tokens = 768
[plugins.units_task]
path = {task:?}
[plugins.units]
path = {units:?}
[[rewards]]
plugin = "units_task"
weights = {{ tool_use = 1.0, correct = 0.0, format = 0.0 }}
[train]
steps = 10
lr = {LEARN_LR}
save_every = 100
"#,
        model = model.display().to_string(),
        task = plugin("units_task").display().to_string(),
        units = plugin("units").display().to_string(),
    );
    std::fs::write(dir.join("learn.toml"), config).unwrap();
    let out = dir.join("run");
    TestCommand::new(&["train", "--no-status", "--config"])
        .arg(dir.join("learn.toml"))
        .arg("--out")
        .arg(&out)
        .ok();
    let rows = super::train_cli::metrics(&out);
    let calls = |r: &[serde_json::Value]| {
        r.iter()
            .map(|x| x["tool_calls"].as_f64().unwrap())
            .sum::<f64>()
            / r.len() as f64
    };
    let (first, last) = (calls(&rows[..1]), calls(&rows[rows.len() - 3..]));
    assert!(first > 0.0, "no function was ever called");
    assert!(
        last > first + 0.3 && last > 0.8,
        "function calls did not rise: step 1 {first:.2} per trajectory, last 3 steps {last:.2}"
    );
    // Every step counts its calls by kind, all of them, and says how many were malformed.
    let mut ok = 0.0;
    for r in rows
        .iter()
        .filter(|r| r["tool_calls"].as_f64().unwrap() > 0.0)
    {
        let kinds = r["function_calls"].as_object().unwrap();
        let count = |pred: &dyn Fn(&str) -> bool| -> f64 {
            kinds
                .iter()
                .filter(|(k, _)| pred(k))
                .map(|(_, n)| n.as_f64().unwrap())
                .sum()
        };
        let all = count(&|_| true);
        let trajectories = r["trajectories"].as_f64().unwrap();
        assert!(
            (all - r["tool_calls"].as_f64().unwrap() * trajectories).abs() < 1e-6,
            "{r}"
        );
        let malformed = count(&|k| !["ok", "tool_error", "fault"].contains(&k));
        let rate = r["malformed_call_rate"].as_f64().unwrap();
        assert!((rate - malformed / all).abs() < 1e-9, "{r}");
        ok += count(&|k| k == "ok");
    }
    assert!(ok > 0.0, "no call ever ran");
    // The trained adapter's trajectories: the tool messages are inserted spans, never
    // sampled (no log-prob) and so never in the loss.
    let rollouts = dir.join("rollouts.jsonl");
    TestCommand::new(&["rollout", "--config"])
        .arg(dir.join("learn.toml"))
        .arg("--adapter")
        .arg(out.join("checkpoints/step-000010"))
        .args(["--split", "train", "--prompts", "4", "--out"])
        .arg(&rollouts)
        .ok();
    let mut tool_spans = 0;
    for line in std::fs::read_to_string(&rollouts).unwrap().lines() {
        let t: serde_json::Value = serde_json::from_str(line).unwrap();
        let logps = t["logps"].as_array().unwrap();
        for span in t["spans"].as_array().unwrap() {
            let (start, end) = (
                span["start"].as_u64().unwrap() as usize,
                span["end"].as_u64().unwrap() as usize,
            );
            let tool = span["kind"] == "tool";
            if tool {
                tool_spans += 1;
                let text = span["text"].as_str().unwrap();
                assert!(text.contains("<tool_response>\n"), "{span}");
            }
            assert!(
                logps[start..end].iter().all(|l| l.is_null() == tool),
                "{span}: inserted tokens have no log-prob, sampled ones do"
            );
        }
        // A call the model made is in the conversation, answered by a tool message.
        let messages = t["messages"].as_array().unwrap();
        if let Some(called) = messages.iter().find(|m| m["tool_calls"].is_array()) {
            let id = &called["tool_calls"][0]["id"];
            assert!(
                messages
                    .iter()
                    .any(|m| m["role"] == "tool" && &m["tool_call_id"] == id),
                "{t}"
            );
        }
    }
    assert!(
        tool_spans > 0,
        "no function answers in the trained model's rollouts"
    );
}

/// `--plugin units.wasm` alone picks the units run (sampled here with the small model).
#[test]
fn the_units_plugin_alone_picks_the_units_run() {
    let dir = temp_dir("units-pick");
    TestCommand::new(&["rollout", "--plugin"])
        .arg(plugin("units"))
        .arg("--set")
        .arg(format!(
            "model.path={:?}",
            small_units_model().display().to_string()
        ))
        .args(["--prompts", "2", "--out"])
        .arg(dir.join("r.jsonl"))
        .current_dir(&dir)
        .ok();
    let first: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(dir.join("r.jsonl"))
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    let asked = first["messages"][0]["content"].as_str().unwrap();
    assert!(
        asked.starts_with("Convert ")
            || asked.starts_with("What date")
            || asked.starts_with("What is "),
        "{asked}"
    );
}
