//! Plugins' outbound HTTP end to end: the hostile plugin's `wasi:http` requests through
//! the host's gate to a real HTTP server on loopback, allowed only as granted.

use rlhost::plugin::{Grants, Limits, Plugin, PluginSpec, Sample};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A real HTTP/1.1 server on loopback, a thread per connection: `/ok` ("hello"),
/// `/redirect` (302 to `localhost` on the same port), `/big` (2 MiB, chunked, no
/// length), `/wait` (answers after 300 ms), `/slow` (after 10 s), `/endless` (a chunked
/// body that never ends). Counts connections.
fn server() -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut sock) = conn else { return };
            count.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&head).to_string();
                let path = text.split_whitespace().nth(1).unwrap_or("/").to_string();
                let ok = |body: &str| {
                    format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    )
                    .into_bytes()
                };
                let reply = match path.as_str() {
                    "/ok" => ok("hello"),
                    "/redirect" => format!(
                        "HTTP/1.1 302 Found\r\nLocation: http://localhost:{port}/ok\r\n\
                         Content-Length: 0\r\nConnection: close\r\n\r\n"
                    )
                    .into_bytes(),
                    "/big" => {
                        let mut r = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                            .to_vec();
                        for _ in 0..32 {
                            r.extend_from_slice(b"10000\r\n");
                            r.extend(std::iter::repeat_n(b'x', 0x10000));
                            r.extend_from_slice(b"\r\n");
                        }
                        r.extend_from_slice(b"0\r\n\r\n");
                        r
                    }
                    "/wait" => {
                        std::thread::sleep(Duration::from_millis(300));
                        ok("waited")
                    }
                    "/slow" => {
                        std::thread::sleep(Duration::from_secs(10));
                        ok("late")
                    }
                    "/endless" => {
                        // A chunked body that never ends.
                        let _ = sock.write_all(
                            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
                        );
                        std::thread::sleep(Duration::from_secs(20));
                        return;
                    }
                    _ => {
                        b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                            .to_vec()
                    }
                };
                let _ = sock.write_all(&reply);
            });
        }
    });
    (port, accepted)
}

async fn hostile(allow: &[String], timeout_ms: u64, max_in_flight: usize) -> Plugin {
    super::runtime(false)
        .load(PluginSpec {
            path: rlhost_tests::plugin("hostile"),
            limits: Limits {
                timeout_ms,
                ..Limits::default()
            },
            grants: Grants {
                allow_http: allow.to_vec(),
                max_http_in_flight: max_in_flight,
                ..Grants::default()
            },
        })
        .await
        .unwrap()
}

/// The hostile trigger in `mode` on `url`: what it returned (it reports HTTP errors as
/// text) and how long it took.
async fn call(plugin: &Plugin, mode: &str, url: &str, count: usize) -> (String, Duration) {
    let config = format!(r#"{{"mode": "{mode}", "url": "{url}", "count": {count}}}"#);
    let mut session = plugin
        .open_trigger(&config, &Sample::from_prompt("hi"), 1)
        .await
        .unwrap();
    let t = Instant::now();
    let out = session.fire("go</go>").await.unwrap().unwrap();
    (out, t.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_reaches_only_what_it_is_granted() {
    let (port, accepted) = server();
    let ok = format!("http://127.0.0.1:{port}/ok");
    let by_name = format!("http://localhost:{port}/ok");

    let none = hostile(&[], 5000, 4).await;
    let (out, _) = call(&none, "http-get", &ok, 1).await;
    assert_eq!(out, "error: ErrorCode::HttpRequestDenied");
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        0,
        "a denied request never connects"
    );
    assert_eq!(none.http().counts.denied.load(Ordering::Relaxed), 1);

    let granted = hostile(&[format!("http://127.0.0.1:{port}")], 5000, 4).await;
    assert_eq!(call(&granted, "http-get", &ok, 1).await.0, "200 hello");
    // The same server by a name the grant does not give; and a redirect to that name,
    // which the plugin follows itself and the host checks again.
    assert_eq!(
        call(&granted, "http-get", &by_name, 1).await.0,
        "error: ErrorCode::HttpRequestDenied"
    );
    let redirect = format!("http://127.0.0.1:{port}/redirect");
    assert_eq!(
        call(&granted, "http-get", &redirect, 1).await.0,
        "302 -> error: ErrorCode::HttpRequestDenied"
    );
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        2,
        "the two granted requests only"
    );

    // A grant for any host never reaches loopback: the name resolves to 127.0.0.1.
    let any = hostile(&[format!("http://*:{port}")], 5000, 4).await;
    assert_eq!(
        call(&any, "http-get", &by_name, 1).await.0,
        "error: ErrorCode::DestinationIpProhibited"
    );
    let named = hostile(&[format!("http://localhost:{port}")], 5000, 4).await;
    assert_eq!(call(&named, "http-get", &by_name, 1).await.0, "200 hello");
    assert_eq!(accepted.load(Ordering::SeqCst), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_bodies_slow_servers_and_floods_are_contained() {
    let (port, _) = server();
    let grant = [format!("http://127.0.0.1:{port}")];
    // A 4 s call: the request's deadline (nine tenths of it) leaves the plugin 0.4 s to
    // answer, which a loaded CI machine's 2 cores once took more than 0.1 s of.
    let plugin = hostile(&grant, 4000, 4).await;
    let (out, _) = call(
        &plugin,
        "http-get",
        &format!("http://127.0.0.1:{port}/big"),
        1,
    )
    .await;
    assert!(
        out.contains("response body size exceeds limit: 1048576 bytes"),
        "{out}"
    );
    // The request's deadline (nine tenths of the call's 4 s) ends it before the call's
    // own deadline and the server's answer: the plugin hears of it and answers.
    let (out, took) = call(
        &plugin,
        "http-get",
        &format!("http://127.0.0.1:{port}/slow"),
        1,
    )
    .await;
    assert!(out.contains("HttpResponseTimeout"), "{out}");
    assert!(took < Duration::from_millis(4000), "{took:?}");
    // Sixteen at once against a cap of four: four answered, twelve refused.
    let (out, _) = call(
        &plugin,
        "http-flood",
        &format!("http://127.0.0.1:{port}/wait"),
        16,
    )
    .await;
    assert_eq!(out, "200 x4, ErrorCode::ConnectionLimitReached x12");
    let counts = &plugin.http().counts;
    assert_eq!(counts.denied.load(Ordering::Relaxed), 12);
    // The slow one failed; the big one was answered (its body was cut off later).
    assert_eq!(counts.failed.load(Ordering::Relaxed), 1);
    assert_eq!(
        plugin.faults().total(),
        0,
        "refusals are answers, not faults"
    );
    // And the plugin goes on: the permits came back.
    assert_eq!(
        call(
            &plugin,
            "http-get",
            &format!("http://127.0.0.1:{port}/ok"),
            1
        )
        .await
        .0,
        "200 hello"
    );
}

/// A training run records each granted plugin's requests per step: the hostile reward
/// (weight 0) fetching the loopback server once per trajectory from one config section
/// with a grant, and once per trajectory refused from another section without one.
#[test]
fn a_training_run_counts_requests_per_step() {
    let (port, _) = server();
    let dir = rlhost_tests::temp_dir("http-train");
    let rows: String = (0..8)
        .map(|i| format!("{{\"prompt\": \"Say something about {i}.\"}}\n"))
        .collect();
    std::fs::write(dir.join("data.jsonl"), rows).unwrap();
    let model = rlhost_tests::repo_root().join("tests/fixtures/models/qwen2");
    let hostile = rlhost_tests::plugin("hostile");
    let pattern = rlhost_tests::plugin("pattern_reward");
    let url = format!("http://127.0.0.1:{port}/ok");
    let config = format!(
        r#"
[model]
path = {model:?}
[data]
path = "data.jsonl"
eval_size = 0
[sampling]
max_new_tokens = 4
[rollout]
group_size = 2
prompts_per_step = 2
[plugins.pattern]
path = {pattern:?}
[plugins.fetch]
path = {hostile:?}
allow_http = ["http://127.0.0.1:{port}"]
[plugins.nogrant]
path = {hostile:?}
[[rewards]]
plugin = "pattern"
config = {{ patterns = {{ e = "e" }}, cap = 4 }}
[[rewards]]
plugin = "fetch"
config = {{ mode = "http-get", url = "{url}" }}
default_weight = 0.0
[[rewards]]
plugin = "nogrant"
config = {{ mode = "http-get", url = "{url}" }}
default_weight = 0.0
[train]
steps = 2
save_every = 100
"#
    );
    let path = dir.join("run.toml");
    std::fs::write(&path, config).unwrap();
    let out = dir.join("run");
    rlhost_tests::TestCommand::new(&["train", "--config"])
        .arg(&path)
        .arg("--out")
        .arg(&out)
        .ok();
    let m = super::train_cli::metrics(&out);
    assert_eq!(m.len(), 2);
    // Four trajectories a step: four answered for the granted section, four refused for
    // the other (both are the plugin `hostile`). A record counts the requests made since
    // the previous one, and the next batch samples and scores while a step trains, so a
    // record may hold some of the next batch's: the two records hold at least the two
    // batches' eight and eight.
    let total = |key: &str| -> u64 {
        m.iter()
            .map(|s| s["http_requests"][key].as_u64().unwrap())
            .sum()
    };
    let all: Vec<&Value> = m.iter().map(|s| &s["http_requests"]).collect();
    assert!(total("hostile/answered") >= 8, "{all:?}");
    assert!(total("hostile/denied") >= 8, "{all:?}");
    assert_eq!(total("hostile/failed"), 0, "{all:?}");
    // The first record holds at least the first batch's (scored before its step trained).
    // A later one may hold none: the next batch can be sampled and scored whole while a
    // step trains, and its requests then fall in the record before (seen on 2 cores).
    let first = &m[0]["http_requests"];
    assert!(first["hostile/answered"].as_u64() >= Some(4), "{all:?}");
    assert!(first["hostile/denied"].as_u64() >= Some(4), "{all:?}");
}

/// The `search` example end to end: the real BM25 service on loopback, the plugin granted
/// it, a question whose answer is the top hit; without the grant the function says so.
#[test]
fn the_search_tool_asks_the_retrieval_service_it_is_granted() {
    let service = rlhost_tests::Bm25Service::start();
    let config = format!(r#"{{"url": "{}"}}"#, service.url());
    let search = rlhost_tests::plugin("search").display().to_string();
    // The corpus's first country, from the service itself.
    let dump = std::process::Command::new("python3")
        .arg(rlhost_tests::repo_root().join("scripts/bm25_service.py"))
        .args(["--dump", "--docs", "6"])
        .output()
        .unwrap();
    let first: serde_json::Value = serde_json::from_str(
        String::from_utf8_lossy(&dump.stdout)
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    let fact = first["text"].as_str().unwrap().to_string();
    let country = first["title"].as_str().unwrap().to_string();
    let call = format!(r#"search:{{"query": "capital of {country}", "k": 2}}"#);
    let ran = rlhost_tests::TestCommand::new(&["plugin", "call", &search, "tools", "--json"])
        .args([
            "--config",
            &config,
            "--call",
            &call,
            "--allow-http",
            &service.url(),
        ])
        .ok();
    let out: serde_json::Value = serde_json::from_str(&ran.stdout).unwrap();
    let result = out["calls"][0]["result"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        result.starts_with(&format!("[1] {country}: {fact}")),
        "{}",
        ran.stdout
    );
    assert_eq!(result.lines().count(), 2, "{result}");
    let ran = rlhost_tests::TestCommand::new(&["plugin", "call", &search, "tools", "--json"])
        .args(["--config", &config, "--call", &call])
        .ok();
    let out: serde_json::Value = serde_json::from_str(&ran.stdout).unwrap();
    assert_eq!(
        out["calls"][0]["error"], "the search service: ErrorCode::HttpRequestDenied",
        "{}",
        ran.stdout
    );
}

/// Issue 68, point 20: with RUST_BACKTRACE=1 in the host's environment, the error a
/// granted request's endless body ends with reached the plugin (and from a trigger, the
/// model's context) with the host's stack backtrace in its text.
#[test]
fn no_host_backtrace_reaches_a_plugin_through_an_http_error() {
    let (port, _) = server();
    let url = format!("http://127.0.0.1:{port}/endless");
    let ran = rlhost_tests::TestCommand::new(&["plugin", "call"])
        .arg(rlhost_tests::plugin("hostile"))
        .args(["trigger", "--text", "x</go>", "--config"])
        .arg(format!(r#"{{"mode": "http-get", "url": "{url}"}}"#))
        .arg("--allow-http")
        .arg(format!("http://127.0.0.1:{port}"))
        .env("RUST_BACKTRACE", "1")
        .run();
    let all = format!("{}{}", ran.stdout, ran.stderr);
    assert!(all.contains("error"), "the request did not fail: {all}");
    assert!(
        !all.contains("Stack backtrace") && !all.contains("backtrace.rs"),
        "{all}"
    );
}
