//! A plugin that misbehaves on purpose, to prove the sandbox holds. Never use it in a run.
//!
//! Config: `{"mode": "...", "at": "fire" | "open", "path": "/etc/passwd", "port": 80,
//! "url": "http://...", "count": 16}`.
//! The trigger misbehaves in `fire` (or in `open` with `"at": "open"`); the dataset in
//! `get`; the reward in `score`. Modes:
//!
//! | mode | what it does | what the host must do |
//! |---|---|---|
//! | `echo` | behaves: returns its input | answer normally |
//! | `loop` | spins forever | time out |
//! | `sleep` | sleeps an hour in a WASI call | time out |
//! | `memory` | allocates until it dies | out-of-memory |
//! | `recursion` | recurses without end | trap (stack overflow) |
//! | `panic` | panics | trap, with the panic message |
//! | `read-file` | reads `path` (default `/etc/passwd`) and lists `/` | nothing to read |
//! | `env` | lists environment variables and arguments | none to list |
//! | `socket` | connects to 127.0.0.1:`port` | refuse the connection |
//! | `huge-output` | returns a 100 MiB string | bad-output |
//! | `stdout-flood` | prints 16 MiB, then returns | cap the captured output |
//! | `guest-error` | returns an error | guest-error |
//! | `nan` | reward: returns a NaN component | bad-output |
//! | `bad-metadata` | dataset: returns metadata that is not JSON | bad-output |
//! | `many-patterns` | trigger: declares 10,000 stop patterns | bad-output |
//! | `http-get` | GETs `url`, following up to 3 redirects itself | only what `allow_http` grants |
//! | `http-flood` | sends `count` GETs to `url` at once | refuse past `max_http_in_flight` |
//! | `generate` | asks the base model for 8 tokens, returns the answer | answer only as granted |
//! | `generate-policy` | the same, of the trained adapter | refuse when only `base` is granted |
//! | `generate-flood` | asks `count` times in one call | refuse past `max_calls_per_trajectory` |
//! | `generate-huge` | asks with a 1,000,000-token and a 64 MiB prompt | refuse, nothing rendered |
//!
//! As tools it offers `count` (stateful: how many times it was called in this session,
//! so a test sees which session a call ran in and in what order) and `misbehave`
//! (stateless: does what its `mode` argument says, one of the modes above, in a fresh
//! instance), and misbehaves in `open` with `"at": "open"`.

use rlhost_sdk::model::{GenerateRequest, Prompt, Weights};
use rlhost_sdk::{
    Component, Dataset, FunctionSpec, Message, Reward, Sample, Tools, Trajectory, Trigger,
};
use serde::Deserialize;
use std::hint::black_box;

#[derive(Deserialize, Clone)]
#[serde(deny_unknown_fields, default)]
struct Config {
    mode: String,
    at: String,
    path: String,
    port: u16,
    url: String,
    count: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            mode: "echo".into(),
            at: "fire".into(),
            path: "/etc/passwd".into(),
            port: 80,
            url: "http://127.0.0.1/".into(),
            count: 16,
        }
    }
}

fn parse(config: &str) -> Result<Config, String> {
    serde_json::from_str(config).map_err(|e| format!("hostile config: {e}"))
}

#[allow(unconditional_recursion)]
fn recurse(depth: u64) -> u64 {
    let frame = black_box([depth; 64]);
    recurse(frame[0] + 1) + frame[63]
}

/// Does what `mode` says; returns the text a well-behaved call would return.
fn misbehave(config: &Config, input: &str) -> Result<String, String> {
    match config.mode.as_str() {
        "echo" | "nan" | "bad-metadata" | "many-patterns" => Ok(input.to_string()),
        "loop" => {
            let mut n = 0u64;
            loop {
                n = black_box(n.wrapping_add(1));
            }
        }
        "sleep" => {
            std::thread::sleep(std::time::Duration::from_secs(3600));
            Ok("woke up".into())
        }
        "memory" => {
            let mut hoard: Vec<Vec<u8>> = Vec::new();
            loop {
                hoard.push(black_box(vec![1u8; 1 << 20]));
            }
        }
        "recursion" => Ok(recurse(0).to_string()),
        "panic" => panic!("hostile plugin panicked on purpose"),
        "read-file" => {
            let file = match std::fs::read_to_string(&config.path) {
                Ok(text) => format!("read {}: {text}", config.path),
                Err(e) => format!("error: {e}"),
            };
            let root = match std::fs::read_dir("/") {
                Ok(entries) => format!("listed /: {}", entries.count()),
                Err(e) => format!("error: {e}"),
            };
            let cwd = match std::fs::read_dir(".") {
                Ok(entries) => format!("listed .: {}", entries.count()),
                Err(e) => format!("error: {e}"),
            };
            Ok(format!("{file}\n{root}\n{cwd}"))
        }
        "env" => {
            let vars: Vec<String> = std::env::vars().map(|(k, v)| format!("{k}={v}")).collect();
            let args: Vec<String> = std::env::args().collect();
            Ok(format!(
                "vars: {} [{}]\nargs: {} [{}]",
                vars.len(),
                vars.join(", "),
                args.len(),
                args.join(", ")
            ))
        }
        "socket" => match std::net::TcpStream::connect(("127.0.0.1", config.port)) {
            Ok(_) => Ok("connected".into()),
            Err(e) => Ok(format!("error: {e}")),
        },
        "huge-output" => Ok("x".repeat(100 << 20)),
        "stdout-flood" => {
            for i in 0..(16 << 20) / 64 {
                println!("{i:063}");
            }
            Ok("flooded".into())
        }
        "http-get" => {
            // Each hop is a request of its own, checked by the host again.
            let mut url = config.url.clone();
            let mut hops = Vec::new();
            for _ in 0..4 {
                match rlhost_sdk::http::get(&url) {
                    Ok(r) => match r
                        .header("location")
                        .filter(|_| (300..400).contains(&r.status))
                    {
                        Some(next) => {
                            hops.push(r.status.to_string());
                            url = next.to_string();
                        }
                        None => {
                            hops.push(format!("{} {}", r.status, r.text()));
                            break;
                        }
                    },
                    Err(e) => {
                        hops.push(format!("error: {e}"));
                        break;
                    }
                }
            }
            Ok(hops.join(" -> "))
        }
        "http-flood" => {
            let requests = (0..config.count)
                .map(|_| rlhost_sdk::http::Request::get(&config.url))
                .collect();
            let mut tally = std::collections::BTreeMap::<String, usize>::new();
            for r in rlhost_sdk::http::send_all(requests) {
                let key = match r {
                    Ok(r) => r.status.to_string(),
                    Err(e) => e,
                };
                *tally.entry(key).or_default() += 1;
            }
            Ok(tally
                .iter()
                .map(|(k, n)| format!("{k} x{n}"))
                .collect::<Vec<_>>()
                .join(", "))
        }
        "generate" => Ok(answered(ask(
            Prompt::TokenIds(vec![1, 2, 3]),
            Weights::Base,
        ))),
        "generate-flood" => {
            Ok(tally((0..config.count).map(|_| {
                ask(Prompt::TokenIds(vec![1, 2, 3]), Weights::Base)
            })))
        }
        "generate-huge" => Ok(tally([
            ask(Prompt::TokenIds(vec![1; 1_000_000]), Weights::Base),
            ask(
                Prompt::Messages(vec![Message::new("user", "x".repeat(64 << 20))]),
                Weights::Base,
            ),
        ])),
        "generate-policy" => Ok(answered(ask(
            Prompt::TokenIds(vec![1, 2, 3]),
            Weights::Policy,
        ))),
        "guest-error" => Err("hostile plugin refuses on purpose".into()),
        other => Err(format!("hostile config: unknown mode `{other}`")),
    }
}

/// One greedy 8-token `model.generate` call.
fn ask(prompt: Prompt, weights: Weights) -> Result<rlhost_sdk::model::Completion, String> {
    let mut request = GenerateRequest::new(prompt, 8);
    request.weights = weights;
    rlhost_sdk::model::generate(&request)
}

/// The answer's ids and finish reason, or the error.
fn answered(r: Result<rlhost_sdk::model::Completion, String>) -> String {
    match r {
        Ok(c) => format!("{:?} {}", c.token_ids, c.finish_reason),
        Err(e) => format!("error: {e}"),
    }
}

/// `ok xN` and each error `xN`, in order of the text.
fn tally<T>(results: impl IntoIterator<Item = Result<T, String>>) -> String {
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    for r in results {
        *counts
            .entry(r.map_or_else(|e| e, |_| "ok".to_string()))
            .or_default() += 1;
    }
    counts
        .iter()
        .map(|(k, n)| format!("{k} x{n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

struct Hostile {
    config: Config,
}

impl Trigger for Hostile {
    fn open(config: &str, _sample: Sample) -> Result<Self, String> {
        let config = parse(config)?;
        if config.at == "open" {
            misbehave(&config, "")?;
        }
        Ok(Hostile { config })
    }

    fn stop_patterns(&self) -> Vec<String> {
        if self.config.mode == "many-patterns" {
            return (0..10_000).map(|i| format!("<{i}>")).collect();
        }
        vec!["</go>".to_string()]
    }

    fn fire(&mut self, text: &str) -> Result<Option<String>, String> {
        if self.config.at == "open" {
            return Ok(Some(text.to_string()));
        }
        misbehave(&self.config, text).map(Some)
    }
}

struct HostileData {
    config: Config,
}

impl Dataset for HostileData {
    fn open(config: &str, _seed: u64) -> Result<Self, String> {
        Ok(HostileData {
            config: parse(config)?,
        })
    }

    fn len(&self) -> u64 {
        10
    }

    fn get(&self, index: u64) -> Result<Sample, String> {
        let content = misbehave(&self.config, &format!("sample {index}"))?;
        let metadata = if self.config.mode == "bad-metadata" {
            "{not json".to_string()
        } else {
            format!("{{\"index\": {index}}}")
        };
        Ok(Sample {
            messages: vec![Message::new("user", content)],
            metadata,
        })
    }
}

struct HostileScore {
    config: Config,
}

impl Reward for HostileScore {
    fn open(config: &str) -> Result<Self, String> {
        Ok(HostileScore {
            config: parse(config)?,
        })
    }

    fn score(&mut self, trajectory: Trajectory) -> Result<Vec<Component>, String> {
        let text = misbehave(&self.config, &trajectory.completion)?;
        // What the model answered: the trajectory's note, for a test to compare.
        if self.config.mode.starts_with("generate") {
            rlhost_sdk::log(rlhost_sdk::Level::Warn, &text);
        }
        let value = if self.config.mode == "nan" {
            f64::NAN
        } else {
            text.len() as f64
        };
        Ok(vec![Component::new("length", value)])
    }
}

struct HostileTools {
    config: Config,
    calls: u64,
}

impl Tools for HostileTools {
    fn open(config: &str, _sample: Sample) -> Result<Self, String> {
        let config = parse(config)?;
        if config.at == "open" {
            misbehave(&config, "")?;
        }
        Ok(HostileTools { config, calls: 0 })
    }

    fn functions(&self) -> Vec<FunctionSpec> {
        vec![
            FunctionSpec {
                name: "count".into(),
                description: "How many times count was called in this session, this call included.".into(),
                parameters: r#"{"type": "object", "properties": {}}"#.into(),
                stateless: false,
            },
            FunctionSpec {
                name: "misbehave".into(),
                description: "Misbehaves as `mode` says.".into(),
                parameters: r#"{"type": "object", "properties": {"mode": {"type": "string"}}, "required": ["mode"]}"#.into(),
                stateless: true,
            },
        ]
    }

    fn call(&mut self, name: &str, arguments: &str) -> Result<String, String> {
        match name {
            "count" => {
                self.calls += 1;
                Ok(self.calls.to_string())
            }
            "misbehave" => {
                let args: serde_json::Value =
                    serde_json::from_str(arguments).map_err(|e| e.to_string())?;
                let mode = args["mode"].as_str().ok_or("mode must be text")?;
                let config = Config {
                    mode: mode.to_string(),
                    ..self.config.clone()
                };
                misbehave(&config, arguments)
            }
            other => Err(format!("there is no function `{other}`")),
        }
    }
}

rlhost_sdk::export!(dataset: HostileData, reward: HostileScore, trigger: Hostile, tools: HostileTools);
