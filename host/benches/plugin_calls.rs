//! Plugin call latency in every plugin language, side by side with how Python RL
//! frameworks run tool code today.
//!
//! For each example plugin, Rust (the calculator), Python (the code tool), JavaScript (the
//! JavaScript code tool) and C (the numeric-answer reward): (a) a call on a warm session;
//! (b) a fresh session (new store + instance + `open`) and one call; (c) a fresh session
//! alone, with its page faults. Beside each, the same work done by a `python3 -c` or
//! `node -e` subprocess with a timeout, started and timed from Python
//! (`subprocess.run(..., timeout=5)`), as the Python peers run tool code. Prints medians
//! and the ratios, for the pooling allocator (the default) and on-demand instances.
//!
//! Run: `bash plugins/build.sh && cargo bench -p rlhost --bench plugin_calls`
//! (the subprocess baselines need `python3` and `node` on the PATH). Words after `--`
//! keep only the subjects whose plugin or label holds one of them
//! (`-- code_trigger` times the Python tool alone).

use rlhost::plugin::{Limits, Plugin, PluginRuntime, PluginSpec, RuntimeOptions, Sample};
use rlhost::plugin::{Message, Transcript};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

const PY_SNIPPET: &str = "total = sum(i * i for i in range(100))\nprint(total)";
const JS_SNIPPET: &str =
    "let total = 0\nfor (let i = 0; i < 100; i++) total += i * i\nconsole.log(total)";

/// One plugin and the call it is timed on.
struct Subject {
    label: &'static str,
    plugin: &'static str,
    call: Call,
    /// The same work as a subprocess: the program, its code, what it prints.
    peer: (&'static str, &'static str, &'static str),
}

enum Call {
    /// `fire` on this text; the answer must hold the string.
    Fire(&'static str, &'static str),
    /// `score` of a trajectory answering with this completion, whose metadata's answer is
    /// 42; the `correct` component must be 1.
    Score(&'static str),
}

fn subjects() -> Vec<Subject> {
    vec![
        Subject {
            label: "calculator (Rust)",
            plugin: "calculator",
            call: Call::Fire("The total is <calc>(12.5 + 7.5) * 3 / 4</calc>", "15"),
            peer: ("python3", "print((12.5 + 7.5) * 3 / 4)", "15.0"),
        },
        Subject {
            label: "code tool (Python)",
            plugin: "code_trigger",
            call: Call::Fire(
                "Let me compute.\n```python\ntotal = sum(i * i for i in range(100))\nprint(total)\n```",
                "328350",
            ),
            peer: ("python3", PY_SNIPPET, "328350"),
        },
        Subject {
            label: "code tool (JavaScript)",
            plugin: "js_trigger",
            call: Call::Fire(
                "Let me compute.\n```js\nlet total = 0\nfor (let i = 0; i < 100; i++) total += i * i\nconsole.log(total)\n```",
                "328350",
            ),
            peer: ("node", JS_SNIPPET, "328350"),
        },
        Subject {
            label: "numeric reward (C)",
            plugin: "c_reward",
            call: Call::Score("So it is <answer>42.0</answer>"),
            peer: (
                "python3",
                "import math, re\nt = 'So it is <answer>42.0</answer>'\ng = float(re.findall(r'<answer>(.*?)</answer>', t)[-1])\nprint(int(math.isclose(g, 42, rel_tol=1e-6)))",
                "1",
            ),
        },
    ]
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn fmt(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1000.0 {
        format!("{us:.1} µs")
    } else {
        format!("{:.2} ms", us / 1000.0)
    }
}

async fn load(runtime: &Arc<PluginRuntime>, name: &str) -> Plugin {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../plugins/dist/{name}.wasm"));
    if !path.exists() {
        eprintln!(
            "{} is missing: run `bash plugins/build.sh` first",
            path.display()
        );
        std::process::exit(1);
    }
    runtime
        .load(PluginSpec {
            path,
            limits: Limits::default(),
            grants: Default::default(),
        })
        .await
        .expect("load plugin")
}

fn trajectory(completion: &str) -> Transcript {
    Transcript {
        messages: vec![Message::new("assistant", completion)],
        completion: completion.into(),
        metadata: serde_json::json!({"answer": 42}),
        turns: 1,
        truncated: false,
    }
}

/// An open session of the subject's role, and one call on it.
enum Session {
    Trigger(rlhost::plugin::TriggerSession),
    Reward(rlhost::plugin::RewardScorer),
}

async fn open(plugin: &Plugin, call: &Call, seed: u64) -> Session {
    match call {
        Call::Fire(..) => Session::Trigger(
            plugin
                .open_trigger("{}", &Sample::from_prompt(""), seed)
                .await
                .unwrap(),
        ),
        Call::Score(_) => Session::Reward(plugin.open_reward("{}").await.unwrap()),
    }
}

async fn call(session: &mut Session, call: &Call) {
    match (session, call) {
        (Session::Trigger(s), Call::Fire(text, want)) => {
            let out = s.fire(text).await.unwrap().unwrap();
            assert!(out.contains(want), "{out}");
        }
        (Session::Reward(s), Call::Score(completion)) => {
            let c = s.score(&trajectory(completion)).await.unwrap();
            assert!(c.iter().any(|c| c.name == "correct" && c.value == 1.0));
        }
        _ => unreachable!("sessions are opened for their call"),
    }
}

async fn warm(plugin: &Plugin, c: &Call, n: usize) -> Duration {
    let mut session = open(plugin, c, 1).await;
    for _ in 0..n / 10 {
        call(&mut session, c).await;
    }
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        call(&mut session, c).await;
        samples.push(t.elapsed());
    }
    median(samples)
}

async fn fresh(plugin: &Plugin, c: &Call, n: usize) -> Duration {
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        let mut session = open(plugin, c, i as u64).await;
        call(&mut session, c).await;
        samples.push(t.elapsed());
    }
    median(samples)
}

/// Minor page faults of this process so far (field 10 of /proc/self/stat), 0 where there
/// is no procfs.
fn minor_faults() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| {
            let after_name = stat.rsplit_once(')')?.1;
            after_name.split_whitespace().nth(7)?.parse().ok()
        })
        .unwrap_or(0)
}

/// A fresh session alone, and the minor page faults per session, which is where a fresh
/// instance's time goes (copy-on-write of the pages the guest writes).
async fn open_only(plugin: &Plugin, c: &Call, n: usize) -> (Duration, u64) {
    let mut samples = Vec::with_capacity(n);
    let faults_before = minor_faults();
    for i in 0..n {
        let t = Instant::now();
        let session = open(plugin, c, i as u64).await;
        samples.push(t.elapsed());
        drop(session);
    }
    (median(samples), (minor_faults() - faults_before) / n as u64)
}

/// Times `program -c/-e code` started by Python's `subprocess.run` with a timeout, as the
/// Python peers run tool code.
fn subprocess(program: &str, code: &str, want: &str, n: usize) -> Duration {
    let flag = if program == "node" { "-e" } else { "-c" };
    let driver = format!(
        r#"
import shutil, statistics, subprocess, time
exe = shutil.which({program:?})
samples = []
for _ in range({n}):
    t = time.perf_counter()
    out = subprocess.run([exe, {flag:?}, {code:?}], capture_output=True, text=True, timeout=5)
    samples.append(time.perf_counter() - t)
    assert out.stdout.strip() == {want:?}, out
print(statistics.median(samples))
"#
    );
    let out = Command::new("python3")
        .arg("-c")
        .arg(driver)
        .output()
        .expect("python3 is needed for the subprocess baselines");
    assert!(
        out.status.success(),
        "{program}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let secs: f64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    Duration::from_secs_f64(secs)
}

/// One subject's medians for one allocation strategy.
struct Times {
    warm: Duration,
    fresh: Duration,
    open: (Duration, u64),
}

async fn measure(subjects: &[Subject], pooling: bool) -> Vec<Times> {
    let cache = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench-cache");
    let runtime = PluginRuntime::new(&RuntimeOptions {
        fuel: false,
        cache_dir: Some(cache),
        pooling,
    })
    .unwrap();
    let mut rows = Vec::new();
    for s in subjects {
        let plugin = load(&runtime, s.plugin).await;
        // Fewer rounds for the slow fresh Python sessions.
        let n = if s.plugin == "code_trigger" {
            200
        } else {
            1000
        };
        rows.push(Times {
            warm: warm(&plugin, &s.call, 5 * n).await,
            fresh: fresh(&plugin, &s.call, n).await,
            open: open_only(&plugin, &s.call, n).await,
        });
    }
    rows
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let subjects: Vec<Subject> = subjects()
        .into_iter()
        .filter(|s| {
            only.is_empty()
                || only
                    .iter()
                    .any(|w| s.plugin.contains(w.as_str()) || s.label.contains(w.as_str()))
        })
        .collect();
    let (pool, demand) = rt.block_on(async {
        (
            measure(&subjects, true).await,
            measure(&subjects, false).await,
        )
    });
    let peers: Vec<Duration> = subjects
        .iter()
        .map(|s| subprocess(s.peer.0, s.peer.1, s.peer.2, 50))
        .collect();

    println!(
        "plugin call latency (median), {} CPU cores; page faults per session in brackets",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("{:<46} {:>18} {:>18}", "", "pooling (default)", "on-demand");
    for ((s, p), d) in subjects.iter().zip(&pool).zip(&demand) {
        let row = |what: &str, a: String, b: String| {
            println!("{:<46} {a:>18} {b:>18}", format!("{}: {what}", s.label));
        };
        let open = |(t, faults): (Duration, u64)| format!("{} [{faults}]", fmt(t));
        row("warm session, call", fmt(p.warm), fmt(d.warm));
        row("fresh session + call", fmt(p.fresh), fmt(d.fresh));
        row("fresh session only", open(p.open), open(d.open));
    }
    for (s, peer) in subjects.iter().zip(&peers) {
        println!(
            "{:<46} {:>18}",
            format!("{} subprocess, same work as {}", s.peer.0, s.label),
            fmt(*peer)
        );
    }
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    println!("ratios, subprocess / wasm (pooling):   fresh session + call   warm session");
    for ((s, p), peer) in subjects.iter().zip(&pool).zip(&peers) {
        println!(
            "  {:<36} {:>20.1}x {:>13.1}x",
            s.label,
            ratio(*peer, p.fresh),
            ratio(*peer, p.warm)
        );
    }
}
