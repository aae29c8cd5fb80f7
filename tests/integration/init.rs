//! `rlhost init` on the fixture models and the generated datasets: the starter config it
//! writes names the columns and plugins it found, and `rlhost train` / `rlhost rollout`
//! run it as written; bad inputs are one clear error and overwrite nothing.

use rlhost_tests::{TestCommand, plugin, repo_root, temp_dir};

fn init(dir: &std::path::Path, data: &str, plugins: &[&str]) -> String {
    let mut cmd = TestCommand::new(&["init", "--model"])
        .arg(repo_root().join("tests/fixtures/models/qwen2"))
        .arg("--data")
        .arg(repo_root().join("configs/data").join(data))
        .arg("--out")
        .arg(dir.join("run.toml"));
    for p in plugins {
        cmd = cmd.arg("--plugin").arg(plugin(p));
    }
    cmd.ok();
    std::fs::read_to_string(dir.join("run.toml")).unwrap()
}

/// The small settings the tests run with: the fixture model is tiny and untrained.
const SMALL: [&str; 8] = [
    "--set",
    "sampling.max_new_tokens=16",
    "--set",
    "rollout.group_size=2",
    "--set",
    "rollout.prompts_per_step=2",
    "--set",
    "train.steps=1",
];

#[test]
fn a_math_dataset_and_its_reward_make_a_config_that_trains() {
    let dir = temp_dir("init-math");
    let text = init(&dir, "gsm8k-sample.jsonl", &["math_answer"]);
    for needle in [
        "prompt_template = \"{question}\"",
        "answer_key = \"answer\"",
        "[plugins.math_answer]",
        "plugin = \"math_answer\"",
        "# The column that holds the answer",
    ] {
        assert!(text.contains(needle), "{needle} not in:\n{text}");
    }
    TestCommand::new(&["train", "-q", "--config"])
        .arg(dir.join("run.toml"))
        .args(SMALL)
        .arg("--out")
        .arg(dir.join("run"))
        .ok();
    let metrics = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 1);
    // Written once: a second init refuses to overwrite it.
    let e = TestCommand::new(&["init", "--model"])
        .arg(repo_root().join("tests/fixtures/models/qwen2"))
        .arg("--data")
        .arg(repo_root().join("configs/data/gsm8k-sample.jsonl"))
        .arg("--out")
        .arg(dir.join("run.toml"))
        .fails();
    assert!(e.contains("exists") && e.contains("--force"), "{e}");
}

#[test]
fn a_code_dataset_gets_its_tests_scored_case_by_case() {
    let dir = temp_dir("init-code");
    let text = init(&dir, "mbpp-sample.jsonl", &["code_tests", "code_trigger"]);
    for needle in [
        "prompt_template = \"{text}\"",
        "tests_key = \"test_list\"",
        "cases = \"tests\"",
        "trigger = \"code_trigger\"",
    ] {
        assert!(text.contains(needle), "{needle} not in:\n{text}");
    }
    assert!(
        !text.contains("answer_key"),
        "a code dataset's `code` is no answer:\n{text}"
    );
    TestCommand::new(&["rollout", "-q", "--config"])
        .arg(dir.join("run.toml"))
        .args(&SMALL[..6])
        .args(["--prompts", "1", "--out"])
        .arg(dir.join("out.jsonl"))
        .ok();
    let row: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(dir.join("out.jsonl"))
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    assert!(row["rewards"].get("passed").is_some(), "{row}");
}

#[test]
fn bad_inputs_are_one_clear_error() {
    let dir = temp_dir("init-bad");
    let e = TestCommand::new(&["init", "--model"])
        .arg(&dir)
        .arg("--data")
        .arg(repo_root().join("configs/data/gsm8k-sample.jsonl"))
        .arg("--out")
        .arg(dir.join("x.toml"))
        .fails();
    assert!(e.contains("config.json not found"), "{e}");
    let e = TestCommand::new(&["init", "--model"])
        .arg(repo_root().join("tests/fixtures/models/qwen2"))
        .arg("--out")
        .arg(dir.join("x.toml"))
        .fails();
    assert!(e.contains("a run needs data"), "{e}");
    let numbers = dir.join("numbers.jsonl");
    std::fs::write(&numbers, "{\"a\": 1, \"b\": 2}\n").unwrap();
    let e = TestCommand::new(&["init", "--model"])
        .arg(repo_root().join("tests/fixtures/models/qwen2"))
        .arg("--data")
        .arg(&numbers)
        .arg("--out")
        .arg(dir.join("x.toml"))
        .fails();
    assert!(
        e.contains("no column holds text for a prompt") && e.contains("a, b"),
        "{e}"
    );
    assert!(!dir.join("x.toml").exists());
}
