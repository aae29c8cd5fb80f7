//! `rlhost status URL`: where a running job is, printed in the terminal.

use crate::status::client;
use anyhow::Result;
use clap::Args;

#[derive(Debug, Args)]
pub struct StatusCommandArgs {
    /// The job's status address, e.g. http://127.0.0.1:8787 (as `rlhost train` printed it).
    url: String,
    /// Print the raw `/status` JSON.
    #[arg(long)]
    json: bool,
    /// Refresh every this many seconds until the run is done or failed.
    #[arg(long, value_name = "SECONDS")]
    watch: Option<f64>,
}

pub fn run(args: StatusCommandArgs) -> Result<()> {
    loop {
        let st = client::fetch(&args.url)?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&st)?);
        } else {
            print!("{}", client::render(&st));
        }
        let finished = matches!(
            st.phase,
            crate::status::Phase::Done | crate::status::Phase::Failed
        );
        match args.watch {
            Some(secs) if !finished => {
                std::thread::sleep(std::time::Duration::from_secs_f64(secs.max(0.2)));
                println!();
            }
            _ => return Ok(()),
        }
    }
}
