//! The rules the house's imports keep (issue 66; docs/src/layout.md), checked by reading
//! the sources: a test fails when an import crosses one. Each rule names the rooms it
//! lets through; everything else is held to it.
//!
//! - Only `config/` reads the raw config, and `cli/` hands it over: no `crate::config`
//!   elsewhere. Other rooms take settings `config/` builds for them (the gateway's
//!   `gateway::train::Settings`, the OpenEnv client's `openenv::settings`).
//! - `openenv/` is the protocol and `rlhost env serve`; the rollout side of it (episodes
//!   against a server) lives in `rollout/env/`, which reads the protocol's types:
//!   `openenv/` names nothing of `rollout/`.
//! - The rollout engine (`rollout/engine/`) reaches what answers turns only through the
//!   environment seam (`rollout/env/mod.rs`): it names no session type and no
//!   environment's own module.
//! - `sampler/` is under every caller (the trajectory engine, the gateway, Tinker,
//!   plugins' `model.generate`): it names none of them.
//! - The CPU and CUDA kernels are the model's: other rooms reach them through
//!   `model::compute`, the compute seam, never `model::cpu` or `model::cuda` (the
//!   benchmarks under `examples/` time the kernels themselves, and may). The other way,
//!   the CPU kernels name none of the model's types: a frozen weight reaches them as
//!   `cpu::frozen`'s traits, which `model/frozen.rs` and `model/nf4/` implement.
//! - Nothing imports back up: each room names only rooms on the floors below it
//!   ([`FLOORS`], as docs/src/layout.md draws them), never one above or beside it.
//! - One name, one type: outside the files that mirror a protocol or contract
//!   ([`MIRRORS`]), no two crate-visible types share a name.

/// Each non-comment line of each source file under `host/src` that names `needle`,
/// outside the rooms `allowed` (folder names, or file names at the crate root), as
/// `path:line: text`.
fn crossings(needle: &str, allowed: &[&str]) -> Vec<String> {
    scan(needle, &|path| !allowed.contains(&room(path)))
}

/// Each non-comment line of a source file in `room` that names `needle`.
fn within(room_name: &str, needle: &str) -> Vec<String> {
    scan(needle, &|path| room(path) == room_name)
}

/// Each non-comment line of a source file whose path (under `host/src`) starts with
/// `prefix` that names `needle`.
fn under(prefix: &str, needle: &str) -> Vec<String> {
    scan(needle, &|path| path.starts_with(prefix))
}

/// The room a source file is in: the first part of its path under `host/src`.
fn room(path: &str) -> &str {
    path.split('/').next().unwrap_or_default()
}

/// Each non-comment line naming `needle` in the files `checked` picks by their path
/// under `host/src` (`/`-separated).
fn scan(needle: &str, checked: &dyn Fn(&str) -> bool) -> Vec<String> {
    let mut out = Vec::new();
    for (rel, text) in sources() {
        if !checked(&rel) {
            continue;
        }
        for (i, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            if code.contains(needle) {
                out.push(format!("{rel}:{}: {code}", i + 1));
            }
        }
    }
    out.sort();
    out
}

/// Every source file under `host/src`: its path there (`/`-separated) and its text.
fn sources() -> Vec<(String, String)> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("the sources are readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(&root).expect("under src");
            let rel: Vec<&str> = rel
                .components()
                .filter_map(|c| c.as_os_str().to_str())
                .collect();
            let text = std::fs::read_to_string(&path).expect("a source file is text");
            out.push((rel.join("/"), text));
        }
    }
    out.sort();
    out
}

/// The files that mirror a protocol or a contract, and so keep its names even where
/// another room has a type of the same name: the OpenAI wire (`gateway/wire.rs`), Tinker's
/// (`tinker/wire.rs`, `tinker/proto.rs`), OpenEnv's (`openenv/wire.rs`) and the bindings
/// generated from the WIT contract (`plugin/bindings/`).
const MIRRORS: &[&str] = &[
    "gateway/wire.rs",
    "tinker/wire.rs",
    "tinker/proto.rs",
    "openenv/wire.rs",
    "plugin/bindings/",
];

/// The crate-visible types (`pub`, `pub(crate)`, `pub(super)`; struct, enum, type alias,
/// trait) defined outside the mirrors, each as `name` and `path:line`.
fn visible_types() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (rel, text) in sources() {
        if MIRRORS.iter().any(|m| rel.starts_with(m)) {
            continue;
        }
        for (i, line) in text.lines().enumerate() {
            let code = line.trim_start();
            let Some(rest) = code.strip_prefix("pub") else {
                continue;
            };
            let rest = match rest.strip_prefix('(') {
                Some(r) => r.split_once(") ").map_or("", |(_, r)| r),
                None => rest.strip_prefix(' ').unwrap_or(""),
            };
            let rest = rest.strip_prefix("unsafe ").unwrap_or(rest);
            let Some(rest) = ["struct ", "enum ", "type ", "trait "]
                .iter()
                .find_map(|k| rest.strip_prefix(k))
            else {
                continue;
            };
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            out.push((name, format!("{rel}:{}", i + 1)));
        }
    }
    out
}

#[test]
fn only_config_and_cli_name_the_config() {
    let found = crossings("crate::config", &["config", "cli", "import_rules.rs"]);
    assert!(
        found.is_empty(),
        "`crate::config` outside config/ and cli/ (take settings config/ builds instead):\n{}",
        found.join("\n")
    );
}

#[test]
fn only_the_model_names_its_kernels() {
    let mut found = crossings("model::cpu", &["model", "import_rules.rs"]);
    found.extend(crossings("model::cuda", &["model", "import_rules.rs"]));
    assert!(
        found.is_empty(),
        "the model's kernels named outside model/ (go through model::compute):\n{}",
        found.join("\n")
    );
}

#[test]
fn openenv_names_nothing_of_the_rollouts() {
    let found = within("openenv", "crate::rollout");
    assert!(
        found.is_empty(),
        "openenv/ imports from rollout/ (the rollout side of OpenEnv is rollout/env/openenv.rs):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_sampler_names_none_of_its_callers() {
    let mut found = Vec::new();
    for caller in [
        "crate::rollout",
        "crate::gateway",
        "crate::tinker",
        "crate::rl",
    ] {
        found.extend(within("sampler", caller));
    }
    assert!(
        found.is_empty(),
        "sampler/ imports from a room that samples through it:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_engine_reaches_environments_through_their_seam() {
    let mut found = Vec::new();
    for needle in [
        "env::openenv",
        "env::tools",
        "env::plugin",
        "TriggerSession",
        "ToolsSession",
        "EnvironmentEpisode",
        "RemoteEpisode",
    ] {
        found.extend(under("rollout/engine/", needle));
    }
    assert!(
        found.is_empty(),
        "the rollout engine names an environment's own types (ask rollout/env/mod.rs, the seam):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_kernels_name_none_of_the_models_types() {
    let mut found = Vec::new();
    for needle in [
        "model::frozen",
        "model::lora",
        "model::nf4",
        "model::decoder",
    ] {
        found.extend(under("model/cpu/", needle));
    }
    assert!(
        found.is_empty(),
        "model/cpu/ names a model type (take it through cpu::frozen's traits):\n{}",
        found.join("\n")
    );
}

/// The scan sees what it is meant to: a room that does name the needle is found.
#[test]
fn the_scan_finds_what_is_there() {
    let found = crossings("crate::config", &["import_rules.rs"]);
    assert!(
        found
            .iter()
            .any(|l| l.starts_with("config/") || l.starts_with("cli/")),
        "{found:?}"
    );
    assert!(!within("rollout", "crate::openenv").is_empty());
    assert!(!under("rollout/env/", "RemoteEpisode").is_empty());
}

/// One name, one type: outside the protocol mirrors, no two crate-visible types share a
/// name, so that a reader (and an import) never has to ask which `Batch` this is.
#[test]
fn each_visible_type_is_named_once() {
    let mut by_name: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for (name, at) in visible_types() {
        by_name.entry(name).or_default().push(at);
    }
    let twice: Vec<String> = by_name
        .iter()
        .filter(|(_, at)| at.len() > 1)
        .map(|(name, at)| format!("{name}: {}", at.join(", ")))
        .collect();
    assert!(
        twice.is_empty(),
        "types defined under one name twice (name each for what it holds):\n{}",
        twice.join("\n")
    );
}

/// The type scan sees what it is meant to: types of every kind and visibility are found,
/// and a mirror's are left out.
#[test]
fn the_type_scan_finds_what_is_there() {
    let types = visible_types();
    let found = |name: &str| types.iter().any(|(n, _)| n == name);
    assert!(found("Trajectory") && found("Sampling") && found("KvPool") && found("Refusal"));
    assert!(
        !types
            .iter()
            .any(|(_, at)| at.starts_with("gateway/wire.rs"))
    );
}

/// The house's floors, from the ground up (docs/src/layout.md): a room may name the rooms
/// on the floors below its own, and no other. A room is a folder under `host/src`, or a
/// file at its root (without `.rs`).
const FLOORS: &[&[&str]] = &[
    &["task", "step", "rng", "progress", "front"],
    &["model"],
    &["plugin", "sampler"],
    &["openenv", "data"],
    &["rollout"],
    &["status", "gateway"],
    &["rl"],
    &["tinker", "builtin"],
    &["config"],
    &["cli"],
    &["main"],
];

fn floor_of(room: &str) -> Option<usize> {
    FLOORS.iter().position(|f| f.contains(&room))
}

/// The rooms a source text names through `crate::` (`crate::rollout::…` and the names of
/// a `crate::{…}` group), comment lines and the inline tests left out: a test may check a
/// room against a reference above it (a kernel's against the composed optimizer step).
fn rooms_named(text: &str) -> Vec<String> {
    let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or(text);
    let code: String = code
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // The group's top-level names: `{a, b::c, d::{e, f}}` names a, b and d.
            let (mut depth, mut start) = (0usize, true);
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if start && !c.is_whitespace() => {
                        start = false;
                        out.push(ident(&group[i..]));
                    }
                    _ => {}
                }
            }
        } else {
            out.push(ident(rest));
        }
    }
    out.sort();
    out.dedup();
    out
}

#[test]
fn nothing_imports_back_up() {
    let mut found = Vec::new();
    for (rel, text) in sources() {
        let room = room(&rel).trim_end_matches(".rs").to_string();
        if room == "lib" || room == "import_rules" {
            continue;
        }
        let Some(own) = floor_of(&room) else {
            found.push(format!(
                "{rel}: room `{room}` is on no floor (add it to FLOORS and layout.md)"
            ));
            continue;
        };
        for named in rooms_named(&text) {
            if named == room {
                continue;
            }
            match floor_of(&named) {
                Some(f) if f < own => {}
                Some(_) => found.push(format!("{rel} names crate::{named}, on its floor or above")),
                None => {}
            }
        }
    }
    assert!(
        found.is_empty(),
        "imports that run back up or across a floor (move what is shared below both):\n{}",
        found.join("\n")
    );
}

/// The floor check reads what it is meant to: plain paths and groups, nested or not.
#[test]
fn the_floor_check_reads_paths_and_groups() {
    let text = "use crate::model::Model;\nuse crate::{rollout, sampler::{Held, Request}, task::Sample};\n// crate::config\nlet x = crate::rng::SplitMix64::new(1);\n#[cfg(test)]\nmod tests {\nuse crate::cli;\n}";
    assert_eq!(
        rooms_named(text),
        ["model", "rng", "rollout", "sampler", "task"]
    );
    assert!(floor_of("rollout") > floor_of("sampler"));
}
