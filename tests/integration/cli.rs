//! The `rlhost` binary: `plugin inspect`, `plugin call`, and one clear line for each
//! loading error.

use rlhost_tests::{TestCommand, plugin, temp_dir};
use sha2::{Digest, Sha256};

fn path(name: &str) -> String {
    plugin(name).display().to_string()
}

#[test]
fn inspect_shows_version_roles_imports_size_and_sha256() {
    let ran = TestCommand::new(&["plugin", "inspect", &path("countdown")]).ok();
    let bytes = std::fs::read(plugin("countdown")).unwrap();
    let sha = hex::encode(Sha256::digest(&bytes));
    assert!(
        ran.stdout.contains("plugin:      countdown 0.1.0"),
        "{}",
        ran.stdout
    );
    // The Rust SDK's plugins are on 0.2.0 (code_trigger, below, stays on 0.1.0).
    assert!(ran.stdout.contains("wit:         rlhost:plugin@0.2.0"));
    assert!(ran.stdout.contains("roles:       trigger, dataset, reward"));
    assert!(ran.stdout.contains("wasi:cli/stdout@"));
    assert!(
        ran.stdout
            .contains(&format!("size:        {} bytes", bytes.len()))
    );
    assert!(ran.stdout.contains(&format!("sha256:      {sha}")));

    let json = TestCommand::new(&["plugin", "inspect", &path("code_trigger"), "--json"])
        .ok()
        .json();
    assert_eq!(json["name"], "code_trigger");
    assert_eq!(json["roles"], serde_json::json!(["trigger"]));
    assert_eq!(json["wit"], "rlhost:plugin@0.1.0");
}

#[test]
fn call_runs_each_role() {
    let ran = TestCommand::new(&["plugin", "call", &path("calculator"), "trigger"])
        .arg("--text")
        .arg("3 apples cost <calc>3 * 0.25</calc>")
        .ok();
    assert!(
        ran.stdout.contains("append: <result>0.75</result>"),
        "{}",
        ran.stdout
    );

    let ran = TestCommand::new(&[
        "plugin",
        "call",
        &path("countdown"),
        "dataset",
        "--index",
        "5",
        "--seed",
        "9",
        "--json",
    ])
    .ok();
    let json = ran.json();
    assert_eq!(json["len"], 10000);
    let sample = json["sample"].clone();
    let solution = sample["metadata"]["solution"].as_str().unwrap().to_string();

    let dir = temp_dir("cli-call");
    let sample_file = dir.join("sample.json");
    std::fs::write(&sample_file, sample.to_string()).unwrap();
    let ran = TestCommand::new(&["plugin", "call", &path("countdown"), "reward", "--sample"])
        .arg(&sample_file)
        .arg("--text")
        .arg(format!("<answer>{solution}</answer>"))
        .ok();
    assert_eq!(ran.stdout, "format: 1\ncorrect: 1\n");

    // Several --text values fire on one session: the Python tool keeps its globals.
    let ran = TestCommand::new(&["plugin", "call", &path("code_trigger"), "trigger", "--json"])
        .arg("--text")
        .arg("```python\nx = 6 * 7\n```")
        .arg("--text")
        .arg("```python\nprint(x)\n```")
        .ok();
    assert_eq!(
        ran.json()["outputs"],
        serde_json::json!(["\n<output>\n</output>\n", "\n<output>\n42\n</output>\n"])
    );
}

/// Issue 19: text with a newline after the closing fence answered "nothing", while a
/// rollout cuts the text at the first stop pattern's end and fires there.
#[test]
fn call_cuts_the_text_where_a_rollout_would_fire() {
    let ran = TestCommand::new(&["plugin", "call", &path("code_trigger"), "trigger"])
        .arg("--text")
        .arg("```python\nprint(1)\n```\nand more")
        .ok();
    assert!(
        ran.stdout.contains("append: \n<output>\n1\n</output>"),
        "{}",
        ran.stdout
    );
    assert!(
        ran.stderr.contains("cut at byte 22") && ran.stderr.contains("\"\\nand more\""),
        "{}",
        ran.stderr
    );
    let json = TestCommand::new(&["plugin", "call", &path("code_trigger"), "trigger", "--json"])
        .arg("--text")
        .arg("```python\nprint(2)\n```\n")
        .ok()
        .json();
    assert_eq!(
        json["outputs"],
        serde_json::json!(["\n<output>\n2\n</output>\n"])
    );
    assert_eq!(json["cut_at"], serde_json::json!([22]));
}

#[test]
fn call_reports_a_typed_fault_and_exits_1() {
    let stderr = TestCommand::new(&["plugin", "call", &path("hostile"), "trigger"])
        .arg("--config")
        .arg(r#"{"mode": "loop"}"#)
        .arg("--timeout-ms")
        .arg("300")
        .arg("--text")
        .arg("x</go>")
        .fails();
    // "still running at the 300 ms deadline" as a rule; on a loaded machine the deadline
    // can also pass while the guest waits in a host call, which says so in its own words.
    assert!(
        stderr.contains("error: plugin `hostile@0.1.0` timeout in trigger.fire: ")
            && stderr.contains("the 300 ms deadline"),
        "{stderr}"
    );
}

#[test]
fn loading_errors_are_one_clear_line() {
    let dir = temp_dir("cli-load");
    let text = dir.join("notes.wasm");
    std::fs::write(&text, "just text").unwrap();
    let core = dir.join("core.wasm");
    std::fs::write(&core, b"\0asm\x01\0\0\0").unwrap();
    let missing = dir.join("missing.wasm");
    let cases = [
        (
            text.display().to_string(),
            "is not a WebAssembly file (it starts with 6a 75 73 74",
        ),
        (
            core.display().to_string(),
            "is a core WebAssembly module, not a component; build it with `cargo build --target wasm32-wasip2`",
        ),
        (missing.display().to_string(), "cannot read plugin"),
        (
            path("future_version"),
            "was built for rlhost:plugin@9.0.0, but this rlhost supports rlhost:plugin@0.2.0, 0.1.0",
        ),
        (
            path("not_a_plugin"),
            "exports no rlhost role (trigger, environment, dataset or reward); its exports are: wasi:cli/run@0.2",
        ),
    ];
    for (file, want) in cases {
        let stderr = TestCommand::new(&["plugin", "inspect", &file]).fails();
        assert!(stderr.starts_with("error: "), "{stderr}");
        assert!(stderr.contains(want), "{file}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    }
    let stderr = TestCommand::new(&[
        "plugin",
        "call",
        &path("calculator"),
        "reward",
        "--text",
        "x",
    ])
    .fails();
    assert!(stderr.contains("plugin `calculator@0.1.0`"), "{stderr}");
    assert!(stderr.contains("exports trigger, not reward"), "{stderr}");
}

#[test]
fn user_mistakes_are_errors_not_panics() {
    let stderr = TestCommand::new(&[
        "plugin",
        "call",
        &path("calculator"),
        "trigger",
        "--config",
        "{oops",
        "--text",
        "x",
    ])
    .fails();
    assert!(stderr.contains("--config is not valid JSON"), "{stderr}");
    let stderr = TestCommand::new(&["plugin", "call", &path("calculator"), "trigger"]).fails();
    assert!(stderr.contains("needs --text"), "{stderr}");
    let ran = TestCommand::new(&["plugin", "call", &path("calculator"), "judge"]).run();
    assert_eq!(ran.code, Some(2));
    assert!(
        ran.stderr.contains("unknown role `judge`"),
        "{}",
        ran.stderr
    );
    let stderr = TestCommand::new(&[
        "plugin",
        "call",
        &path("countdown"),
        "reward",
        "--trajectory",
        "/nonexistent.json",
    ])
    .fails();
    assert!(
        stderr.contains("cannot read trajectory file /nonexistent.json"),
        "{stderr}"
    );
}

/// `rlhost config reference` lists every key with its type, default and range (generated
/// from the config types; the book's copy is checked against it in the host's tests), and
/// `rlhost config show` prints the config a run would use: the file with `--set` applied
/// and every default filled in, which reads back as the same config.
#[test]
fn config_reference_and_show() {
    let reference = TestCommand::new(&["config", "reference"]).ok().stdout;
    for needle in [
        "[train]",
        "train.lr  (number; default 1e-5)",
        "allowed: a finite number > 0",
        "[[rewards]]",
        "rewards[].cases",
        "[plugins.NAME]",
    ] {
        assert!(reference.contains(needle), "{needle} not in:\n{reference}");
    }
    let markdown = TestCommand::new(&["config", "reference", "--markdown"])
        .ok()
        .stdout;
    assert!(
        markdown.contains("| `train.keep_last` | integer | `3` |"),
        "{markdown}"
    );

    let config = rlhost_tests::repo_root().join("configs/fixture-code-tests.toml");
    let shown = TestCommand::new(&["config", "show", "--config"])
        .arg(&config)
        .args(["--set", "train.steps=7"])
        .ok()
        .stdout;
    let parsed: toml::Table = toml::from_str(&shown).unwrap();
    assert_eq!(parsed["train"]["steps"].as_integer(), Some(7));
    assert_eq!(
        parsed["train"]["keep_last"].as_integer(),
        Some(3),
        "defaults filled in"
    );
    assert_eq!(parsed["rewards"][0]["cases"].as_str(), Some("tests"));
    let dir = rlhost_tests::temp_dir("config-show");
    let copy = dir.join("shown.toml");
    std::fs::write(&copy, &shown).unwrap();
    let again = TestCommand::new(&["config", "show", "--config"])
        .arg(&copy)
        .ok()
        .stdout;
    let body = |s: &str| {
        s.lines()
            .filter(|l| !l.starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(body(&again), body(&shown));
    let e = TestCommand::new(&["config", "show", "--config"])
        .arg(&config)
        .args(["--set", "train.stepz=3"])
        .fails();
    assert!(e.contains("unknown field `stepz`"), "{e}");
}
