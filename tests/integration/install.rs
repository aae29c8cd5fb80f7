//! An installed rlhost works outside the checkout: `scripts/install.sh --root PREFIX`
//! puts the binary in PREFIX/bin and the plugins in PREFIX/share/rlhost/plugins, and from
//! a folder elsewhere, with no RLHOST_PLUGIN_DIR, the built-in run finds its task plugin
//! there, runs, and a plugin is named without its path.

use rlhost_tests::{cache_dir, repo_root, rlhost_bin, temp_dir};
use std::path::Path;
use std::process::{Command, Output};

fn run(bin: &Path, cwd: &Path, home: &Path, args: &[&str]) -> Output {
    let out = Command::new(bin)
        .args(args)
        .current_dir(cwd)
        .env_remove("RLHOST_PLUGIN_DIR")
        .env_remove("XDG_DATA_HOME")
        .env_remove("RUST_LOG")
        .env("HOME", home)
        .env("RLHOST_CACHE_DIR", cache_dir())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "rlhost {args:?} failed: {err}");
    out
}

#[test]
fn the_installed_binary_runs_from_any_folder() {
    let dir = temp_dir("install");
    let prefix = dir.join("prefix");
    let status = Command::new("bash")
        .arg(repo_root().join("scripts/install.sh"))
        .arg("--root")
        .arg(&prefix)
        .arg("--bin")
        .arg(rlhost_bin())
        .status()
        .unwrap();
    assert!(status.success());
    let bin = prefix.join("bin/rlhost");
    let plugins = prefix.join("share/rlhost/plugins");
    assert!(plugins.join("multiply.wasm").is_file() && plugins.join("code_tests.wasm").is_file());
    assert!(
        !plugins.join("hostile.wasm").exists(),
        "test components stay out"
    );
    let (elsewhere, home) = (dir.join("elsewhere"), dir.join("home"));
    std::fs::create_dir_all(&elsewhere).unwrap();
    std::fs::create_dir_all(&home).unwrap();

    // The built-in run's task plugin comes from the prefix, before the checkout the
    // binary was built in.
    let shown = run(&bin, &elsewhere, &home, &["config", "show"]);
    let config: toml::Table = toml::from_str(&String::from_utf8_lossy(&shown.stdout)).unwrap();
    let path = config["plugins"]["multiply"]["path"].as_str().unwrap();
    assert_eq!(Path::new(path), plugins.join("multiply.wasm"));

    // A plugin by name alone.
    let inspected = run(
        &bin,
        &elsewhere,
        &home,
        &["plugin", "inspect", "code_tests.wasm"],
    );
    let text = String::from_utf8_lossy(&inspected.stdout);
    assert!(
        text.contains(&plugins.join("code_tests.wasm").display().to_string()),
        "{text}"
    );

    // The built-in run itself, a short rollout.
    let out = elsewhere.join("rollout.jsonl");
    run(
        &bin,
        &elsewhere,
        &home,
        &[
            "rollout",
            "-q",
            "--prompts",
            "2",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    let rows = std::fs::read_to_string(&out).unwrap();
    assert!(rows.lines().count() >= 2, "{rows}");
}
