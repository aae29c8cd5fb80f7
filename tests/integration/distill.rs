//! On-policy distillation (`[distill]`) on the fixture model: a teacher taught by `rlhost
//! sft` to answer every prompt with one short reply, then an untaught student that samples
//! on its own and learns from the teacher's log-probs of its tokens alone. The teacher as
//! an adapter over the student's weights and as a merged model folder read the same
//! log-probs; a teacher that is not one is named in one line.

use super::train_cli::metrics;
use rlhost_tests::{TestCommand, repo_root as root, temp_dir};
use std::path::Path;

/// The teacher's one reply to every prompt.
const REPLY: &str = "ok, done.";

/// A run of the fixture model; `model` adds lines to `[model]`, `distill` sections.
fn config(dir: &Path, name: &str, out: &str, model: &str, distill: &str) -> std::path::PathBuf {
    let path = root().join("tests/fixtures/models/qwen2");
    let text = format!(
        "[run]\nseed = 4\nout_dir = \"{out}\"\n[model]\npath = {path:?}\n{model}[data]\npath = \"data.jsonl\"\neval_size = 0\n[sampling]\nmax_new_tokens = 16\n[rollout]\ngroup_size = 8\nprompts_per_step = 8\n[train]\nsteps = 30\nlr = 0.01\nsave_every = 100\n{distill}"
    );
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn mean(rows: &[serde_json::Value], key: &str) -> f64 {
    rows.iter().map(|r| r[key].as_f64().unwrap()).sum::<f64>() / rows.len() as f64
}

/// Issue 65, item 5: the student's reverse KL to the teacher falls and it comes to say
/// what the teacher says, with no reward at all. Measured (run seeds 1-5): the mean
/// reverse KL per token fell from 2.6-2.8 over the first three steps to 0.15-0.30 over the
/// last three; cut replies from 0.41-0.56 of a step's to 0.005-0.047.
#[test]
fn a_student_learns_what_its_teacher_says_from_its_log_probs_alone() {
    let dir = temp_dir("distill");
    let prompts: String = (0..40)
        .map(|i| format!("{{\"prompt\": \"Write something about topic {i}.\"}}\n"))
        .collect();
    std::fs::write(dir.join("data.jsonl"), prompts).unwrap();
    let conversations: String = (0..40)
        .map(|i| {
            serde_json::json!({"messages": [
                {"role": "user", "content": format!("Write something about topic {i}.")},
                {"role": "assistant", "content": REPLY},
            ]})
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(dir.join("sft.jsonl"), conversations).unwrap();
    let base = config(&dir, "base.toml", "base", "", "");
    let sft = |epochs: &str, out: &str| {
        TestCommand::new(&["sft", "--config"])
            .arg(&base)
            .arg("--data")
            .arg(dir.join("sft.jsonl"))
            .args(["--epochs", epochs, "--batch", "8", "--lr", "0.02", "--out"])
            .arg(dir.join(out))
    };
    // The teacher learnt the reply for 8 epochs; the student starts from 1 epoch of it.
    // (From the untaught model, whose replies are near-uniform over 505 tokens, the
    // student would first have to sample the reply's tokens to be told about them.)
    sft("8", "teacher")
        .arg("--merge")
        .arg(dir.join("teacher-model"))
        .ok();
    sft("1", "weak").ok();
    let student = "adapter = \"weak\"\n";

    // The teacher as an adapter over the student's own weights.
    let adapter = config(
        &dir,
        "distill.toml",
        "student",
        student,
        "[distill]\nteacher = \"teacher\"\n",
    );
    TestCommand::new(&["train", "--config"]).arg(&adapter).ok();
    let m = metrics(&dir.join("student"));
    assert_eq!(m.len(), 30);
    let (first, last) = (&m[..3], &m[m.len() - 3..]);
    let kl = |rows: &[serde_json::Value]| mean(rows, "teacher_kl");
    assert!(
        kl(first) > 1.0 && kl(last) < 0.25 * kl(first),
        "the reverse KL to the teacher did not fall: {} -> {}",
        kl(first),
        kl(last)
    );
    assert!(
        mean(last, "truncated") < 0.2 && mean(last, "truncated") < mean(first, "truncated"),
        "the student did not come to finish as the teacher does: cut replies {} -> {}",
        mean(first, "truncated"),
        mean(last, "truncated")
    );
    // Greedy, the student now says what the teacher says.
    let sampled = dir.join("greedy.jsonl");
    TestCommand::new(&["rollout", "--config"])
        .arg(&adapter)
        .arg("--adapter")
        .arg(dir.join("student/checkpoints/step-000030"))
        .args([
            "--split",
            "train",
            "--prompts",
            "8",
            "--set",
            "sampling.temperature=0",
            "--out",
        ])
        .arg(&sampled)
        .ok();
    let replies: Vec<String> = std::fs::read_to_string(&sampled)
        .unwrap()
        .lines()
        .map(|l| {
            let t: serde_json::Value = serde_json::from_str(l).unwrap();
            t["messages"].as_array().unwrap().last().unwrap()["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let said = replies.iter().filter(|r| r.trim() == REPLY).count();
    assert!(said * 4 >= replies.len() * 3, "{replies:?}");

    // The merged teacher, a model folder of its own, reads the same log-probs: the first
    // step's samples are the same (same seed, same untaught student), so is its KL.
    let merged = config(
        &dir,
        "merged.toml",
        "student-merged",
        student,
        "[distill]\nteacher = \"teacher-model\"\n",
    );
    TestCommand::new(&["train", "--config"])
        .arg(&merged)
        .args(["--steps", "1"])
        .ok();
    let one = metrics(&dir.join("student-merged"));
    let (a, b) = (
        m[0]["teacher_kl"].as_f64().unwrap(),
        one[0]["teacher_kl"].as_f64().unwrap(),
    );
    assert!(
        (a - b).abs() < 1e-3 * a.abs().max(1.0),
        "adapter {a} vs merged {b}"
    );
}

/// Each teacher that cannot teach this run stops it at start with one line naming
/// `distill.teacher` and what is wrong.
#[test]
fn a_teacher_that_cannot_teach_is_named_in_one_line() {
    let dir = temp_dir("distill-bad");
    std::fs::write(
        dir.join("data.jsonl"),
        "{\"prompt\": \"Say something.\"}\n{\"prompt\": \"Say more.\"}\n",
    )
    .unwrap();
    // A model folder whose tokenizer gives two tokens each other's ids.
    let from = root().join("tests/fixtures/models/qwen2");
    let other = dir.join("other-model");
    std::fs::create_dir_all(&other).unwrap();
    for e in std::fs::read_dir(&from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), other.join(e.file_name())).unwrap();
        }
    }
    let mut t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(other.join("tokenizer.json")).unwrap())
            .unwrap();
    t["model"]["vocab"]["sul"] = 302.into();
    t["model"]["vocab"]["calc"] = 300.into();
    std::fs::write(other.join("tokenizer.json"), t.to_string()).unwrap();
    // A folder that holds nothing a teacher is made of.
    std::fs::create_dir_all(dir.join("empty")).unwrap();
    for (teacher, says) in [
        ("other-model", "tokenizer differs from the run's at id 300"),
        ("nowhere", "does not exist"),
        ("empty", "holds no teacher"),
        ("builtin:multiply", "only the run's own model"),
    ] {
        let path = config(
            &dir,
            "bad.toml",
            "bad",
            "",
            &format!("[distill]\nteacher = \"{teacher}\"\n"),
        );
        let err = TestCommand::new(&["train", "--config"]).arg(&path).fails();
        assert!(
            err.contains(&format!("distill.teacher = \"{teacher}\"")) && err.contains(says),
            "{teacher}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "{teacher}: {err}");
    }
    // Settings a distillation run cannot go with.
    for (extra, set, says) in [
        ("coef = 0\n", None, "distill.coef is 0"),
        (
            "",
            Some("train.algorithm=\"ppo\""),
            "with train.algorithm = \"ppo\"",
        ),
    ] {
        let path = config(
            &dir,
            "bad.toml",
            "bad",
            "",
            &format!("[distill]\nteacher = \"other-model\"\n{extra}"),
        );
        let mut run = TestCommand::new(&["train", "--config"]).arg(&path);
        if let Some(set) = set {
            run = run.args(["--set", set]);
        }
        let err = run.fails();
        assert!(err.contains(says), "{err}");
    }
}
