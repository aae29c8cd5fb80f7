//! `rlhost env serve` driven by OpenEnv's own client (openenv-core's `GenericEnvClient`,
//! installed by `bash scripts/openenv.sh install`): tests/openenv/drive.py against three
//! real servers. Without the client the test says it skipped, unless
//! `RLHOST_REQUIRE_OPENENV=1` (scripts/test.sh sets it after installing the client).

use rlhost_tests::{TestCommand, plugin, repo_root, temp_dir};
use std::io::BufRead;
use std::process::Child;

/// A running `rlhost env serve`, stopped when dropped.
pub(super) struct Server {
    child: Child,
    pub(super) url: String,
}

impl Server {
    pub(super) fn start(args: &[&str]) -> Server {
        let mut child = TestCommand::new(&["env", "serve"])
            .args(args)
            .args(["--port", "0"])
            .env("RLHOST_CACHE_DIR", rlhost_tests::cache_dir())
            .spawn();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().expect("piped"))
            .read_line(&mut line)
            .expect("the server prints where it listens");
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                panic!("env serve printed {line:?}; stderr: {err}")
            })
            .to_string();
        Server { child, url }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The client's python, or `None` (skipped).
pub(super) fn openenv_python() -> Option<std::path::PathBuf> {
    let venv = std::env::var_os("RLHOST_OPENENV_VENV")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| std::path::Path::new(&h).join(".cache/rlhost/openenv-venv"))
        })?;
    let python = venv.join("bin/python");
    let ok = std::process::Command::new(&python)
        .args(["-c", "from openenv import GenericEnvClient"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(python);
    }
    assert!(
        std::env::var("RLHOST_REQUIRE_OPENENV").as_deref() != Ok("1"),
        "RLHOST_REQUIRE_OPENENV=1 but no OpenEnv client in {}: run `bash scripts/openenv.sh install`",
        venv.display()
    );
    eprintln!("skipped: no OpenEnv client (bash scripts/openenv.sh install)");
    None
}

#[test]
fn openenvs_own_client_drives_served_plugins() {
    let Some(python) = openenv_python() else {
        return;
    };
    let dir = temp_dir("openenv-serve");
    let data = dir.join("guess.jsonl");
    std::fs::write(
        &data,
        r#"{"messages": [{"role": "user", "content": "Guess my number between 1 and 100."}], "metadata": {"secret": 42}}"#,
    )
    .unwrap();
    let guess = Server::start(&[
        plugin("guess_number").to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ]);
    let tools = Server::start(&[plugin("hostile").to_str().unwrap(), "--max-sessions", "12"]);
    let small = Server::start(&[plugin("hostile").to_str().unwrap(), "--max-sessions", "2"]);
    let out = std::process::Command::new(python)
        .arg(repo_root().join("tests/openenv/drive.py"))
        .args([&guess.url, &tools.url, &small.url])
        .output()
        .expect("run drive.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "drive.py failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("all OpenEnv checks passed"), "{stdout}");
    println!("{stdout}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bad_serve_inputs_are_one_clear_error() {
    let err = TestCommand::new(&[
        "env",
        "serve",
        plugin("math_answer").to_str().unwrap(),
        "--port",
        "0",
    ])
    .fails();
    assert!(err.contains("neither an environment nor tools"), "{err}");
    let dir = temp_dir("openenv-bad");
    let data = dir.join("bad.jsonl");
    std::fs::write(&data, "{\"messages\": []}\nnot json\n").unwrap();
    let err = TestCommand::new(&[
        "env",
        "serve",
        plugin("guess_number").to_str().unwrap(),
        "--data",
    ])
    .arg(&data)
    .args(["--port", "0"])
    .fails();
    assert!(err.contains("bad.jsonl line 1"), "{err}");
    let err = TestCommand::new(&[
        "env",
        "serve",
        plugin("guess_number").to_str().unwrap(),
        "--config",
        "{",
        "--port",
        "0",
    ])
    .fails();
    assert!(err.contains("--config is not valid JSON"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}
