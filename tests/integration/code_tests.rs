//! The code-tests reward (Python, in the sandbox) scoring model-written solutions against
//! their tests: case by case in fresh instances, so a solution that loops, exhausts memory,
//! recurses without end or reaches for the host fails only the cases it does that on, each
//! contained, counted and named in the trajectory's note, while the other cases count.

use super::{load_with, tokio_runtime};
use rlhost::plugin::{FaultKind, Limits, Plugin, Sample, Transcript};
use rlhost::rollout::{RewardSpec, Rewards, Scored};
use serde_json::json;
use std::time::Instant;

const TIMEOUT_MS: u64 = 1_000;

fn limits() -> Limits {
    Limits {
        timeout_ms: TIMEOUT_MS,
        memory_mib: 128,
        ..Limits::default()
    }
}

fn spec(plugin: &Plugin, cases: Option<&str>) -> RewardSpec {
    RewardSpec {
        plugin: plugin.clone(),
        config: "{}".into(),
        weights: Default::default(),
        default_weight: 1.0,
        fallback: 0.0,
        cases: cases.map(str::to_string),
    }
}

/// `solution` (the body of a ```python block) scored against `tests`.
fn score(
    rt: &tokio::runtime::Runtime,
    rewards: &Rewards,
    solution: &str,
    tests: serde_json::Value,
) -> Scored {
    let sample = Sample {
        messages: vec![],
        metadata: json!({"tests": tests}),
    };
    let completion = format!("Here is my solution.\n```python\n{solution}\n```");
    rt.block_on(rewards.fns[0].score(&Transcript::single_turn(&sample, completion), None))
}

fn components(s: &Scored) -> (f64, f64) {
    let c = s.result.as_ref().unwrap_or_else(|f| panic!("faulted: {f}"));
    let get = |n: &str| c.iter().find(|c| c.name == n).unwrap().value;
    (get("passed"), get("all_passed"))
}

#[test]
fn hostile_solutions_fail_only_their_own_cases() {
    let rt = tokio_runtime();
    let plugin = rt.block_on(load_with("code_tests", limits()));
    let rewards = rt
        .block_on(Rewards::open(vec![spec(&plugin, Some("tests"))], 1.0, 2))
        .unwrap();
    let tests = json!(["assert f(1) == 2", "assert f(3) == 6", "assert f(4) == 8"]);

    let right = score(&rt, &rewards, "def f(x):\n    return 2 * x", tests.clone());
    assert_eq!(components(&right), (1.0, 1.0));
    assert!(right.case_faults.is_empty() && right.note.is_none());

    // Each hostile solution misbehaves on f(3) only: the other two cases pass. What the
    // sandbox stops (a deadline, the memory cap, a wasm trap) is a fault of that case,
    // counted; what Python itself refuses (no files, no network) is a failed case that the
    // plugin explains; deep recursion is either, as Python may catch it (RecursionError)
    // before the wasm stack runs out.
    let hostile = [
        ("while x == 3:\n        pass", Some(FaultKind::Timeout)),
        (
            "if x == 3:\n        b = bytearray(1 << 30)",
            Some(FaultKind::OutOfMemory),
        ),
        ("if x == 3:\n        return f(x)", Some(FaultKind::Trap)),
        (
            "if x == 3:\n        return open('/etc/passwd').read()",
            None,
        ),
        (
            "if x == 3:\n        import os; return os.listdir('/')",
            None,
        ),
        (
            "if x == 3:\n        import socket; return socket.create_connection(('127.0.0.1', 22))",
            None,
        ),
    ];
    for (misdeed, kind) in hostile {
        let solution = format!("def f(x):\n    {misdeed}\n    return 2 * x");
        let before = plugin.faults().total();
        let t0 = Instant::now();
        let s = score(&rt, &rewards, &solution, tests.clone());
        let took = t0.elapsed();
        let (passed, all) = components(&s);
        assert!(
            (passed - 2.0 / 3.0).abs() < 1e-12 && all == 0.0,
            "{misdeed}: {passed} {all}"
        );
        let note = s.note.clone().unwrap_or_default();
        assert!(note.starts_with("case 1: "), "{misdeed}: {note}");
        let faults = plugin.faults().total() - before;
        match kind {
            None => assert!(
                s.case_faults.is_empty() && faults == 0,
                "{misdeed}: {:?}",
                s.case_faults
            ),
            Some(FaultKind::Trap) => assert!(s.case_faults.len() as u64 == faults && faults <= 1),
            Some(kind) => {
                assert_eq!(s.case_faults.len(), 1, "{misdeed}: {note}");
                assert_eq!(
                    s.case_faults[0].kind, kind,
                    "{misdeed}: {:?}",
                    s.case_faults
                );
                assert_eq!(faults, 1, "{misdeed}");
            }
        }
        assert!(
            took.as_millis() < u128::from(4 * TIMEOUT_MS),
            "{misdeed}: {took:?}"
        );
        eprintln!("{misdeed:?}: {note} [{took:?}]");
    }
}

#[test]
fn every_case_runs_in_a_fresh_instance() {
    let rt = tokio_runtime();
    let plugin = rt.block_on(load_with("code_tests", limits()));
    // The solution keeps a count on a module, which outlives a case's fresh globals when
    // the cases share one instance.
    let solution = "import math\ndef f():\n    math.calls = getattr(math, 'calls', 0) + 1\n    return math.calls";
    let tests = json!(["assert f() == 1", "assert f() == 1", "assert f() == 1"]);
    for (cases, expected) in [(Some("tests"), (1.0, 1.0)), (None, (1.0 / 3.0, 0.0))] {
        let rewards = rt
            .block_on(Rewards::open(vec![spec(&plugin, cases)], 1.0, 2))
            .unwrap();
        let s = score(&rt, &rewards, solution, tests.clone());
        assert_eq!(components(&s), expected, "cases = {cases:?}");
    }
}

#[test]
fn a_solution_that_faults_every_case_falls_back_and_stdin_cases_are_split() {
    let rt = tokio_runtime();
    let plugin = rt.block_on(load_with("code_tests", limits()));
    let rewards = rt
        .block_on(Rewards::open(vec![spec(&plugin, Some("tests"))], 1.0, 2))
        .unwrap();
    // APPS' layout: parallel lists in a JSON string, split by the host into two cases.
    let apps = json!(r#"{"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}"#);
    let add = "a, b = map(int, input().split())\nprint(a + b)";
    assert_eq!(
        components(&score(&rt, &rewards, add, apps.clone())),
        (1.0, 1.0)
    );
    let wrong = "a, b = map(int, input().split())\nprint(a * b)";
    let s = score(&rt, &rewards, wrong, apps.clone());
    assert_eq!(components(&s), (0.0, 0.0));
    assert_eq!(
        s.note.as_deref(),
        Some(r"case 0: wrong output for input '1 2\n': expected '3\n', got '2\n'")
    );
    // No cases at all: the plugin's own error, counted, never a panic.
    let s = score(&rt, &rewards, add, json!([]));
    let fault = s.result.unwrap_err();
    assert_eq!(fault.kind, FaultKind::GuestError);
    assert!(fault.message.contains("holds no test cases"), "{fault}");
    let s = score(&rt, &rewards, "while True:\n    pass", apps);
    let fault = s.result.unwrap_err();
    assert_eq!(fault.kind, FaultKind::Timeout);
    assert_eq!(
        s.case_faults.len(),
        1,
        "the second case's fault is kept too"
    );
}

/// The sample datasets' reference solutions (scripts/make_code_data.py) pass their own
/// tests in every layout, scored case by case through the sandboxed reward, and a wrong
/// solution passes none: the layouts are read as the datasets mean them.
#[test]
fn the_sample_datasets_reference_solutions_pass_their_tests() {
    let rt = tokio_runtime();
    let plugin = rt.block_on(load_with("code_tests", limits()));
    let rewards = rt
        .block_on(Rewards::open(vec![spec(&plugin, Some("tests"))], 1.0, 2))
        .unwrap();
    let read = |name: &str| -> Vec<serde_json::Value> {
        let path = rlhost_tests::repo_root().join(format!("configs/data/{name}-sample.jsonl"));
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let mut cases = 0;
    for (layout, tests_key) in [
        ("mbpp", "test_list"),
        ("humaneval", "test"),
        ("apps", "input_output"),
    ] {
        for row in read(layout) {
            let reference = match layout {
                "mbpp" => row["code"].as_str().unwrap().to_string(),
                "humaneval" => format!(
                    "{}{}",
                    row["prompt"].as_str().unwrap(),
                    row["canonical_solution"].as_str().unwrap()
                ),
                _ => {
                    let all: Vec<String> =
                        serde_json::from_str(row["solutions"].as_str().unwrap()).unwrap();
                    all[0].clone()
                }
            };
            let mut metadata = row.clone();
            metadata["tests"] = row[tests_key].clone();
            for (solution, expected) in
                [(reference.as_str(), 1.0), ("print(0)\ndef f(): pass", 0.0)]
            {
                let sample = Sample {
                    messages: vec![],
                    metadata: metadata.clone(),
                };
                let completion = format!("```python\n{solution}\n```");
                let s = rt.block_on(
                    rewards.fns[0].score(&Transcript::single_turn(&sample, completion), None),
                );
                assert_eq!(
                    components(&s),
                    (expected, expected),
                    "{layout} {row}: {:?}",
                    s.note
                );
            }
            cases += rlhost::rollout::reward::split_cases(&metadata["tests"]).len();
        }
    }
    assert!(cases > 150, "{cases}");
}
