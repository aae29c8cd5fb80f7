//! What forking a plugin session costs (issue 67), against the call it would branch
//! after.
//!
//! For the Python and JavaScript code tools: a session makes k blocks (each sets a
//! variable and does the same small sum), then is forked. Printed, as medians: one block
//! on a warm session (the tool call a tree branches after), a fresh session's open, and the
//! fork after k = 1, 4 and 16 blocks, with the fork's cost as a multiple of one call. A
//! fork replays the session's calls ([`rlhost::plugin::fork`]), so its cost is the open
//! plus k calls again; the goal it is held to (issue 67) is 0.1 of one call.
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
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
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
        "{:<24} {:>10} {:>10} {:>22} {:>22} {:>22}",
        "tool", "call", "open", "fork after 1", "fork after 4", "fork after 16"
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
        let mut row = format!(
            "{:<24} {:>10} {:>10}",
            tool.label,
            ms(call),
            ms(median(opens))
        );
        for k in [1, 4, 16] {
            let mut session = open(&plugin).await;
            for i in 0..k {
                fire(&mut session, &(tool.block)(i)).await;
            }
            let mut forks = Vec::new();
            for _ in 0..ROUNDS {
                let t = Instant::now();
                let mut fork = session.fork().await.expect("fork");
                forks.push(t.elapsed());
                // The fork holds the state: its next block sees v0.
                fire(&mut fork, tool.look).await;
            }
            let fork = median(forks);
            let ratio = fork.as_secs_f64() / call.as_secs_f64();
            row += &format!(" {:>22}", format!("{} ({ratio:.1}x call)", ms(fork)));
        }
        println!("{row}");
    }
}
