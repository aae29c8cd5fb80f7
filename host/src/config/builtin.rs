//! The built-in runs: what `rlhost train`, `eval` and `rollout` do without `--config`.
//!
//! Each is a config from `configs/` compiled into the binary, with a built-in model
//! (`builtin:NAME`) and its task plugin. With no `--plugin` the default is the calculator
//! run (`configs/multiply.toml`). A `--plugin` that is a trigger picks the first run whose
//! task has a reference call the tool answers (the code task for the Python tool, the
//! multiply task for the calculator), the same test the warm start uses to write traces in
//! the tool's style. A `--plugin` of functions (the tools role) picks the first run with
//! `rollout.tools` whose task's reference calls name only its functions, with arguments
//! their schemas accept (the units task for `units.wasm`). The task plugins are found beside the `--plugin` files or in the
//! [`installed_dirs`]: `$RLHOST_PLUGIN_DIR`, `plugins/dist/` here, an installed prefix's
//! `share/rlhost/plugins/`, the user's data folder, the checkout the binary was built in.

use super::{LoadedConfig, RunConfig};
use crate::builtin::{answered_style, calls_functions};
use crate::plugin::{Plugin, PluginRuntime, PluginSpec, Role, RuntimeOptions, cache};
use crate::rollout::env::tools::Catalogue;
use crate::rollout::tool_calls::CallFormat;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};

/// A config compiled into the binary.
pub struct BuiltinRun {
    pub name: &'static str,
    toml: &'static str,
}

pub const MULTIPLY: BuiltinRun = BuiltinRun {
    name: "multiply",
    toml: include_str!("../../../configs/multiply.toml"),
};

pub const CODE: BuiltinRun = BuiltinRun {
    name: "code",
    toml: include_str!("../../../configs/code.toml"),
};

pub const UNITS: BuiltinRun = BuiltinRun {
    name: "units",
    toml: include_str!("../../../configs/units.toml"),
};

/// The built-in run whose model is `builtin:NAME` (each recipe has the run of its name).
pub fn run_of(name: &str) -> Option<&'static BuiltinRun> {
    [&MULTIPLY, &CODE, &UNITS]
        .into_iter()
        .find(|r| r.name == name)
}

/// The folder of the built-in model `recipe` as its built-in run with `seed` builds it (or
/// finds it in the cache): the model `rlhost train` of that run starts from with that seed.
/// For the commands whose own data is not the run's task (`rlhost dpo`, `rlhost rm`).
pub fn build_model(
    recipe: &crate::builtin::Recipe,
    seed: u64,
    handle: &tokio::runtime::Handle,
    quiet: bool,
) -> Result<PathBuf> {
    let run =
        run_of(recipe.name).with_context(|| format!("no built-in run builds {}", recipe.name))?;
    let loaded = run.load(&[], &[format!("run.seed={seed}")])?;
    let opened = super::setup::Opened::open(loaded, &[], handle)?;
    opened.build(recipe, handle, quiet)
}

/// The run without `--config` and without a tool among the `--plugin` files.
pub const DEFAULT: &BuiltinRun = &MULTIPLY;

/// The runs a `--plugin` tool may pick, in the order they are tried.
pub const BY_TOOL: [&BuiltinRun; 3] = [&CODE, &MULTIPLY, &UNITS];

impl BuiltinRun {
    /// The run's config with `overrides` applied, its plugins pointed at the files found
    /// on this machine (see the module's header), writing to `runs/NAME` unless
    /// `run.out_dir` is set.
    pub fn load(&self, extra_plugins: &[PathBuf], overrides: &[String]) -> Result<LoadedConfig> {
        let label = PathBuf::from(format!("configs/{}.toml (built in)", self.name));
        let dirs = plugin_dirs(extra_plugins);
        LoadedConfig::from_text(
            self.toml,
            &label,
            Path::new("."),
            overrides,
            |c: &mut RunConfig| {
                if c.run.out_dir.is_none() {
                    c.run.out_dir = Some(Path::new("runs").join(self.name));
                }
                for (name, section) in &mut c.plugins {
                    let file = section
                        .path
                        .file_name()
                        .context("a built-in plugin path has a file name")?
                        .to_owned();
                    section.path = dirs
                        .iter()
                        .map(|d| d.join(&file))
                        .find(|p| p.is_file())
                        .with_context(|| {
                            format!(
                                "the built-in `{}` run needs its plugin `{name}` ({}), which is in none of: {}; build the plugins with `bash plugins/build.sh` (a checkout), install them with `bash scripts/install.sh`, or set RLHOST_PLUGIN_DIR to the folder that holds them",
                                self.name,
                                file.to_string_lossy(),
                                dirs.iter()
                                    .map(|d| d.display().to_string())
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            )
                        })?;
                }
                Ok(())
            },
        )
    }
}

/// Where the built-in runs' plugins are looked for, in this order: beside the `--plugin`
/// files, then the [`installed_dirs`].
fn plugin_dirs(extra_plugins: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = extra_plugins
        .iter()
        .filter_map(|p| p.parent())
        .map(|p| {
            if p.as_os_str().is_empty() {
                PathBuf::from(".")
            } else {
                p.to_path_buf()
            }
        })
        .collect();
    dirs.extend(installed_dirs());
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| seen.insert(d.canonicalize().unwrap_or_else(|_| d.clone())));
    dirs
}

/// Where plugins are found by file name alone (the built-in runs' task plugins, and a
/// `--plugin NAME.wasm` that is not a path here), in this order:
/// - `$RLHOST_PLUGIN_DIR`;
/// - `plugins/dist/` under the current folder (a checkout);
/// - `share/rlhost/plugins/` beside the binary's `bin/` (`scripts/install.sh --root
///   PREFIX`, as `cargo install --root PREFIX` lays a prefix out);
/// - `$XDG_DATA_HOME/rlhost/plugins/` (default `~/.local/share/rlhost/plugins/`, where
///   `scripts/install.sh` puts them);
/// - the `plugins/dist/` of the checkout the binary was built in, if it is still there.
pub fn installed_dirs() -> Vec<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
    let mut dirs = Vec::new();
    if let Some(dir) = var("RLHOST_PLUGIN_DIR") {
        dirs.push(PathBuf::from(dir));
    }
    dirs.push(PathBuf::from("plugins/dist"));
    if let Some(prefix) = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.to_path_buf()))
    {
        dirs.push(prefix.join("share/rlhost/plugins"));
    }
    if let Some(data) = var("XDG_DATA_HOME") {
        dirs.push(PathBuf::from(data).join("rlhost/plugins"));
    } else if let Some(home) = var("HOME") {
        dirs.push(PathBuf::from(home).join(".local/share/rlhost/plugins"));
    }
    dirs.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/dist"));
    dirs
}

/// A `--plugin` argument as a file: the path when it is one, else (a bare file name, as
/// `--plugin code_trigger.wasm` from any folder) the first of the [`installed_dirs`] that
/// holds it. An error names every place looked in.
pub fn plugin_file(arg: &str) -> std::result::Result<PathBuf, String> {
    let path = PathBuf::from(arg);
    let bare = path.components().count() == 1;
    if path.exists() || !bare {
        return Ok(path);
    }
    let dirs = installed_dirs();
    dirs.iter()
        .map(|d| d.join(&path))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            format!(
                "no file {arg} here, nor in {}; build the plugins with `bash plugins/build.sh` or install them with `bash scripts/install.sh`",
                dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
            )
        })
}

/// The built-in run for these `--plugin` files: the default without a tool among them,
/// else the first of [`BY_TOOL`] whose task's reference calls the tool answers.
pub async fn choose(extra_plugins: &[PathBuf], overrides: &[String]) -> Result<LoadedConfig> {
    let runtime = probe_runtime()?;
    let tool = load_all(&runtime, extra_plugins)
        .await?
        .into_iter()
        .rfind(|p| p.roles().contains(&Role::Trigger) || p.roles().contains(&Role::Tools));
    let Some(tool) = tool else {
        return DEFAULT.load(extra_plugins, overrides);
    };
    let functions = tool.roles().contains(&Role::Tools);
    let mut tried = Vec::new();
    for run in BY_TOOL {
        let loaded = run.load(extra_plugins, overrides)?;
        let c = &loaded.config;
        if functions == c.rollout.tools.is_empty() {
            continue;
        }
        let task = c
            .data
            .plugin
            .as_ref()
            .context("a built-in run's data comes from its task plugin")?;
        let data = load(&runtime, &loaded.resolve(&c.plugins[task].path)).await?;
        let mut source = data
            .open_dataset(&c.data.plugin_config.to_string(), c.run.seed)
            .await
            .with_context(|| format!("opening the built-in `{}` run's task", run.name))?;
        let sample = source
            .get(0)
            .await
            .map_err(|f| anyhow::anyhow!("the built-in `{}` run's task: {f}", run.name))?;
        if functions {
            let spec = crate::rollout::ToolSpec {
                plugin: tool.clone(),
                config: "{}".into(),
            };
            let catalogue = Catalogue::open(vec![(tool.name().to_string(), spec)])
                .await
                .with_context(|| format!("--plugin {}", tool.spec().path.display()))?;
            if calls_functions(&catalogue.functions, CallFormat::Hermes, &sample)? {
                return Ok(loaded);
            }
            tried.push(format!(
                "`{}` (task {task}, whose reference calls name functions `{}` does not offer)",
                run.name,
                tool.name()
            ));
            continue;
        }
        let spec = crate::rollout::ToolSpec {
            plugin: tool.clone(),
            config: c.rollout.trigger_config.to_string(),
        };
        match answered_style(&spec, &sample).await? {
            (Some(_), _) => return Ok(loaded),
            (None, styles) => tried.push(format!(
                "`{}` (task {task}, reference calls in styles {styles})",
                run.name
            )),
        }
    }
    bail!(
        "no built-in run can use the tool `{}` ({}): it answers none of the reference calls of {}; write a run config whose task suits this tool and pass it with --config",
        tool.name(),
        tool.spec().path.display(),
        tried.join(" or ")
    )
}

/// The `--plugin` files loaded with the default sandbox, in order, to ask what they are
/// (name, roles) before a config is made for them; an error names the file.
pub async fn probe(paths: &[PathBuf]) -> Result<Vec<Plugin>> {
    load_all(&probe_runtime()?, paths).await
}

/// A runtime for plugins loaded only to be asked what they are (and, here, to try a tool
/// on a task), with the user's compile cache.
fn probe_runtime() -> Result<std::sync::Arc<PluginRuntime>> {
    PluginRuntime::new(&RuntimeOptions {
        cache_dir: cache::default_dir(),
        ..RuntimeOptions::default()
    })
}

async fn load_all(
    runtime: &std::sync::Arc<PluginRuntime>,
    paths: &[PathBuf],
) -> Result<Vec<Plugin>> {
    let mut plugins = Vec::with_capacity(paths.len());
    for path in paths {
        let plugin = load(runtime, path)
            .await
            .with_context(|| format!("--plugin {}", path.display()))?;
        plugins.push(plugin);
    }
    Ok(plugins)
}

async fn load(runtime: &std::sync::Arc<PluginRuntime>, path: &Path) -> Result<Plugin> {
    runtime
        .load(PluginSpec {
            path: path.to_path_buf(),
            limits: Default::default(),
            grants: Default::default(),
        })
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtin_configs_parse_and_write_under_runs() {
        // The plugins may not be built in a unit test's checkout: point the lookup at a
        // folder holding empty stand-ins (only the paths are checked here).
        let dir = std::env::temp_dir().join(format!("rlhost-builtin-runs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in [
            "multiply.wasm",
            "code_task.wasm",
            "code_trigger.wasm",
            "units_task.wasm",
            "units.wasm",
        ] {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        let probe = dir.join("code_trigger.wasm");
        for run in BY_TOOL {
            let loaded = run.load(std::slice::from_ref(&probe), &[]).unwrap();
            let c = &loaded.config;
            assert_eq!(
                c.run.out_dir.as_deref(),
                Some(Path::new("runs").join(run.name).as_path())
            );
            assert_eq!(c.model.path, PathBuf::from(format!("builtin:{}", run.name)));
            assert!(c.plugins.values().all(|p| p.path.starts_with(&dir)));
            let over = run
                .load(std::slice::from_ref(&probe), &["train.steps=3".into()])
                .unwrap();
            assert_eq!(over.config.train.steps, 3);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
