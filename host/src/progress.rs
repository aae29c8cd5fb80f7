//! Progress bars on a terminal: indicatif when stderr is one and `--quiet` is off;
//! otherwise callers print a line now and then (logs and CI keep a readable record).

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;

/// Whether to draw bars.
pub fn enabled(quiet: bool) -> bool {
    !quiet && std::io::stderr().is_terminal()
}

/// A bar of `len` with an indicatif `template`.
pub fn bar(len: u64, template: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    // Templates are written in this crate; a bad one is a bug caught by any run.
    bar.set_style(ProgressStyle::with_template(template).expect("a valid progress template"));
    bar
}
