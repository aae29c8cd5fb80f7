//! `rlhost serve`, the OpenAI-compatible gateway (issue 46), driven by real clients: the
//! official `openai` package (tests/gateway/client.py, from the venv that
//! `bash scripts/openenv.sh install` makes), `curl` for a second client, and a flood of
//! idle connections. Served: a small `builtin:units` model warm-started on `add_days`
//! calls, so that agents' function calls and their replayed results are exercised.

use rlhost_tests::{TestCommand, plugin, repo_root, temp_dir};
use std::io::{BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

/// A running `rlhost serve`, stopped when dropped.
pub(crate) struct Gateway {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub(crate) url: String,
}

impl Gateway {
    pub(crate) fn start(dir: &Path, record: &Path, extra: &[&str]) -> Gateway {
        let config = units_config(
            3,
            "[rollout]\ngroup_size = 8\n[[rewards]]\nplugin = \"units_task\"\n",
        );
        let path = dir.join("serve.toml");
        std::fs::write(&path, config).unwrap();
        let mut child = TestCommand::new(&["serve", "--addr", "127.0.0.1:0", "--config"])
            .arg(&path)
            .arg("--record")
            .arg(record)
            .args(extra)
            .spawn();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().expect("piped"))
            .read_line(&mut line)
            .expect("serve prints where it listens");
        let url = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("http://"))
            .map(|w| format!("http://{}", w.trim_end_matches("/v1")))
            .unwrap_or_else(|| {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                panic!("serve printed {line:?}; stderr: {err}")
            });
        Gateway { child, url }
    }

    fn addr(&self) -> &str {
        self.url.trim_start_matches("http://")
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A run config on the small units model and its `add_days` tasks, `rest` after it.
fn units_config(seed: u64, rest: &str) -> String {
    format!(
        r#"
[run]
seed = {seed}
[model]
path = {model:?}
[data]
plugin = "units_task"
plugin_config = {{ kinds = ["add_days"] }}
eval_size = 0
[plugins.units_task]
path = {task:?}
{rest}"#,
        model = super::units_task::small_units_model().display().to_string(),
        task = plugin("units_task").display().to_string(),
    )
}

/// The official client's python, or `None` (skipped) — the OpenEnv venv holds `openai`.
pub(crate) fn openai_python() -> Option<PathBuf> {
    let python = super::openenv::openenv_python()?;
    let ok = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(ok, "{} has no `openai` package", python.display());
    Some(python)
}

/// Every check of tests/gateway/client.py passes against the gateway, and the sessions it
/// ended are in the record file with their token-exact rows.
#[test]
fn the_official_openai_client_drives_the_gateway() {
    let Some(python) = openai_python() else {
        return;
    };
    let dir = temp_dir("gateway-openai");
    let record = dir.join("sessions.jsonl");
    let gw = Gateway::start(&dir, &record, &[]);
    let out = std::process::Command::new(python)
        .arg(repo_root().join("tests/gateway/client.py"))
        .arg(&gw.url)
        .output()
        .expect("run client.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "client.py failed:\n{stdout}\n{stderr}"
    );
    let sessions: Vec<serde_json::Value> = std::fs::read_to_string(&record)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The task group's 8, the drifted one, 6 concurrent, the hung-up one, the bad-reward one.
    assert!(sessions.len() >= 17, "{} sessions recorded", sessions.len());
    let grouped: Vec<_> = sessions
        .iter()
        .filter(|s| s["task"]["group_size"] == 8)
        .collect();
    assert_eq!(grouped.len(), 8);
    for s in grouped {
        assert_eq!(s["reward"]["total"], 1.0);
        let row = &s["rows"][0];
        let (tokens, logps) = (
            row["tokens"].as_array().unwrap(),
            row["logps"].as_array().unwrap(),
        );
        assert_eq!(
            tokens.len(),
            row["prompt_len"].as_u64().unwrap() as usize + logps.len()
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A second client in another language: `curl` opens a session, calls the model in it
/// with the session as its API key, rewards and ends it.
#[test]
fn curl_drives_a_session() {
    if std::process::Command::new("curl")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipped: no curl");
        return;
    }
    let dir = temp_dir("gateway-curl");
    let gw = Gateway::start(&dir, &dir.join("sessions.jsonl"), &[]);
    let curl = |args: &[&str]| -> serde_json::Value {
        let out = std::process::Command::new("curl")
            .args([
                "-sS",
                "--max-time",
                "60",
                "-H",
                "content-type: application/json",
            ])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
    };
    let s = curl(&["-X", "POST", &format!("{}/rl/tasks/next", gw.url)]);
    let key = s["api_key"].as_str().unwrap();
    let body =
        serde_json::json!({"model": "policy", "messages": s["task"]["messages"], "max_tokens": 16});
    let answer = curl(&[
        "-H",
        &format!("Authorization: Bearer {key}"),
        "-d",
        &body.to_string(),
        &format!("{}/v1/chat/completions", gw.url),
    ]);
    assert_eq!(answer["object"], "chat.completion", "{answer}");
    let recorded = curl(&[&format!("{}/sessions/{key}", gw.url)]);
    assert_eq!(recorded["calls"], 1, "{recorded}");
    assert_eq!(
        recorded["rows"][0]["logps"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| !l.is_null())
            .count() as u64,
        answer["usage"]["completion_tokens"].as_u64().unwrap()
    );
    let end = curl(&[
        "-d",
        r#"{"rewards": {"correct": 1, "format": 0.5}}"#,
        &format!("{}/sessions/{key}/end", gw.url),
    ]);
    assert_eq!(end["reward"]["total"], 1.5, "{end}");
    let again = curl(&[&format!("{}/sessions/{key}", gw.url)]);
    assert_eq!(again["error"]["code"], "session_not_found", "{again}");
    let _ = std::fs::remove_dir_all(dir);
}

/// 1,000 connections that never send a request, twice what the gateway is set to serve
/// at once: the oldest idle ones are closed to admit new ones, and `/status` still
/// answers.
#[test]
fn a_flood_of_idle_connections_leaves_status_answering() {
    raise_open_files(4096);
    let dir = temp_dir("gateway-flood");
    let gw = Gateway::start(
        &dir,
        &dir.join("sessions.jsonl"),
        &["--max-connections", "500"],
    );
    let idle: Vec<std::net::TcpStream> = (0..1000)
        .filter_map(|_| std::net::TcpStream::connect(gw.addr()).ok())
        .collect();
    assert_eq!(idle.len(), 1000, "connections refused");
    let mut s = std::net::TcpStream::connect(gw.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "GET /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"sessions\""), "{answer}");
    drop(idle);
    let _ = std::fs::remove_dir_all(dir);
}

/// Raises this process's open-file limit (inherited by the server it starts) to `n`, or
/// as far as the hard limit allows.
fn raise_open_files(n: u64) {
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < n {
            lim.rlim_cur = n.min(lim.rlim_max);
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// `rlhost train` with `[gateway]`, driven by examples/agents/units_agent.py (the official
/// `openai` package, its functions run in Python): three steps train on the agent's
/// sessions, scored by the units_task reward (and by a reward model `rlhost rm` trained, at
/// weight 0: it scores what the config's rewards score); the trainer's log-probs of the recorded
/// tokens equal the sampler's (the recording is token-exact; on-policy, a session that
/// straddles an update is left out). The run refuses calls while it updates
/// (`while_updating = "refuse"`): the official client retries them after `Retry-After`
/// (the 503 itself is tested in `gateway/server.rs`).
#[test]
fn a_run_trains_on_the_sessions_of_an_agent() {
    let Some(python) = openai_python() else {
        return;
    };
    let dir = temp_dir("gateway-train");
    let config = units_config(
        5,
        &format!(
            r#"
[rollout]
group_size = 4
prompts_per_step = 2
tools = ["units"]
max_total_tokens = 768
[plugins.units]
path = {units:?}
[[rewards]]
plugin = "units_task"
weights = {{ tool_use = 1.0, correct = 1.0, format = 0.0 }}
[plugins.judge]
path = {judge:?}
generate = {{ max_calls_per_trajectory = 1, max_new_tokens = 8, temperature_max = 1.0 }}
[[rewards]]
plugin = "judge"
config = {{ rubric = "a correct date", temperature = 1.0, max_new_tokens = 8 }}
default_weight = 0.0
[[rewards]]
model = {rm:?}
default_weight = 0.0
[gateway]
addr = "127.0.0.1:0"
while_updating = "refuse"
[train]
steps = 3
lr = 0.004
save_every = 100
"#,
            units = plugin("units").display().to_string(),
            judge = plugin("judge").display().to_string(),
            rm = super::vllm::reward_model(super::units_task::small_units_model(), &dir)
                .display()
                .to_string(),
        ),
    );
    std::fs::write(dir.join("gw.toml"), config).unwrap();
    let out = dir.join("run");
    let mut train = TestCommand::new(&["train", "--no-status", "--config"])
        .arg(dir.join("gw.toml"))
        .arg("--out")
        .arg(&out)
        .spawn();
    let (url, mut stderr, seen) = gateway_line(&mut train);
    let agent = std::process::Command::new(python)
        .arg(repo_root().join("examples/agents/units_agent.py"))
        .args(["--url", &url, "--workers", "4", "--wait", "60"])
        .output()
        .expect("run units_agent.py");
    let agent_out = String::from_utf8_lossy(&agent.stdout);
    let mut rest = String::new();
    let _ = stderr.read_to_string(&mut rest);
    let status = train.wait().unwrap();
    assert!(status.success(), "train failed: {seen}{rest}");
    assert!(
        agent.status.success(),
        "{agent_out}{}",
        String::from_utf8_lossy(&agent.stderr)
    );
    assert!(agent_out.contains("units_agent: done"), "{agent_out}");
    let rows = super::train_cli::metrics(&out);
    assert_eq!(rows.len(), 3, "{rest}");
    for r in &rows {
        assert!(r["trajectories"].as_u64().unwrap() >= 2, "{r}");
        assert!(
            r["rewards"].get("correct").is_some(),
            "scored by units_task: {r}"
        );
        assert!(
            r["rewards"]["rm"].is_f64(),
            "scored by the reward model: {r}"
        );
        // The judge asks the model while the sessions are scored: answered by the run's
        // sampler, one call a trajectory (none refused, none failed).
        let calls = &r["generate_calls"];
        assert_eq!(calls["judge/answered"], r["trajectories"], "{r}");
        assert_eq!(calls["judge/failed"], 0, "{r}");
        assert!(r["generate_tokens"].as_u64().unwrap() > 0, "{r}");
        // Sampled and recomputed log-probs of the same ids agree: nothing re-tokenized.
        let ratio = r["rollout_max_ratio"].as_f64().unwrap();
        assert!(
            (ratio - 1.0).abs() < 1e-3,
            "max importance ratio {ratio}: {r}"
        );
    }
    assert!(out.join("checkpoints").is_dir());
    let _ = std::fs::remove_dir_all(dir);
}

/// A `train` run's gateway URL (`http://ADDR/v1`), from the line it prints on stderr once
/// the model is loaded; the rest of stderr, and what came before the line.
pub(super) fn gateway_line(
    train: &mut std::process::Child,
) -> (
    String,
    std::io::BufReader<std::process::ChildStderr>,
    String,
) {
    let mut stderr = std::io::BufReader::new(train.stderr.take().expect("piped"));
    let mut seen = String::new();
    for _ in 0..200 {
        let mut line = String::new();
        if stderr.read_line(&mut line).unwrap() == 0 {
            break;
        }
        seen.push_str(&line);
        if let Some(url) = line
            .strip_prefix("gateway: ")
            .and_then(|rest| rest.split_whitespace().next())
        {
            return (url.to_string(), stderr, seen);
        }
    }
    panic!("no gateway line; stderr: {seen}")
}
