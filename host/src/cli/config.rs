//! `rlhost config reference` (every key of a run config: type, default, range, what it
//! does, generated from the config types) and `rlhost config show` (the config a run would
//! use, defaults filled in).

use crate::config::reference;
use anyhow::{Context, Result};
use clap::{Args, Subcommand};

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Every key of a run config: its type, default, allowed range and what it does.
    Reference(ReferenceArgs),
    /// The config a run would use: the file (or the built-in run) with --set applied and
    /// every default filled in, as TOML.
    Show(ShowArgs),
}

#[derive(Debug, Args)]
pub struct ReferenceArgs {
    /// Markdown tables, as the book includes them.
    #[arg(long)]
    markdown: bool,
}

#[derive(Debug, Args)]
pub struct ShowArgs {
    #[command(flatten)]
    source: super::source::RunSource,
}

pub fn run(command: ConfigCommand, handle: &tokio::runtime::Handle) -> Result<()> {
    match command {
        ConfigCommand::Reference(args) => {
            let entries = reference::entries();
            if args.markdown {
                print!("{}", reference::markdown(&entries));
            } else {
                print!("{}", reference::text(&entries));
            }
            Ok(())
        }
        ConfigCommand::Show(args) => {
            let loaded = super::source::load_config(
                args.source.config.as_deref(),
                &args.source.plugins,
                &args.source.set,
                handle,
            )?;
            let text = toml::to_string(&loaded.config).context("writing the config as TOML")?;
            println!(
                "# The config a run would use: {} with every default filled in.\n# Relative paths start at {}.\n",
                loaded.path.display(),
                loaded.base_dir.display()
            );
            print!("{text}");
            Ok(())
        }
    }
}
