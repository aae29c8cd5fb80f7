//! The hostile suite: each abuse is contained within its limit, its fault is typed
//! correctly and counted, the host answers the next call, and nothing of the host is
//! readable by the plugin.

use super::{load, load_with};
use rlhost::plugin::{DirGrant, FaultKind, Grants, Limits, Plugin, PluginSpec, Sample, Transcript};
use std::time::{Duration, Instant};

/// A short deadline keeps the suite fast; the slack on top covers a loaded CI machine.
const TIMEOUT_MS: u64 = 400;
const SLACK: Duration = Duration::from_millis(1_500);

fn limits() -> Limits {
    Limits {
        timeout_ms: TIMEOUT_MS,
        memory_mib: 64,
        ..Limits::default()
    }
}

fn config(mode: &str) -> String {
    format!(r#"{{"mode": "{mode}"}}"#)
}

/// Fires a hostile trigger in `mode`; returns what happened and how long it took.
async fn fire(
    plugin: &Plugin,
    mode: &str,
) -> (Result<Option<String>, rlhost::plugin::Fault>, Duration) {
    let mut session = plugin
        .open_trigger(&config(mode), &Sample::from_prompt("hi"), 3)
        .await
        .unwrap();
    let started = Instant::now();
    let result = session.fire("go</go>").await;
    (result, started.elapsed())
}

/// After a fault, the same plugin still opens sessions and answers.
async fn still_answers(plugin: &Plugin) {
    let (result, _) = fire(plugin, "echo").await;
    assert_eq!(result.unwrap().as_deref(), Some("go</go>"));
}

async fn assert_fault(mode: &str, kind: FaultKind, within: Duration) -> String {
    let plugin = load_with("hostile", limits()).await;
    let (result, took) = fire(&plugin, mode).await;
    let fault = result.expect_err(mode);
    assert_eq!(fault.kind, kind, "{mode}: {fault}");
    assert_eq!(fault.plugin, "hostile@0.1.0");
    assert!(took < within, "{mode} took {took:?}, limit {within:?}");
    assert_eq!(plugin.faults().get(kind), 1, "{mode} counted once");
    still_answers(&plugin).await;
    assert_eq!(plugin.faults().total(), 1, "the next call adds no fault");
    fault.message
}

#[tokio::test]
async fn infinite_loop_times_out() {
    let deadline = Duration::from_millis(TIMEOUT_MS);
    let message = assert_fault("loop", FaultKind::Timeout, deadline + SLACK).await;
    assert!(message.contains("400 ms deadline"), "{message}");
}

#[tokio::test]
async fn sleeping_in_a_host_call_times_out() {
    let deadline = Duration::from_millis(TIMEOUT_MS);
    let message = assert_fault("sleep", FaultKind::Timeout, deadline + SLACK).await;
    assert!(message.contains("waiting in a host call"), "{message}");
}

#[tokio::test]
async fn memory_bomb_hits_the_cap() {
    let message = assert_fault("memory", FaultKind::OutOfMemory, SLACK * 4).await;
    assert!(message.contains("64 MiB cap"), "{message}");
}

#[tokio::test]
async fn unbounded_recursion_traps() {
    assert_fault("recursion", FaultKind::Trap, SLACK * 4).await;
}

#[tokio::test]
async fn panic_traps_with_its_message() {
    let message = assert_fault("panic", FaultKind::Trap, SLACK).await;
    assert!(
        message.contains("hostile plugin panicked on purpose"),
        "{message}"
    );
}

#[tokio::test]
async fn huge_output_is_refused() {
    // Writing 100 MB takes the guest longer than the suite's short deadline on a loaded
    // machine (a CI run beside other jobs timed out here): the limit under test is the
    // output's size, so the deadline is far from it.
    let limits = Limits {
        memory_mib: 512,
        timeout_ms: 20_000,
        ..limits()
    };
    let plugin = load_with("hostile", limits).await;
    let (result, _) = fire(&plugin, "huge-output").await;
    let fault = result.unwrap_err();
    assert_eq!(fault.kind, FaultKind::BadOutput, "{fault}");
    assert!(fault.message.contains("104857600 bytes"), "{fault}");
    still_answers(&plugin).await;
}

#[tokio::test]
async fn stdout_flood_is_capped_not_fatal() {
    let plugin = load_with("hostile", Limits::default()).await;
    let (result, _) = fire(&plugin, "stdout-flood").await;
    assert_eq!(result.unwrap().as_deref(), Some("flooded"));
    assert_eq!(plugin.faults().total(), 0);
}

#[tokio::test]
async fn guest_error_is_passed_on() {
    let message = assert_fault("guest-error", FaultKind::GuestError, SLACK).await;
    assert_eq!(message, "hostile plugin refuses on purpose");
}

#[tokio::test]
async fn too_many_stop_patterns_are_refused() {
    let plugin = load_with("hostile", limits()).await;
    let err = plugin
        .open_trigger(&config("many-patterns"), &Sample::from_prompt(""), 1)
        .await
        .err()
        .unwrap();
    let fault = err.downcast_ref::<rlhost::plugin::Fault>().unwrap();
    assert_eq!(fault.kind, FaultKind::BadOutput);
    assert!(fault.message.contains("10000 stop patterns"), "{fault}");
}

#[tokio::test]
async fn misbehaving_open_is_contained() {
    let plugin = load_with("hostile", limits()).await;
    let started = Instant::now();
    let err = plugin
        .open_trigger(
            r#"{"mode": "loop", "at": "open"}"#,
            &Sample::from_prompt(""),
            1,
        )
        .await
        .err()
        .unwrap();
    assert!(started.elapsed() < Duration::from_millis(TIMEOUT_MS) + SLACK);
    let fault = err.downcast_ref::<rlhost::plugin::Fault>().unwrap();
    assert_eq!(
        (fault.kind, fault.call),
        (FaultKind::Timeout, "trigger.open")
    );
    still_answers(&plugin).await;
}

#[tokio::test]
async fn fuel_budget_stops_a_loop() {
    let limits = Limits {
        fuel: Some(50_000_000),
        timeout_ms: 60_000,
        ..limits()
    };
    let plugin = load_with("hostile", limits).await;
    let (result, took) = fire(&plugin, "loop").await;
    let fault = result.unwrap_err();
    assert_eq!(fault.kind, FaultKind::Timeout);
    assert!(fault.message.contains("ran out of fuel"), "{fault}");
    assert!(
        took < Duration::from_secs(30),
        "stopped by fuel, not the deadline: {took:?}"
    );
    still_answers(&plugin).await;
}

#[tokio::test]
async fn host_files_are_not_readable() {
    let plugin = load_with("hostile", limits()).await;
    let (result, _) = fire(&plugin, "read-file").await;
    let out = result.unwrap().unwrap();
    assert!(!out.contains("root:"), "read /etc/passwd: {out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(lines.iter().all(|l| l.starts_with("error:")), "{out}");
    // The plugin's own source, next to the host, is not readable either.
    let source = concat!(env!("CARGO_MANIFEST_DIR"), "/../plugins/hostile/src/lib.rs");
    let mut session = plugin
        .open_trigger(
            &format!(r#"{{"mode": "read-file", "path": "{source}"}}"#),
            &Sample::from_prompt(""),
            1,
        )
        .await
        .unwrap();
    let out = session.fire("</go>").await.unwrap().unwrap();
    assert!(out.starts_with("error:"), "{out}");
}

#[tokio::test]
async fn environment_and_arguments_are_empty() {
    // The test process has variables (PATH, cargo's CARGO_*); none may reach the plugin.
    // (Setting one here would race with other test threads reading the environment.)
    assert!(std::env::vars_os().count() > 0);
    let plugin = load_with("hostile", limits()).await;
    let (result, _) = fire(&plugin, "env").await;
    let out = result.unwrap().unwrap();
    assert_eq!(out, "vars: 0 []\nargs: 0 []");
}

#[tokio::test]
async fn network_is_refused_even_to_a_listening_local_port() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let plugin = load_with("hostile", limits()).await;
    let mut session = plugin
        .open_trigger(
            &format!(r#"{{"mode": "socket", "port": {port}}}"#),
            &Sample::from_prompt(""),
            1,
        )
        .await
        .unwrap();
    let out = session.fire("</go>").await.unwrap().unwrap();
    assert!(out.starts_with("error:"), "{out}");
    assert!(
        matches!(listener.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "nothing connected"
    );
}

#[tokio::test]
async fn a_granted_directory_is_readable_and_only_that() {
    let dir = rlhost_tests::temp_dir("grant");
    std::fs::write(dir.join("data.txt"), "granted content").unwrap();
    let plugin = super::runtime(false)
        .load(PluginSpec {
            path: rlhost_tests::plugin("hostile"),
            limits: limits(),
            grants: Grants {
                read_only_dirs: vec![DirGrant {
                    host: dir.clone(),
                    guest: "/data".into(),
                }],
                ..Grants::default()
            },
        })
        .await
        .unwrap();
    let mut session = plugin
        .open_trigger(
            r#"{"mode": "read-file", "path": "/data/data.txt"}"#,
            &Sample::from_prompt(""),
            1,
        )
        .await
        .unwrap();
    let out = session.fire("</go>").await.unwrap().unwrap();
    assert!(
        out.starts_with("read /data/data.txt: granted content"),
        "{out}"
    );
    // /etc/passwd is still out of reach.
    let mut session = plugin
        .open_trigger(r#"{"mode": "read-file"}"#, &Sample::from_prompt(""), 1)
        .await
        .unwrap();
    let out = session.fire("</go>").await.unwrap().unwrap();
    assert!(out.starts_with("error:"), "{out}");
}

/// `allow_http` entries are read when the plugin loads, from the library, the command
/// line and a run config alike; a mistake is one line naming the entry.
#[tokio::test]
async fn http_grants_are_read_when_the_plugin_loads() {
    let runtime = super::runtime(false);
    let load = |allow: &[&str]| {
        runtime.load(PluginSpec {
            path: rlhost_tests::plugin("hostile"),
            limits: limits(),
            grants: Grants {
                allow_http: allow.iter().map(|s| s.to_string()).collect(),
                ..Grants::default()
            },
        })
    };
    let plugin = load(&["http://127.0.0.1:8080", "https://*.example.org"])
        .await
        .unwrap();
    assert_eq!(plugin.http().access().max_in_flight, 4);
    let err = format!(
        "{:#}",
        load(&["https://example.com/v1"]).await.err().unwrap()
    );
    assert!(
        err.contains("allow_http entry \"https://example.com/v1\""),
        "{err}"
    );
    assert!(err.contains("drop \"/v1\""), "{err}");

    let stderr = rlhost_tests::TestCommand::new(&[
        "plugin",
        "call",
        &rlhost_tests::plugin("calculator").display().to_string(),
        "trigger",
        "--text",
        "x",
        "--allow-http",
        "ftp://files.example.com",
    ])
    .fails();
    assert!(
        stderr.contains("allow_http entry \"ftp://files.example.com\": scheme `ftp`"),
        "{stderr}"
    );

    let dir = rlhost_tests::temp_dir("http-grant");
    let config = dir.join("run.toml");
    let calc = rlhost_tests::plugin("calculator").display().to_string();
    std::fs::write(
        &config,
        format!(
            "[model]\npath = \"builtin:multiply\"\n[data]\npath = \"none.jsonl\"\n\
             [plugins.calc]\npath = {calc:?}\nallow_http = [\"https://*.org\"]\n"
        ),
    )
    .unwrap();
    let stderr = rlhost_tests::TestCommand::new(&["rollout", "--config"])
        .arg(&config)
        .arg("--out")
        .arg(dir.join("r.jsonl"))
        .fails();
    assert!(stderr.contains(&config.display().to_string()), "{stderr}");
    assert!(
        stderr.contains("plugins.calc.allow_http entry \"https://*.org\""),
        "{stderr}"
    );
    assert!(stderr.contains("two labels"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}

#[tokio::test]
async fn reward_and_dataset_faults_are_typed() {
    let plugin = load_with("hostile", limits()).await;
    let mut scorer = plugin.open_reward(&config("nan")).await.unwrap();
    let trajectory = Transcript {
        messages: vec![],
        completion: "x".into(),
        metadata: serde_json::json!({}),
        turns: 1,
        truncated: false,
    };
    let fault = scorer.score(&trajectory).await.unwrap_err();
    assert_eq!(fault.kind, FaultKind::BadOutput);
    assert!(fault.message.contains("NaN"), "{fault}");

    let mut source = plugin
        .open_dataset(&config("bad-metadata"), 1)
        .await
        .unwrap();
    let fault = source.get(0).await.unwrap_err();
    assert_eq!(fault.kind, FaultKind::BadOutput);
    let fault = source.get(99).await.unwrap_err();
    assert!(
        fault.message.contains("past the dataset's 10 samples"),
        "{fault}"
    );

    let mut source = plugin.open_dataset(&config("loop"), 1).await.unwrap();
    let fault = source.get(0).await.unwrap_err();
    assert_eq!(fault.kind, FaultKind::Timeout);
    let mut scorer = plugin.open_reward(&config("echo")).await.unwrap();
    assert_eq!(scorer.score(&trajectory).await.unwrap()[0].value, 1.0);
}

#[tokio::test]
async fn randomness_is_seeded() {
    // The Python tool draws from wasi:random through Python's `random`: the same session
    // seed gives the same numbers, another seed other numbers.
    let plugin = load("code_trigger").await;
    let draw = async |seed| {
        let mut session = plugin
            .open_trigger("{}", &Sample::from_prompt(""), seed)
            .await
            .unwrap();
        let text = "```python\nimport random, os\n[random.random(), os.urandom(4).hex()]\n```";
        session.fire(text).await.unwrap().unwrap()
    };
    let a = draw(1).await;
    assert_eq!(a, draw(1).await);
    assert_ne!(a, draw(2).await);
}

/// The JavaScript tool under model-written abuse, through the real host: an endless loop
/// times out, a memory bomb hits the cap, a flood of output is cut by the tool, and
/// nothing of the host (files, environment, Node's or QuickJS's system modules) is
/// reachable. After each fault the next call gets a fresh instance.
#[tokio::test]
async fn javascript_tool_contains_hostile_code() {
    let plugin = load_with("js_trigger", limits()).await;
    let mut session = plugin
        .open_trigger("{}", &Sample::from_prompt(""), 1)
        .await
        .unwrap();
    let js = |code: &str| format!("```js\n{code}\n```");
    let started = Instant::now();
    let fault = session.fire(&js("while (true) {}")).await.unwrap_err();
    assert_eq!(fault.kind, FaultKind::Timeout, "{fault}");
    assert!(started.elapsed() < Duration::from_millis(TIMEOUT_MS) + SLACK);
    // Chunks past a tenth of the 64 MiB cap each: the cap is hit within a few pushes,
    // long before the deadline even on a loaded machine (1e6-element chunks took the
    // whole 400 ms there once, and the bomb timed out instead).
    let bomb = "const a = []; while (true) a.push(new Array(1e7).fill(1.5));";
    let fault = session.fire(&js(bomb)).await.unwrap_err();
    assert_eq!(fault.kind, FaultKind::OutOfMemory, "{fault}");
    let out = session
        .fire(&js("console.log('y'.repeat(1e6))"))
        .await
        .unwrap()
        .unwrap();
    assert!(out.len() < 2_200, "{} bytes", out.len());
    assert!(out.contains("...[998000 more characters]"), "{out}");
    let probe = "[typeof require, typeof process, typeof std, typeof os, typeof fetch].join(' ')";
    let out = session.fire(&js(probe)).await.unwrap().unwrap();
    assert!(
        out.contains("'undefined undefined undefined undefined undefined'"),
        "{out}"
    );
    // A dynamic import of a host file never resolves to its content.
    let out = session
        .fire(&js(
            "let got = 'nothing'; import('/etc/passwd').then((m) => { got = String(m); }, (e) => { got = String(e); }); got",
        ))
        .await
        .unwrap()
        .unwrap();
    assert!(!out.contains("root:"), "{out}");
    assert_eq!(plugin.faults().get(FaultKind::Timeout), 1);
    assert_eq!(plugin.faults().get(FaultKind::OutOfMemory), 1);
    assert_eq!(plugin.faults().total(), 2);
}
