//! Writes the macro that generates a plugin's bindings.
//!
//! `wit_bindgen::generate!` resolves a relative `path` against the manifest directory of
//! the crate that invokes it, which is the plugin's, not ours. So the SDK bakes the
//! absolute path of its own copy of the WIT package into a `macro_rules!` at build time,
//! and `export!` expands to that.

use std::path::PathBuf;

/// Role combinations the contract's worlds do not list, built from its worlds. They live
/// in the SDK, not in `wit/`: a released contract is frozen, and the host reads the roles a
/// component exports, not the name of the world it was built from.
const SDK_WORLDS: &str = "package rlhost:sdk;

/// A task whose tool is whatever the run chooses: samples and their reward.
world dataset-reward-plugin {
    include rlhost:plugin/dataset-plugin@0.2.0;
    include rlhost:plugin/reward-plugin@0.2.0;
}

/// A task with its tool, and functions too: every role but the environment.
world task-tools-plugin {
    include rlhost:plugin/task-plugin@0.2.0;
    include rlhost:plugin/tools-plugin@0.2.0;
}
";

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let wit = manifest.join("../wit/v0.2.0");
    let wit = wit.canonicalize().unwrap_or(wit);
    println!("cargo:rerun-if-changed={}", wit.display());
    let wit = wit.to_str().expect("the WIT path must be valid UTF-8");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap()).join("generate_world.rs");
    // `with` names every interface the plugin's world imports, so that all plugins share
    // the SDK's types and imports; wit-bindgen refuses a remapping its world does not use,
    // and the dataset world alone does not import `model` (a dataset stays a pure function
    // of its seed).
    let text = format!(
        r#"/// Generates the bindings of one world of `rlhost:plugin@0.2.0` in the calling crate,
/// sharing the SDK's types and host imports.
#[doc(hidden)]
#[macro_export]
macro_rules! __generate_world {{
    ($world:literal) => {{
        ::rlhost_sdk::__wit_bindgen::generate!({{
            path: {wit:?},
            world: $world,
            runtime_path: "::rlhost_sdk::__wit_bindgen::rt",
            with: {{
                "rlhost:plugin/types@0.2.0": ::rlhost_sdk::__bindings::rlhost::plugin::types,
                "rlhost:plugin/host@0.2.0": ::rlhost_sdk::__bindings::rlhost::plugin::host,
                "rlhost:plugin/model@0.2.0": ::rlhost_sdk::__bindings::rlhost::plugin::model,
            }},
        }});
    }};
    (no_model $world:literal) => {{
        ::rlhost_sdk::__wit_bindgen::generate!({{
            path: {wit:?},
            world: $world,
            runtime_path: "::rlhost_sdk::__wit_bindgen::rt",
            with: {{
                "rlhost:plugin/types@0.2.0": ::rlhost_sdk::__bindings::rlhost::plugin::types,
                "rlhost:plugin/host@0.2.0": ::rlhost_sdk::__bindings::rlhost::plugin::host,
            }},
        }});
    }};
    (sdk $world:literal) => {{
        ::rlhost_sdk::__wit_bindgen::generate!({{
            path: {wit:?},
            inline: {SDK_WORLDS:?},
            world: $world,
            runtime_path: "::rlhost_sdk::__wit_bindgen::rt",
            with: {{
                "rlhost:plugin/types@0.2.0": ::rlhost_sdk::__bindings::rlhost::plugin::types,
                "rlhost:plugin/host@0.2.0": ::rlhost_sdk::__bindings::rlhost::plugin::host,
                "rlhost:plugin/model@0.2.0": ::rlhost_sdk::__bindings::rlhost::plugin::model,
            }},
        }});
    }};
}}
"#
    );
    std::fs::write(out, text).unwrap();
}
