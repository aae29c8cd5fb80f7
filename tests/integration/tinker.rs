//! `rlhost serve --tinker`, the Tinker training API (issue 49), driven by the official
//! `tinker` SDK (tests/tinker/client.py, from the venv `bash scripts/tinker.sh install`
//! makes): supervised and RL loops, the losses against their formulas, two clients at
//! once, a future outliving several polls, a checkpoint resumed exactly, bad requests; and
//! tinker-cookbook's two basic recipes (tests/tinker/cookbook.py, from the venv
//! `bash scripts/tinker.sh cookbook` makes).
//! Served: the built-in multiply model, from the cache the README's default run and the
//! vLLM tests build it into (`~/.cache/rlhost`).

use rlhost_tests::{TestCommand, repo_root, temp_dir};
use std::io::{BufRead, Read};
use std::path::PathBuf;
use std::process::Child;

/// A running `rlhost serve --tinker`, stopped when dropped.
pub(crate) struct Server {
    pub(crate) child: Child,
    pub(crate) url: String,
    /// The served model's directory (its tokenizer), from the ready line.
    dir: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How long the server holds a poll here: short, so that a step outlives several.
const POLL_MS: &str = "1000";

fn start(checkpoints: &std::path::Path, extra: &[&str]) -> Server {
    start_with(checkpoints, extra, &[])
}

/// [`start`] with `envs` set for the server.
pub(crate) fn start_with(
    checkpoints: &std::path::Path,
    extra: &[&str],
    envs: &[(&str, &str)],
) -> Server {
    let mut cmd = TestCommand::new(&[
        "serve",
        "--tinker",
        "--addr",
        "127.0.0.1:0",
        "--checkpoints",
    ])
    .arg(checkpoints)
    .env("RLHOST_TINKER_POLL_MS", POLL_MS);
    for a in extra {
        cmd = cmd.arg(a);
    }
    for (k, v) in envs {
        cmd = cmd.env(k, v);
    }
    // The built-in model where the default run keeps it (built there once, if missing).
    if let Some(home) = std::env::var_os("HOME") {
        cmd = cmd.env(
            "RLHOST_CACHE_DIR",
            PathBuf::from(home).join(".cache/rlhost"),
        );
    }
    let mut child = cmd.spawn();
    let mut out = std::io::BufReader::new(child.stdout.take().expect("piped"));
    let mut line = String::new();
    // The build's progress may come first; the ready line names the URL.
    while !line.contains("rlhost serve --tinker") {
        line.clear();
        if out.read_line(&mut line).unwrap_or(0) == 0 {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            panic!("serve --tinker ended before it listened; stderr: {err}");
        }
    }
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .expect("the ready line names its URL")
        .to_string();
    // `rlhost serve --tinker: DIR as base model ...`
    let dir = line
        .split_once("--tinker: ")
        .and_then(|(_, rest)| rest.split_once(" as base model"))
        .map(|(dir, _)| PathBuf::from(dir))
        .expect("the ready line names the model's directory");
    Server { child, url, dir }
}

/// A venv's python that can `import` what `imports` names, or `None` (skipped; a failure
/// under RLHOST_REQUIRE_TINKER=1). `var` overrides the venv, `default` is under ~/.cache/rlhost,
/// `install` is the scripts/tinker.sh command that makes it.
fn venv_python(var: &str, default: &str, imports: &str, install: &str) -> Option<PathBuf> {
    let venv = std::env::var_os(var).map(PathBuf::from).or_else(|| {
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/rlhost").join(default))
    })?;
    let python = venv.join("bin/python");
    let ok = std::process::Command::new(&python)
        .args(["-c", &format!("import {imports}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(python);
    }
    assert!(
        std::env::var("RLHOST_REQUIRE_TINKER").as_deref() != Ok("1"),
        "RLHOST_REQUIRE_TINKER=1 but `import {imports}` fails in {}: run `bash scripts/tinker.sh {install}`",
        venv.display()
    );
    eprintln!("skipped: `import {imports}` fails (bash scripts/tinker.sh {install})");
    None
}

/// The SDK's python, or `None` (skipped).
fn tinker_python() -> Option<PathBuf> {
    venv_python(
        "RLHOST_TINKER_VENV",
        "tinker-venv",
        "tinker, jinja2",
        "install",
    )
}

/// Every check of tests/tinker/client.py passes with the official SDK.
#[test]
fn the_official_tinker_sdk_drives_the_server() {
    let Some(python) = tinker_python() else {
        return;
    };
    let dir = temp_dir("tinker-sdk");
    // With a key (issue 68): the SDK sends it as X-API-Key on every call; client.py checks
    // that another key is turned away.
    let server = start(&dir.join("checkpoints"), &["--api-key", "tml-rlhost-local"]);
    let out = std::process::Command::new(&python)
        .arg(repo_root().join("tests/tinker/client.py"))
        .arg(&server.url)
        .env("RLHOST_TINKER_POLL_MS", POLL_MS)
        .env("RLHOST_TINKER_SLOW_ROWS", "8")
        .env("TINKER_TELEMETRY", "0")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run client.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("checks passed"),
        "client.py failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    // What it measured, for the test log.
    for line in stdout.lines().filter(|l| l.starts_with("measured:")) {
        eprintln!("{line}");
    }
    // The checkpoints are PEFT adapters in the directory the server was given.
    let saved: Vec<PathBuf> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .flatten()
        .flat_map(|m| {
            std::fs::read_dir(m.path().join("weights"))
                .into_iter()
                .flatten()
                .flatten()
        })
        .map(|e| e.path())
        .collect();
    assert!(
        saved.iter().any(|p| p.ends_with("resume-check")
            && p.join("adapter_config.json").is_file()
            && p.join("adapter_model.safetensors").is_file()
            && p.join("optimizer.safetensors").is_file()),
        "{saved:?}"
    );
    drop(server);
    let _ = std::fs::remove_dir_all(dir);
}

/// tinker-cookbook's `recipes/sl_basic.py` and `recipes/rl_basic.py` run against the server
/// with their own `main` (tests/tinker/cookbook.py says what was swapped: local data, the
/// built-in task as an environment). The built-in model is served under the Hub name the
/// recipes take their renderer from; sl_basic drives the held-out loss down and rl_basic
/// raises the task's held-out accuracy. The same venv has torch, so the SDK's
/// `forward_backward_custom` is checked there too.
#[test]
fn tinker_cookbooks_basic_recipes_run_against_the_server() {
    let Some(python) = venv_python(
        "RLHOST_COOKBOOK_VENV",
        "cookbook-venv",
        "tinker_cookbook.recipes.sl_basic, tinker_cookbook.recipes.rl_basic",
        "cookbook",
    ) else {
        return;
    };
    let dir = temp_dir("tinker-cookbook");
    let server = start(
        &dir.join("checkpoints"),
        &["--served-model-name", "Qwen/Qwen3-4B-Instruct-2507"],
    );
    let out = std::process::Command::new(&python)
        .arg(repo_root().join("tests/tinker/cookbook.py"))
        .arg(&server.url)
        .arg(&server.dir)
        .arg(dir.join("runs"))
        .env("TINKER_TELEMETRY", "0")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run cookbook.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success()
            && ["ok: sl", "ok: rl", "ok: custom"]
                .iter()
                .all(|ok| stdout.contains(ok)),
        "cookbook.py failed:\n{stdout}\n{stderr}"
    );
    for line in stdout.lines().filter(|l| l.starts_with("measured:")) {
        eprintln!("{line}");
    }
    drop(server);
    let _ = std::fs::remove_dir_all(dir);
}

/// The server refuses what it cannot serve before it loads anything.
#[test]
fn serve_tinker_refuses_the_gateways_options() {
    let ran = TestCommand::new(&["serve", "--tinker", "--record", "x.jsonl"]).run();
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(ran.stderr.contains("--record"), "{}", ran.stderr);
    let ran = TestCommand::new(&["serve", "--tinker", "--served-model-name", " "]).run();
    assert_eq!(ran.code, Some(1), "{}", ran.stderr);
    assert!(ran.stderr.contains("--served-model-name"), "{}", ran.stderr);
    let ran = TestCommand::new(&["serve", "--checkpoints", "x"]).run();
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    assert!(ran.stderr.contains("--tinker"), "{}", ran.stderr);
}
