//! Test cases per second: the code-tests reward scoring solutions case by case in the
//! sandbox, side by side with a `python3` subprocess per case doing the same work, the way
//! Python RL frameworks without a sandbox service grade code (verl's and DeepCoder's local
//! runners: `subprocess.run([python3, ...], input=..., timeout=...)` per test).
//!
//! Workload: the reference solutions of the generated MBPP-, HumanEval- and APPS-shaped
//! files in `configs/data/` (`python3 scripts/make_code_data.py`), every case of every
//! sample (assert lines, `check(candidate)`, stdin/stdout and call cases); every case must
//! pass on both sides. Timed with one worker and with one per core, each side alike: on
//! the sandbox's side, trajectories scored that many at a time (each one's cases as many at
//! a time); on the subprocesses' side, that many threads each waiting on its subprocess.
//!
//! Run: `bash plugins/build.sh && cargo bench -p rlhost --bench code_tests`

use futures_util::StreamExt;
use rlhost::plugin::{Limits, PluginRuntime, PluginSpec, RuntimeOptions, Sample, Transcript};
use rlhost::rollout::reward::split_cases;
use rlhost::rollout::{RewardSpec, Rewards};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Each sample file's rows as (reference solution, metadata with `tests`).
fn workload() -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for (layout, key) in [
        ("mbpp", "test_list"),
        ("humaneval", "test"),
        ("apps", "input_output"),
    ] {
        let path = root().join(format!("configs/data/{layout}-sample.jsonl"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            eprintln!(
                "{}: {e}; run `python3 scripts/make_code_data.py`",
                path.display()
            );
            std::process::exit(1)
        });
        for line in text.lines() {
            let row: Value = serde_json::from_str(line).unwrap();
            let code = match layout {
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
            let mut meta = row.clone();
            meta["tests"] = row[key].clone();
            out.push((code, meta));
        }
    }
    out
}

/// Cases per second of the sandboxed reward with `workers` cases at a time, over `rounds`.
fn sandboxed(
    rt: &tokio::runtime::Runtime,
    work: &[(String, Value)],
    workers: usize,
    rounds: usize,
) -> f64 {
    let runtime = PluginRuntime::new(&RuntimeOptions {
        cache_dir: Some(root().join("target/bench-cache")),
        ..RuntimeOptions::default()
    })
    .unwrap();
    let plugin = rt
        .block_on(runtime.load(PluginSpec {
            path: root().join("plugins/dist/code_tests.wasm"),
            limits: Limits {
                timeout_ms: 5_000,
                ..Limits::default()
            },
            grants: Default::default(),
        }))
        .unwrap_or_else(|e| {
            eprintln!("{e:#}: run `bash plugins/build.sh` first");
            std::process::exit(1)
        });
    let spec = RewardSpec {
        plugin,
        config: "{}".into(),
        weights: Default::default(),
        default_weight: 1.0,
        fallback: 0.0,
        cases: Some("tests".into()),
    };
    let rewards = rt
        .block_on(Rewards::open(vec![spec], 1.0, workers))
        .unwrap();
    let trajectories: Vec<Transcript> = work
        .iter()
        .map(|(code, meta)| {
            let sample = Sample {
                messages: vec![],
                metadata: meta.clone(),
            };
            Transcript::single_turn(&sample, format!("```python\n{code}\n```"))
        })
        .collect();
    let cases: usize = work
        .iter()
        .map(|(_, m)| split_cases(&m["tests"]).len())
        .sum();
    let f = &rewards.fns[0];
    // Trajectories scored `workers` at a time, as the rollout engine scores those that
    // finish together; a first round unmeasured (the compile cache and the pool warm up).
    let run = || {
        rt.block_on(
            futures_util::stream::iter(&trajectories)
                .map(|t| {
                    // A task per trajectory, as the engine spawns its scoring.
                    let (f, t) = (f.clone(), t.clone());
                    async move {
                        tokio::spawn(async move { f.score(&t, None).await })
                            .await
                            .unwrap()
                    }
                })
                .buffer_unordered(workers)
                .for_each(|scored| {
                    let parts = scored.result.unwrap();
                    assert!(
                        parts.iter().all(|c| c.value == 1.0),
                        "{parts:?} {:?}",
                        scored.note
                    );
                    std::future::ready(())
                }),
        )
    };
    run();
    let t0 = Instant::now();
    for _ in 0..rounds {
        run();
    }
    (cases * rounds) as f64 / t0.elapsed().as_secs_f64()
}

/// Cases per second of a `python3` subprocess per case, `workers` at a time (threads
/// waiting on the subprocesses, as the Python runners do), over `rounds`.
fn subprocesses(work: &[(String, Value)], workers: usize, rounds: usize) -> f64 {
    let rows: Vec<Value> = work
        .iter()
        .map(|(code, meta)| json!({"code": code, "meta": meta}))
        .collect();
    let driver = format!(
        r#"
import concurrent.futures, json, shutil, subprocess, sys, time
exe = shutil.which("python3")
rows = json.loads(sys.stdin.read())

def cases(code, meta):
    tests = meta["tests"]
    if isinstance(tests, str) and tests.lstrip()[:1] in "[{{":
        tests = json.loads(tests)
    if isinstance(tests, str):  # HumanEval: check(candidate) on the entry point
        return [(code + "\n" + tests + f"\ncheck({{meta['entry_point']}})\n", "", None)]
    if isinstance(tests, list):  # MBPP: one assert per case
        return [(code + "\n" + t + "\n", "", None) for t in tests]
    out = []
    for i, given in enumerate(tests["inputs"]):
        expected = tests["outputs"][i]
        if "fn_name" in tests:  # APPS call case: print the value as JSON
            call = f"\nimport json\nprint(json.dumps({{tests['fn_name']}}(*{{given!r}})))\n"
            out.append((code + call, "", json.dumps(expected[0])))
        else:
            out.append((code, given, expected))
    return out

def lines(text):
    out = [l.rstrip() for l in text.splitlines()]
    while out and not out[-1]:
        out.pop()
    return out

def run(case):
    program, given, expected = case
    p = subprocess.run([exe, "-c", program], input=given, capture_output=True, text=True, timeout=5)
    ok = p.returncode == 0 and (expected is None or lines(p.stdout) == lines(expected))
    assert ok, (program, p.stdout, p.stderr)

work = [c for r in rows for c in cases(r["code"], r["meta"])]
with concurrent.futures.ThreadPoolExecutor({workers}) as pool:
    list(pool.map(run, work[:4]))
    t0 = time.perf_counter()
    for _ in range({rounds}):
        list(pool.map(run, work))
    print(len(work) * {rounds} / (time.perf_counter() - t0))
"#
    );
    let mut child = Command::new("python3")
        .arg("-c")
        .arg(driver)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 is needed for the subprocess runner");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(serde_json::to_string(&rows).unwrap().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the subprocess runner failed");
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let work = workload();
    let cases: usize = work
        .iter()
        .map(|(_, m)| split_cases(&m["tests"]).len())
        .sum();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "code_tests: {} samples, {cases} cases (MBPP, HumanEval, APPS layouts), every case passing; {cores} cores",
        work.len()
    );
    println!(
        "{:<10} {:>22} {:>26} {:>8}",
        "workers", "sandbox (cases/s)", "python3 subprocess (cases/s)", "ratio"
    );
    for workers in [1, cores] {
        let ours = sandboxed(&rt, &work, workers, 10);
        let peer = subprocesses(&work, workers, 2);
        println!(
            "{workers:<10} {ours:>22.0} {peer:>26.1} {:>7.1}×",
            ours / peer
        );
    }
}
