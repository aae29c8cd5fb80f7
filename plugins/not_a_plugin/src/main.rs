//! A WASI command (it exports `wasi:cli/run`, no rlhost role), so that the host's
//! "exports no rlhost role" error can be tested. Not a real plugin.

fn main() {
    println!("hello from a command, not a plugin");
}
