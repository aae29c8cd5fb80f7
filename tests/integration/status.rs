//! The status endpoint of a real `rlhost train` run: JSON, history, Prometheus text,
//! `rlhost status`, the run directory's records, and the dashboard in a real headless
//! Chromium (driven over WebDriver by Debian's chromedriver) updating live from
//! `/events`.

use rlhost_tests::{TestCommand, fixture_countdown, plugin, temp_dir};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

const STEPS: u64 = 5;

/// A training run serving its status on a free port, and its stderr so far.
pub(super) struct Run {
    child: Child,
    pub(super) url: String,
    stderr: Arc<Mutex<String>>,
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The small countdown run the status tests watch, serving on a free port.
fn countdown_run(out: &Path) -> TestCommand {
    fixture_countdown("train")
        .args([
            "--set",
            "rollout.group_size=2",
            "--set",
            "rollout.prompts_per_step=2",
            "--set",
            "sampling.max_new_tokens=16",
            "--set",
            "train.save_every=2",
            "--set",
            "data.eval_size=3",
            "--set",
            "train.eval_every=2",
            "--steps",
            &STEPS.to_string(),
            "--status-addr",
            "127.0.0.1:0",
            "--status-linger",
            "600",
            "--out",
        ])
        .arg(out)
}

/// Spawns `command` (one that serves its status: `--status-addr 127.0.0.1:0` and a
/// linger) and waits for the URL it prints.
pub(super) fn start_with(command: TestCommand) -> Run {
    let mut child = command.spawn();
    let stderr = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = mpsc::channel();
    let pipe = child.stderr.take().unwrap();
    let log = stderr.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            if let Some(url) = line.strip_prefix("status: ") {
                let _ = tx.send(url.to_string());
            }
            log.lock().unwrap().push_str(&(line + "\n"));
        }
    });
    let url = rx
        .recv_timeout(Duration::from_secs(120))
        .unwrap_or_else(|_| panic!("no status URL printed:\n{}", stderr.lock().unwrap()));
    Run { child, url, stderr }
}

pub(super) fn get(url: &str) -> String {
    ureq::get(url)
        .call()
        .and_then(|mut r| r.body_mut().read_to_string())
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
}

pub(super) fn status(run: &Run) -> serde_json::Value {
    serde_json::from_str(&get(&format!("{}status", run.url))).unwrap()
}

pub(super) fn wait_until_done(run: &Run) -> serde_json::Value {
    let t0 = Instant::now();
    loop {
        let st = status(run);
        match st["phase"].as_str().unwrap() {
            "done" => return st,
            "failed" => panic!("run failed: {st}\n{}", run.stderr.lock().unwrap()),
            _ if t0.elapsed() > Duration::from_secs(600) => {
                panic!(
                    "run not done in 600 s: {st}\n{}",
                    run.stderr.lock().unwrap()
                )
            }
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

#[test]
fn a_training_run_serves_status_metrics_history_and_records_its_run_dir() {
    let dir = temp_dir("status-run");
    let out = dir.join("run");
    // No dashboard comes: the run waits its second and trains (this test reads /status).
    let run = start_with(countdown_run(&out).args(["--status-wait", "1"]));
    assert!(run.url.starts_with("http://127.0.0.1:"), "{}", run.url);
    let st = wait_until_done(&run);
    assert!(
        run.stderr
            .lock()
            .unwrap()
            .contains("no dashboard connected in 1 s; training starts"),
        "{}",
        run.stderr.lock().unwrap()
    );
    assert_eq!(st["step"], STEPS);
    assert_eq!(st["total_steps"], STEPS);
    assert_eq!(st["adapter_version"], STEPS);
    assert_eq!(
        st["last_checkpoint"],
        format!("checkpoints/step-{STEPS:06}")
    );
    assert_eq!(st["eta_s"], 0.0);
    assert!(
        st["run_id"]
            .as_str()
            .unwrap()
            .starts_with("fixture-countdown-")
    );
    assert!(st["metrics"]["rewards"]["correct"].is_number());
    assert!(st["tokens_per_s"].as_f64().unwrap() > 0.0);

    // /history is metrics.jsonl, step for step.
    let history: serde_json::Value =
        serde_json::from_str(&get(&format!("{}history", run.url))).unwrap();
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(history["steps"].as_array().unwrap(), &lines);
    // Held-out evaluation on steps 2, 4 and the last.
    let evaluated: Vec<u64> = lines
        .iter()
        .filter(|m| m["eval_accuracy"].is_number())
        .map(|m| m["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evaluated, [2, 4, 5]);
    assert!(lines[1]["eval_tool_use"].is_number() && lines[1]["eval_s"].is_number());
    assert!(lines[1]["tool_wait_share"].is_number());
    // And once before the first update: the "before" of the run's last line.
    assert_eq!(st["eval_start"]["step"], 0);
    let start: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("eval_start.json")).unwrap()).unwrap();
    assert_eq!(start["prompts"], 3);
    assert_eq!(st["eval_start"]["reward"], start["reward_mean"]);

    let metrics = get(&format!("{}metrics", run.url));
    assert!(
        metrics.contains(&format!("\nrlhost_step {STEPS}.0\n")),
        "{metrics}"
    );
    assert!(
        metrics.contains("rlhost_phase{phase=\"done\"} 1.0"),
        "{metrics}"
    );
    assert!(metrics.contains("\nrlhost_eval_reward "), "{metrics}");

    let rollouts: serde_json::Value =
        serde_json::from_str(&get(&format!("{}rollouts/latest?n=3", run.url))).unwrap();
    let ts = rollouts["trajectories"].as_array().unwrap();
    assert_eq!(ts.len(), 3);
    assert!(ts[0]["prompt"].as_str().unwrap().contains("user: "));
    assert_eq!(ts[0]["spans"][0]["kind"], "model");

    // `rlhost status URL`, for people and for scripts.
    let text = TestCommand::new(&["status", &run.url]).ok().stdout;
    assert!(
        text.contains(&format!("phase done  step {STEPS}/{STEPS} (100%)")),
        "{text}"
    );
    assert!(text.contains("plugin faults: none"), "{text}");
    assert!(text.contains("held-out (step 5): reward "), "{text}");
    let json = TestCommand::new(&["status", "--json", &run.url])
        .ok()
        .json();
    assert_eq!(json["step"], STEPS);

    // The run directory: resolved config, metrics, checkpoints, plugins by sha256,
    // TensorBoard events.
    assert!(out.join("config.toml").is_file());
    let plugins: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("plugins.json")).unwrap()).unwrap();
    let calc = plugins
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "calculator")
        .expect("calculator in plugins.json");
    use sha2::Digest;
    let sha = hex::encode(sha2::Sha256::digest(
        std::fs::read(plugin("calculator")).unwrap(),
    ));
    assert_eq!(calc["sha256"], sha.as_str());
    let events: Vec<_> = std::fs::read_dir(out.join("tensorboard"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(events.len(), 1);
    let name = events[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    let bytes = std::fs::read(&events[0]).unwrap();
    // One record per step after the file-version record, each carrying reward/mean.
    let tag = b"reward/mean";
    let hits = bytes.windows(tag.len()).filter(|w| w == tag).count();
    assert_eq!(hits as u64, STEPS);

    // A taken address is an error that says what to do, before anything runs.
    let addr = run.url.trim_start_matches("http://").trim_end_matches('/');
    let err = fixture_countdown("train")
        .args(["--status-addr", addr, "--out"])
        .arg(dir.join("second"))
        .fails();
    assert!(
        err.contains(&format!("cannot listen on --status-addr {addr}")),
        "{err}"
    );
}

/// Issue 19: `--status-addr 0.0.0.0:0` was accepted silently, serving the run's prompts
/// and trajectories to the network without authentication.
#[test]
fn binding_beyond_loopback_needs_a_flag_and_warns() {
    let dir = temp_dir("status-public");
    let err = fixture_countdown("train")
        .args(["--steps", "1", "--status-addr", "0.0.0.0:0", "--out"])
        .arg(dir.join("refused"))
        .fails();
    assert!(
        err.contains("no authentication") && err.contains("--status-public"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(!dir.join("refused").exists(), "nothing is written");
    // One short step, serving on `addr` with `extra` flags.
    let one_step = |addr: &str, extra: &[&str], out: &str| {
        fixture_countdown("train")
            .args(["--steps", "1", "--status-addr", addr])
            .args(extra)
            .args([
                "--set",
                "rollout.group_size=2",
                "--set",
                "sampling.max_new_tokens=4",
            ])
            .arg("--out")
            .arg(dir.join(out))
            .ok()
    };
    let ran = one_step("0.0.0.0:0", &["--status-public"], "public");
    assert!(
        ran.stderr
            .contains("warning: the status server listens on 0.0.0.0:0")
            && ran.stderr.contains("without authentication"),
        "{}",
        ran.stderr
    );
    // Loopback names need no flag.
    one_step("localhost:0", &[], "local");
}

// ---------------------------------------------------------------- the browser test

/// Issue 51: on a fresh machine the README's test command (scripts/test.sh) failed this
/// file's browser test, whose chromium and chromedriver only .ci/run installed. The test
/// command installs each browser package .ci/run does, when its command is missing.
#[test]
fn the_readme_test_command_installs_the_browser() {
    let read = |p: &str| std::fs::read_to_string(rlhost_tests::repo_root().join(p)).unwrap();
    let (ci, test) = (read(".ci/run"), read("scripts/test.sh"));
    for (command, package) in [
        ("chromium", "chromium"),
        ("chromedriver", "chromium-driver"),
    ] {
        let check = format!("command -v {command} >/dev/null ||");
        for (file, text) in [(".ci/run", &ci), ("scripts/test.sh", &test)] {
            assert!(
                text.lines()
                    .any(|l| l.starts_with(&check) && l.contains(&format!("({package})"))),
                "{file} does not install {package} when {command} is missing"
            );
        }
    }
    assert!(
        test.contains("apt-get install"),
        "scripts/test.sh installs nothing"
    );
}

/// Debian's chromedriver driving Debian's chromium, headless. CI installs both
/// (`.ci/run`); elsewhere the test says how to get them.
struct Browser {
    driver: Child,
    base: String,
    session: String,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = ureq::delete(&format!("{}/session/{}", self.base, self.session)).call();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn webdriver(method: &str, url: &str, body: Option<serde_json::Value>) -> serde_json::Value {
    let r = match body {
        Some(b) => ureq::post(url)
            .header("content-type", "application/json")
            .send(b.to_string()),
        None if method == "GET" => ureq::get(url).call(),
        None => ureq::delete(url).call(),
    };
    let text = r
        .and_then(|mut r| r.body_mut().read_to_string())
        .unwrap_or_else(|e| panic!("webdriver {method} {url}: {e}"));
    serde_json::from_str::<serde_json::Value>(&text).unwrap()["value"].take()
}

impl Browser {
    fn start(profile: &Path) -> Browser {
        let driver_bin = std::env::var("RLHOST_CHROMEDRIVER").unwrap_or("chromedriver".into());
        let chromium = std::env::var("RLHOST_CHROMIUM").unwrap_or("/usr/bin/chromium".into());
        let port = free_port();
        let driver = Command::new(&driver_bin)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {driver_bin} ({e}): the dashboard test needs a headless browser; \
                     install Debian's `chromium` and `chromium-driver` (as scripts/test.sh and \
                     .ci/run do), or point RLHOST_CHROMEDRIVER and RLHOST_CHROMIUM at them"
                )
            });
        let base = format!("http://127.0.0.1:{port}");
        let t0 = Instant::now();
        while ureq::get(&format!("{base}/status")).call().is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "chromedriver did not start"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        // The flags the machine notes give for this network: no background connections
        // (refused here, many at a time), a fresh profile, no sandbox as root.
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1400,2200",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("--user-data-dir={}", profile.display())])
        .collect::<Vec<_>>();
        let session = webdriver(
            "POST",
            &format!("{base}/session"),
            Some(serde_json::json!({
                "capabilities": {"alwaysMatch": {
                    "browserName": "chrome",
                    "goog:chromeOptions": {"binary": chromium, "args": args},
                }}
            })),
        );
        let session = session["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no WebDriver session: {session}"))
            .to_string();
        Browser {
            driver,
            base,
            session,
        }
    }

    fn goto(&self, url: &str) {
        webdriver(
            "POST",
            &format!("{}/session/{}/url", self.base, self.session),
            Some(serde_json::json!({ "url": url })),
        );
    }

    fn eval(&self, script: &str) -> serde_json::Value {
        webdriver(
            "POST",
            &format!("{}/session/{}/execute/sync", self.base, self.session),
            Some(serde_json::json!({ "script": script, "args": [] })),
        )
    }

    fn screenshot(&self, path: &Path) {
        use base64::Engine;
        let png = webdriver(
            "GET",
            &format!("{}/session/{}/screenshot", self.base, self.session),
            None,
        );
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().unwrap())
            .unwrap();
        std::fs::write(path, bytes).unwrap();
    }
}

/// What the page shows, read from its DOM.
const PROBE: &str = r#"
const charts = [...document.querySelectorAll('.chart[data-chart]')];
const span = (c) => document.querySelectorAll('#rollouts .span-' + c).length;
return {
  charts: charts.map(c => c.dataset.chart),
  points: charts.map(c => Number(c.dataset.points || 0)),
  rows: charts.map(c => Number(c.dataset.rows || 0)),
  canvases: charts.map(c => {
    const k = c.querySelector('canvas');
    return k ? k.width * k.height : 0;
  }),
  phase: document.querySelector('#phase')?.dataset.phase,
  conn: document.querySelector('#conn')?.dataset.state,
  errors: Number(document.documentElement.dataset.jsErrors || 0),
  live_steps: Number(document.documentElement.dataset.liveSteps || 0),
  cards: document.querySelectorAll('#rollouts article.card').length,
  model_spans: span('model'),
  progress: document.querySelector('#progress-text')?.textContent,
  tool_wait: document.querySelector('#tool-wait')?.textContent,
  scripts_in_rollouts: document.querySelectorAll('#rollouts script').length,
};
"#;

/// The stylesheet's colours for model text and tool output (checked on spans the
/// viewer's own CSS classes style, whether or not this run's model called a tool).
const COLOURS: &str = r#"
const box = document.querySelector('#rollouts') || document.body;
const bg = (cls) => {
  const s = document.createElement('span');
  s.className = 'span ' + cls;
  s.textContent = 'x';
  box.appendChild(s);
  const c = getComputedStyle(s).backgroundColor + '|' + getComputedStyle(s).color;
  s.remove();
  return c;
};
return [bg('span-model'), bg('span-tool'), bg('span-env')];
"#;

#[test]
fn the_dashboard_renders_live_charts_and_rollouts_in_a_real_browser() {
    let dir = temp_dir("status-browser");
    let out = dir.join("run");
    let browser = Browser::start(&dir.join("chromium-profile"));
    // `--status-wait`: the run holds its first step until the page reads `/events`, so
    // that a busy machine's slow browser still sees the whole run live.
    let run = start_with(countdown_run(&out).args(["--status-wait", "300"]));
    browser.goto(&run.url);
    // Watch the page while the run trains: the charts must grow step by step from the
    // event stream, not only show a finished run.
    let t0 = Instant::now();
    let mut seen = std::collections::BTreeSet::new();
    let last = loop {
        let p = browser.eval(PROBE);
        assert_eq!(p["errors"], 0, "JavaScript errors on the page: {p}");
        let points: Vec<u64> = p["points"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        if let Some(n) = points.first() {
            seen.insert(*n);
        }
        if p["phase"] == "done" && points.iter().all(|n| *n == STEPS) && p["cards"] != 0 {
            break p;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(600),
            "the dashboard did not show the finished run: {p}\n{}",
            run.stderr.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(150));
    };
    browser.screenshot(&out.join("dashboard.png"));
    let charts: Vec<&str> = last["charts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    // The accuracy chart starts at step 0 with the held-out evaluation before the first
    // update (the run evaluates every 2 steps); the other charts have a point per step.
    let rows = |name: &str| {
        let i = charts.iter().position(|c| *c == name).unwrap();
        last["rows"][i].as_u64().unwrap()
    };
    assert_eq!(rows("accuracy"), STEPS + 1, "{last}");
    assert_eq!(rows("reward"), STEPS, "{last}");
    for want in [
        "reward",
        "accuracy",
        "kl",
        "response_length",
        "tool_calls",
        "throughput",
        "faults",
    ] {
        assert!(charts.contains(&want), "no {want} chart: {last}");
    }
    assert!(
        last["canvases"]
            .as_array()
            .unwrap()
            .iter()
            .all(|a| a.as_u64().unwrap() > 10_000),
        "a chart has no drawn canvas: {last}"
    );
    // Every step reached the page over the stream; the probe (every 150 ms) saw the
    // charts between the first point and the last.
    assert_eq!(
        last["live_steps"], STEPS,
        "the charts did not grow live: {last}"
    );
    assert!(
        seen.len() >= 2,
        "the charts did not grow live (point counts seen: {seen:?})"
    );
    assert_eq!(last["conn"], "live", "{last}");
    // prompts_per_step x group_size trajectories, each with its model text.
    assert_eq!(last["cards"], 4, "{last}");
    assert!(last["model_spans"].as_u64().unwrap() >= 4, "{last}");
    assert_eq!(last["scripts_in_rollouts"], 0);
    let progress: Vec<&str> = last["progress"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(progress.join(" "), format!("step {STEPS} / {STEPS} (100%)"));
    // The tools' share of sampling time, latest and mean: "0.4% (mean 1.2%)".
    let tool_wait = last["tool_wait"].as_str().unwrap_or_default();
    let shares: Vec<f64> = tool_wait
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter(|w| !w.is_empty())
        .map(|w| w.parse().unwrap())
        .collect();
    assert!(
        tool_wait.contains("% (mean ")
            && shares.len() == 2
            && shares.iter().all(|s| (0.0..=100.0).contains(s)),
        "tool wait shows {tool_wait:?}: {last}"
    );
    let colours = browser.eval(COLOURS);
    let c: Vec<&str> = colours
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        c[0] != c[1] && c[1] != c[2] && c[0] != c[2],
        "model, tool and environment spans look alike: {c:?}"
    );
    let png = std::fs::read(out.join("dashboard.png")).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 20_000,
        "{}",
        png.len()
    );
    eprintln!(
        "dashboard screenshot: {}",
        out.join("dashboard.png").display()
    );
}
