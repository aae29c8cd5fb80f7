//! Forked plugin sessions (issue 67): a fork has its original's state at the fork, goes
//! its own way after, and answers as a fresh session that made the same calls would.
//! Each plugin below is a real one from `plugins/`.

use super::load;
use rlhost::plugin::{DirGrant, ForkError, Grants, Limits, PluginSpec, Sample, TriggerSession};

fn py(code: &str) -> String {
    format!("```python\n{code}\n```")
}

fn js(code: &str) -> String {
    format!("```js\n{code}\n```")
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
    let mut a = plugin
        .open_trigger("{}", &Sample::from_prompt(""), 9)
        .await
        .unwrap();
    for text in &history {
        fire(&mut a, text).await;
    }
    let mut b = a.fork().await.unwrap();
    let mut replayed = plugin
        .open_trigger("{}", &Sample::from_prompt(""), 9)
        .await
        .unwrap();
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
    let mut a = plugin
        .open_trigger("{}", &Sample::from_prompt(""), 3)
        .await
        .unwrap();
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

/// A plugin granted the network or the model cannot be forked: one line, asked before a
/// run, and the same refusal from `fork`.
#[tokio::test]
async fn a_plugin_granted_http_cannot_be_forked() {
    let plugin = super::runtime(false)
        .load(PluginSpec {
            path: rlhost_tests::plugin("hostile"),
            limits: Limits::default(),
            grants: Grants {
                allow_http: vec!["http://127.0.0.1:9".into()],
                ..Grants::default()
            },
        })
        .await
        .unwrap();
    let why = plugin.forkable().unwrap_err();
    assert!(
        why.contains("plugin `hostile` cannot be forked: it is granted HTTP (`allow_http`)"),
        "{why}"
    );
    let mut session = plugin
        .open_trigger(r#"{"mode": "read-file"}"#, &Sample::from_prompt(""), 1)
        .await
        .unwrap();
    let err = session.fork().await.err().expect("refused");
    assert!(
        matches!(&err, ForkError::Refused(line) if *line == why),
        "{err}"
    );
    assert!(load("calculator").await.forkable().is_ok());
}
