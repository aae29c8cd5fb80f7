//! Builds the plugins under test (`plugins/build.sh`) and tells the tests where they are,
//! so that `cargo test` never runs against stale or missing plugins.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let plugins = manifest
        .join("../plugins")
        .canonicalize()
        .expect("plugins/ exists");
    for dir in ["../plugins", "../sdk/src", "../wit"] {
        println!("cargo:rerun-if-changed={}", manifest.join(dir).display());
    }
    let status = Command::new("bash")
        .arg(plugins.join("build.sh"))
        // The nested cargo must build for wasm32-wasip2 in its own workspace, whatever
        // the outer build's environment says.
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .status()
        .expect("cannot run bash plugins/build.sh");
    if !status.success() {
        panic!(
            "plugins/build.sh failed ({status}); it needs `rustup target add wasm32-wasip2` and `pip install componentize-py==0.25.1`"
        );
    }
    println!(
        "cargo:rustc-env=RLHOST_PLUGIN_DIR={}",
        plugins.join("dist").display()
    );
}
