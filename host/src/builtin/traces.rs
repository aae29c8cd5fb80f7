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
//! The other traces skip the tool and guess: the answer text with each number replaced by
//! another of as many digits. The share of tool traces is the recipe's.

use crate::rollout::ToolSpec;
use crate::sample::{Message, Sample};
use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use tokio::runtime::Handle;

/// One warm-start conversation: the prompt, the model's text before the tool, the tool's
/// output (not trained on), and the model's text after it.
pub struct Trace {
    pub messages: Vec<Message>,
    pub before: String,
    pub tool: Option<String>,
    pub after: String,
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
    pub trigger: &'a ToolSpec,
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
    let style = handle.block_on(tool_style(source, *first_id, first))?;
    let mut rng = SplitMix(seed ^ 0x7472_6163_6573);
    let mut out = Vec::with_capacity(samples.len());
    for (id, s) in samples {
        let reference =
            reference(s).with_context(|| format!("the task `{}`'s sample {id}", source.task))?;
        let use_tool = (rng.next() % 1000) as f64 / 1000.0 < tool_share;
        if use_tool {
            let call = reference.tool_calls.get(&style).with_context(|| {
                format!(
                    "the task `{}`'s sample {id} has no reference call in the `{style}` style of the tool `{}` (it has {})",
                    source.task,
                    source.trigger.plugin.name(),
                    styles(&reference)
                )
            })?;
            let tool = handle
                .block_on(fire(source.trigger, s, call))?
                .with_context(|| {
                    format!(
                        "the tool `{}` did not answer the task `{}`'s reference call for sample {id}: {call:?}",
                        source.trigger.plugin.name(),
                        source.task
                    )
                })?;
            out.push(Trace {
                messages: s.messages.clone(),
                before: call.clone(),
                tool: Some(tool),
                after: reference.answer,
            });
        } else {
            out.push(Trace {
                messages: s.messages.clone(),
                before: guess(&reference.answer, &mut rng),
                tool: None,
                after: String::new(),
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

/// The style of the run's tool: the first of `sample`'s reference calls (by style name)
/// that the trigger answers.
async fn tool_style(source: &Source<'_>, id: u64, sample: &Sample) -> Result<String> {
    let (style, styles) = answered_style(source.trigger, sample)
        .await
        .with_context(|| format!("the task `{}`'s sample {id}", source.task))?;
    style.with_context(|| {
        format!(
            "the tool `{}` ({}) answers none of the task `{}`'s reference calls (styles: {styles}): the warm start has no tool call to write for it; use a tool in one of those styles, or a task whose references include this tool's",
            source.trigger.plugin.name(),
            source.trigger.plugin.spec().path.display(),
            source.task,
        )
    })
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

/// `answer` with each run of digits replaced by a random number of as many digits (no
/// leading zero): a guess of the right form, wrong somewhere.
fn guess(answer: &str, rng: &mut SplitMix) -> String {
    let mut out = String::with_capacity(answer.len());
    let mut rest = answer;
    while let Some(start) = rest.find(|c: char| c.is_ascii_digit()) {
        out.push_str(&rest[..start]);
        let len = rest[start..]
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len() - start);
        out.push_str(&random_digits(len, rng));
        rest = &rest[start + len..];
    }
    out.push_str(rest);
    out
}

fn random_digits(len: usize, rng: &mut SplitMix) -> String {
    if len == 1 {
        return (rng.next() % 10).to_string();
    }
    // Up to 18 digits as one number; longer runs digit by digit after a leading one.
    if len <= 18 {
        let lo = 10u64.pow(len as u32 - 1);
        return (lo + rng.next() % (9 * lo)).to_string();
    }
    let mut s = (1 + rng.next() % 9).to_string();
    for _ in 1..len {
        s.push(char::from(b'0' + (rng.next() % 10) as u8));
    }
    s
}

/// SplitMix64: the warm start's draws, reproducible from the run's seed.
pub(super) struct SplitMix(pub u64);

impl SplitMix {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guesses_keep_the_form_and_change_the_numbers() {
        let mut rng = SplitMix(1);
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
    fn the_multiply_draws_are_those_the_warm_start_always_made() {
        // The built-in multiply model's cache key and README figures assume these draws:
        // one for the tool choice, one for a guess of as many digits.
        let mut a = SplitMix(7 ^ 0x7472_6163_6573);
        let mut b = SplitMix(7 ^ 0x7472_6163_6573);
        let _ = (a.next(), b.next());
        let lo = 10_000u64;
        assert_eq!(
            guess("<answer>40711</answer>", &mut a),
            format!("<answer>{}</answer>", lo + b.next() % (9 * lo))
        );
    }
}
