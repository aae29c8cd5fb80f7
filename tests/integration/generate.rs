//! `model.generate` end to end: plugins asking the run's model (the `judge` reward, the
//! `sim_user` environment, the hostile plugin's abuse) through real runs of the binary on
//! the fixture model, answered within their grants, seeded, never trained on.

use rlhost_tests::{TestCommand, plugin, repo_root, temp_dir};
use serde_json::Value;
use std::path::Path;

fn fixture_model() -> String {
    format!(
        "{:?}",
        repo_root()
            .join("tests/fixtures/models/qwen2")
            .display()
            .to_string()
    )
}

fn quoted(name: &str) -> String {
    format!("{:?}", plugin(name).display().to_string())
}

/// A run config on the fixture model: eight prompts, groups of two, `extra` appended.
fn config(dir: &Path, name: &str, extra: &str) -> std::path::PathBuf {
    let rows: String = (0..8)
        .map(|i| format!("{{\"prompt\": \"Say something about {i}.\"}}\n"))
        .collect();
    std::fs::write(dir.join("data.jsonl"), rows).unwrap();
    let text = format!(
        "[model]\npath = {}\n[data]\npath = \"data.jsonl\"\neval_size = 0\n\
         [sampling]\nmax_new_tokens = 6\n[rollout]\ngroup_size = 2\nprompts_per_step = 2\n{extra}",
        fixture_model()
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

fn rollout(config: &Path, out: &Path) -> Vec<Value> {
    TestCommand::new(&[
        "rollout",
        "-q",
        "--split",
        "train",
        "--prompts",
        "4",
        "--config",
    ])
    .arg(config)
    .arg("--out")
    .arg(out)
    .ok();
    super::vllm::trajectories(out)
}

const JUDGE: &str = "[plugins.judge]\npath = JUDGE\n\
    generate = { max_calls_per_trajectory = 1, max_new_tokens = 12, temperature_max = 1.0 }\n\
    [[rewards]]\nplugin = \"judge\"\n\
    config = { rubric = \"a helpful, correct answer\", temperature = 1.0, max_new_tokens = 12 }\n";

/// The judge's calls are answered (at T = 1, seeded: the same replies run to run), its
/// verdicts are kept as notes, and the trajectories are token for token those of a run
/// without it: its tokens are never part of them, and its sampling draws from no
/// trajectory's generator.
#[test]
fn a_judge_is_seeded_and_never_part_of_the_trajectories() {
    let dir = temp_dir("generate-judge");
    let with = config(&dir, "with", &JUDGE.replace("JUDGE", &quoted("judge")));
    let without = config(&dir, "without", "");
    let a = rollout(&with, &dir.join("a.jsonl"));
    let b = rollout(&with, &dir.join("b.jsonl"));
    let plain = rollout(&without, &dir.join("plain.jsonl"));
    assert_eq!(a.len(), 8);
    // Below full marks the judge's reply is the trajectory's note.
    let notes: Vec<&Value> = a
        .iter()
        .filter(|t| t["rewards"]["judge"].as_f64().unwrap() < 1.0)
        .map(|t| &t["notes"]["judge"])
        .collect();
    assert!(notes.len() >= 4, "{a:?}");
    assert!(
        notes
            .iter()
            .all(|n| n.as_str().is_some_and(|s| s.starts_with("judge said:"))),
        "{notes:?}"
    );
    // Replies sampled at T = 1 that differ from one another, and repeat run to run.
    let distinct: std::collections::BTreeSet<String> =
        notes.iter().map(|n| n.to_string()).collect();
    assert!(distinct.len() > 1, "{notes:?}");
    for ((x, y), z) in a.iter().zip(&b).zip(&plain) {
        assert_eq!(x["notes"], y["notes"]);
        assert_eq!(x["rewards"], y["rewards"]);
        assert_eq!(x["tokens"], z["tokens"], "the judge changed a trajectory");
        assert_eq!(x["logps"], z["logps"]);
        assert_eq!(x["spans"], z["spans"]);
    }
}

/// A training run in which a judge reward, a simulated user and the hostile plugin's
/// abuse ask the model: each plugin's calls counted per step (answered within its grant,
/// the rest refused with the reason the plugin sees), no fault, the run completes.
#[test]
fn a_training_run_counts_each_plugins_calls_and_refuses_past_the_grants() {
    let dir = temp_dir("generate-train");
    let hostile = quoted("hostile");
    let extra = format!(
        "environment = \"user\"\n\
         [plugins.user]\npath = {user}\ngenerate = {{ weights = [\"base\"] }}\n\
         {judge}\
         [plugins.flood]\npath = {hostile}\ngenerate = {{ max_calls_per_trajectory = 2, max_new_tokens = 4 }}\n\
         [plugins.huge]\npath = {hostile}\ngenerate = {{ max_prompt_tokens = 64 }}\n\
         [plugins.policy]\npath = {hostile}\ngenerate = {{ weights = [\"base\"] }}\n\
         [plugins.nogrant]\npath = {hostile}\n\
         [[rewards]]\nplugin = \"flood\"\nconfig = {{ mode = \"generate-flood\", count = 5 }}\ndefault_weight = 0.0\n\
         [[rewards]]\nplugin = \"huge\"\nconfig = {{ mode = \"generate-huge\" }}\ndefault_weight = 0.0\n\
         [[rewards]]\nplugin = \"policy\"\nconfig = {{ mode = \"generate-policy\" }}\ndefault_weight = 0.0\n\
         [[rewards]]\nplugin = \"nogrant\"\nconfig = {{ mode = \"generate\" }}\ndefault_weight = 0.0\n\
         [train]\nsteps = 2\nsave_every = 100\n",
        user = quoted("sim_user"),
        judge = JUDGE.replace("JUDGE", &quoted("judge")),
    );
    let path = config(&dir, "run", &extra);
    let out = dir.join("run");
    TestCommand::new(&["train", "--config"])
        .arg(&path)
        .arg("--out")
        .arg(&out)
        .ok();
    let m = super::train_cli::metrics(&out);
    assert_eq!(m.len(), 2);
    for step in &m {
        let calls = &step["generate_calls"];
        // Four trajectories a step. The flood: 2 answered and 3 refused each; the huge
        // prompts: 2 refused each; the policy: 1 refused; no grant: 1 refused (the four
        // sections are all the plugin `hostile`).
        assert_eq!(calls["hostile/answered"], 8, "{calls}");
        assert_eq!(calls["hostile/refused"], 12 + 8 + 4 + 4, "{calls}");
        assert_eq!(calls["hostile/failed"], 0, "{calls}");
        assert_eq!(calls["judge/answered"], 4, "{calls}");
        assert_eq!(calls["judge/refused"], 0, "{calls}");
        assert!(calls["sim_user/answered"].is_u64(), "{calls}");
        assert!(step["faults"].as_object().unwrap().is_empty(), "{step}");
        let answered = step["generate_answered"].as_u64().unwrap();
        assert!(answered >= 12, "{step}");
        assert!(step["generate_tokens"].as_u64().unwrap() >= 4 * 8, "{step}");
        assert!(step["generate_s"].as_f64().unwrap() > 0.0, "{step}");
        assert!(
            step["generate_wait_s"]["judge"].as_f64().unwrap() > 0.0,
            "{step}"
        );
    }
}

/// `plugin call` and `plugin test` answer a plugin's calls with `--model`, only as
/// `--generate` grants; the simulated user's turns repeat under a seed.
#[test]
fn a_plugin_on_its_own_asks_the_model_it_is_given() {
    let model = repo_root().join("tests/fixtures/models/qwen2");
    let user = || {
        TestCommand::new(&["plugin", "call", "--json"])
            .arg(plugin("sim_user"))
            .args([
                "environment",
                "--config",
                r#"{"turns": 4, "max_new_tokens": 8}"#,
            ])
            .args(["--prompt", "Help me plan a trip.", "--text", "Where to?"])
            .args(["--text", "How long?", "--seed", "3", "--generate"])
            .arg(r#"{"weights": ["base"]}"#)
            .arg("--model")
            .arg(&model)
            .ok()
            .stdout
    };
    let first = user();
    assert_eq!(first, user(), "seeded: the same user turns");
    assert!(first.contains("\"user\""), "{first}");
    // Without the grant, the plugin's error says how to grant it.
    let err = TestCommand::new(&["plugin", "call"])
        .arg(plugin("judge"))
        .args([
            "reward",
            "--config",
            r#"{"rubric": "right"}"#,
            "--prompt",
            "2+2?",
        ])
        .args(["--text", "4"])
        .fails();
    assert!(err.contains("generate is not granted"), "{err}");
    let err = TestCommand::new(&["plugin", "call"])
        .arg(plugin("judge"))
        .args(["reward", "--config", r#"{"rubric": "right"}"#, "--generate"])
        .fails();
    assert!(err.contains("--generate needs --model DIR"), "{err}");
    let err = TestCommand::new(&["plugin", "call"])
        .arg(plugin("judge"))
        .args(["reward", "--generate", r#"{"weights": []}"#, "--model"])
        .arg(&model)
        .fails();
    assert!(err.contains("weights must name"), "{err}");
}

/// A run config's grant mistakes are one line naming the field.
#[test]
fn a_bad_grant_is_one_line_naming_the_field() {
    let dir = temp_dir("generate-config");
    for (grant, want) in [
        (
            "{ weights = [] }",
            "plugins.judge.generate: weights must name",
        ),
        (
            "{ max_calls_per_trajectory = 0 }",
            "plugins.judge.generate: max_calls_per_trajectory must be at least 1",
        ),
        // TOML's own error: the line, the field, and the keys there are.
        (
            "{ weight = [\"base\"] }",
            "unknown field `weight`, expected one of",
        ),
    ] {
        let path = config(
            &dir,
            "bad",
            &format!(
                "[plugins.judge]\npath = {}\ngenerate = {grant}\n[[rewards]]\nplugin = \"judge\"\nconfig = {{ rubric = \"x\" }}\n",
                quoted("judge")
            ),
        );
        let err = TestCommand::new(&["rollout", "--split", "train", "--config"])
            .arg(&path)
            .arg("--out")
            .arg(dir.join("r.jsonl"))
            .fails();
        assert!(err.contains(want), "{grant}: {err}");
        assert!(err.contains("bad.toml"), "{err}");
        if !grant.contains("weight =") {
            assert_eq!(err.trim().lines().count(), 1, "{err}");
        }
    }
}
