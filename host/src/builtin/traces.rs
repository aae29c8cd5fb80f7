//! Warm-start conversations written from the task's reference solutions, in the style of
//! whatever tool the run uses: the warm start knows no tool's syntax.
//!
//! A task's sample carries, in its metadata, a `reference`:
//!
//! ```json
//! {"reference": {"tool_calls": {"python": "```python\nprint(6 * 7)\n```", "calc": "<calc>6*7</calc>"},
//!                "answer": "<answer>42</answer>"}}
//! ```
//!
//! The run's tool is the real trigger plugin. Its style is the first of the reference calls
//! it answers (tried in name order on the first sample); each tool trace is then that call,
//! the trigger's own output (masked from the loss, as in rollouts), and the answer text.
//!
//! With functions (`rollout.tools`) instead, the style is the call format's name (`hermes`):
//! the trace is that call and the end of the turn, then the real tools' answers as the chat
//! template continues with `tool` messages (masked), then the answer text.
//! The other traces skip the tool and guess: the answer text with each number replaced by
//! another of as many digits. The share of tool traces is the recipe's; a recipe with
//! `untrained_guess_digits` learns a guess's form but not its digits (`sft_row`).

use crate::model::chat::ChatTemplate;
use crate::rng::SplitMix64;
use crate::rollout::ToolSpec;
use crate::rollout::env::tools::{self as functions, Toolbox, Written};
use crate::rollout::turns::TurnFormat;
use crate::task::{Message, Sample};
use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use tokio::runtime::Handle;

/// One warm-start conversation: the prompt, the model's text before the tool, the tool's
/// output (not trained on), and the model's text after it.
pub struct Trace {
    /// The messages as the model sees them, up to the assistant's first token.
    pub prompt: String,
    pub before: String,
    pub tool: Option<String>,
    pub after: String,
    /// Whether the model's text before the tool is trained on, and its text after it
    /// (both, but for the copy drills: see [`drills`]).
    pub learn_call: bool,
    pub learn_answer: bool,
}

/// A sample's reference solution.
#[derive(Debug, serde::Deserialize)]
struct Reference {
    /// The call that solves the sample, by tool style.
    tool_calls: BTreeMap<String, String>,
    /// The final answer, written after the tool's output.
    answer: String,
}

/// The task the warm start's samples come from, and the tool its traces call.
pub struct Source<'a> {
    /// The task's name for messages (its dataset plugin or file).
    pub task: &'a str,
    pub tool: Tool<'a>,
}

/// The run's tool: a trigger, or functions the model calls in its own format.
pub enum Tool<'a> {
    Trigger(&'a ToolSpec),
    /// The toolbox, the chat template that renders its functions into prompts, and the
    /// turn format that writes its answers as `tool` messages.
    Functions(&'a Toolbox, &'a ChatTemplate, &'a TurnFormat<'a>),
}

impl Tool<'_> {
    /// `messages` as the model sees them, up to the assistant's first token: ChatML, with
    /// the functions in the system turn when there are functions.
    fn prompt(&self, messages: &[Message]) -> Result<String> {
        match self {
            Tool::Trigger(_) => {
                let mut s = String::new();
                for m in messages {
                    s.push_str(&format!(
                        "<|im_start|>{}\n{}<|im_end|>\n",
                        m.role, m.content
                    ));
                }
                Ok(s + "<|im_start|>assistant\n")
            }
            Tool::Functions(toolbox, chat, _) => {
                let messages: Vec<serde_json::Value> = messages
                    .iter()
                    .map(|m| serde_json::to_value(m).expect("a message is JSON"))
                    .collect();
                chat.render(&messages, Some(&toolbox.template_tools), true)
            }
        }
    }

    /// The tool's name for messages.
    fn name(&self) -> String {
        match self {
            Tool::Trigger(t) => t.plugin.name().to_string(),
            Tool::Functions(b, _, _) => b
                .plugins
                .iter()
                .map(|p| p.plugin.name().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        }
    }
}

/// The traces of `samples` (the task's first training samples): a `tool_share` of them
/// call the tool.
pub fn write(
    source: &Source,
    samples: &[(u64, Sample)],
    tool_share: f64,
    seed: u64,
    handle: &Handle,
) -> Result<Vec<Trace>> {
    let Some((first_id, first)) = samples.first() else {
        bail!(
            "the task `{}` has no training samples for the warm start",
            source.task
        );
    };
    let style = match &source.tool {
        Tool::Trigger(trigger) => handle.block_on(tool_style(source, trigger, *first_id, first))?,
        Tool::Functions(toolbox, _, _) => toolbox.format.name().to_string(),
    };
    let mut rng = SplitMix64::from_state(seed ^ 0x7472_6163_6573);
    let mut out = Vec::with_capacity(samples.len());
    for (id, s) in samples {
        let reference =
            reference(s).with_context(|| format!("the task `{}`'s sample {id}", source.task))?;
        let use_tool = (rng.next_u64() % 1000) as f64 / 1000.0 < tool_share;
        if use_tool {
            let call = reference.tool_calls.get(&style).with_context(|| {
                format!(
                    "the task `{}`'s sample {id} has no reference call in the `{style}` style of the tool `{}` (it has {})",
                    source.task,
                    source.tool.name(),
                    styles(&reference)
                )
            })?;
            let (before, tool) = match &source.tool {
                Tool::Trigger(trigger) => {
                    let tool = handle.block_on(fire(trigger, s, call))?.with_context(|| {
                        format!(
                            "the tool `{}` did not answer the task `{}`'s reference call for sample {id}: {call:?}",
                            trigger.plugin.name(),
                            source.task
                        )
                    })?;
                    (call.clone(), tool)
                }
                // The turn ends after its calls; the tool messages follow it.
                Tool::Functions(toolbox, _, turns) => (
                    format!("{call}{END_OF_TURN}"),
                    handle
                        .block_on(answer_calls(toolbox, turns, s, call))
                        .with_context(|| {
                            format!(
                                "the task `{}`'s sample {id}'s reference call {call:?}",
                                source.task
                            )
                        })?,
                ),
            };
            out.push(Trace {
                prompt: source.tool.prompt(&s.messages)?,
                before,
                tool: Some(tool),
                after: reference.answer,
                learn_call: true,
                learn_answer: true,
            });
        } else {
            out.push(Trace {
                prompt: source.tool.prompt(&s.messages)?,
                before: guess(&reference.answer, &mut rng),
                tool: None,
                after: String::new(),
                learn_call: true,
                learn_answer: true,
            });
        }
    }
    Ok(out)
}

fn reference(sample: &Sample) -> Result<Reference> {
    const FORM: &str = "{\"tool_calls\": {STYLE: CALL}, \"answer\": TEXT}";
    let value = sample.metadata.get("reference").with_context(|| {
        format!("no `reference` in its metadata: a built-in model's warm start writes the task's reference solutions ({FORM})")
    })?;
    serde_json::from_value(value.clone())
        .with_context(|| format!("metadata.reference is not {FORM}"))
}

fn styles(reference: &Reference) -> String {
    let names: Vec<&str> = reference.tool_calls.keys().map(String::as_str).collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// The built-in models' end-of-turn token (ChatML).
pub const END_OF_TURN: &str = "<|im_end|>";

/// The style of the run's trigger: the first of `sample`'s reference calls (by style name)
/// that it answers.
async fn tool_style(
    source: &Source<'_>,
    trigger: &ToolSpec,
    id: u64,
    sample: &Sample,
) -> Result<String> {
    let (style, styles) = answered_style(trigger, sample)
        .await
        .with_context(|| format!("the task `{}`'s sample {id}", source.task))?;
    style.with_context(|| {
        format!(
            "the tool `{}` ({}) answers none of the task `{}`'s reference calls (styles: {styles}): the warm start has no tool call to write for it; use a tool in one of those styles, or a task whose references include this tool's",
            trigger.plugin.name(),
            trigger.plugin.spec().path.display(),
            source.task,
        )
    })
}

/// What follows a reference call of functions in a trace: the real tools' answers as the
/// chat template continues the conversation with `tool` messages, up to the next assistant
/// header. Every call must be well formed and answered.
async fn answer_calls(
    toolbox: &Toolbox,
    turns: &TurnFormat<'_>,
    sample: &Sample,
    call: &str,
) -> Result<String> {
    let turn = toolbox.read(call);
    if turn.calls.is_empty() {
        bail!("no call in the `{}` format", toolbox.format.name());
    }
    let written: Vec<Written> = turn
        .calls
        .into_iter()
        .enumerate()
        .map(|(k, call)| Written {
            id: format!("call_1_{k}"),
            call,
        })
        .collect();
    let sessions = toolbox.plugins.iter().map(|_| None).collect();
    let (_, answers, faults) = functions::run(toolbox, sessions, sample, 0, &written).await;
    if let Some(f) = faults.first() {
        bail!("the tools failed: {f}");
    }
    if let Some(a) = answers.iter().find(|a| a.kind != "ok") {
        bail!("the call was answered `{}` ({}): {}", a.kind, a.id, a.text);
    }
    let mut history = sample.messages.clone();
    history.push(functions::assistant_message(turn.content, &written));
    turns.continuation(&history, &functions::tool_messages(&answers), END_OF_TURN)
}

/// Whether `sample`'s reference has a call in the toolbox's format that only calls its
/// functions: the test a built-in run's task passes for a `--plugin` of functions.
pub fn calls_functions(
    toolbox_functions: &[crate::plugin::FunctionSpec],
    format: crate::rollout::tool_calls::CallFormat,
    sample: &Sample,
) -> Result<bool> {
    let reference = reference(sample)?;
    let Some(call) = reference.tool_calls.get(format.name()) else {
        return Ok(false);
    };
    let turn = crate::rollout::tool_calls::parse(format, call, toolbox_functions);
    Ok(!turn.calls.is_empty()
        && turn.calls.iter().all(|c| {
            c.as_ref()
                .is_ok_and(|c| crate::rollout::tool_calls::check(c, toolbox_functions).is_ok())
        }))
}

/// The first style (by name) of `sample`'s reference calls that the trigger answers, if
/// any, and the list of styles the sample has (for messages).
pub async fn answered_style(
    trigger: &ToolSpec,
    sample: &Sample,
) -> Result<(Option<String>, String)> {
    let reference = reference(sample)?;
    for (style, call) in &reference.tool_calls {
        if fire(trigger, sample, call).await?.is_some() {
            return Ok((Some(style.clone()), styles(&reference)));
        }
    }
    Ok((None, styles(&reference)))
}

/// What the trigger answers to `call` written as the whole assistant text so far, in a
/// fresh session (as a rollout's first call).
async fn fire(trigger: &ToolSpec, sample: &Sample, call: &str) -> Result<Option<String>> {
    let mut session = trigger
        .plugin
        .open_trigger(&trigger.config, sample, 0)
        .await
        .with_context(|| {
            format!(
                "opening the tool `{}` for the warm-start traces",
                trigger.plugin.name()
            )
        })?;
    session.fire(call).await.map_err(|f| {
        anyhow::anyhow!(
            "the tool `{}` failed on a reference call {call:?}: {f}",
            trigger.plugin.name()
        )
    })
}

/// `n` copy drills made from `traces`' tool traces, in turn, two of each (one of each kind):
/// - **answer drills**: every number in the tool's output replaced by a random one of 1 to
///   [`DRILL_DIGITS`] digits, and the same number in the answer by the same; only the
///   answer is trained on (the call no longer matches the output);
/// - **call drills**: every number of two or more digits in the problem that the call
///   copies replaced by a random one of 2 to [`CALL_DRILL_DIGITS`] digits, there and in
///   the call; only the call is trained on (the output was the old numbers'). A trace
///   whose call copies no such number gives an answer drill instead.
///
/// The task's own numbers are mostly short, and a 2-layer model learns to copy those by
/// their position (after the output's tag, in the problem's sentence); copying a number of
/// any length is what the task needs, and these drills ask for it alone, at every length.
/// Empty when no trace calls the tool.
pub fn drills(traces: &[Trace], n: usize, seed: u64) -> Vec<Trace> {
    let tools: Vec<&Trace> = traces.iter().filter(|t| t.tool.is_some()).collect();
    if tools.is_empty() {
        return Vec::new();
    }
    let mut rng = SplitMix64::from_state(seed ^ 0x6472_696c_6c73);
    (0..n)
        .map(|i| {
            // Each trace gives one drill of each kind before the next is used.
            let t = tools[(i / 2) % tools.len()];
            if i % 2 == 1
                && let Some(drill) = call_drill(t, &mut rng)
            {
                return drill;
            }
            let mut swap = BTreeMap::new();
            let tool = map_numbers(t.tool.as_deref().unwrap_or(""), |run| {
                let len = 1 + (rng.next_u64() % DRILL_DIGITS as u64) as usize;
                swap.entry(run.to_string())
                    .or_insert_with(|| random_digits(len, &mut rng))
                    .clone()
            });
            let after = map_numbers(&t.after, |run| {
                swap.get(run).cloned().unwrap_or_else(|| run.to_string())
            });
            Trace {
                prompt: t.prompt.clone(),
                before: t.before.clone(),
                tool: Some(tool),
                after,
                learn_call: false,
                learn_answer: true,
            }
        })
        .collect()
}

/// A call drill of `t` (see [`drills`]), if its call copies a number of the problem.
fn call_drill(t: &Trace, rng: &mut SplitMix64) -> Option<Trace> {
    let mut copied = std::collections::BTreeSet::new();
    map_numbers(&t.before, |run| {
        copied.insert(run.to_string());
        run.to_string()
    });
    let mut swap = BTreeMap::new();
    let prompt = map_numbers(&t.prompt, |run| {
        if run.len() < 2 || !copied.contains(run) {
            return run.to_string();
        }
        let len = 2 + (rng.next_u64() % (CALL_DRILL_DIGITS as u64 - 1)) as usize;
        swap.entry(run.to_string())
            .or_insert_with(|| random_digits(len, rng))
            .clone()
    });
    if swap.is_empty() {
        return None;
    }
    let before = map_numbers(&t.before, |run| {
        swap.get(run).cloned().unwrap_or_else(|| run.to_string())
    });
    Some(Trace {
        prompt,
        before,
        tool: t.tool.clone(),
        after: t.after.clone(),
        learn_call: true,
        learn_answer: false,
    })
}

/// The longest number of a call drill's problem.
pub const CALL_DRILL_DIGITS: usize = 6;

/// The longest number a copy drill asks for.
pub const DRILL_DIGITS: usize = 12;

/// `text` with each run of ASCII digits replaced by `with(run)`.
fn map_numbers(text: &str, mut with: impl FnMut(&str) -> String) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find(|c: char| c.is_ascii_digit()) {
        out.push_str(&rest[..start]);
        let len = rest[start..]
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len() - start);
        out.push_str(&with(&rest[start..start + len]));
        rest = &rest[start + len..];
    }
    out.push_str(rest);
    out
}

/// `answer` with each run of digits replaced by a random number of as many digits (no
/// leading zero): a guess of the right form, wrong somewhere.
fn guess(answer: &str, rng: &mut SplitMix64) -> String {
    map_numbers(answer, |run| random_digits(run.len(), rng))
}

fn random_digits(len: usize, rng: &mut SplitMix64) -> String {
    if len == 1 {
        return (rng.next_u64() % 10).to_string();
    }
    // Up to 18 digits as one number; longer runs digit by digit after a leading one.
    if len <= 18 {
        let lo = 10u64.pow(len as u32 - 1);
        return (lo + rng.next_u64() % (9 * lo)).to_string();
    }
    let mut s = (1 + rng.next_u64() % 9).to_string();
    for _ in 1..len {
        s.push(char::from(b'0' + (rng.next_u64() % 10) as u8));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guesses_keep_the_form_and_change_the_numbers() {
        let mut rng = SplitMix64::from_state(1);
        for _ in 0..50 {
            let g = guess("<answer>40711</answer>", &mut rng);
            let digits = &g["<answer>".len()..g.len() - "</answer>".len()];
            assert_eq!(digits.len(), 5, "{g}");
            assert!(!digits.starts_with('0'), "{g}");
            assert!(g.starts_with("<answer>") && g.ends_with("</answer>"));
        }
        let g = guess("a 7 b 1234567890123456789012 c", &mut rng);
        let parts: Vec<&str> = g.split(' ').collect();
        assert_eq!((parts[0], parts[2], parts[4]), ("a", "b", "c"));
        assert_eq!((parts[1].len(), parts[3].len()), (1, 22));
        assert_eq!(guess("no digits", &mut rng), "no digits");
    }

    #[test]
    fn drills_swap_numbers_consistently_and_train_only_the_copy() {
        let trace = |prompt: &str, before: &str, tool: Option<&str>, after: &str| Trace {
            prompt: format!("<|im_start|>user\n{prompt}<|im_end|>\n"),
            before: before.into(),
            tool: tool.map(str::to_string),
            after: after.into(),
            learn_call: true,
            learn_answer: true,
        };
        let output = Some("\n<output>\n408\n</output>\n");
        let traces = [
            trace("What is 5 * 6?", "", None, "<answer>99</answer>"),
            trace(
                "What is 12 * 34?",
                "<calc>12*34</calc>",
                output,
                "<answer>408</answer> (408)",
            ),
            // Nothing of two digits in the problem: its call drills are answer drills.
            trace(
                "What is 2 * 3?",
                "<calc>2*3</calc>",
                output,
                "<answer>408</answer> (408)",
            ),
        ];
        let drills = drills(&traces, 400, 1);
        assert_eq!(drills.len(), 400);
        let (mut answers, mut calls) = (std::collections::BTreeSet::new(), 0);
        for (i, d) in drills.iter().enumerate() {
            let from = &traces[1 + (i / 2) % 2];
            assert_eq!(d.learn_call, !d.learn_answer, "one copy trained");
            if d.learn_call {
                // The problem's numbers and the call's, swapped alike; the rest kept.
                calls += 1;
                let (a, b) = d.before["<calc>".len()..d.before.len() - "</calc>".len()]
                    .split_once('*')
                    .unwrap();
                assert_eq!(
                    d.prompt,
                    format!("<|im_start|>user\nWhat is {a} * {b}?<|im_end|>\n")
                );
                for n in [a, b] {
                    assert!((2..=CALL_DRILL_DIGITS).contains(&n.len()), "{n}");
                }
                assert_eq!((&d.tool, &d.after), (&from.tool, &from.after));
                continue;
            }
            assert_eq!((&d.prompt, &d.before), (&from.prompt, &from.before));
            let tool = d.tool.as_deref().unwrap();
            let n = tool
                .strip_prefix("\n<output>\n")
                .and_then(|t| t.strip_suffix("\n</output>\n"))
                .unwrap();
            assert!(n.bytes().all(|b| b.is_ascii_digit()), "{tool}");
            assert_eq!(d.after, format!("<answer>{n}</answer> ({n})"));
            answers.insert(n.len());
        }
        assert_eq!(
            calls, 100,
            "every other drill of the trace with two-digit numbers"
        );
        assert_eq!(answers, (1..=DRILL_DIGITS).collect());
        assert!(super::drills(&traces[..1], 5, 1).is_empty());
    }

    #[test]
    fn the_multiply_draws_are_those_the_warm_start_always_made() {
        // The built-in multiply model's cache key and README figures assume these draws:
        // one for the tool choice, one for a guess of as many digits.
        let mut a = SplitMix64::from_state(7 ^ 0x7472_6163_6573);
        let mut b = SplitMix64::from_state(7 ^ 0x7472_6163_6573);
        let _ = (a.next_u64(), b.next_u64());
        let lo = 10_000u64;
        assert_eq!(
            guess("<answer>40711</answer>", &mut a),
            format!("<answer>{}</answer>", lo + b.next_u64() % (9 * lo))
        );
    }
}
