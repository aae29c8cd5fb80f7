//! `rlhost plugin new`: for every language and role, the project it makes builds with the
//! one command its README gives, and the component passes `rlhost plugin test` unchanged.

use rlhost_tests::{TestCommand, temp_dir};
use std::path::{Path, PathBuf};
use std::process::Command;

const ROLES: [&str; 5] = ["trigger", "environment", "dataset", "reward", "tools"];

/// The first ```sh block of the project's README: its build command.
fn build_command(project: &Path) -> String {
    let readme = std::fs::read_to_string(project.join("README.md")).unwrap();
    let block = readme.split("```sh\n").nth(1).expect("a ```sh block");
    block.split("```").next().unwrap().trim().to_string()
}

/// Makes, builds and tests one plugin per role in `lang`; `wasm` says where a project's
/// component lands.
fn scaffolds_build_and_pass(
    lang: &str,
    env: &[(&str, PathBuf)],
    wasm: impl Fn(&Path, &str) -> PathBuf,
) {
    let dir = temp_dir(&format!("scaffold-{lang}"));
    for role in ROLES {
        let name = format!("my_{lang}_{role}");
        let ran = TestCommand::new(&[
            "plugin", "new", &name, "--lang", lang, "--role", role, "--dir",
        ])
        .arg(&dir)
        .ok();
        assert!(ran.stdout.contains("build it:"), "{}", ran.stdout);
        let project = dir.join(&name);
        let command = build_command(&project);
        let mut build = Command::new("bash");
        build.arg("-c").arg(&command).current_dir(&project);
        // A cargo build inside `cargo test` must not take the outer build's settings.
        for var in [
            "CARGO_ENCODED_RUSTFLAGS",
            "RUSTFLAGS",
            "CARGO_BUILD_TARGET",
            "CARGO_TARGET_DIR",
        ] {
            build.env_remove(var);
        }
        build.envs(env.iter().map(|(k, v)| (k, v)));
        let out = build.output().unwrap();
        assert!(
            out.status.success(),
            "{name}: `{command}` failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let file = wasm(&project, &name);
        let ran = TestCommand::new(&["plugin", "test", "--json"])
            .arg(&file)
            .run();
        let report: serde_json::Value = serde_json::from_str(&ran.stdout)
            .unwrap_or_else(|e| panic!("{name}: {e}: {}{}", ran.stdout, ran.stderr));
        let not_passed: Vec<&serde_json::Value> = report["checks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["outcome"] != "pass")
            .collect();
        assert!(not_passed.is_empty(), "{name}: {not_passed:#?}");
        assert_eq!(ran.code, Some(0), "{name}: {}", ran.stderr);
        assert_eq!(report["plugin"], format!("{name}@0.1.0"));
    }
    // A name that is taken is refused, and the project in it is left as it was.
    let taken = dir.join(format!("my_{lang}_reward"));
    let before = std::fs::read_to_string(taken.join("README.md")).unwrap();
    let err = TestCommand::new(&[
        "plugin",
        "new",
        &format!("my_{lang}_reward"),
        "--lang",
        lang,
        "--role",
        "trigger",
        "--dir",
    ])
    .arg(&dir)
    .fails();
    assert!(err.contains("exists already"), "{err}");
    assert_eq!(
        std::fs::read_to_string(taken.join("README.md")).unwrap(),
        before
    );
    // Passed: the projects go (each C and JavaScript one has ~340 MB of node_modules);
    // a failed test leaves them to look at.
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn rust_scaffolds_build_and_pass_the_conformance_test() {
    // One target folder for the four projects: their dependencies build once.
    let target = temp_dir("scaffold-rust-target");
    scaffolds_build_and_pass(
        "rust",
        &[("CARGO_TARGET_DIR", target.clone())],
        |_, name| target.join(format!("wasm32-wasip2/release/{name}.wasm")),
    );
    let _ = std::fs::remove_dir_all(&target);
}

#[test]
fn python_scaffolds_build_and_pass_the_conformance_test() {
    scaffolds_build_and_pass("python", &[], |project, name| {
        project.join(format!("{name}.wasm"))
    });
}

#[test]
fn javascript_scaffolds_build_and_pass_the_conformance_test() {
    scaffolds_build_and_pass("js", &[], |project, name| {
        project.join(format!("{name}.wasm"))
    });
}

#[test]
fn c_scaffolds_build_and_pass_the_conformance_test() {
    scaffolds_build_and_pass("c", &[], |project, name| {
        project.join(format!("{name}.wasm"))
    });
}

#[test]
fn an_unknown_language_or_role_names_the_ones_there_are() {
    for (lang, role, want) in [
        (
            "cobol",
            "reward",
            "unknown language `cobol`: expected rust, python, js or c",
        ),
        (
            "c",
            "judge",
            "unknown role `judge`: expected trigger, environment, dataset, reward or tools",
        ),
    ] {
        // clap's usage errors exit with 2.
        let ran = TestCommand::new(&["plugin", "new", "x", "--lang", lang, "--role", role]).run();
        assert_eq!(ran.code, Some(2), "{}", ran.stderr);
        assert!(ran.stderr.contains(want), "{}", ran.stderr);
    }
    let err = TestCommand::new(&[
        "plugin", "new", "Bad-Name", "--lang", "c", "--role", "reward",
    ])
    .fails();
    assert!(err.contains("lowercase letters"), "{err}");
}
