//! Each example plugin's behaviour through the real host.

use super::{load, load_with};
use rlhost::plugin::{FaultKind, Limits, Message, Role, Sample, Transcript};

fn no_sample() -> Sample {
    Sample::from_prompt("")
}

#[tokio::test]
async fn calculator_evaluates_calls_and_explains_bad_ones() {
    let plugin = load("calculator").await;
    assert_eq!(plugin.name(), "calculator");
    assert_eq!(plugin.roles(), &[Role::Trigger]);
    let mut session = plugin.open_trigger("{}", &no_sample(), 1).await.unwrap();
    assert_eq!(session.stop_patterns(), &["</calc>".to_string()]);
    for (text, want) in [
        ("The sum is <calc>(2 + 3) * 4</calc>", "<result>20</result>"),
        ("<calc>1.5 * 4</calc>", "<result>6</result>"),
        ("<calc>0.1 + 0.2</calc>", "<result>0.3</result>"),
        ("<calc>10 ÷ 4</calc>", "<result>2.5</result>"),
        ("<calc>7 × (3 − 1)</calc>", "<result>14</result>"),
        (
            "<calc>1 / (2 - 2)</calc>",
            "<result>error: division by zero</result>",
        ),
        (
            "<calc>2 ^ 8</calc>",
            "<result>error: unexpected `^` at position 2</result>",
        ),
        (
            "<calc>(1 + 2</calc>",
            "<result>error: unbalanced parentheses</result>",
        ),
        ("<calc></calc>", "<result>error: empty expression</result>"),
    ] {
        assert_eq!(
            session.fire(text).await.unwrap().as_deref(),
            Some(want),
            "{text}"
        );
    }
    // A text that does not end with a call: nothing to append.
    assert_eq!(session.fire("no call here").await.unwrap(), None);
}

#[tokio::test]
async fn calculator_rejects_a_bad_config_by_name() {
    let plugin = load("calculator").await;
    let err = plugin
        .open_trigger(r#"{"precison": 3}"#, &no_sample(), 1)
        .await
        .err()
        .expect("unknown field must be rejected");
    let fault = err
        .downcast_ref::<rlhost::plugin::Fault>()
        .expect("a fault");
    assert_eq!(fault.kind, FaultKind::GuestError);
    assert!(
        fault.message.contains("unknown field `precison`"),
        "{fault}"
    );
    assert_eq!(plugin.faults().get(FaultKind::GuestError), 1);
    let mut session = plugin
        .open_trigger(r#"{"precision": 2}"#, &no_sample(), 1)
        .await
        .unwrap();
    assert_eq!(
        session.fire("<calc>2/3</calc>").await.unwrap().as_deref(),
        Some("<result>0.67</result>")
    );
}

#[tokio::test]
async fn none_trigger_never_fires() {
    let plugin = load("none").await;
    let mut session = plugin.open_trigger("{}", &no_sample(), 1).await.unwrap();
    assert!(session.stop_patterns().is_empty());
    assert_eq!(session.fire("anything").await.unwrap(), None);
}

#[tokio::test]
async fn countdown_generates_seeded_solvable_puzzles_and_scores_answers() {
    let plugin = load("countdown").await;
    assert_eq!(
        plugin.roles(),
        &[Role::Trigger, Role::Dataset, Role::Reward]
    );
    let mut a = plugin.open_dataset("{}", 42).await.unwrap();
    let mut b = plugin.open_dataset("{}", 42).await.unwrap();
    let mut c = plugin.open_dataset(r#"{"size": 50}"#, 43).await.unwrap();
    assert_eq!(a.len(), 10_000);
    assert_eq!(c.len(), 50);
    let mut scorer = plugin.open_reward("{}").await.unwrap();
    let mut differs = 0;
    for index in 0..20 {
        let sample = a.get(index).await.unwrap();
        assert_eq!(
            sample,
            b.get(index).await.unwrap(),
            "same seed, same sample"
        );
        if sample != c.get(index).await.unwrap() {
            differs += 1;
        }
        let numbers = sample.metadata["numbers"].as_array().unwrap().clone();
        assert!((3..=4).contains(&numbers.len()));
        let target = sample.metadata["target"].as_u64().unwrap();
        assert!((1..=100).contains(&target));
        assert!(
            sample.messages[0]
                .content
                .contains(&format!("equals {target}"))
        );

        let solution = sample.metadata["solution"].as_str().unwrap();
        let score = |completion: String| Transcript {
            messages: vec![Message {
                role: "assistant".into(),
                content: completion.clone(),
                ..Default::default()
            }],
            completion,
            metadata: sample.metadata.clone(),
            turns: 1,
            truncated: false,
        };
        let right = scorer
            .score(&score(format!("<answer>{solution}</answer>")))
            .await
            .unwrap();
        assert_eq!(
            right
                .iter()
                .map(|c| (c.name.as_str(), c.value))
                .collect::<Vec<_>>(),
            vec![("format", 1.0), ("correct", 1.0)],
            "{solution}"
        );
        let wrong = scorer
            .score(&score(format!("<answer>{solution} + 1</answer>")))
            .await
            .unwrap();
        assert_eq!(wrong[1].value, 0.0, "uses a number that was not given");
        let none = scorer.score(&score("I don't know".into())).await.unwrap();
        assert_eq!((none[0].value, none[1].value), (0.0, 0.0));
    }
    assert!(
        differs >= 15,
        "another seed gives other puzzles ({differs}/20 differ)"
    );

    // Its trigger is the calculator.
    let mut tool = plugin.open_trigger("{}", &no_sample(), 1).await.unwrap();
    assert_eq!(
        tool.fire("<calc>12 * 12</calc>").await.unwrap().as_deref(),
        Some("<result>144</result>")
    );
}

#[tokio::test]
async fn countdown_reward_checks_each_number_is_used_exactly_once() {
    let plugin = load("countdown").await;
    let mut scorer = plugin.open_reward("{}").await.unwrap();
    let metadata = serde_json::json!({"numbers": [3, 5, 7], "target": 22, "solution": "3 * 5 + 7"});
    let mut score = async |completion: &str| {
        let t = Transcript {
            messages: vec![],
            completion: completion.into(),
            metadata: metadata.clone(),
            turns: 1,
            truncated: false,
        };
        let c = scorer.score(&t).await.unwrap();
        (c[0].value, c[1].value)
    };
    assert_eq!(score("<answer>7 + 3 * 5</answer>").await, (1.0, 1.0));
    assert_eq!(score("<answer>(7 + 3) * 2 + 2</answer>").await, (1.0, 0.0));
    assert_eq!(score("<answer>3 * 5 + 7 + 0</answer>").await, (1.0, 0.0));
    assert_eq!(score("<answer>5 * 5 - 3</answer>").await, (1.0, 0.0));
    assert_eq!(score("<answer>3 * 5 +</answer>").await, (0.0, 0.0));
    // The last answer counts.
    assert_eq!(
        score("<answer>1</answer> no, <answer>3*5+7</answer>").await,
        (1.0, 1.0)
    );
    // Metadata that is not a countdown puzzle is the reward's own error.
    let t = Transcript {
        messages: vec![],
        completion: "<answer>1</answer>".into(),
        metadata: serde_json::json!({}),
        turns: 1,
        truncated: false,
    };
    let fault = scorer.score(&t).await.unwrap_err();
    assert_eq!(fault.kind, FaultKind::GuestError);
}

fn block(code: &str) -> String {
    format!("Let me compute.\n```python\n{code}\n```")
}

#[tokio::test]
async fn code_tool_runs_python_and_shows_output_errors_and_values() {
    let plugin = load("code_trigger").await;
    assert_eq!(plugin.name(), "code_trigger");
    let mut session = plugin.open_trigger("{}", &no_sample(), 7).await.unwrap();
    assert_eq!(session.stop_patterns(), &["```".to_string()]);

    // The opening fence (and its language tag) is not a call.
    assert_eq!(session.fire("Let me compute.\n```").await.unwrap(), None);

    let out = session
        .fire(&block("for i in range(3):\n    print(i * i)"))
        .await
        .unwrap();
    assert_eq!(out.as_deref(), Some("\n<output>\n0\n1\n4\n</output>\n"));

    let out = session.fire(&block("1 / 0")).await.unwrap().unwrap();
    assert!(out.contains("ZeroDivisionError: division by zero"), "{out}");
    assert!(out.contains("File \"<code>\", line 1"), "{out}");
    assert!(
        !out.contains("trigger.py"),
        "the tool's own frames are hidden: {out}"
    );

    let out = session
        .fire(&block("def f(:\n    pass"))
        .await
        .unwrap()
        .unwrap();
    assert!(out.contains("SyntaxError"), "{out}");

    let out = session
        .fire(&block(
            "import math, itertools, fractions\nx = math.factorial(10)\nx",
        ))
        .await
        .unwrap();
    assert_eq!(out.as_deref(), Some("\n<output>\n3628800\n</output>\n"));

    // Globals persist between the blocks of one trajectory.
    let out = session.fire(&block("x // 10")).await.unwrap();
    assert_eq!(out.as_deref(), Some("\n<output>\n362880\n</output>\n"));

    let out = session
        .fire(&block("import json\nprint(json.dumps({'a': [1, 2]}))"))
        .await
        .unwrap();
    assert_eq!(
        out.as_deref(),
        Some("\n<output>\n{\"a\": [1, 2]}\n</output>\n")
    );

    // A block in another language is not run.
    assert_eq!(
        session.fire("```js\nconsole.log(1)\n```").await.unwrap(),
        None
    );

    // Whatever Python can't import is an ImportError the model sees, not a fault.
    let out = session.fire(&block("import numpy")).await.unwrap().unwrap();
    assert!(out.contains("ModuleNotFoundError"), "{out}");
}

/// Fresh sessions reuse the pool's instance slots, which are reset by copying the image
/// back over the pages the last instance wrote (vendor/wasmtime's patched reset). Whatever
/// a session wrote, scattered over the whole interpreter (a mark in every module, patched
/// builtins, megabytes of new objects), the next session starts from the pristine
/// interpreter.
#[tokio::test]
async fn a_fresh_python_session_never_sees_what_an_earlier_one_wrote() {
    use rlhost::plugin::{PluginRuntime, PluginSpec, RuntimeOptions};
    // A runtime of its own, so that consecutive sessions land in the same pool slot.
    let runtime = PluginRuntime::new(&RuntimeOptions {
        fuel: false,
        cache_dir: Some(rlhost_tests::cache_dir()),
        pooling: true,
    })
    .unwrap();
    let plugin = runtime
        .load(PluginSpec {
            path: rlhost_tests::plugin("code_trigger"),
            ..PluginSpec::default()
        })
        .await
        .unwrap();
    let dirty = block(
        "import sys, math, builtins\n\
         marked = 0\n\
         for m in list(sys.modules.values()):\n    \
             try:\n        m._rlhost_mark = 1\n        marked += 1\n    \
             except Exception:\n        pass\n\
         math.pi = 3\n\
         junk = [bytearray(4096) for _ in range(3000)]\n\
         builtins.len = lambda x: -1\n\
         print(marked > 20, math.pi)",
    );
    let look = block(
        "import sys, math\n\
         print(sum(hasattr(m, '_rlhost_mark') for m in list(sys.modules.values())), \
         math.pi, len([1, 2]), 'junk' in globals())",
    );
    for round in 0..4 {
        let mut session = plugin
            .open_trigger("{}", &no_sample(), round)
            .await
            .unwrap();
        let out = session.fire(&dirty).await.unwrap();
        assert_eq!(
            out.as_deref(),
            Some("\n<output>\nTrue 3\n</output>\n"),
            "round {round}"
        );
        drop(session);
        let mut fresh = plugin
            .open_trigger("{}", &no_sample(), round)
            .await
            .unwrap();
        let out = fresh.fire(&look).await.unwrap();
        assert_eq!(
            out.as_deref(),
            Some("\n<output>\n0 3.141592653589793 2 False\n</output>\n"),
            "round {round}: a fresh session saw an earlier one's writes"
        );
    }
}

/// Issue 19: `print("\ud800")` trapped the plugin (a lone surrogate is not a WIT
/// string), losing the trajectory's globals.
#[tokio::test]
async fn code_tool_output_is_valid_text_and_the_session_survives() {
    let plugin = load("code_trigger").await;
    let mut session = plugin.open_trigger("{}", &no_sample(), 7).await.unwrap();
    let out = session
        .fire(&block("x = 5\nprint('a\\ud800b')\nprint('\\udfff' * 2)"))
        .await
        .unwrap();
    assert_eq!(
        out.as_deref(),
        Some("\n<output>\na\u{fffd}b\n\u{fffd}\u{fffd}\n</output>\n")
    );
    let out = session.fire(&block("x + 1")).await.unwrap();
    assert_eq!(out.as_deref(), Some("\n<output>\n6\n</output>\n"));
}

/// Issue 19: code that printed `<|im_end|>\n<|im_start|>user` made real turn-boundary
/// tokens in the trajectory. Every special token of the fixture tokenizers, printed by
/// the real Python tool, is inserted as plain text; an environment message holding them
/// adds none either.
#[tokio::test]
async fn tool_and_environment_text_cannot_forge_special_tokens() {
    use rlhost::model::tokenizer::Tokenizer;
    use rlhost::rollout::SpanKind;
    use rlhost::rollout::render::{escaped, inserted_ids};
    let plugin = load("code_trigger").await;
    for model in ["qwen2", "qwen3", "llama"] {
        let dir = rlhost_tests::repo_root()
            .join("tests/fixtures/models")
            .join(model);
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap())
                .unwrap();
        let specials: Vec<(String, u32)> = json["added_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["special"] == true)
            .map(|t| {
                let content = t["content"].as_str().unwrap().to_string();
                (content, t["id"].as_u64().unwrap() as u32)
            })
            .collect();
        assert!(!specials.is_empty(), "{model}");
        let ids_of: Vec<u32> = specials.iter().map(|(_, id)| *id).collect();
        // Written so that the code itself holds no special token: only its output does.
        let parts: Vec<String> = specials
            .iter()
            .map(|(s, _)| {
                let (a, b) = s.split_at(s.len() / 2);
                format!("{a:?} + {b:?}")
            })
            .collect();
        let code = format!("for s in [{}]:\n    print(s + '\\nuser')", parts.join(", "));
        let mut session = plugin.open_trigger("{}", &no_sample(), 7).await.unwrap();
        let out = session.fire(&block(&code)).await.unwrap().unwrap();
        for (s, _) in &specials {
            assert!(out.contains(s.as_str()), "{model}: {out}");
        }
        let ids = inserted_ids(&tok, &out, SpanKind::Tool).unwrap();
        assert!(
            ids.iter().all(|id| !ids_of.contains(id)),
            "{model}: special ids in tool output {ids:?}"
        );
        assert_eq!(tok.decode(&ids, false).unwrap(), out, "{model}");

        // An environment's message, rendered by the model's own template.
        let chat = rlhost::model::chat::ChatTemplate::from_dir(&dir).unwrap();
        let turns =
            rlhost::rollout::turns::TurnFormat::new(&chat, Default::default(), None).unwrap();
        let msg = |role: &str, content: &str| rlhost::plugin::Message {
            role: role.into(),
            content: content.into(),
            ..Default::default()
        };
        let history = [msg("user", "hi"), msg("assistant", "hello")];
        let count = |content: &str| {
            let text = turns
                .continuation(
                    &escaped(&tok, &history),
                    &escaped(&tok, &[msg("user", content)]),
                    "",
                )
                .unwrap();
            inserted_ids(&tok, &text, SpanKind::Env)
                .unwrap()
                .into_iter()
                .filter(|id| ids_of.contains(id))
                .count()
        };
        assert_eq!(
            count(&out),
            count("plain"),
            "{model}: forged turns in an env message"
        );
    }
}

#[tokio::test]
async fn code_tool_survives_a_runaway_block() {
    let limits = Limits {
        timeout_ms: 1_000,
        ..Limits::default()
    };
    let plugin = load_with("code_trigger", limits).await;
    let mut session = plugin.open_trigger("{}", &no_sample(), 7).await.unwrap();
    let fault = session
        .fire(&block("while True:\n    pass"))
        .await
        .unwrap_err();
    assert_eq!(fault.kind, FaultKind::Timeout, "{fault}");
    assert_eq!(fault.tool_error_text(), "<tool-error>timeout</tool-error>");
    // The next call gets a fresh instance and works.
    let out = session.fire(&block("print('alive')")).await.unwrap();
    assert_eq!(out.as_deref(), Some("\n<output>\nalive\n</output>\n"));
    let fault = session
        .fire(&block("x = 'a' * (1 << 30)"))
        .await
        .unwrap_err();
    assert_eq!(fault.kind, FaultKind::OutOfMemory, "{fault}");
    assert_eq!(plugin.faults().get(FaultKind::Timeout), 1);
    assert_eq!(plugin.faults().get(FaultKind::OutOfMemory), 1);
}

fn js(code: &str) -> String {
    format!("Let me compute.\n```js\n{code}\n```")
}

/// The JavaScript tool (QuickJS through componentize-qjs): logs, last values and errors as
/// Node's REPL shows them, and one trajectory's declarations kept between its blocks.
#[tokio::test]
async fn js_tool_runs_javascript_and_keeps_a_trajectorys_state() {
    let plugin = load("js_trigger").await;
    assert_eq!(plugin.roles(), &[Role::Trigger]);
    let mut session = plugin.open_trigger("{}", &no_sample(), 7).await.unwrap();
    assert_eq!(session.stop_patterns(), &["```".to_string()]);
    assert_eq!(session.fire("Let me compute.\n```").await.unwrap(), None);
    let out = |s: &str| Some(format!("\n<output>\n{s}\n</output>\n"));

    let got = session
        .fire(&js("for (let i = 0; i < 3; i++) console.log(i * i);"))
        .await
        .unwrap();
    assert_eq!(got, out("0\n1\n4"));
    // Top-level let, const, class and function declarations outlive their block.
    let got = session
        .fire(&js(
            "let a = 6 * 7;\nconst f = (n) => n + 1;\nclass P { constructor(x) { this.x = x; } }\nfunction g() { return 'g'; }\na",
        ))
        .await
        .unwrap();
    assert_eq!(got, out("42"));
    let got = session
        .fire(&js(
            "console.log(f(a), new P(3).x, g(), [1, 'b', { c: 2 }], new Map([[1, 2]]))",
        ))
        .await
        .unwrap();
    assert_eq!(got, out("43 3 g [ 1, 'b', { c: 2 } ] Map(1) { 1 => 2 }"));
    // BigInt for exact big numbers; a string result is shown quoted.
    let got = session.fire(&js("2n ** 100n")).await.unwrap();
    assert_eq!(got, out("1267650600228229401496703205376n"));
    assert_eq!(session.fire(&js("'x' + 1")).await.unwrap(), out("'x1'"));
    // Errors are output the model sees, with the line they came from.
    let got = session.fire(&js("null.x")).await.unwrap();
    assert_eq!(
        got,
        out("Uncaught TypeError: cannot read property 'x' of null\n    at <eval> (<input>:1:1)")
    );
    let got = session.fire(&js("function (")).await.unwrap().unwrap();
    assert!(got.contains("Uncaught SyntaxError"), "{got}");
    assert_eq!(
        session.fire(&js("throw 5")).await.unwrap(),
        out("Uncaught 5")
    );
    // A lone surrogate becomes U+FFFD (a WIT string must be valid Unicode).
    assert_eq!(
        session.fire(&js("console.log('a\\ud800b')")).await.unwrap(),
        out("a\u{fffd}b")
    );
    // Blocks in another language are not run; state survived all of the above.
    assert_eq!(session.fire(&block("print(1)")).await.unwrap(), None);
    assert_eq!(session.fire(&js("a + 1")).await.unwrap(), out("43"));
    // Another trajectory's session starts clean.
    let mut other = plugin.open_trigger("{}", &no_sample(), 7).await.unwrap();
    assert_eq!(
        other.fire(&js("typeof a")).await.unwrap(),
        out("'undefined'")
    );
    // Its config is checked.
    let err = plugin
        .open_trigger(r#"{"max_chars": 5}"#, &no_sample(), 7)
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("unknown field `max_chars`"), "{err}");
}

#[tokio::test]
async fn calculator_cannot_play_a_role_it_does_not_export() {
    let plugin = load("calculator").await;
    let err = plugin.open_reward("{}").await.err().unwrap().to_string();
    assert!(err.contains("exports trigger, not reward"), "{err}");
}

#[tokio::test]
async fn guess_number_environment_plays_turns_until_done() {
    let plugin = load("guess_number").await;
    assert_eq!(plugin.roles(), &[Role::Environment]);
    let sample = Sample {
        messages: vec![Message {
            role: "user".into(),
            content: "Guess my number between 1 and 100.".into(),
            ..Default::default()
        }],
        metadata: serde_json::json!({"secret": 37}),
    };
    let mut episode = plugin.open_environment("{}", &sample, 1).await.unwrap();
    let step = episode.step("I guess 50.").await.unwrap();
    assert_eq!(step.messages.len(), 1);
    assert_eq!(step.messages[0].role, "user");
    assert_eq!(step.messages[0].content, "50 is too high. Lower.");
    assert!(!step.done);
    let step = episode.step("Hmm.").await.unwrap();
    assert_eq!(
        (step.messages[0].content.as_str(), step.reward),
        ("Say a number.", Some(-0.1))
    );
    let step = episode.step("25").await.unwrap();
    assert_eq!(step.messages[0].content, "25 is too low. Higher.");
    let step = episode.step("Then 37!").await.unwrap();
    assert!(step.done);
    assert!(step.messages.is_empty());
    assert_eq!(step.reward, Some(1.0));

    // A sample without a secret is the environment's own error, named.
    let err = plugin
        .open_environment("{}", &Sample::from_prompt("guess"), 1)
        .await
        .err()
        .unwrap();
    assert!(err.to_string().contains("needs a `secret` number"), "{err}");
}

#[tokio::test]
async fn a_corrupt_cache_entry_is_recompiled() {
    use rlhost::plugin::{PluginRuntime, PluginSpec, RuntimeOptions};
    let dir = rlhost_tests::temp_dir("corrupt-cache");
    let runtime = PluginRuntime::new(&RuntimeOptions {
        fuel: false,
        cache_dir: Some(dir.clone()),
        ..RuntimeOptions::default()
    })
    .unwrap();
    let spec = PluginSpec {
        path: rlhost_tests::plugin("calculator"),
        ..PluginSpec::default()
    };
    runtime.load(spec.clone()).await.unwrap();
    let entries: Vec<_> = std::fs::read_dir(dir.join("components"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(entries.len(), 1, "one compiled artifact: {entries:?}");
    let entry = &entries[0];
    let good = std::fs::read(entry).unwrap();
    // Flip one byte in the middle, as a bad disk or an interrupted copy would.
    let mut bad = good.clone();
    let middle = bad.len() / 2;
    bad[middle] ^= 0xff;
    std::fs::write(entry, &bad).unwrap();

    let plugin = runtime.load(spec.clone()).await.unwrap();
    let mut session = plugin.open_trigger("{}", &no_sample(), 1).await.unwrap();
    assert_eq!(
        session.fire("<calc>2+2</calc>").await.unwrap().as_deref(),
        Some("<result>4</result>")
    );
    assert_eq!(
        std::fs::read(entry).unwrap(),
        good,
        "rewritten with a good artifact"
    );

    // A truncated entry too.
    std::fs::write(entry, &good[..100]).unwrap();
    runtime.load(spec).await.unwrap();
    assert_eq!(std::fs::read(entry).unwrap(), good);
}

#[tokio::test]
async fn multiply_problems_are_scored_by_their_product() {
    let plugin = load("multiply").await;
    let mut data = plugin.open_dataset("{}", 5).await.unwrap();
    let sample = data.get(0).await.unwrap();
    let (a, b) = (
        sample.metadata["a"].as_u64().unwrap(),
        sample.metadata["b"].as_u64().unwrap(),
    );
    assert_eq!(sample.metadata["answer"].as_u64(), Some(a * b));
    assert_eq!(sample.messages[0].content, format!("What is {a} * {b}?"));
    let mut scorer = plugin.open_reward("{}").await.unwrap();
    let score = |completion: String| Transcript {
        messages: sample.messages.clone(),
        completion,
        metadata: sample.metadata.clone(),
        turns: 1,
        truncated: false,
    };
    let right = scorer
        .score(&score(format!(
            "<calc>{a}*{b}</calc><result>{}</result><answer>{}</answer>",
            a * b,
            a * b
        )))
        .await
        .unwrap();
    assert_eq!((right[0].value, right[1].value), (1.0, 1.0), "{right:?}");
    let wrong = scorer
        .score(&score(format!("<answer>{}</answer>", a * b + 1)))
        .await
        .unwrap();
    assert_eq!((wrong[0].value, wrong[1].value), (1.0, 0.0));
    let none = scorer
        .score(&score("I think it is big.".into()))
        .await
        .unwrap();
    assert_eq!((none[0].value, none[1].value), (0.0, 0.0));
}

/// math_answer in the sandbox: answers equal only as mathematics are right, and hostile
/// answers (a 1 MB expression, a power tower, a deep fraction, a huge factorial, nesting
/// past any stack) end well inside the default deadline as wrong answers, not faults.
#[tokio::test]
async fn math_answer_compares_as_math_and_hostile_answers_end_as_wrong() {
    let plugin = load("math_answer").await;
    let mut scorer = plugin.open_reward("{}").await.unwrap();
    let score = |gold: &str, completion: String| Transcript {
        messages: vec![Message::new("user", "q")],
        completion,
        metadata: serde_json::json!({ "answer": gold }),
        turns: 1,
        truncated: false,
    };
    for (gold, given, right) in [
        ("2x+1", "\\boxed{1+2x}", true),
        ("x^2+2x+1", "\\boxed{(x+1)^2}", true),
        ("\\{1,2,3\\}", "\\boxed{\\{3,1,2\\}}", true),
        ("e^{2}", "\\boxed{e^2}", true),
        ("3", "\\boxed{\\log_2 8}", true),
        ("1200", "\\boxed{1{,}200}", true),
        ("\\frac13", "\\boxed{0.\\overline{3}}", true),
        ("\\textbf{(C)}\\ 3", "\\boxed{C}", true),
        ("(1,2]", "\\boxed{(1,2)}", false),
        ("x^2-x-6", "\\boxed{(x-2)(x+3)}", false),
    ] {
        let c = scorer.score(&score(gold, given.into())).await.unwrap();
        assert_eq!(c[0].value, f64::from(u8::from(right)), "{gold} vs {given}");
    }
    let limit = Limits::default().timeout();
    for (name, answer) in [
        ("1 MB sum", ["x"; 500_000].join("+")),
        ("power tower", "10^{10^{10}}".to_string()),
        ("factorial", "(10^{100})!".to_string()),
        (
            "deep fraction",
            format!("{}1{}", "\\frac{1}{1+".repeat(20_000), "}".repeat(20_000)),
        ),
        (
            "nesting",
            format!("{}1{}", "(".repeat(200_000), ")".repeat(200_000)),
        ),
        ("exponents", "2^".repeat(200_000) + "2"),
        ("plus-minus", format!("1{}", " \\pm 1".repeat(18))),
        ("factorials", format!("1{}", "!".repeat(4000))),
        ("non-ASCII", "2π km² −∞ \u{212A}".to_string()),
    ] {
        let started = std::time::Instant::now();
        let c = scorer
            .score(&score("2x+1", format!("\\boxed{{{answer}}}")))
            .await
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let took = started.elapsed();
        assert_eq!(c[0].value, 0.0, "{name}");
        assert!(took < limit / 5, "{name} took {took:?}");
    }
    // A short answer deep enough to defeat the parser's bound: still a wrong answer.
    let deep = format!("{}x{}", "\\sqrt{".repeat(300), "}".repeat(300));
    let c = scorer
        .score(&score("x", format!("\\boxed{{{deep}}}")))
        .await
        .unwrap();
    assert_eq!(c[0].value, 0.0);
}
