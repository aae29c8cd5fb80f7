//! Command-line interface: arguments as the user typed them, parsed by clap, dispatched
//! to one function per command. `main` prints one error chain and returns an exit code;
//! user mistakes never panic.

mod config;
mod env;
mod export;
mod generate;
mod init;
mod interrupt;
mod pairs;
mod plugin;
mod rollout;
mod serve;
mod sft;
mod source;
mod status;
mod train;

use clap::{Parser, Subcommand};
use std::io::Write;
use std::process::ExitCode;

#[derive(Debug, Parser)]
#[command(
    name = "rlhost",
    version,
    about = "Train LLM agents with reinforcement learning; tools and rewards run as sandboxed WebAssembly plugins"
)]
struct Cli {
    /// Print only errors (RUST_LOG overrides this).
    #[arg(long, short, global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Inspect and try out plugins.
    #[command(subcommand)]
    Plugin(plugin::PluginCommand),
    /// Environments in OpenEnv's standard: `env serve` serves a plugin under its API.
    #[command(subcommand)]
    Env(env::EnvCommand),
    /// Sample from a Hugging Face model directory (optionally with a LoRA adapter).
    Generate(generate::GenerateArgs),
    /// Write an adapter merged into its base model, as a Hugging Face model directory.
    Export(export::ExportArgs),
    /// Train a LoRA adapter with GRPO-family RL: the main job.
    Train(train::TrainArgs),
    /// Sample and score trajectories with a run config, without training.
    Rollout(rollout::RolloutArgs),
    /// Serve the run's model behind an OpenAI-compatible API, recording sessions.
    Serve(serve::ServeArgs),
    /// Supervised fine-tuning of an adapter on conversations (assistant tokens only).
    Sft(sft::SftArgs),
    /// Preference optimisation of an adapter on chosen/rejected pairs (DPO, IPO, SimPO).
    Dpo(pairs::PairsArgs),
    /// Train a Bradley–Terry reward model (adapter + score head) on chosen/rejected pairs.
    Rm(pairs::PairsArgs),
    /// Accuracy, tool-use rate and rewards on the held-out split.
    Eval(rollout::EvalArgs),
    /// Print the status of a running job (its --status-addr URL).
    Status(status::StatusCommandArgs),
    /// Write a commented starter config for your own model, data and plugins.
    Init(init::InitArgs),
    /// The run config's keys (`config reference`) and a resolved config (`config show`).
    #[command(subcommand)]
    Config(config::ConfigCommand),
}

/// Runs the CLI with the process's arguments.
pub fn main() -> ExitCode {
    // Errors never carry the host's stack backtrace, whatever RUST_BACKTRACE says (panics
    // still print theirs): wasmtime captures one into every error it makes, and some of
    // those errors' text reaches a plugin (an HTTP body that times out, in wasi-http),
    // naming the host's files and functions inside the sandbox. RUST_LIB_BACKTRACE set by
    // hand still wins.
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        // SAFETY: the first thing the process does, before any thread is started.
        unsafe { std::env::set_var("RUST_LIB_BACKTRACE", "0") };
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // clap prints help and version to stdout with exit code 0, usage errors to
            // stderr with 2.
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    init_logging(cli.quiet);
    crate::model::compute::set_up_process();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = std::io::stdout().flush();
            if let Some(stop) = e.downcast_ref::<interrupt::Interrupted>() {
                eprintln!("{stop}");
                return ExitCode::from(stop.exit_code());
            }
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Command::Plugin(command) => runtime.block_on(plugin::run(command)),
        Command::Env(command) => runtime.block_on(env::run(command)),
        Command::Generate(args) => generate::run(args),
        Command::Export(args) => export::run(args),
        Command::Rollout(args) => rollout::run(args, runtime.handle(), cli.quiet),
        Command::Train(args) => train::run(args, runtime.handle(), cli.quiet),
        Command::Serve(args) => serve::run(args, runtime.handle(), cli.quiet),
        Command::Sft(args) => sft::run(args, cli.quiet),
        Command::Dpo(args) => pairs::run(pairs::Objective::Dpo, args, runtime.handle(), cli.quiet),
        Command::Rm(args) => pairs::run(pairs::Objective::Rm, args, runtime.handle(), cli.quiet),
        Command::Eval(args) => rollout::eval(args, runtime.handle(), cli.quiet),
        Command::Status(args) => status::run(args),
        Command::Config(command) => config::run(command, runtime.handle()),
        Command::Init(args) => init::run(args, runtime.handle()),
    }
}

/// Logs go to stderr. The default shows warnings and what plugins print; `RUST_LOG`
/// (e.g. `RUST_LOG=debug`) overrides it.
fn init_logging(quiet: bool) {
    use tracing_subscriber::EnvFilter;
    let default = if quiet { "error" } else { "warn,plugin=info" };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .without_time()
        .try_init();
}
