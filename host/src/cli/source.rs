//! The run a command names and its opening: [`RunSource`] (`--config`, `--plugin` and
//! `--set`, as `train`, `rollout`, `eval`, `serve` and `config show` take them), the config
//! it loads ([`load_config`]), and the run it opens ([`open_run`]: plugins, data, the
//! built-in model when one is named, the model).

/// The run config a command uses, as `train`, `rollout`, `eval` and `config show` take it.
#[derive(Debug, clap::Args)]
pub struct RunSource {
    /// The run config (TOML). Without it, a built-in run: the calculator task, or the
    /// task that suits the --plugin tool (the code task for the Python tool).
    #[arg(long)]
    pub config: Option<std::path::PathBuf>,
    /// A plugin component to load; a trigger or environment replaces the config's. A bare
    /// name is looked for where installed plugins are.
    #[arg(long = "plugin", value_name = "FILE.wasm", value_parser = crate::config::builtin::plugin_file)]
    pub plugins: Vec<std::path::PathBuf>,
    /// Override a config value, e.g. --set train.steps=20 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub set: Vec<String>,
}

/// The run config: `--config`'s file, or the built-in run the `--plugin` files call for.
pub fn load_config(
    config: Option<&std::path::Path>,
    plugins: &[std::path::PathBuf],
    overrides: &[String],
    handle: &tokio::runtime::Handle,
) -> anyhow::Result<crate::config::LoadedConfig> {
    match config {
        Some(path) => crate::config::LoadedConfig::load(path, overrides),
        None => handle.block_on(crate::config::builtin::choose(plugins, overrides)),
    }
}

/// Opens what `loaded` names (plugins, tools, rewards, data), builds the built-in model
/// when `model.path` names one (after `before_build`: it is the slow part), and loads the
/// model.
pub fn open_run(
    loaded: crate::config::LoadedConfig,
    plugins: &[std::path::PathBuf],
    handle: &tokio::runtime::Handle,
    quiet: bool,
    before_build: &dyn Fn(),
) -> anyhow::Result<crate::config::setup::Setup> {
    let opened = crate::config::setup::Opened::open(loaded, plugins, handle)?;
    let built = match opened.builtin()? {
        Some(recipe) => {
            before_build();
            Some(opened.build(recipe, handle, quiet)?)
        }
        None => None,
    };
    opened.with_model(built.as_deref())
}
