//! The code tools meet the trainer: the code task's answers are what the sandboxed Python
//! and JavaScript print, a small built-in model warm-started on the task learns by GRPO
//! to call either tool (whose output is never trained on; the JavaScript run is scored by
//! the C reward too), the `--plugin`-only command line picks the run that suits the tool,
//! and a tool no task can use is one clear error.

use super::{load, tokio_runtime};
use rlhost::builtin::{CODE, Inputs, Recipe, ensure};
use rlhost::data::{DataConfig, Dataset};
use rlhost::rollout::ToolSpec;
use rlhost_tests::{TestCommand, plugin, temp_dir};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

#[test]
fn the_code_tasks_answers_are_what_the_python_and_javascript_tools_print() {
    let rt = tokio_runtime();
    let task = rt.block_on(load("code_task"));
    for (tool, style) in [("code_trigger", "python"), ("js_trigger", "js")] {
        let tool = rt.block_on(load(tool));
        let mut data = rt.block_on(task.open_dataset("{}", 11)).unwrap();
        let mut families = std::collections::BTreeSet::new();
        for i in 0..42 {
            let sample = rt.block_on(data.get(i)).unwrap();
            let meta = &sample.metadata;
            families.insert(meta["family"].as_str().unwrap().to_string());
            let call = meta["reference"]["tool_calls"][style].as_str().unwrap();
            let mut session = rt.block_on(tool.open_trigger("{}", &sample, 0)).unwrap();
            let output = rt.block_on(session.fire(call)).unwrap();
            assert_eq!(
                output.as_deref(),
                Some(format!("\n<output>\n{}\n</output>\n", meta["answer"]).as_str()),
                "{call}"
            );
        }
        assert_eq!(families.len(), 7, "{families:?}");
    }
}

/// A small `builtin:code` model warm-started with `tool` on the `modpow` family (the
/// shortest call), in a private cache; built once per tool for the tests of this module.
pub(super) fn small_code_model(tool: &str) -> PathBuf {
    static MODELS: Mutex<BTreeMap<String, PathBuf>> = Mutex::new(BTreeMap::new());
    let mut models = MODELS.lock().unwrap_or_else(|e| e.into_inner());
    models
        .entry(tool.to_string())
        .or_insert_with(|| build_small_code_model(&temp_dir(&format!("code-model-{tool}")), tool))
        .clone()
}

fn build_small_code_model(dir: &Path, tool: &str) -> PathBuf {
    let rt = tokio_runtime();
    let (task, tool) = rt.block_on(async { (load("code_task").await, load(tool).await) });
    let cfg = DataConfig {
        plugin: Some("code_task".into()),
        plugin_config: serde_json::json!({"families": ["modpow"]}),
        eval_size: Some(0),
        ..DataConfig::default()
    };
    let dataset = rt
        .block_on(Dataset::open(&cfg, Path::new("."), Some(&task), 1))
        .unwrap();
    let trigger = ToolSpec {
        plugin: tool,
        config: "{}".into(),
    };
    let recipe = Recipe {
        vocab_size: 320,
        hidden: 64,
        layers: 2,
        heads: 2,
        kv_heads: 1,
        intermediate: 128,
        sft_examples: 384,
        // Measured without copy drills, its guesses trained whole.
        copy_drills: 0,
        untrained_guess_digits: false,
        sft_epochs: 4,
        sft_batch: 16,
        // One pass and no bar: this small model's outcomes were measured without one.
        bar: None,
        ..CODE
    };
    let inputs = Inputs {
        dataset: &dataset,
        task: "code_task",
        trigger: Some(&trigger),
        tools: None,
        seed: 1,
    };
    ensure(&recipe, &inputs, rt.handle(), &dir.join("cache"), true).unwrap()
}

#[test]
fn the_python_tool_is_learned_and_its_output_is_never_trained_on() {
    tool_is_learned("code_trigger", "");
}

/// The JavaScript tool learned the same way, and the run scored by the C reward beside
/// the task's own: its `format` and `correct` (exact, `rel_tol = 0`) agree with the Rust
/// task's on every step, so the C plugin read every trajectory as the task did.
#[test]
fn the_javascript_tool_is_learned_and_the_c_reward_scores_the_run() {
    let c_reward = format!(
        r#"
[plugins.c_reward]
path = {:?}
[[rewards]]
plugin = "c_reward"
config = {{ rel_tol = 0 }}
weights = {{ correct = 0.0, format = 0.0 }}
"#,
        plugin("c_reward").display().to_string()
    );
    let rows = tool_is_learned("js_trigger", &c_reward);
    let mut formatted = 0.0;
    for row in &rows {
        let r = &row["rewards"];
        assert_eq!(r["c_reward/format"], r["format"], "step {}", row["step"]);
        assert_eq!(r["c_reward/correct"], r["correct"], "step {}", row["step"]);
        formatted += r["format"].as_f64().unwrap();
    }
    assert!(
        formatted > 0.0,
        "no trajectory gave an answer: the rewards' agreement says nothing"
    );
}

/// Trains the small code model warm-started with `tool` for 10 GRPO steps on the tool's
/// use alone (a reward sign error drives the rate down, a tool that never fires leaves it
/// at zero), with `extra` appended to the config; checks that tool use rose and that the
/// tool's output is never trained on; returns the metrics rows.
fn tool_is_learned(tool: &str, extra: &str) -> Vec<serde_json::Value> {
    let dir = temp_dir(&format!("code-learn-{tool}"));
    let model = small_code_model(tool);
    let config = format!(
        r#"
[run]
seed = 5
[model]
path = {model:?}
[data]
plugin = "code_task"
plugin_config = {{ families = ["modpow"] }}
eval_size = 0
[sampling]
max_new_tokens = 48
[rollout]
group_size = 8
prompts_per_step = 4
trigger = "{tool}"
max_total_tokens = 160
[plugins.code_task]
path = {task:?}
[plugins.{tool}]
path = {tool_path:?}
[[rewards]]
plugin = "code_task"
weights = {{ tool_use = 1.0, correct = 0.0, format = 0.0 }}
[train]
steps = 10
lr = 0.004
save_every = 100
{extra}"#,
        model = model.display().to_string(),
        task = plugin("code_task").display().to_string(),
        tool_path = plugin(tool).display().to_string(),
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
    // Step 1's batch was sampled before any update.
    let (first, last) = (calls(&rows[..1]), calls(&rows[rows.len() - 3..]));
    assert!(first > 0.0, "the tool never fired");
    assert!(
        last > first + 0.4 && last > 0.8,
        "tool use did not rise: step 1 {first:.2} calls per trajectory, last 3 steps {last:.2}"
    );
    // The trained adapter's trajectories: the tool's output is an inserted span, never
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
                // Whole, or cut by the length limit.
                let text = span["text"].as_str().unwrap();
                assert!(
                    text.starts_with("\n<output>\n") || "\n<output>\n".starts_with(text),
                    "{span}"
                );
            }
            assert!(
                logps[start..end].iter().all(|l| l.is_null() == tool),
                "{span}: inserted tokens have no log-prob, sampled ones do"
            );
        }
    }
    assert!(
        tool_spans > 0,
        "no tool output in the trained model's rollouts"
    );
    rows
}

#[test]
fn the_plugin_alone_picks_the_run_and_an_unusable_tool_is_one_clear_error() {
    // `none` is a trigger that answers nothing: no built-in run can use it.
    let err = TestCommand::new(&["train", "--no-status", "--plugin"])
        .arg(plugin("none"))
        .fails();
    assert!(
        err.contains("no built-in run can use the tool `none`")
            && err.contains("`code` (task code_task, reference calls in styles js, python)")
            && err.contains("`multiply` (task multiply, reference calls in styles calc, python)"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    // With a config, the warm start names both the tool and the task.
    let err = TestCommand::new(&["train", "--no-status", "--config"])
        .arg(rlhost_tests::repo_root().join("configs/multiply.toml"))
        .arg("--plugin")
        .arg(plugin("none"))
        .args(["--out"])
        .arg(temp_dir("code-unusable"))
        .fails();
    assert!(
        err.contains("the tool `none`")
            && err.contains(
                "answers none of the task `multiply`'s reference calls (styles: calc, python)"
            ),
        "{err}"
    );
    // The tool alone picks the run: the Python and JavaScript tools the code task, the
    // calculator the multiply task (sampled here with the small model, to keep the test
    // short).
    let modpow = "data.plugin_config={families=[\"modpow\"]}";
    for (tool, data, asks) in [
        ("code_trigger", modpow, " to the power "),
        ("js_trigger", modpow, " to the power "),
        ("calculator", "data.eval_size=10", " * "),
    ] {
        let dir = temp_dir(&format!("code-pick-{tool}"));
        TestCommand::new(&["rollout", "--plugin"])
            .arg(plugin(tool))
            .arg("--set")
            .arg(format!(
                "model.path={:?}",
                small_code_model("code_trigger").display().to_string()
            ))
            .args(["--set", data, "--prompts", "2", "--out"])
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
        assert!(asked.contains(asks), "--plugin {tool}: {asked}");
    }
}
