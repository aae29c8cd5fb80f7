//! `rlhost env serve`: an environment or tools plugin served under OpenEnv's API.

use super::plugin::SandboxArgs;
use crate::openenv::{self, ServeOptions, Served};
use anyhow::{Result, bail};
use clap::{Args, Subcommand};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Subcommand)]
pub enum EnvCommand {
    /// Serve an environment or tools plugin under the OpenEnv API (HTTP and `/ws`
    /// sessions, `/mcp`), one sandboxed episode per session.
    Serve(EnvServeArgs),
}

#[derive(Debug, Args)]
pub struct EnvServeArgs {
    /// The plugin component (.wasm); a bare name is looked for where installed plugins are.
    #[arg(value_parser = crate::config::builtin::plugin_file)]
    file: PathBuf,
    /// The plugin's configuration, as JSON.
    #[arg(long, default_value = "{}")]
    config: String,
    /// Samples episodes start from: a JSONL file of {"messages": [...], "metadata": {...}}.
    /// Default: the plugin's own dataset when it has one, else an empty prompt.
    #[arg(long)]
    data: Option<PathBuf>,
    /// The address to listen on. Anything but loopback lets other machines run the
    /// plugin's episodes: there is no authentication.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// The port (0 picks a free one and prints it).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Sessions open at once; a session beyond them is refused (CAPACITY_REACHED).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    max_sessions: u32,
    /// Seconds a session may go without a message before it is closed.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    idle_timeout_s: u64,
    /// The largest message (a `/ws` message or an HTTP body) a client may send, in MiB.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1024))]
    max_message_mib: u32,
    /// The seed the plugin's dataset is opened with.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    sandbox: SandboxArgs,
}

pub async fn run(command: EnvCommand) -> Result<()> {
    match command {
        EnvCommand::Serve(args) => serve(args).await,
    }
}

async fn serve(args: EnvServeArgs) -> Result<()> {
    if let Err(e) = serde_json::from_str::<serde_json::Value>(&args.config) {
        bail!("--config is not valid JSON ({e}); pass an object such as '{{}}'");
    }
    let plugin = args.sandbox.load(&args.file).await?;
    let name = plugin.id().to_string();
    let served = Served::new(plugin, args.config, args.data.as_deref(), args.seed).await?;
    let options = ServeOptions {
        max_sessions: args.max_sessions as usize,
        idle: Duration::from_secs(args.idle_timeout_s),
        max_message_bytes: args.max_message_mib as usize * (1 << 20),
    };
    let loopback = matches!(args.host.as_str(), "127.0.0.1" | "localhost" | "::1");
    if !loopback {
        tracing::warn!(
            "serving on {}: anyone who reaches it can run episodes (OpenEnv has no authentication)",
            args.host
        );
    }
    let addr = if args.host.contains(':') {
        format!("[{}]:{}", args.host, args.port)
    } else {
        format!("{}:{}", args.host, args.port)
    };
    let sessions = options.max_sessions;
    openenv::serve(served, &addr, options, |bound| {
        // The first line on stdout says where: scripts and tests read it.
        println!("serving {name} over OpenEnv at http://{bound} (sessions: ws://{bound}/ws, at most {sessions})");
        let _ = std::io::stdout().flush();
    })
    .await
}
