//! Forked plugin sessions (issue 67): a fork has its original's state at the fork, goes
//! its own way after, and answers as a fresh session that made the same calls would.
//! Each plugin below is a real one from `plugins/`.

use super::load;
use rlhost::plugin::model::{GenerateCall, GenerateGrant, Generated, ModelLink};
use rlhost::plugin::{
    DirGrant, FaultKind, ForkError, Grants, Limits, Plugin, PluginSpec, Sample, TriggerSession,
};
use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

fn py(code: &str) -> String {
    format!("```python\n{code}\n```")
}

fn js(code: &str) -> String {
    format!("```js\n{code}\n```")
}

/// A code tool's session on an empty sample, seeded `seed`.
async fn fresh(plugin: &Plugin, seed: u64) -> TriggerSession {
    plugin
        .open_trigger("{}", &Sample::from_prompt(""), seed)
        .await
        .unwrap()
}

async fn fire(session: &mut TriggerSession, text: &str) -> String {
    session
        .fire(text)
        .await
        .unwrap_or_else(|e| panic!("{text}: {e}"))
        .unwrap_or_default()
}

/// The Python tool: a variable set before the fork is in both branches, one set in a
/// branch after is in that branch only, and the random numbers and clock readings go on
/// alike in the fork, the original and a fresh session that replayed the same blocks.
#[tokio::test]
async fn a_forked_python_session_keeps_its_globals_and_goes_its_own_way() {
    let plugin = load("code_trigger").await;
    let history = [
        py("x = 6 * 7"),
        py("import random, time\nr = random.random()\nt0 = time.time()\nm0 = time.monotonic()"),
    ];
    let mut a = fresh(&plugin, 9).await;
    for text in &history {
        fire(&mut a, text).await;
    }
    let mut b = a.fork().await.unwrap();
    let mut replayed = fresh(&plugin, 9).await;
    for text in &history {
        fire(&mut replayed, text).await;
    }

    let look =
        py("print(x, r, t0, m0)\nprint(random.random(), time.time() - t0, time.monotonic() - m0)");
    let seen = fire(&mut a, &look).await;
    assert!(seen.contains("42 0."), "{seen}");
    assert_eq!(
        fire(&mut b, &look).await,
        seen,
        "the fork reads what the original does"
    );
    assert_eq!(
        fire(&mut replayed, &look).await,
        seen,
        "and so does a replay"
    );

    // A branch's own variable stays in that branch.
    assert_eq!(
        fire(&mut b, &py("y = x + 1\ny")).await,
        "\n<output>\n43\n</output>\n"
    );
    let has_y = py("print('y' in globals())");
    assert_eq!(fire(&mut a, &has_y).await, "\n<output>\nFalse\n</output>\n");
    assert_eq!(fire(&mut b, &has_y).await, "\n<output>\nTrue\n</output>\n");
    // ...and the original's change stays in the original.
    fire(&mut a, &py("x = 0")).await;
    assert_eq!(fire(&mut b, &py("x")).await, "\n<output>\n42\n</output>\n");

    // A fork of a fork is the branch as it is now.
    let mut c = b.fork().await.unwrap();
    assert_eq!(fire(&mut c, &has_y).await, "\n<output>\nTrue\n</output>\n");
}

/// The JavaScript tool (QuickJS), whose `let` bindings persist across blocks.
#[tokio::test]
async fn a_forked_javascript_session_keeps_its_bindings() {
    let plugin = load("js_trigger").await;
    let mut a = fresh(&plugin, 3).await;
    fire(
        &mut a,
        &js("let n = 5; const seen = [Math.random(), Date.now()]"),
    )
    .await;
    let mut b = a.fork().await.unwrap();
    let look = js("[n, seen, Math.random(), Date.now() - seen[1]]");
    let seen = fire(&mut a, &look).await;
    assert!(seen.contains("5"), "{seen}");
    assert_eq!(fire(&mut b, &look).await, seen);
    fire(&mut b, &js("n = 6")).await;
    assert_eq!(fire(&mut a, &js("n")).await, "\n<output>\n5\n</output>\n");
    assert_eq!(fire(&mut b, &js("n")).await, "\n<output>\n6\n</output>\n");
}

/// The units tools (Python, function calling): a forked tools session answers each call
/// as the original does.
#[tokio::test]
async fn a_forked_tools_session_answers_alike() {
    let plugin = load("units").await;
    let mut a = plugin
        .open_tools("{}", &Sample::from_prompt(""), 1)
        .await
        .unwrap();
    let convert = r#"{"value": 3.5, "from": "mi", "to": "km"}"#;
    let first = a.invoke("convert", convert).await.unwrap();
    assert!(first.is_ok(), "{first:?}");
    // A refusal is part of the history too.
    let refused = a.invoke("convert", r#"{"value": 1}"#).await.unwrap();
    assert!(refused.is_err(), "{refused:?}");
    let mut b = a.fork().await.unwrap();
    assert_eq!(b.functions(), a.functions());
    let days = r#"{"date": "2024-02-27", "days": 3}"#;
    assert_eq!(
        b.invoke("add_days", days).await.unwrap(),
        a.invoke("add_days", days).await.unwrap()
    );
    assert_eq!(b.invoke("convert", convert).await.unwrap(), first);
}

/// The guessing game (a Rust environment): the fork has made the original's guesses, so
/// it runs out of guesses when the original would; a guess in one does not count in the
/// other.
#[tokio::test]
async fn a_forked_episode_counts_only_its_own_turns() {
    let plugin = load("guess_number").await;
    let sample = Sample {
        metadata: serde_json::json!({"secret": 37}),
        ..Sample::from_prompt("Guess my number.")
    };
    let mut a = plugin
        .open_environment(r#"{"max_guesses": 3}"#, &sample, 1)
        .await
        .unwrap();
    let first = a.step("I guess 50.").await.unwrap();
    assert!(!first.done, "{first:?}");
    a.step("20").await.unwrap();
    let mut b = a.fork().await.unwrap();
    // The third guess is the last in both: wrong in the fork, right in the original.
    let wrong = b.step("30").await.unwrap();
    assert!(wrong.done && wrong.reward == Some(0.0), "{wrong:?}");
    let right = a.step("37").await.unwrap();
    assert!(right.done && right.reward == Some(1.0), "{right:?}");
    // A fork of a fresh episode has nothing to replay and plays as a new one.
    let mut c = plugin
        .open_environment(r#"{"max_guesses": 3}"#, &sample, 1)
        .await
        .unwrap();
    let mut d = c.fork().await.unwrap();
    assert_eq!(d.step("50").await.unwrap(), first);
}

/// A plugin that reads what the host does not supply (here a granted file, changed after
/// the read) is caught when the fork's replay answers otherwise, and the fork refused.
#[tokio::test]
async fn a_replay_that_answers_otherwise_refuses_the_fork() {
    let dir = rlhost_tests::temp_dir("fork-diverged");
    std::fs::write(dir.join("data.txt"), "before").unwrap();
    let plugin = super::runtime(false)
        .load(PluginSpec {
            path: rlhost_tests::plugin("hostile"),
            limits: Limits::default(),
            grants: Grants {
                read_only_dirs: vec![DirGrant {
                    host: dir.clone(),
                    guest: "/data".into(),
                }],
                ..Grants::default()
            },
        })
        .await
        .unwrap();
    let config = r#"{"mode": "read-file", "path": "/data/data.txt"}"#;
    let mut a = plugin
        .open_trigger(config, &Sample::from_prompt(""), 1)
        .await
        .unwrap();
    assert!(fire(&mut a, "</go>").await.contains("before"));
    // Unchanged, the fork replays fine.
    a.fork().await.unwrap();
    std::fs::write(dir.join("data.txt"), "after").unwrap();
    let err = a.fork().await.err().expect("the replay read another file");
    assert!(matches!(err, ForkError::Diverged { index: 0, .. }), "{err}");
    assert!(
        err.to_string()
            .contains("replaying call 0 of the session (`trigger.fire`) answered otherwise"),
        "{err}"
    );
}

/// A deferred fork opens nothing until it is called, then replays the history as it was
/// at the fork, whatever the original did since; a deferred fork of a deferred fork is
/// the same history again.
#[tokio::test]
async fn a_deferred_fork_replays_at_its_first_call_what_was_there_at_the_fork() {
    let plugin = load("code_trigger").await;
    let mut a = fresh(&plugin, 4).await;
    fire(&mut a, &py("x = 6 * 7\nimport random\nr = random.random()")).await;
    let mut d = a.fork_deferred().unwrap();
    let mut e = d.fork_deferred().unwrap();
    assert!(d.is_deferred() && e.is_deferred());
    assert_eq!(d.stop_patterns(), a.stop_patterns());
    let mut eager = a.fork().await.unwrap();
    // The original moves on; the deferred forks were taken before.
    fire(&mut a, &py("x = 0")).await;
    let look = py("print(x, r, random.random())");
    let seen = fire(&mut eager, &look).await;
    assert!(seen.contains("42 0."), "{seen}");
    assert_eq!(d.take_replays().0, 0, "nothing replayed before a call");
    assert_eq!(fire(&mut d, &look).await, seen);
    assert!(!d.is_deferred());
    let (replays, took) = d.take_replays();
    assert_eq!(replays, 1);
    assert!(took.as_nanos() > 0);
    assert_eq!(fire(&mut e, &look).await, seen);
    // A fork of the replayed fork has its own history on top.
    fire(&mut d, &py("y = 1")).await;
    let mut f = d.fork_deferred().unwrap();
    assert_eq!(
        fire(&mut f, &py("print(x, y)")).await,
        "\n<output>\n42 1\n</output>\n"
    );
}

/// A deferred fork whose replay answers otherwise (a granted file changed after the
/// fork) faults at its first call, with kind `fork` and the replay's reason; its next
/// call opens a fresh instance, as after any fault.
#[tokio::test]
async fn a_deferred_fork_that_replays_otherwise_faults_at_its_first_call() {
    let dir = rlhost_tests::temp_dir("fork-deferred-diverged");
    std::fs::write(dir.join("data.txt"), "before").unwrap();
    let plugin = hostile(Grants {
        read_only_dirs: vec![DirGrant {
            host: dir.clone(),
            guest: "/data".into(),
        }],
        ..Grants::default()
    })
    .await;
    let config = r#"{"mode": "read-file", "path": "/data/data.txt"}"#;
    let mut a = plugin
        .open_trigger(config, &Sample::from_prompt(""), 1)
        .await
        .unwrap();
    assert!(fire(&mut a, "</go>").await.contains("before"));
    let mut d = a
        .fork_deferred()
        .expect("nothing is checked until the replay");
    std::fs::write(dir.join("data.txt"), "after").unwrap();
    let fault = d
        .fire("</go>")
        .await
        .expect_err("the replay read another file");
    assert_eq!(fault.kind, FaultKind::Fork, "{fault}");
    assert_eq!(fault.call, "trigger.fire");
    assert_eq!(
        plugin.faults().get(FaultKind::Fork),
        1,
        "counted as the plugin's fault"
    );
    assert!(
        fault
            .message
            .contains("replaying call 0 of the session (`trigger.fire`) answered otherwise"),
        "{fault}"
    );
    assert!(fire(&mut d, "</go>").await.contains("after"));
}

/// The hostile plugin with `grants`.
async fn hostile(grants: Grants) -> Plugin {
    super::runtime(false)
        .load(PluginSpec {
            path: rlhost_tests::plugin("hostile"),
            limits: Limits::default(),
            grants,
        })
        .await
        .unwrap()
}

/// A loopback HTTP server that answers each request with the number of requests it has
/// answered so far: the network never answers the same twice.
fn counting_server() -> (u16, Arc<AtomicUsize>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let answered = Arc::new(AtomicUsize::new(0));
    let count = answered.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut sock) = conn else { return };
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match sock.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let body = format!("n={}", count.fetch_add(1, Ordering::SeqCst) + 1);
            let _ = sock.write_all(
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                )
                .as_bytes(),
            );
        }
    });
    (port, answered)
}

/// A plugin granted HTTP forks: the fork's replay is served the answers the session got
/// (the server, asked again, would answer otherwise), the server is not asked, and after
/// the fork each session's requests go out and are recorded for their own forks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_is_served_the_http_answers_its_original_got() {
    let (port, answered) = counting_server();
    let url = format!("http://127.0.0.1:{port}/count");
    let plugin = hostile(Grants {
        allow_http: vec![format!("http://127.0.0.1:{port}")],
        ..Grants::default()
    })
    .await;
    let config = format!(r#"{{"mode": "http-get", "url": "{url}"}}"#);
    let mut a = plugin
        .open_trigger(&config, &Sample::from_prompt(""), 1)
        .await
        .unwrap();
    assert_eq!(fire(&mut a, "go</go>").await, "200 n=1");
    assert_eq!(fire(&mut a, "go</go>").await, "200 n=2");

    let mut b = a.fork().await.unwrap();
    assert_eq!(
        answered.load(Ordering::SeqCst),
        2,
        "the replay asked the server nothing"
    );
    // A fresh session that makes the same calls is answered by the server, otherwise.
    let mut fresh = plugin
        .open_trigger(&config, &Sample::from_prompt(""), 1)
        .await
        .unwrap();
    assert_eq!(fire(&mut fresh, "go</go>").await, "200 n=3");

    assert_eq!(
        fire(&mut b, "go</go>").await,
        "200 n=4",
        "the fork asks anew"
    );
    assert_eq!(fire(&mut a, "go</go>").await, "200 n=5");
    // A fork of the fork replays its three answers: two recorded by its original, one
    // by itself.
    let mut c = b.fork().await.unwrap();
    assert_eq!(answered.load(Ordering::SeqCst), 5);
    assert_eq!(fire(&mut c, "go</go>").await, "200 n=6");
}

/// A plugin granted `model.generate` forks: the replay is served the model's recorded
/// answers (the model, asked again, answers otherwise: it trains between steps), and the
/// calls it made still count against the per-trajectory grant in the fork.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_is_served_the_model_answers_its_original_got() {
    let plugin = hostile(Grants {
        generate: Some(GenerateGrant {
            max_calls_per_trajectory: 3,
            ..GenerateGrant::default()
        }),
        ..Grants::default()
    })
    .await;
    // The model: each answer the number of calls it has answered so far.
    let asked = Arc::new(AtomicUsize::new(0));
    let count = asked.clone();
    let link = ModelLink::new(5, move |call: GenerateCall| {
        let n = count.fetch_add(1, Ordering::SeqCst) as u32 + 1;
        let _ = call.reply.send(Ok(Generated {
            text: format!("{n}"),
            token_ids: vec![n],
            finish_reason: "stop".into(),
            prompt_tokens: 3,
        }));
        Ok(())
    });
    let mut a = plugin
        .open_trigger(r#"{"mode": "generate"}"#, &Sample::from_prompt(""), 1)
        .await
        .unwrap();
    a.set_model(Some(link.clone()));
    assert_eq!(fire(&mut a, "go</go>").await, "[1] stop");
    assert_eq!(fire(&mut a, "go</go>").await, "[2] stop");

    let mut b = a.fork().await.unwrap();
    assert_eq!(
        asked.load(Ordering::SeqCst),
        2,
        "the replay asked the model nothing"
    );
    assert_eq!(
        fire(&mut b, "go</go>").await,
        "[3] stop",
        "the fork asks anew"
    );
    // The fork's call was the trajectory's third, the grant's last: the link's count
    // is the session's and its fork's (a tree's branch gets a link of its own that
    // goes on from its parent's count).
    assert!(
        fire(&mut a, "go</go>").await.contains("over the grant's 3"),
        "the fourth call of the trajectory is refused"
    );
    assert_eq!(b.model_calls(), 4);
}
