//! `rlhost plugin test`, the conformance runner: every plugin that `plugins/build.sh`
//! builds passes it (Rust, Python, JavaScript and C), the hostile plugin fails it with
//! its faults named, and a file that is not a plugin gets `plugin inspect`'s one line.

use rlhost_tests::{TestCommand, plugin_dir, temp_dir};

/// The contract each plugin is built against: one per language stays on WIT 0.1.0, so that
/// the first contract is proven to load and run (the SDK's Rust plugins and `units` are on
/// 0.2.0).
const WIT_VERSIONS: [(&str, &str); 7] = [
    ("calculator_v0_1_0", "0.1.0"),
    ("code_trigger", "0.1.0"),
    ("code_tests", "0.1.0"),
    ("js_trigger", "0.1.0"),
    ("c_reward", "0.1.0"),
    ("calculator", "0.2.0"),
    ("units", "0.2.0"),
];

/// The plugins that are not meant to pass: the hostile one (its faults are the point) and
/// the two components that test the host's loading errors.
const NOT_PLUGINS: [&str; 3] = ["hostile", "future_version", "not_a_plugin"];

#[test]
fn every_example_plugin_passes_the_conformance_test() {
    let dir = temp_dir("conformance");
    let samples = dir.join("answers.jsonl");
    std::fs::write(
        &samples,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"What is 6 times 7?\"}], \"metadata\": {\"answer\": 42}}\n\
         {\"messages\": [{\"role\": \"user\", \"content\": \"Half of 5?\"}], \"metadata\": {\"answer\": \"2.5\"}}\n",
    )
    .unwrap();
    let code = dir.join("code.jsonl");
    std::fs::write(
        &code,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Write add(a, b).\"}], \"metadata\": {\"tests\": [\"assert add(1, 2) == 3\"]}}\n\
         {\"messages\": [{\"role\": \"user\", \"content\": \"Add a and b from stdin.\"}], \"metadata\": {\"tests\": {\"inputs\": [\"1 2\\n\"], \"outputs\": [\"3\\n\"]}}}\n",
    )
    .unwrap();
    let secrets = dir.join("secrets.jsonl");
    std::fs::write(
        &secrets,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Guess my number.\"}], \"metadata\": {\"secret\": 37}}\n",
    )
    .unwrap();
    let mut names: Vec<String> = std::fs::read_dir(plugin_dir())
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            name.strip_suffix(".wasm").map(str::to_string)
        })
        .filter(|n| !NOT_PLUGINS.contains(&n.as_str()))
        .collect();
    names.sort();
    for (lang, _) in WIT_VERSIONS {
        assert!(names.iter().any(|n| n == lang), "{lang} missing: {names:?}");
    }
    // The search tool asks a real retrieval service, granted to it.
    let service = rlhost_tests::Bm25Service::start();
    let search = format!(r#"{{"url": "{}"}}"#, service.url());
    for name in &names {
        let file = plugin_dir().join(format!("{name}.wasm"));
        let mut cmd = TestCommand::new(&["plugin", "test", "--json"]).arg(&file);
        match name.as_str() {
            "pattern_reward" => {
                cmd = cmd.args(["--config", r#"{"patterns": {"calc": "<calc>"}}"#]);
            }
            // The C reward and the math checker score answers: samples that have one.
            "c_reward" | "math_answer" => cmd = cmd.arg("--sample").arg(&samples),
            // The code reward runs solutions against the samples' tests.
            "code_tests" => cmd = cmd.arg("--sample").arg(&code),
            // The guessing game's samples hold the secret number.
            "guess_number" => cmd = cmd.arg("--sample").arg(&secrets),
            "search" => {
                cmd = cmd
                    .args(["--config", &search])
                    .args(["--allow-http", &service.url()]);
            }
            // The judge and the simulated user ask a model: the fixture, granted.
            "judge" | "sim_user" => {
                if name == "judge" {
                    cmd = cmd.args(["--config", r#"{"rubric": "a correct answer"}"#]);
                }
                cmd = cmd
                    .args(["--generate", "--model"])
                    .arg(rlhost_tests::repo_root().join("tests/fixtures/models/qwen2"));
            }
            _ => {}
        }
        let ran = cmd.run();
        let report: serde_json::Value = serde_json::from_str(&ran.stdout)
            .unwrap_or_else(|e| panic!("{name}: {e}: {}{}", ran.stdout, ran.stderr));
        let failed: Vec<&serde_json::Value> = report["checks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["outcome"] == "fail" || c["outcome"] == "skip")
            .collect();
        assert!(failed.is_empty(), "{name}: {failed:#?}");
        assert_eq!(ran.code, Some(0), "{name}: {}", ran.stderr);
        if let Some((_, version)) = WIT_VERSIONS.iter().find(|(n, _)| n == name) {
            let wit = report["checks"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["name"] == "WIT version is supported")
                .map(|c| c["detail"].clone());
            assert_eq!(
                wit,
                Some(format!("rlhost:plugin@{version}").into()),
                "{name}"
            );
        }
        // Each exported role was exercised and timed.
        let timed: Vec<&str> = report["timings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["call"].as_str().unwrap())
            .collect();
        assert!(
            timed.iter().any(|c| c.ends_with(".open")),
            "{name}: {timed:?}"
        );
    }
}

#[test]
fn the_hostile_plugin_fails_with_its_faults_named_and_a_non_plugin_gets_one_line() {
    // With `{}` it echoes whatever it is given, also text without its stop pattern.
    let ran = TestCommand::new(&["plugin", "test", "--inputs", "20"])
        .arg(plugin_dir().join("hostile.wasm"))
        .run();
    assert_eq!(ran.code, Some(1), "{}{}", ran.stdout, ran.stderr);
    assert!(
        ran.stdout.contains("plugin test: hostile 0.1.0"),
        "{}",
        ran.stdout
    );
    let fails = |stdout: &str| -> Vec<String> {
        stdout
            .lines()
            .filter(|l| l.contains(" FAIL "))
            .map(str::to_string)
            .collect()
    };
    let rows = fails(&ran.stdout);
    assert!(
        rows.iter()
            .any(|r| r.contains("silent without a stop pattern") && r.contains("answered 10 of 10")),
        "{}",
        ran.stdout
    );
    assert!(
        ran.stderr.contains("error: plugin `hostile@0.1.0`: ")
            && ran.stderr.contains("checks failed"),
        "{}",
        ran.stderr
    );
    // Configured to loop, every role's calls time out, and the table says so.
    let ran = TestCommand::new(&["plugin", "test", "--inputs", "4", "--timeout-ms", "200"])
        .arg(plugin_dir().join("hostile.wasm"))
        .args(["--config", r#"{"mode": "loop"}"#])
        .run();
    assert_eq!(ran.code, Some(1), "{}{}", ran.stdout, ran.stderr);
    for role in ["trigger", "dataset", "reward"] {
        assert!(
            fails(&ran.stdout)
                .iter()
                .any(|r| r.trim_start().starts_with(role) && r.contains("timeout")),
            "{role}: {}",
            ran.stdout
        );
    }

    // Memory mode: every dataset.get dies, so there is nothing to compare: those checks
    // say skip and why, never pass.
    let ran = TestCommand::new(&["plugin", "test", "--inputs", "20"])
        .arg(plugin_dir().join("hostile.wasm"))
        .args(["--config", r#"{"mode": "memory"}"#])
        .run();
    assert_eq!(ran.code, Some(1), "{}{}", ran.stdout, ran.stderr);
    let row = |name: &str| -> String {
        ran.stdout
            .lines()
            .find(|l| l.trim_start().starts_with("dataset") && l.contains(name))
            .unwrap_or_else(|| panic!("no dataset row {name:?}: {}", ran.stdout))
            .to_string()
    };
    for name in ["deterministic for a seed", "samples are well formed"] {
        assert!(
            row(name).contains(" skip ") && row(name).contains("nothing to"),
            "{}",
            ran.stdout
        );
    }
    assert!(
        row("get: no fault").contains("stopped after 3 out-of-memory faults in a row"),
        "{}",
        ran.stdout
    );

    let dir = temp_dir("conformance-not-a-plugin");
    let text = dir.join("notes.wasm");
    std::fs::write(&text, "just text").unwrap();
    for file in [text, plugin_dir().join("not_a_plugin.wasm")] {
        let test = TestCommand::new(&["plugin", "test"]).arg(&file).fails();
        let inspect = TestCommand::new(&["plugin", "inspect"]).arg(&file).fails();
        assert_eq!(test, inspect);
        assert_eq!(test.trim_end().lines().count(), 1, "{test}");
    }
}

/// A plugin that hangs in every call, tested at the default 5 s deadline: each check
/// stops after two timeouts in a row and says so, progress shows on stderr as it goes,
/// and at most 8 calls wait out the deadline, so the run ends within a minute (before:
/// every one of ~1,200 calls did, over an hour).
#[test]
fn a_plugin_that_hangs_is_tested_within_a_minute() {
    let started = std::time::Instant::now();
    let ran = TestCommand::new(&["plugin", "test"])
        .arg(plugin_dir().join("hostile.wasm"))
        .args(["--config", r#"{"mode": "loop"}"#])
        .run();
    let took = started.elapsed();
    assert_eq!(ran.code, Some(1), "{}{}", ran.stdout, ran.stderr);
    // The bound is in calls, not seconds: every call that hung waited the deadline, and
    // at most 8 did (40 s at 5 s each; this run took {took:?}).
    let hung: usize = ran
        .stdout
        .lines()
        .filter(|l| {
            ["dataset.get", "reward.score", "trigger.fire"]
                .contains(&l.split_whitespace().next().unwrap_or(""))
        })
        .map(|l| {
            l.split_whitespace()
                .nth(1)
                .unwrap()
                .parse::<usize>()
                .unwrap()
        })
        .sum();
    assert!(hung <= 8, "{hung} calls hung ({took:?}): {}", ran.stdout);
    for role in ["dataset", "reward", "trigger"] {
        assert!(
            ran.stdout.lines().any(|l| l.trim_start().starts_with(role)
                && l.contains("stopped after 2 timeout faults in a row")),
            "{role}: {}",
            ran.stdout
        );
    }
    // Each check was printed as it completed, before the table.
    assert!(
        ran.stderr.contains("dataset     get: no fault: fail"),
        "{}",
        ran.stderr
    );
}
