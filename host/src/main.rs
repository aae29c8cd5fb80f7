//! The `rlhost` binary: parses arguments, runs, prints one error chain on failure.

use std::process::ExitCode;

fn main() -> ExitCode {
    rlhost::cli::main()
}
