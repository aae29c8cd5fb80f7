//! `rlhost plugin new`: a plugin project in Rust, Python, JavaScript or C for one role,
//! that builds at once with the command its README gives and passes `rlhost plugin test`
//! unchanged.
//!
//! Each role has one small working example, the same in every language (a trigger that
//! upper-cases `<shout>…</shout>`, a three-turn environment, addition problems, an
//! `<answer>` reward, functions `add` and `tally`), so that an author starts from a plugin
//! that keeps the contract and changes what it does. The templates are the files beside
//! this one, with `{{name}}`-style holes; Python, JavaScript and C projects get a copy of
//! the contract (`wit/`), and C ones its bindings, generated here by wit-bindgen's C
//! generator.

use super::Role;
use super::bindings::SUPPORTED;
use anyhow::{Context, Result, bail};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// The languages a plugin project can be made in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lang {
    Rust,
    Python,
    Js,
    C,
}

impl Lang {
    pub const ALL: [Lang; 4] = [Lang::Rust, Lang::Python, Lang::Js, Lang::C];

    pub fn as_str(self) -> &'static str {
        match self {
            Lang::Rust => "rust",
            Lang::Python => "python",
            Lang::Js => "js",
            Lang::C => "c",
        }
    }
}

impl fmt::Display for Lang {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Lang {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Lang::ALL
            .into_iter()
            .find(|l| l.as_str() == s)
            .ok_or_else(|| format!("unknown language `{s}`: expected rust, python, js or c"))
    }
}

/// What to make.
#[derive(Debug, Clone)]
pub struct Spec {
    /// The plugin's name: the folder, the package and the name it reports.
    pub name: String,
    pub lang: Lang,
    pub role: Role,
    /// The folder the project folder is made in.
    pub parent: PathBuf,
    /// Rust: the `rlhost-sdk` crate to depend on (by path).
    pub sdk: Option<PathBuf>,
}

/// The contract the projects are built against: the newest supported version (the first
/// of [`SUPPORTED`]); `WIT` is its folder (a test checks that they agree).
const WIT_VERSION: &str = SUPPORTED[0];
const WIT: [(&str, &str); 3] = [
    (
        "roles.wit",
        include_str!("../../../../wit/v0.2.0/roles.wit"),
    ),
    (
        "types.wit",
        include_str!("../../../../wit/v0.2.0/types.wit"),
    ),
    (
        "worlds.wit",
        include_str!("../../../../wit/v0.2.0/worlds.wit"),
    ),
];

/// A project made.
#[derive(Debug, Clone)]
pub struct Made {
    pub dir: PathBuf,
    /// The command that builds it, run in `dir` (its README says the same).
    pub build: String,
    /// Where the build writes the component, relative to `dir`.
    pub component: String,
}

/// Makes the project. Nothing is written when it fails, and an existing folder is never
/// touched.
pub fn create(request: &Spec) -> Result<Made> {
    check_name(&request.name)?;
    let dir = request.parent.join(&request.name);
    if dir.exists() {
        bail!(
            "{} exists already: choose another name or folder (nothing was written)",
            dir.display()
        );
    }
    let files = files(request)?;
    // Written beside the destination, then renamed: a failure leaves no half project.
    let staging = request
        .parent
        .join(format!(".{}.new-{}", request.name, std::process::id()));
    let written = write_all(&staging, &files, request);
    let result = written.and_then(|()| {
        std::fs::rename(&staging, &dir)
            .with_context(|| format!("cannot move the new project to {}", dir.display()))
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    result.map(|()| Made {
        dir,
        build: build_command(request.lang, request.role, &request.name),
        component: component(request.lang, &request.name),
    })
}

/// The one command that builds a project.
fn build_command(lang: Lang, role: Role, name: &str) -> String {
    match lang {
        Lang::Rust => "cargo build --release".into(),
        Lang::Python => {
            format!("componentize-py -d wit -w {role}-plugin componentize app -o {name}.wasm")
        }
        Lang::Js | Lang::C => "npm install && npm run build".into(),
    }
}

/// Where the build writes the component, relative to the project.
fn component(lang: Lang, name: &str) -> String {
    match lang {
        Lang::Rust => format!("target/wasm32-wasip2/release/{name}.wasm"),
        _ => format!("{name}.wasm"),
    }
}

fn write_all(staging: &Path, files: &[(String, String)], request: &Spec) -> Result<()> {
    for (path, text) in files {
        let path = staging.join(path);
        std::fs::create_dir_all(path.parent().expect("a file in the project"))
            .with_context(|| format!("cannot create {}", path.display()))?;
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if request.lang == Lang::C {
        c_bindings(
            &staging.join("wit"),
            request.role,
            &staging.join("bindings"),
        )?;
    }
    Ok(())
}

/// A name that is a Rust crate, a Python module, a C identifier and an npm package.
fn check_name(name: &str) -> Result<()> {
    let mut chars = name.chars();
    let ok = chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && name.len() <= 64;
    if !ok {
        bail!(
            "plugin name `{name}`: use 1 to 64 lowercase letters, digits and `_`, starting with a letter (it names the package, the module and the component)"
        );
    }
    Ok(())
}

/// The project's files, holes filled (C bindings come after, from the written `wit/`).
fn files(request: &Spec) -> Result<Vec<(String, String)>> {
    let role = request.role;
    let mut files: Vec<(String, String)> = Vec::new();
    let mut add = |path: String, template: &str| files.push((path, template.to_string()));
    match request.lang {
        Lang::Rust => {
            add("Cargo.toml".into(), include_str!("rust/Cargo.toml"));
            add(
                ".cargo/config.toml".into(),
                include_str!("rust/.cargo/config.toml"),
            );
            add("README.md".into(), include_str!("rust/README.md"));
            add("src/lib.rs".into(), pick(role, RUST));
            add(".gitignore".into(), "/target\n");
        }
        Lang::Python => {
            add("app.py".into(), include_str!("python/app.py"));
            add(format!("{role}.py"), pick(role, PYTHON));
            add("README.md".into(), include_str!("python/README.md"));
            add(".gitignore".into(), "__pycache__/\n*.wasm\n");
        }
        Lang::Js => {
            let app = format!("{}{}", pick(role, JS), include_str!("js/common.js"));
            add("app.js".into(), &app);
            add("package.json".into(), include_str!("js/package.json"));
            add("README.md".into(), include_str!("js/README.md"));
            add(".gitignore".into(), "node_modules/\n*.wasm\n");
        }
        Lang::C => {
            let source = format!("{}{}", pick(role, C), include_str!("c/common.c"));
            add(format!("{}.c", request.name), &source);
            add("package.json".into(), include_str!("c/package.json"));
            add("README.md".into(), include_str!("c/README.md"));
            add(".gitignore".into(), "node_modules/\nbuild/\n*.wasm\n");
        }
    }
    if request.lang != Lang::Rust {
        for (file, text) in WIT {
            files.push((format!("wit/{file}"), text.to_string()));
        }
    }
    let sdk = match request.lang {
        Lang::Rust => sdk_path(request.sdk.as_deref())?,
        _ => String::new(),
    };
    let holes = [
        ("{{name}}", request.name.clone()),
        ("{{role}}", role.to_string()),
        ("{{world}}", format!("{role}_plugin")),
        ("{{description}}", description(role).to_string()),
        ("{{call_example}}", call_example(role).to_string()),
        ("{{wit_version}}", WIT_VERSION.to_string()),
        ("{{sdk}}", sdk),
        (
            "{{build}}",
            build_command(request.lang, role, &request.name),
        ),
        ("{{component}}", component(request.lang, &request.name)),
    ];
    Ok(files
        .into_iter()
        .map(|(path, text)| {
            let text = if path.starts_with("wit/") {
                text
            } else {
                holes
                    .iter()
                    .fold(text, |text, (hole, value)| text.replace(hole, value))
            };
            (path, text)
        })
        .collect())
}

/// Templates per role, in `Role::ALL`'s order.
type Templates = [&'static str; Role::ALL.len()];

const RUST: Templates = [
    include_str!("rust/trigger.rs"),
    include_str!("rust/environment.rs"),
    include_str!("rust/dataset.rs"),
    include_str!("rust/reward.rs"),
    include_str!("rust/tools.rs"),
];
const PYTHON: Templates = [
    include_str!("python/trigger.py"),
    include_str!("python/environment.py"),
    include_str!("python/dataset.py"),
    include_str!("python/reward.py"),
    include_str!("python/tools.py"),
];
const JS: Templates = [
    include_str!("js/trigger.js"),
    include_str!("js/environment.js"),
    include_str!("js/dataset.js"),
    include_str!("js/reward.js"),
    include_str!("js/tools.js"),
];
const C: Templates = [
    include_str!("c/trigger.c"),
    include_str!("c/environment.c"),
    include_str!("c/dataset.c"),
    include_str!("c/reward.c"),
    include_str!("c/tools.c"),
];

fn pick(role: Role, templates: Templates) -> &'static str {
    let i = Role::ALL
        .iter()
        .position(|r| *r == role)
        .expect("every role is in Role::ALL");
    templates[i]
}

fn description(role: Role) -> &'static str {
    match role {
        Role::Trigger => "A tool the model calls: upper-cases <shout>...</shout>",
        Role::Environment => "A three-turn conversation that rewards saying done",
        Role::Dataset => "Addition problems with their answers",
        Role::Reward => "format and correct components for <answer>...</answer>",
        Role::Tools => "Functions the model calls: add two integers, keep a running tally",
    }
}

fn call_example(role: Role) -> &'static str {
    match role {
        Role::Trigger => "--text 'say <shout>hello</shout>'",
        Role::Environment => "--text 'one' --text 'two' --text 'done'",
        Role::Dataset => "--index 0",
        Role::Reward => "--prompt 'What is 2 + 2?' --text '<answer>4</answer>'",
        Role::Tools => {
            "--call 'add:{\"a\": 2, \"b\": 3}' --call 'tally:{\"amount\": 5}' --call 'tally:{\"amount\": 7}'"
        }
    }
}

/// The `rlhost-sdk` folder a Rust project depends on: the one given, else the one of the
/// checkout this binary was built from, if it is still there.
fn sdk_path(given: Option<&Path>) -> Result<String> {
    let built_from = Path::new(env!("CARGO_MANIFEST_DIR")).join("../sdk");
    let sdk = given.map_or(built_from, Path::to_path_buf);
    if !sdk.join("Cargo.toml").is_file() {
        bail!(
            "the rlhost-sdk crate is not at {} (a Rust plugin depends on it by path; it is not on crates.io): pass --sdk with the `sdk` folder of an rlhost checkout",
            sdk.display()
        );
    }
    let sdk = sdk
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", sdk.display()))?;
    // TOML strings: forward slashes work on every platform and need no escapes.
    Ok(sdk.display().to_string().replace('\\', "/"))
}

/// Writes the C bindings of `role`'s world of the contract in `wit` into `out`:
/// `ROLE_plugin.h`, `ROLE_plugin.c` and `ROLE_plugin_component_type.o` (the component type
/// that turns the compiled module into a component).
pub fn c_bindings(wit: &Path, role: Role, out: &Path) -> Result<()> {
    use wit_bindgen_core::wit_parser::Resolve;
    let mut resolve = Resolve::default();
    let (package, _) = resolve
        .push_dir(wit)
        .with_context(|| format!("cannot read the WIT package in {}", wit.display()))?;
    let world = resolve.select_world(&[package], Some(&format!("{role}-plugin")))?;
    let mut files = wit_bindgen_core::Files::default();
    wit_bindgen_c::Opts::default()
        .build()
        .generate(&mut resolve, world, &mut files)?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    for (name, bytes) in files.iter() {
        let path = out.join(name);
        std::fs::write(&path, bytes).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("rlhost-scaffold-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn every_language_and_role_fills_every_hole() {
        let parent = temp("holes");
        for lang in Lang::ALL {
            for role in Role::ALL {
                let name = format!("p_{lang}_{role}");
                let request = Spec {
                    name: name.clone(),
                    lang,
                    role,
                    parent: parent.clone(),
                    sdk: None,
                };
                let made = create(&request).unwrap();
                let dir = made.dir;
                for entry in walk(&dir) {
                    if entry.extension().is_some_and(|e| e == "o") {
                        continue;
                    }
                    let text = std::fs::read_to_string(&entry).unwrap();
                    assert!(
                        !text.contains("{{"),
                        "{}: an unfilled hole",
                        entry.display()
                    );
                }
                let readme = std::fs::read_to_string(dir.join("README.md")).unwrap();
                assert!(
                    readme.contains(&format!("```sh\n{}\n```", made.build))
                        && readme.contains(&format!("rlhost plugin test {}", made.component)),
                    "{readme}"
                );
            }
        }
        std::fs::remove_dir_all(parent).unwrap();
    }

    fn walk(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                out.extend(walk(&path));
            } else {
                out.push(path);
            }
        }
        out
    }

    #[test]
    fn a_taken_name_or_a_bad_one_is_an_error_and_nothing_is_written() {
        let parent = temp("taken");
        std::fs::create_dir(parent.join("mine")).unwrap();
        std::fs::write(parent.join("mine/keep.txt"), "mine").unwrap();
        let request = |name: &str| Spec {
            name: name.into(),
            lang: Lang::Python,
            role: Role::Reward,
            parent: parent.clone(),
            sdk: None,
        };
        let err = create(&request("mine")).unwrap_err().to_string();
        assert!(err.contains("exists already"), "{err}");
        assert_eq!(
            std::fs::read_to_string(parent.join("mine/keep.txt")).unwrap(),
            "mine"
        );
        for bad in ["My-Plugin", "9lives", "", "a.b"] {
            let err = create(&request(bad)).unwrap_err().to_string();
            assert!(err.contains("lowercase letters"), "{bad}: {err}");
        }
        let names: Vec<_> = std::fs::read_dir(&parent).unwrap().collect();
        assert_eq!(names.len(), 1, "only `mine`: {names:?}");
        assert_eq!(
            "cobol".parse::<Lang>().unwrap_err(),
            "unknown language `cobol`: expected rust, python, js or c"
        );
        std::fs::remove_dir_all(parent).unwrap();
    }

    /// The projects' `wit/` is the version they say they target.
    #[test]
    fn the_wit_copied_is_the_newest_supported() {
        for (file, text) in WIT {
            assert!(
                text.contains(&format!("package rlhost:plugin@{WIT_VERSION};")),
                "{file} is not rlhost:plugin@{WIT_VERSION}"
            );
        }
    }

    /// The C plugin in `plugins/c_reward` builds with bindings made by this generator:
    /// they must be what it makes from today's `wit/`.
    #[test]
    fn the_c_example_plugins_bindings_are_current() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let out = temp("bindings");
        c_bindings(&root.join("wit/v0.1.0"), Role::Reward, &out).unwrap();
        let committed = root.join("plugins/c_reward/bindings");
        for name in [
            "reward_plugin.h",
            "reward_plugin.c",
            "reward_plugin_component_type.o",
        ] {
            assert!(
                std::fs::read(out.join(name)).unwrap()
                    == std::fs::read(committed.join(name)).unwrap(),
                "plugins/c_reward/bindings/{name} is stale: regenerate it with `rlhost plugin new x --lang c --role reward` and copy its bindings/"
            );
        }
        std::fs::remove_dir_all(out).unwrap();
    }
}
