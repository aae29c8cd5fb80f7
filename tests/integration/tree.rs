//! Tree rollouts (`[rollout.tree]`, issue 67) with the Python code tool on the small
//! warm-started code model: trajectories branch after the tool's output, branches share
//! their parent's tokens up to there, `rollout` writes each one's place, and `train`
//! trains on the trees and reports their shape.

use super::code_task::small_code_model;
use rlhost_tests::{TestCommand, plugin, temp_dir};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A run of the code task with the Python tool, its groups grown as trees (`tree`: the
/// `[rollout.tree]` keys); written to `dir/tree.toml`.
fn write_config(dir: &Path, tree: &str, extra: &str) -> PathBuf {
    let text = format!(
        r#"
[run]
seed = 3
[model]
path = {model:?}
[data]
plugin = "code_task"
plugin_config = {{ families = ["modpow"] }}
eval_size = 0
[sampling]
max_new_tokens = 48
[rollout]
group_size = 4
prompts_per_step = 4
trigger = "code_trigger"
max_total_tokens = 320
max_tool_output_tokens = 64
[rollout.tree]
{tree}
[plugins.code_task]
path = {task:?}
[plugins.code_trigger]
path = {tool:?}
{extra}
[[rewards]]
plugin = "code_task"
weights = {{ tool_use = 1.0, correct = 1.0, format = 0.0 }}
[train]
steps = 2
lr = 0.002
save_every = 100
"#,
        model = small_code_model("code_trigger").display().to_string(),
        task = plugin("code_task").display().to_string(),
        tool = plugin("code_trigger").display().to_string(),
    );
    let path = dir.join("tree.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn rows(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn branches_share_their_parent_up_to_the_tool_output_they_branch_after() {
    branches_share_their_parent("tree-rollout", "");
}

/// ARPO's rule with a threshold of 0: every branch point whose window is sampled
/// branches, from the tool's output, not from after the window.
#[test]
fn the_entropy_rule_branches_from_the_answer() {
    branches_share_their_parent(
        "tree-entropy",
        "branch_at = \"entropy\"\nentropy_window = 2\nentropy_threshold = 0.0",
    );
}

fn branches_share_their_parent(name: &str, rule: &str) {
    let dir = temp_dir(name);
    let config = write_config(
        &dir,
        &format!("chains = 2\nbranch_factor = 2\nmax_depth = 1\n{rule}"),
        "",
    );
    let out = dir.join("r.jsonl");
    TestCommand::new(&["rollout", "-q", "--config"])
        .arg(&config)
        .args(["--split", "train", "--prompts", "8", "--out"])
        .arg(&out)
        .ok();
    let trajectories = rows(&out);
    let mut by_node: BTreeMap<(u64, String), &serde_json::Value> = BTreeMap::new();
    for t in &trajectories {
        let node = t["tree"]["node"]
            .as_str()
            .expect("every trajectory has a place");
        let key = (t["sample_id"].as_u64().unwrap(), node.to_string());
        assert!(by_node.insert(key, t).is_none(), "node {node} twice");
    }
    let mut branched = 0;
    for ((sample, node), t) in &by_node {
        let place = &t["tree"];
        let Some(parent) = place["parent"].as_str() else {
            // A chain that never branched: its tool never answered.
            assert!(place["branch_points"].as_array().unwrap().is_empty());
            continue;
        };
        let at = place["branch_points"][0].as_u64().unwrap() as usize;
        // Its sibling (child 0 went on as the trajectory that branched).
        let sibling = if node.ends_with(".0") {
            continue;
        } else {
            by_node[&(*sample, format!("{parent}.0"))]
        };
        branched += 1;
        let prompt = t["prompt_len"].as_u64().unwrap() as usize;
        let tokens =
            |x: &serde_json::Value| x["tokens"].as_array().unwrap()[..prompt + at].to_vec();
        assert_eq!(
            tokens(t),
            tokens(sibling),
            "{node}: its prefix is its parent's"
        );
        assert_eq!(
            t["logps"].as_array().unwrap()[..at],
            sibling["logps"].as_array().unwrap()[..at],
            "{node}: and so are its log-probs"
        );
        // The branch point is the end of the tool's output.
        let spans = t["spans"].as_array().unwrap();
        assert!(
            spans
                .iter()
                .any(|s| s["kind"] == "tool" && s["end"].as_u64() == Some(at as u64)),
            "{node}: branch point {at} ends no tool output: {spans:?}"
        );
    }
    assert!(
        branched > 0,
        "no trajectory's tool answered in 8 prompts × 2 chains"
    );
    // At most the tree's leaves, and at least the chains, per prompt.
    let mut per_sample: BTreeMap<u64, usize> = BTreeMap::new();
    for (sample, _) in by_node.keys() {
        *per_sample.entry(*sample).or_default() += 1;
    }
    assert!(
        per_sample.values().all(|&n| (2..=4).contains(&n)),
        "{per_sample:?}"
    );
}

#[test]
fn a_tree_run_trains_and_reports_its_trees() {
    let dir = temp_dir("tree-train");
    for shared in ["per_path", "once"] {
        let config = write_config(
            &dir,
            &format!("chains = 2\nbranch_factor = 2\nmax_depth = 1\nshared_prefix = \"{shared}\""),
            "",
        );
        let out = dir.join(format!("run-{shared}"));
        TestCommand::new(&["train", "--no-status", "--config"])
            .arg(&config)
            .arg("--out")
            .arg(&out)
            .ok();
        let metrics = super::train_cli::metrics(&out);
        assert_eq!(metrics.len(), 2);
        let tree: Vec<&serde_json::Value> = metrics.iter().map(|m| &m["tree"]).collect();
        let leaves: f64 = tree.iter().map(|t| t["leaves"].as_f64().unwrap()).sum();
        assert!((4.0..=8.0).contains(&leaves), "{tree:?}");
        let forks: u64 = tree.iter().map(|t| t["forks"].as_u64().unwrap()).sum();
        let branch_points: u64 = tree
            .iter()
            .map(|t| t["branch_points"].as_u64().unwrap())
            .sum();
        assert_eq!(
            forks, branch_points,
            "one fork per branch point at branch factor 2"
        );
        assert!(forks > 0, "{tree:?}");
        assert!(tree.iter().all(|t| t["fork_failures"] == 0), "{tree:?}");
        assert!(
            metrics
                .iter()
                .all(|m| m["sampled_tokens"].as_u64().unwrap() > 0)
        );
    }
    // ARPO's rule with a threshold no mean surprisal reaches: measured, never branched.
    let config = write_config(
        &dir,
        "chains = 2\nbranch_factor = 2\nmax_depth = 1\nbranch_at = \"entropy\"\nentropy_window = 2\nentropy_threshold = 1e9",
        "",
    );
    let out = dir.join("run-entropy");
    TestCommand::new(&["train", "--no-status", "--config"])
        .arg(&config)
        .arg("--out")
        .arg(&out)
        .ok();
    let metrics = super::train_cli::metrics(&out);
    let sum = |k: &str| -> u64 { metrics.iter().map(|m| m["tree"][k].as_u64().unwrap()).sum() };
    assert!(sum("probes") > 0 && sum("forks") == 0, "{metrics:?}");
}

#[test]
fn a_tree_that_cannot_work_is_one_line() {
    let dir = temp_dir("tree-refused");
    // More leaves than the group holds.
    let config = write_config(&dir, "chains = 4\nbranch_factor = 2\nmax_depth = 1", "");
    let err = TestCommand::new(&["rollout", "-q", "--config"])
        .arg(&config)
        .args(["--prompts", "1", "--out"])
        .arg(dir.join("r.jsonl"))
        .fails();
    assert!(
        err.contains(
            "4 chains × branch_factor 2 ^ max_depth 1 = 8 leaves do not fit rollout.group_size = 4"
        ),
        "{err}"
    );
}
