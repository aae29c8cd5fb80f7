//! `rlhost dpo` and `rlhost rm` on the fixture model: pairs in TRL's and RL2's shapes,
//! the held-out line, an interrupted run that resumes into the uninterrupted one's steps,
//! the reward model's saved form, a GRPO run whose only reward is the reward model, and
//! bad pairs named by file, line and key.

use super::train_cli::metrics;
use rlhost_tests::{TestCommand, repo_root as root, temp_dir};
use std::path::Path;

/// Pairs of a made-up task the fixture model can learn to prefer: the right sum over a
/// wrong one, in the three shapes a row may take.
fn write_pairs(path: &Path, n: usize) {
    let rows: String = (0..n)
        .map(|i| {
            let (q, right, wrong) = (format!("{i}+{i}="), format!("{}", 2 * i), format!("{}", 2 * i + 1));
            let row = match i % 3 {
                0 => serde_json::json!({"prompt": q, "chosen": right, "rejected": wrong}),
                1 => serde_json::json!({
                    "prompt": [{"role": "user", "content": q}],
                    "chosen": [{"role": "assistant", "content": right}],
                    "rejected": [{"role": "assistant", "content": wrong}],
                }),
                _ => serde_json::json!({
                    "chosen": [{"role": "user", "content": q}, {"role": "assistant", "content": right}],
                    "rejected": [{"role": "user", "content": q}, {"role": "assistant", "content": wrong}],
                }),
            };
            row.to_string() + "\n"
        })
        .collect();
    std::fs::write(path, rows).unwrap();
}

/// A config for the fixture model; `pairs` adds lines to `[pairs]`, `extra` sections.
fn write_config(dir: &Path, data: &str, pairs: &str, extra: &str) -> std::path::PathBuf {
    let model = root().join("tests/fixtures/models/qwen2");
    let text = format!(
        "[run]\nseed = 5\nout_dir = \"run\"\n[model]\npath = {model:?}\n[data]\npath = {data:?}\neval_size = 6\n[train]\nsteps = 8\nlr = 0.01\nsave_every = 3\neval_every = 4\n[pairs]\nper_step = 4\n{pairs}[dpo]\nbeta = 0.5\n{extra}"
    );
    let path = dir.join("dpo.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn dpo_learns_the_pairs_and_a_resumed_run_takes_the_same_steps() {
    let dir = temp_dir("dpo-cli");
    write_pairs(&dir.join("pairs.jsonl"), 30);
    let config = write_config(&dir, "pairs.jsonl", "", "");
    let dpo = || TestCommand::new(&["dpo", "--config"]).arg(&config);
    let ran = dpo().ok();
    assert!(ran.stdout.contains("adapter in"), "{}", ran.stdout);
    // "held-out (6 pairs), start -> step 8: preference accuracy A% -> B%, margin ..."
    let line = ran
        .stdout
        .lines()
        .find(|l| l.starts_with("held-out (6 pairs), start -> step 8"))
        .unwrap();
    let acc: Vec<f64> = line
        .split("preference accuracy ")
        .nth(1)
        .unwrap()
        .split(',')
        .next()
        .unwrap()
        .split(" -> ")
        .map(|x| x.trim_end_matches('%').parse().unwrap())
        .collect();
    assert!(acc[1] > acc[0], "{line}");
    assert!(dir.join("run/adapter/adapter_model.safetensors").is_file());
    let straight = metrics(&dir.join("run"));
    assert_eq!(straight.len(), 8);
    assert!(
        straight[3]["eval"]["rewards_accuracies"].is_number(),
        "{:?}",
        straight[3]
    );
    // Interrupted after step 5 (a checkpoint at 3 and at 5), resumed: the same steps.
    dpo().args(["--overwrite", "--stop-after", "5"]).ok();
    let resumed = dpo().args(["--resume", "latest"]).ok();
    assert!(
        resumed.stdout.contains("step 5 -> step 8"),
        "{}",
        resumed.stdout
    );
    let again = metrics(&dir.join("run"));
    assert_eq!(again.len(), 8);
    for (a, b) in straight.iter().zip(&again) {
        assert_eq!(a["loss"], b["loss"], "step {}", a["step"]);
        assert_eq!(a["grad_norm"], b["grad_norm"], "step {}", a["step"]);
    }
    // A run directory that holds a run is not overwritten by accident.
    let err = dpo().fails();
    assert!(err.contains("holds a run already"), "{err}");
}

#[test]
fn rm_learns_which_reply_is_preferred_and_saves_a_sequence_classifier() {
    let dir = temp_dir("rm-cli");
    // The preferred reply answers; the other declines: a pattern a reward model can read.
    let rows: String = (0..40)
        .map(|i| {
            serde_json::json!({"prompt": format!("{i}+{i}="), "chosen": format!("{}", 2 * i), "rejected": "I cannot say.", "margin": 0.5})
                .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(dir.join("pairs.jsonl"), rows).unwrap();
    let config = write_config(
        &dir,
        "pairs.jsonl",
        "margin_key = \"margin\"\n",
        "[rm]\ncenter_rewards_coefficient = 0.01\n",
    );
    let rm = || TestCommand::new(&["rm", "--config"]).arg(&config);
    let ran = rm().ok();
    let line = ran
        .stdout
        .lines()
        .find(|l| l.starts_with("held-out (6 pairs), start -> step 8: pairwise accuracy"))
        .unwrap_or_else(|| panic!("{}", ran.stdout));
    assert!(line.contains("-> 100.0%"), "{line}");
    let adapter = dir.join("run/adapter");
    let config_json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config_json["task_type"], "SEQ_CLS");
    assert_eq!(config_json["modules_to_save"], serde_json::json!(["score"]));
    let tensors = std::fs::read(adapter.join("adapter_model.safetensors")).unwrap();
    assert!(
        String::from_utf8_lossy(&tensors[..4096.min(tensors.len())])
            .contains("base_model.model.score.weight")
    );
    // Interrupted and resumed: the head comes back from the checkpoint with the adapter.
    let straight = metrics(&dir.join("run"));
    rm().args(["--overwrite", "--stop-after", "3"]).ok();
    assert!(
        dir.join("run/checkpoints/step-000003/score.safetensors")
            .is_file()
    );
    rm().args(["--resume", "latest"]).ok();
    for (a, b) in straight.iter().zip(&metrics(&dir.join("run"))) {
        assert_eq!(a["loss"], b["loss"], "step {}", a["step"]);
    }
}

/// Issue 65: a reward model `rlhost rm` trained scores a GRPO run's trajectories
/// (`[[rewards]] model`), and the run learns what it prefers, as in RLHF: the policy's own
/// samples are ranked (a reply that finished over one cut at `max_new_tokens`), the reward
/// model learns the ranking from pairs of them, and a GRPO run whose only reward is the
/// reward model learns to finish its replies, which the run's own count of cut replies
/// measures. With a KL penalty toward the base, as RLHF runs keep one: without it, one
/// run seed of five found replies the reward model overrates (entropy 5 -> 0.3, cut
/// replies 0.84 -> 1.0 while the score rose). Measured: the reward model 35% -> 95% on
/// held-out pairs; with `kl_coef = 0.1`, run seeds 1-5 went from 0.84-0.97 cut replies to
/// 0-0.06 by step 24 and stayed at 0-0.12, entropy 2.6-4.6.
#[test]
fn a_grpo_run_learns_what_a_reward_model_prefers() {
    let dir = temp_dir("rm-grpo");
    let prompts: String = (0..40)
        .map(|i| format!("{{\"prompt\": \"Write something about topic {i}.\"}}\n"))
        .collect();
    std::fs::write(dir.join("data.jsonl"), prompts).unwrap();
    let model = root().join("tests/fixtures/models/qwen2");
    let config = |rewards: &str| {
        format!(
            "[run]\nseed = 3\nout_dir = \"grpo\"\n[model]\npath = {model:?}\n[data]\npath = \"data.jsonl\"\neval_size = 0\n[sampling]\nmax_new_tokens = 16\n[rollout]\ngroup_size = 8\nprompts_per_step = 4\n{rewards}[train]\nsteps = 40\nlr = 0.02\nkl_coef = 0.1\nsave_every = 100\n"
        )
    };
    // The policy's samples, ranked: per prompt, each finished reply over each cut one.
    std::fs::write(dir.join("sample.toml"), config("")).unwrap();
    TestCommand::new(&["rollout", "--config"])
        .arg(dir.join("sample.toml"))
        .args(["--split", "train", "--prompts", "40", "--out"])
        .arg(dir.join("samples.jsonl"))
        .ok();
    let mut groups: std::collections::BTreeMap<u64, Vec<(bool, String)>> = Default::default();
    for line in std::fs::read_to_string(dir.join("samples.jsonl"))
        .unwrap()
        .lines()
    {
        let t: serde_json::Value = serde_json::from_str(line).unwrap();
        let reply = t["messages"].as_array().unwrap().last().unwrap()["content"]
            .as_str()
            .unwrap()
            .to_string();
        groups
            .entry(t["sample_id"].as_u64().unwrap())
            .or_default()
            .push((t["stop"] == "end_of_turn", reply));
    }
    let mut rows = String::new();
    for (id, g) in &groups {
        for (finished, chosen) in g.iter().filter(|s| s.0) {
            for (_, rejected) in g.iter().filter(|s| !s.0) {
                assert!(*finished);
                let row = serde_json::json!({
                    "prompt": format!("Write something about topic {id}."),
                    "chosen": chosen,
                    "rejected": rejected,
                });
                rows += &(row.to_string() + "\n");
            }
        }
    }
    assert!(rows.lines().count() >= 60, "too few ranked pairs:\n{rows}");
    std::fs::write(dir.join("pairs.jsonl"), rows).unwrap();
    std::fs::write(
        dir.join("rm.toml"),
        format!(
            "[run]\nseed = 5\nout_dir = \"rm\"\n[model]\npath = {model:?}\n[data]\npath = \"pairs.jsonl\"\neval_size = 20\n[train]\nsteps = 30\nlr = 0.01\n[pairs]\nper_step = 8\n"
        ),
    )
    .unwrap();
    let ran = TestCommand::new(&["rm", "--config"])
        .arg(dir.join("rm.toml"))
        .ok();
    // "held-out (20 pairs), start -> step 30: pairwise accuracy A% -> B%, ..."
    let line = ran
        .stdout
        .lines()
        .find(|l| l.contains("pairwise accuracy"))
        .unwrap_or_else(|| panic!("{}", ran.stdout));
    let after: f64 = line
        .split(" -> ")
        .nth(2)
        .unwrap()
        .split('%')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(after >= 90.0, "{line}");

    std::fs::write(
        dir.join("grpo.toml"),
        config("[[rewards]]\nmodel = \"rm\"\n"),
    )
    .unwrap();
    TestCommand::new(&["train", "--config"])
        .arg(dir.join("grpo.toml"))
        .ok();
    let m = metrics(&dir.join("grpo"));
    let mean = |rows: &[serde_json::Value], get: &dyn Fn(&serde_json::Value) -> f64| {
        rows.iter().map(get).sum::<f64>() / rows.len() as f64
    };
    let rm = |r: &serde_json::Value| r["rewards"]["rm"].as_f64().unwrap();
    let cut = |r: &serde_json::Value| r["truncated"].as_f64().unwrap();
    for r in &m {
        let total = r["reward_mean"].as_f64().unwrap();
        assert!(
            (total - rm(r)).abs() < 1e-4,
            "step {}: total {total}, rm {}",
            r["step"],
            rm(r)
        );
    }
    let (first, last) = (&m[..3], &m[m.len() - 3..]);
    assert!(
        mean(last, &rm) > mean(first, &rm) + 1.0,
        "the reward model's score did not rise: {} -> {}",
        mean(first, &rm),
        mean(last, &rm)
    );
    assert!(
        mean(first, &cut) > 0.5 && mean(last, &cut) < 0.2,
        "the share of cut replies did not fall: {} -> {}",
        mean(first, &cut),
        mean(last, &cut)
    );
}

/// `model.path = "builtin:multiply"` in a `dpo` config trains the model the built-in
/// calculator run starts from with the same seed (built once into the shared cache, as
/// `rlhost train` builds it), on pairs `rlhost rollout --pairs` made from its own samples.
#[test]
fn dpo_trains_the_builtin_model_on_pairs_of_its_own_samples() {
    let dir = temp_dir("dpo-builtin");
    let config = root().join("configs/multiply.toml");
    let ran = TestCommand::new(&["rollout", "--config"])
        .arg(&config)
        .args(["--split", "train", "--prompts", "16", "--out"])
        .arg(dir.join("samples.jsonl"))
        .arg("--pairs")
        .arg(dir.join("pairs.jsonl"))
        .ok();
    assert!(
        ran.stdout.contains("preference pairs from 16 groups"),
        "{}",
        ran.stdout
    );
    let pairs = std::fs::read_to_string(dir.join("pairs.jsonl")).unwrap();
    assert!(pairs.lines().count() >= 4, "{pairs}");
    for line in pairs.lines() {
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(
            row["chosen_reward"].as_f64() > row["rejected_reward"].as_f64(),
            "{row}"
        );
    }
    std::fs::write(
        dir.join("dpo.toml"),
        "[run]\nseed = 7\nout_dir = \"run\"\n[model]\npath = \"builtin:multiply\"\n[data]\npath = \"pairs.jsonl\"\neval_size = 0\n[train]\nsteps = 2\nlr = 5e-4\n[pairs]\nper_step = 2\n",
    )
    .unwrap();
    let ran = TestCommand::new(&["dpo", "--config"])
        .arg(dir.join("dpo.toml"))
        .ok();
    assert!(
        ran.stderr.contains("built-in model builtin:multiply:")
            && ran.stderr.contains("multiply-v"),
        "{}",
        ran.stderr
    );
    assert!(dir.join("run/adapter/adapter_model.safetensors").is_file());
}

/// `rlhost rm` serves the status endpoint as `train` does: each step's loss, pairwise
/// accuracy and rewards under TRL's names, the held-out pairs, the checkpoint, Prometheus.
#[test]
fn a_pair_trainer_serves_its_status() {
    let dir = temp_dir("rm-status");
    write_pairs(&dir.join("pairs.jsonl"), 30);
    let config = write_config(&dir, "pairs.jsonl", "", "");
    let run = super::status::start_with(TestCommand::new(&["rm", "--config"]).arg(&config).args([
        "--status-addr",
        "127.0.0.1:0",
        "--status-linger",
        "600",
    ]));
    let st = super::status::wait_until_done(&run);
    assert_eq!(
        (st["step"].as_u64(), st["total_steps"].as_u64()),
        (Some(8), Some(8))
    );
    let m = &st["metrics"];
    for key in ["chosen", "rejected", "margins"] {
        assert!(m["rewards"][key].is_f64(), "{m}");
    }
    assert!(m["accuracy"].is_f64() && m["eval_accuracy"].is_f64(), "{m}");
    assert_eq!(st["eval"]["step"].as_u64(), Some(8), "{st}");
    assert!(
        st["last_checkpoint"]
            .as_str()
            .unwrap()
            .ends_with("step-000008"),
        "{st}"
    );
    let prometheus = super::status::get(&format!("{}metrics", run.url));
    assert!(prometheus.contains("rlhost_accuracy "), "{prometheus}");
    let history: serde_json::Value =
        serde_json::from_str(&super::status::get(&format!("{}history", run.url))).unwrap();
    assert_eq!(
        history["steps"].as_array().map(Vec::len),
        Some(8),
        "{history}"
    );
}

/// Each bad pair stops `rlhost dpo` with one line naming the file, the line and the key.
#[test]
fn bad_pairs_get_one_clear_line() {
    let dir = temp_dir("dpo-bad");
    let cases = [
        (
            "{\"prompt\": \"1+1=\", \"chosen\": \"2\"}\n",
            "",
            "",
            "bad.jsonl:1",
            "no \"rejected\" (pairs.rejected_key)",
        ),
        (
            "{\"prompt\": \"1+1=\", \"chosen\": \"2\", \"rejected\": \"2\"}\n",
            "",
            "",
            "bad.jsonl:1",
            "the same as",
        ),
        (
            "{\"prompt\": \"1+1=\", \"chosen\": \"2\", \"rejected\": \"3\"}\n{\"prompt\": \"1+1=\", \"chosen\": \"2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2\", \"rejected\": \"3\"}\n",
            "max_length = 60\n",
            "",
            "bad.jsonl:2",
            "\"chosen\" is",
        ),
        (
            "{\"prompt\": \"1+1=\", \"chosen\": \"2\", \"rejected\": \"3\"}\n",
            "",
            "loss = \"robust\"\nlabel_smoothing = 0.5\n",
            "dpo.toml",
            "dpo.label_smoothing is 0.5",
        ),
    ];
    for (rows, pairs, extra, place, what) in cases {
        std::fs::write(dir.join("bad.jsonl"), rows).unwrap();
        let config = write_config(&dir, "bad.jsonl", pairs, extra);
        let err = TestCommand::new(&["dpo", "--config"])
            .arg(&config)
            .args(["--set", "data.eval_size=0", "--overwrite"])
            .fails();
        assert!(err.contains(place) && err.contains(what), "{what}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
}
