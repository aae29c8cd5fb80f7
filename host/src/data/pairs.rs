//! Preference pairs for `rlhost dpo` and `rlhost rm`, in the shapes RL2 and TRL take:
//! a row holds a prompt and two completions, the `chosen` one preferred to the
//! `rejected` one, and optionally a `margin` (how much it is preferred, TRL's reward
//! trainer's column).
//!
//! - The prompt is `messages` (a list of `{role, content}`), or `prompt` as a string (one
//!   user message) or as a list of messages (TRL's conversational rows).
//! - Each completion is a string (one assistant reply) or a list of messages that starts
//!   with the assistant (a multi-turn reply, tool results included).
//! - With neither `messages` nor `prompt`, `chosen` and `rejected` are whole conversations
//!   and the prompt is the messages they share from the start (TRL's implicit prompt).
//!
//! The columns are named by `pairs.chosen_key`, `pairs.rejected_key` and `pairs.margin_key`;
//! the files are those `data.path` reads ([`super::rows`]), and a bad row is an error
//! naming the file, the row and the key (or is skipped with `data.on_bad_row = "skip"`).

use super::formats::describe;
use super::rows::{self, Loaded, RowOptions, parse_messages};
use super::{Format, OnBadRow};
use crate::task::Message;
use anyhow::Result;
use serde_json::{Map, Value};
use std::path::Path;

/// One preference pair.
#[derive(Debug, Clone, PartialEq)]
pub struct Pair {
    pub prompt: Vec<Message>,
    pub chosen: Vec<Message>,
    pub rejected: Vec<Message>,
    pub margin: Option<f32>,
}

/// The pairs of one file, with where each came from.
pub type LoadedPairs = Loaded<Pair>;

/// The columns a pair is read from.
#[derive(Debug, Clone, Copy)]
pub struct PairKeys<'a> {
    pub prompt: &'a str,
    pub messages: &'a str,
    pub chosen: &'a str,
    pub rejected: &'a str,
    pub margin: Option<&'a str>,
}

/// Reads the pairs of `path`: every row, or the first `max_rows` good ones.
pub fn read(
    path: &Path,
    format: Format,
    keys: PairKeys,
    on_bad_row: OnBadRow,
    max_rows: Option<usize>,
) -> Result<LoadedPairs> {
    let options = RowOptions {
        on_bad_row,
        max_rows,
        absent_if_empty: &[keys.prompt, keys.messages],
    };
    rows::read_rows(path, format, &options, |row| to_pair(row, keys))
}

/// One row as a pair, or what is wrong with it (without its location).
pub fn to_pair(row: Value, keys: PairKeys) -> Result<Pair, String> {
    let Value::Object(mut row) = row else {
        return Err(format!(
            "the row is {}; expected an object with \"{}\" and \"{}\"",
            describe(&row),
            keys.chosen,
            keys.rejected
        ));
    };
    // The settings that name the columns, for errors.
    let setting = |name: &str| format!("pairs.{name}");
    let mut chosen = completion(&mut row, keys.chosen, &setting("chosen_key"))?;
    let mut rejected = completion(&mut row, keys.rejected, &setting("rejected_key"))?;
    let prompt = match (take(&mut row, keys.messages), take(&mut row, keys.prompt)) {
        (Some(messages), _) => parse_messages(messages, keys.messages)?,
        (None, Some(Value::String(p))) if json_list(&p).is_none() => {
            if p.is_empty() {
                return Err(format!("\"{}\" is empty; expected the prompt", keys.prompt));
            }
            vec![Message::new("user", p)]
        }
        (None, Some(Value::String(p))) => parse_messages(json_list(&p).unwrap(), keys.prompt)?,
        (None, Some(p)) => parse_messages(p, keys.prompt)?,
        (None, None) => {
            // TRL's implicit prompt: the messages both conversations start with.
            let shared = chosen
                .iter()
                .zip(&rejected)
                .take_while(|(c, r)| c == r)
                .count();
            // The completions start at the last assistant message of the shared part's
            // end, never inside a prompt turn.
            let shared = chosen[..shared]
                .iter()
                .rposition(|m| m.role != "assistant")
                .map_or(0, |p| p + 1);
            if shared == 0 {
                return Err(format!(
                    "has neither \"{}\" nor \"{}\", and \"{}\" and \"{}\" share no prompt messages to take as the prompt; give the prompt in \"{}\"",
                    keys.messages, keys.prompt, keys.chosen, keys.rejected, keys.prompt
                ));
            }
            let prompt = chosen[..shared].to_vec();
            chosen.drain(..shared);
            rejected.drain(..shared);
            prompt
        }
    };
    for (key, side) in [(keys.chosen, &chosen), (keys.rejected, &rejected)] {
        match side.first() {
            None => return Err(format!("\"{key}\" has no reply after the prompt")),
            Some(m) if m.role != "assistant" => {
                return Err(format!(
                    "\"{key}\" starts with a {} message; a completion starts with the assistant's reply",
                    m.role
                ));
            }
            Some(_) => {}
        }
        if let Some((i, m)) = side.iter().enumerate().find(|(_, m)| m.role == "system") {
            return Err(format!(
                "\"{key}\"[{i}] is a system message ({:?}); a completion holds the assistant's turns and what answered them",
                m.content
            ));
        }
    }
    if prompt.last().is_some_and(|m| m.role == "assistant") {
        return Err(format!(
            "the prompt ends with an assistant message; the completions in \"{}\" and \"{}\" are the assistant's reply to it",
            keys.chosen, keys.rejected
        ));
    }
    if chosen == rejected {
        return Err(format!(
            "\"{}\" is the same as \"{}\"; a pair needs two different completions",
            keys.chosen, keys.rejected
        ));
    }
    let margin = match keys.margin {
        None => None,
        Some(key) => Some(number(take(&mut row, key), key, &setting("margin_key"))?),
    };
    Ok(Pair {
        prompt,
        chosen,
        rejected,
        margin,
    })
}

/// Text that is the JSON of a list of objects (a conversation in a CSV cell), parsed; any
/// other text is a plain message (`[INST] …` and `[1, 2]` included).
fn json_list(text: &str) -> Option<Value> {
    if !text.trim_start().starts_with('[') {
        return None;
    }
    serde_json::from_str::<Value>(text).ok().filter(|v| {
        v.as_array()
            .is_some_and(|l| !l.is_empty() && l.iter().all(Value::is_object))
    })
}

/// The value of `key`, a null counting as absent.
fn take(row: &mut Map<String, Value>, key: &str) -> Option<Value> {
    match row.shift_remove(key) {
        Some(Value::Null) | None => None,
        Some(v) => Some(v),
    }
}

/// A completion column: a string (one assistant reply) or a list of messages (or the JSON
/// text of one, as a CSV cell holds it).
fn completion(
    row: &mut Map<String, Value>,
    key: &str,
    setting: &str,
) -> Result<Vec<Message>, String> {
    let fields = row.keys().take(8).cloned().collect::<Vec<_>>().join(", ");
    match take(row, key) {
        None => Err(format!(
            "has no \"{key}\" ({setting}); its fields: {}",
            if fields.is_empty() { "none" } else { &fields }
        )),
        Some(Value::String(text)) => match json_list(&text) {
            Some(list) => parse_messages(list, key),
            None => Ok(vec![Message::new("assistant", text)]),
        },
        Some(list @ Value::Array(_)) => parse_messages(list, key),
        Some(other) => Err(format!(
            "\"{key}\" is {}; expected the reply as a string or a list of messages",
            describe(&other)
        )),
    }
}

/// A margin: a finite number (or numeric text, as a CSV cell holds it).
fn number(value: Option<Value>, key: &str, setting: &str) -> Result<f32, String> {
    let v = match &value {
        Some(Value::Number(n)) => n.as_f64(),
        Some(Value::String(s)) => s.trim().parse::<f64>().ok(),
        _ => None,
    };
    match v {
        Some(v) if v.is_finite() => Ok(v as f32),
        _ => Err(format!(
            "\"{key}\" ({setting}) is {}; expected a finite number",
            value.as_ref().map_or("absent".into(), describe)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const KEYS: PairKeys = PairKeys {
        prompt: "prompt",
        messages: "messages",
        chosen: "chosen",
        rejected: "rejected",
        margin: None,
    };

    fn roles(m: &[Message]) -> Vec<&str> {
        m.iter().map(|m| m.role.as_str()).collect()
    }

    #[test]
    fn the_shapes_rl2_and_trl_write_read_alike() {
        let want = to_pair(
            json!({"prompt": "2+2?", "chosen": "4", "rejected": "5"}),
            KEYS,
        )
        .unwrap();
        assert_eq!(roles(&want.prompt), ["user"]);
        assert_eq!(want.chosen[0].content, "4");
        let conversational = json!({
            "prompt": [{"role": "user", "content": "2+2?"}],
            "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "5"}],
        });
        assert_eq!(to_pair(conversational, KEYS).unwrap(), want);
        let rl2 = json!({"messages": [{"role": "user", "content": "2+2?"}], "chosen": "4", "rejected": "5"});
        assert_eq!(to_pair(rl2, KEYS).unwrap(), want);
        let implicit = json!({
            "chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
            "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}],
        });
        assert_eq!(to_pair(implicit, KEYS).unwrap(), want);
        // A CSV cell holds a conversation as JSON text.
        let csv = json!({"prompt": "[{\"role\": \"user\", \"content\": \"2+2?\"}]", "chosen": "4", "rejected": "5"});
        assert_eq!(to_pair(csv, KEYS).unwrap(), want);
    }

    #[test]
    fn a_multi_turn_completion_keeps_its_tool_results() {
        let p = to_pair(
            json!({"prompt": "6*7?", "chosen": [
                {"role": "assistant", "content": "<calc>6*7</calc>"},
                {"role": "tool", "content": "42"},
                {"role": "assistant", "content": "42"}], "rejected": "41"}),
            KEYS,
        )
        .unwrap();
        assert_eq!(roles(&p.chosen), ["assistant", "tool", "assistant"]);
    }

    #[test]
    fn bad_pairs_are_refused_by_key() {
        let err = |row: Value, keys: PairKeys| to_pair(row, keys).unwrap_err();
        assert!(
            err(json!({"prompt": "q", "chosen": "a"}), KEYS)
                .contains("no \"rejected\" (pairs.rejected_key)")
        );
        assert!(
            err(json!({"prompt": "q", "chosen": "a", "rejected": "a"}), KEYS)
                .contains("the same as")
        );
        assert!(
            err(json!({"prompt": "q", "chosen": 3, "rejected": "a"}), KEYS)
                .contains("\"chosen\" is 3")
        );
        assert!(
            err(json!({"prompt": "q", "chosen": [{"role": "user", "content": "x"}], "rejected": "a"}), KEYS)
                .contains("starts with a user message")
        );
        assert!(err(json!({"chosen": "a", "rejected": "b"}), KEYS).contains("share no prompt"));
        let margin = PairKeys {
            margin: Some("margin"),
            ..KEYS
        };
        assert!(
            err(
                json!({"prompt": "q", "chosen": "a", "rejected": "b"}),
                margin
            )
            .contains("\"margin\" (pairs.margin_key) is absent")
        );
        let p = to_pair(
            json!({"prompt": "q", "chosen": "a", "rejected": "b", "margin": "1.5"}),
            margin,
        )
        .unwrap();
        assert_eq!(p.margin, Some(1.5));
    }
}
