//! A small `builtin:units` model for benchmarks that compare runs on one model: the units
//! recipe's shape warm-started on a tenth of its conversations, `add_days` problems only,
//! the real `units` plugin answering the traces' calls (as the integration tests build
//! it). Prints the model's folder.
//!
//! ```sh
//! cargo run --example units_model -- CACHE_DIR [PLUGINS_DIR]   # PLUGINS_DIR: plugins/dist
//! ```
//!
//! `bench/openenv_learning.sh` trains it in process and through OpenEnv.

use anyhow::{Context, Result};
use rlhost::builtin::{Inputs, Recipe, UNITS, ensure};
use rlhost::data::{DataConfig, Dataset};
use rlhost::plugin::{Limits, PluginRuntime, PluginSpec, RuntimeOptions};
use rlhost::rollout::ToolSpec;
use rlhost::rollout::env::tools::Catalogue;
use std::path::{Path, PathBuf};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let cache = PathBuf::from(
        args.next()
            .context("usage: units_model CACHE_DIR [PLUGINS_DIR]")?,
    );
    let plugins = PathBuf::from(args.next().unwrap_or_else(|| "plugins/dist".into()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let runtime = PluginRuntime::new(&RuntimeOptions::default())?;
    let load = |name: &str| {
        let path = plugins.join(format!("{name}.wasm"));
        rt.block_on(runtime.load(PluginSpec {
            path: path.clone(),
            limits: Limits::default(),
            grants: Default::default(),
        }))
        .with_context(|| format!("loading {}", path.display()))
    };
    let task = load("units_task")?;
    let units = ToolSpec {
        plugin: load("units")?,
        config: "{}".into(),
    };
    let data = DataConfig {
        plugin: Some("units_task".into()),
        plugin_config: serde_json::json!({"kinds": ["add_days"]}),
        eval_size: Some(0),
        ..DataConfig::default()
    };
    let dataset = rt.block_on(Dataset::open(&data, Path::new("."), Some(&task), 1))?;
    let catalogue = rt.block_on(Catalogue::open(vec![("units".into(), units)]))?;
    let recipe = Recipe {
        sft_examples: 1536,
        sft_epochs: 4,
        sft_batch: 16,
        // One pass and no bar: this small model's outcomes were measured without one.
        bar: None,
        ..UNITS
    };
    let inputs = Inputs {
        dataset: &dataset,
        task: "units_task",
        trigger: None,
        tools: Some(&catalogue),
        seed: 1,
    };
    let dir = ensure(&recipe, &inputs, rt.handle(), &cache, true)?;
    println!("{}", dir.display());
    Ok(())
}
