//! Plugin call latency, side by side with how Python RL frameworks run tool code today.
//!
//! (a) `fire` on a warm trigger session; (b) a fresh session (new store + instance +
//! `open`) and one `fire`, for the Rust calculator and the Python code tool; (c) the same
//! Python snippet run by `subprocess.run(["python3", "-c", code], timeout=5)` from Python,
//! timed by Python itself. Prints medians and the ratios.
//!
//! Run: `bash plugins/build.sh && cargo bench -p rlhost --bench plugin_calls`.

use rlhost::plugin::{Limits, Plugin, PluginRuntime, PluginSpec, RuntimeOptions, Sample};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

const SNIPPET: &str = "total = sum(i * i for i in range(100))\nprint(total)";

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

async fn load(runtime: &std::sync::Arc<PluginRuntime>, name: &str) -> Plugin {
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

async fn warm(plugin: &Plugin, text: &str, n: usize) -> Duration {
    let mut session = plugin
        .open_trigger("{}", &Sample::from_prompt(""), 1)
        .await
        .unwrap();
    for _ in 0..n / 10 {
        session.fire(text).await.unwrap();
    }
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let out = session.fire(text).await.unwrap();
        samples.push(t.elapsed());
        assert!(out.is_some());
    }
    median(samples)
}

async fn fresh(plugin: &Plugin, text: &str, n: usize) -> Duration {
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        let mut session = plugin
            .open_trigger("{}", &Sample::from_prompt(""), i as u64)
            .await
            .unwrap();
        let out = session.fire(text).await.unwrap();
        samples.push(t.elapsed());
        assert!(out.is_some());
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

/// A fresh session alone: store, instance, `open`, `stop-patterns`; and the minor page
/// faults per session, which is where a fresh instance's time goes (copy-on-write of the
/// pages the guest writes).
async fn open_only(plugin: &Plugin, n: usize) -> (Duration, u64) {
    let mut samples = Vec::with_capacity(n);
    let faults_before = minor_faults();
    for i in 0..n {
        let t = Instant::now();
        let session = plugin
            .open_trigger("{}", &Sample::from_prompt(""), i as u64)
            .await
            .unwrap();
        samples.push(t.elapsed());
        drop(session);
    }
    (median(samples), (minor_faults() - faults_before) / n as u64)
}

/// Times the subprocess way from Python, as the Python peers do it.
fn subprocess(n: usize) -> Duration {
    let driver = format!(
        r#"
import statistics, subprocess, sys, time
code = {SNIPPET:?}
samples = []
for _ in range({n}):
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=5)
    samples.append(time.perf_counter() - t)
    assert out.stdout.strip() == "328350", out
print(statistics.median(samples))
"#
    );
    let out = Command::new("python3")
        .arg("-c")
        .arg(driver)
        .output()
        .expect("python3 is needed for the subprocess baseline");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let secs: f64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    Duration::from_secs_f64(secs)
}

/// Medians for one allocation strategy.
struct Row {
    calc_warm: Duration,
    calc_fresh: Duration,
    calc_open: (Duration, u64),
    py_warm: Duration,
    py_fresh: Duration,
    py_open: (Duration, u64),
}

async fn measure(pooling: bool) -> Row {
    let cache = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench-cache");
    let runtime = PluginRuntime::new(&RuntimeOptions {
        fuel: false,
        cache_dir: Some(cache),
        pooling,
    })
    .unwrap();
    let calc = load(&runtime, "calculator").await;
    let python = load(&runtime, "code_trigger").await;
    let calc_text = "The total is <calc>(12.5 + 7.5) * 3 / 4</calc>";
    let py_text = format!("Let me compute.\n```python\n{SNIPPET}\n```");
    Row {
        calc_warm: warm(&calc, calc_text, 5000).await,
        calc_fresh: fresh(&calc, calc_text, 1000).await,
        calc_open: open_only(&calc, 1000).await,
        py_warm: warm(&python, &py_text, 1000).await,
        py_fresh: fresh(&python, &py_text, 200).await,
        py_open: open_only(&python, 200).await,
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let (pool, demand) = rt.block_on(async { (measure(true).await, measure(false).await) });
    let sub = subprocess(50);

    println!(
        "plugin call latency (median), {} CPU cores; page faults per session in brackets",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("{:<44} {:>18} {:>18}", "", "pooling (default)", "on-demand");
    let row = |name: &str, a: Duration, b: Duration| {
        println!("{name:<44} {:>18} {:>18}", fmt(a), fmt(b));
    };
    let open_row = |name: &str, a: (Duration, u64), b: (Duration, u64)| {
        let cell = |(d, faults): (Duration, u64)| format!("{} [{faults}]", fmt(d));
        println!("{name:<44} {:>18} {:>18}", cell(a), cell(b));
    };
    row(
        "calculator (Rust): warm session, fire",
        pool.calc_warm,
        demand.calc_warm,
    );
    row(
        "calculator (Rust): fresh session + fire",
        pool.calc_fresh,
        demand.calc_fresh,
    );
    open_row(
        "calculator (Rust): fresh session only",
        pool.calc_open,
        demand.calc_open,
    );
    row(
        "code tool (Python): warm session, fire",
        pool.py_warm,
        demand.py_warm,
    );
    row(
        "code tool (Python): fresh session + fire",
        pool.py_fresh,
        demand.py_fresh,
    );
    open_row(
        "code tool (Python): fresh session only",
        pool.py_open,
        demand.py_open,
    );
    println!(
        "{:<44} {:>18}",
        "python3 subprocess with timeout (Python)",
        fmt(sub)
    );
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    println!("ratios, subprocess / wasm (pooling):");
    println!(
        "  Python tool, fresh session + fire: {:>8.1}x",
        ratio(sub, pool.py_fresh)
    );
    println!(
        "  Python tool, warm session:         {:>8.1}x",
        ratio(sub, pool.py_warm)
    );
    println!(
        "  Rust calculator, fresh session:    {:>8.1}x",
        ratio(sub, pool.calc_fresh)
    );
    println!(
        "pooling speed-up of a fresh Python session + fire: {:.1}x",
        ratio(demand.py_fresh, pool.py_fresh)
    );
}
