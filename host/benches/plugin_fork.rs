//! What forking a plugin session costs (issue 67), against the call it would branch
//! after.
//!
//! For the Python and JavaScript code tools: a session makes k blocks (each sets a
//! variable and does the same small sum), then is forked. Printed, as medians: one block
//! on a warm session (the tool call a tree branches after), a fresh session's open, and
//! for k = 1, 4 and 16:
//! - the fork replayed at once ([`rlhost::plugin::TriggerSession::fork`]): the open plus
//!   k calls again;
//! - the deferred fork ([`rlhost::plugin::TriggerSession::fork_deferred`]), which copies
//!   the log and opens nothing: what a branch that never calls the tool again pays;
//! - the first call on a deferred fork, which replays first: what a branch that does
//!   call again pays, less its own call.
//!
//! Each as a multiple of one call; the goal the fork is held to (issue 67) is 0.1 of one.
//!
//! Run: `bash plugins/build.sh && cargo bench -p rlhost --bench plugin_fork`.

use rlhost::plugin::{Plugin, PluginRuntime, PluginSpec, RuntimeOptions, Sample, TriggerSession};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

const ROUNDS: usize = 15;

struct Tool {
    label: &'static str,
    plugin: &'static str,
    /// Block `i`: sets `v{i}` and sums 100 squares.
    block: fn(usize) -> String,
    /// A block that prints `v0`, which only a session that ran block 0 has.
    look: &'static str,
}

fn tools() -> [Tool; 2] {
    [
        Tool {
            label: "code tool (Python)",
            plugin: "code_trigger",
            block: |i| {
                format!("```python\nv{i} = sum(j * j for j in range(100))\nprint(v{i})\n```")
            },
            look: "```python\nprint(v0)\n```",
        },
        Tool {
            label: "code tool (JavaScript)",
            plugin: "js_trigger",
            block: |i| {
                format!(
                    "```js\nlet v{i} = 0\nfor (let j = 0; j < 100; j++) v{i} += j * j\nconsole.log(v{i})\n```"
                )
            },
            look: "```js\nconsole.log(v0)\n```",
        },
    ]
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn ms(d: Duration) -> String {
    if d < Duration::from_micros(100) {
        format!("{:.1} µs", d.as_secs_f64() * 1e6)
    } else {
        format!("{:.2} ms", d.as_secs_f64() * 1e3)
    }
}

async fn load(runtime: &Arc<PluginRuntime>, name: &str) -> Plugin {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../plugins/dist/{name}.wasm"));
    if !path.exists() {
        eprintln!(
            "{} is missing: run `bash plugins/build.sh` first",
            path.display()
        );
        std::process::exit(1);
    }
    runtime
        .load(PluginSpec {
            path,
            limits: Default::default(),
            grants: Default::default(),
        })
        .await
        .expect("load plugin")
}

async fn open(plugin: &Plugin) -> TriggerSession {
    plugin
        .open_trigger("{}", &Sample::from_prompt(""), 1)
        .await
        .unwrap()
}

async fn fire(session: &mut TriggerSession, text: &str) {
    let out = session.fire(text).await.unwrap().unwrap();
    assert!(out.contains("328350"), "{out}");
}

#[tokio::main]
async fn main() {
    let runtime = PluginRuntime::new(&RuntimeOptions::default()).expect("plugin runtime");
    println!(
        "{:<24} {:>9} {:>9} {:>3} {:>22} {:>22} {:>30}",
        "tool",
        "call",
        "open",
        "k",
        "fork, replayed",
        "fork, deferred",
        "first call on it (+ replay)"
    );
    for tool in tools() {
        let plugin = load(&runtime, tool.plugin).await;
        // One block on a warm session, after a few to warm it.
        let mut session = open(&plugin).await;
        let mut calls = Vec::new();
        for i in 0..ROUNDS + 3 {
            let block = (tool.block)(i);
            let t = Instant::now();
            fire(&mut session, &block).await;
            if i >= 3 {
                calls.push(t.elapsed());
            }
        }
        let call = median(calls);
        let mut opens = Vec::new();
        for _ in 0..ROUNDS {
            let t = Instant::now();
            open(&plugin).await;
            opens.push(t.elapsed());
        }
        let times =
            |d: Duration| format!("{} ({:.2}x)", ms(d), d.as_secs_f64() / call.as_secs_f64());
        for k in [1, 4, 16] {
            let mut session = open(&plugin).await;
            for i in 0..k {
                fire(&mut session, &(tool.block)(i)).await;
            }
            let (mut replayed, mut deferred, mut first) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..ROUNDS {
                let t = Instant::now();
                let mut fork = session.fork().await.expect("fork");
                replayed.push(t.elapsed());
                // The fork holds the state: its next block sees v0.
                fire(&mut fork, tool.look).await;

                let t = Instant::now();
                let mut fork = session.fork_deferred().expect("deferred fork");
                deferred.push(t.elapsed());
                let t = Instant::now();
                fire(&mut fork, tool.look).await;
                first.push(t.elapsed());
            }
            println!(
                "{:<24} {:>9} {:>9} {:>3} {:>22} {:>22} {:>30}",
                tool.label,
                ms(call),
                ms(median(opens.clone())),
                k,
                times(median(replayed)),
                times(median(deferred)),
                times(median(first))
            );
        }
    }
}
