//! Rows of a dataset file as [`Sample`]s, in RL2's format.
//!
//! A row is `{"messages": [{"role", "content"}, ...], ...}` or `{"prompt": "...", ...}` (the
//! prompt becomes one user message); every other field goes into the sample's metadata
//! unchanged, e.g. `{"answer": "42"}`. When a row has both, `messages` wins and `prompt`
//! stays in the metadata. A `null` `messages` or `prompt` counts as absent, so that a
//! parquet file can mix both kinds of row.
//!
//! Each format is turned into JSON objects first, then one function makes samples of them:
//! - JSONL: one object per line; blank lines are skipped. Errors name the line (1-based).
//! - JSON: an array of objects; errors name the row (0-based). A `.json` file whose first
//!   character is `{` is read as JSON Lines, which is what `datasets`' `to_json` writes.
//! - CSV: a header row; cells become metadata *strings* (a CSV cell has no type, and
//!   guessing `007` into `7` would change answers); the `messages` cell holds JSON text; an
//!   empty `messages` or `prompt` cell counts as absent. Errors name the line (1-based).
//! - Parquet: columns become JSON values (nested lists and structs as arrays and objects,
//!   dates and decimals as strings, raw bytes as base64); `messages` may be a
//!   `list<struct<role, content>>`, as pyarrow writes a list of dicts, or JSON text.
//!   Errors name the row (0-based, as `df.iloc[i]`).
//! - Arrow IPC: the stream format (`datasets`' cache files and `save_to_disk` shards, read
//!   in `state.json`'s order when given the folder) or the file format (Feather v2, lz4 or
//!   zstd compressed or not); columns become JSON values as for parquet. Errors name the
//!   row (0-based, counted across shards).
//!
//! A bad row is an error naming the file, the row, the field and the fix; with
//! `on_bad_row = "skip"` it is counted instead, and one warning shows the first error.

use super::config::{Format, OnBadRow};
use super::formats::describe;
use super::formats::{
    At, RowSink, read_arrow, read_csv, read_json, read_jsonl, read_parquet, without_position,
};
use crate::task::{Message, Sample};
use anyhow::{Result, bail};
use serde_json::Value;
use std::path::Path;

/// The roles a message may have.
pub const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// The columns that hold the prompt, by name, and how a row's columns become the prompt
/// and the reward's answer.
#[derive(Debug, Clone, Copy)]
pub struct RowKeys<'a> {
    pub prompt: &'a str,
    pub messages: &'a str,
    /// `data.prompt_template`: the user message built from the row's columns.
    pub template: Option<&'a str>,
    /// `data.answer_key`: the column copied to the metadata's `answer`.
    pub answer: Option<&'a str>,
    /// `data.tests_key`: the column copied to the metadata's `tests` (JSON text parsed).
    pub tests: Option<&'a str>,
}

/// What reading rows with a [`RowKeys`] and an [`OnBadRow`] policy asks for.
#[derive(Debug, Clone, Copy)]
pub struct ReadOptions<'a> {
    pub keys: RowKeys<'a>,
    pub on_bad_row: OnBadRow,
    /// Stop after this many good samples.
    pub max_samples: Option<usize>,
}

/// The items of one file (samples, or whatever `convert` makes of a row) and the rows
/// that were skipped.
#[derive(Debug)]
pub struct Loaded<T = Sample> {
    pub samples: Vec<T>,
    /// Where each sample is in the file, for errors found after reading.
    pub origins: Origins,
    pub skipped: u64,
    /// The first skipped row's error, with its location.
    pub first_error: Option<String>,
}

/// Reads every row of `path` as a sample. An error that is not one row's (a missing file, a
/// corrupt parquet footer) always fails; so does a file with no good row.
pub fn read_file(path: &Path, format: Format, options: &ReadOptions) -> Result<Loaded> {
    let keys = options.keys;
    let how = RowOptions {
        on_bad_row: options.on_bad_row,
        max_rows: options.max_samples,
        absent_if_empty: &[keys.prompt, keys.messages],
    };
    read_rows(path, format, &how, |row| to_sample(row, keys))
}

/// How [`read_rows`] reads a file.
#[derive(Debug, Clone, Copy)]
pub struct RowOptions<'a> {
    pub on_bad_row: OnBadRow,
    /// Stop after this many good rows.
    pub max_rows: Option<usize>,
    /// CSV columns whose empty cell counts as absent (a CSV cell cannot be null).
    pub absent_if_empty: &'a [&'a str],
}

/// Reads every row of `path` as a JSON object and makes an item of it with `convert`
/// (which says what is wrong with a bad row, without its location: the reader adds the
/// file and row). Bad rows fail or are skipped as `options` says; a file with no good row
/// fails.
pub fn read_rows<T>(
    path: &Path,
    format: Format,
    options: &RowOptions,
    convert: impl Fn(Value) -> Result<T, String>,
) -> Result<Loaded<T>> {
    let mut rows = Rows::new(path, options, &convert);
    match format {
        Format::Jsonl => read_jsonl(path, &mut rows)?,
        Format::Json => read_json(path, &mut rows)?,
        Format::Csv => read_csv(path, &mut rows)?,
        Format::Parquet => read_parquet(path, &mut rows)?,
        Format::Arrow => read_arrow(path, &mut rows)?,
    }
    rows.finish()
}

/// Where the samples of one file came from: the file, and each sample's line or row.
#[derive(Debug, Default)]
pub struct Origins {
    path: std::path::PathBuf,
    at: Vec<At>,
}

impl Origins {
    /// `FILE:LINE` or `FILE: row N` of sample `i`.
    pub fn locate(&self, i: usize) -> String {
        match self.at.get(i) {
            Some(At::Line(line)) => format!("{}:{line}", self.path.display()),
            Some(At::Row(row)) => format!("{}: row {row}", self.path.display()),
            None => format!("{}: sample {i}", self.path.display()),
        }
    }
}

/// Collects items as a reader hands rows over.
struct Rows<'a, T> {
    path: &'a Path,
    options: &'a RowOptions<'a>,
    convert: &'a dyn Fn(Value) -> Result<T, String>,
    samples: Vec<T>,
    at: Vec<At>,
    skipped: u64,
    first_error: Option<String>,
}

impl<'a, T> Rows<'a, T> {
    fn new(
        path: &'a Path,
        options: &'a RowOptions<'a>,
        convert: &'a dyn Fn(Value) -> Result<T, String>,
    ) -> Self {
        Rows {
            path,
            options,
            convert,
            samples: Vec::new(),
            at: Vec::new(),
            skipped: 0,
            first_error: None,
        }
    }

    fn locate(&self, at: At) -> String {
        Origins {
            path: self.path.to_path_buf(),
            at: vec![at],
        }
        .locate(0)
    }

    fn finish(self) -> Result<Loaded<T>> {
        if self.samples.is_empty() {
            match &self.first_error {
                Some(first) => bail!(
                    "{} has no good row: all {} were skipped; the first: {first}",
                    self.path.display(),
                    self.skipped
                ),
                None => bail!("{} has no rows", self.path.display()),
            }
        }
        if let Some(first) = &self.first_error {
            tracing::warn!(
                "skipped {} bad rows of {}; the first: {first}",
                self.skipped,
                self.path.display()
            );
        }
        Ok(Loaded {
            samples: self.samples,
            origins: Origins {
                path: self.path.to_path_buf(),
                at: self.at,
            },
            skipped: self.skipped,
            first_error: self.first_error,
        })
    }
}

impl<T> RowSink for Rows<'_, T> {
    fn full(&self) -> bool {
        self.options
            .max_rows
            .is_some_and(|max| self.samples.len() >= max)
    }

    /// Takes one row, or its error; fails on a bad row unless bad rows are skipped.
    fn push(&mut self, at: At, row: Result<Value, String>) -> Result<()> {
        match row.and_then(|row| (self.convert)(row)) {
            Ok(sample) => {
                self.samples.push(sample);
                self.at.push(at);
            }
            Err(message) => {
                let located = format!("{}: {message}", self.locate(at));
                match self.options.on_bad_row {
                    OnBadRow::Error => {
                        bail!("{located} (or set data.on_bad_row = \"skip\" to skip bad rows)")
                    }
                    OnBadRow::Skip => {
                        self.skipped += 1;
                        self.first_error.get_or_insert(located);
                    }
                }
            }
        }
        Ok(())
    }

    fn absent_if_empty(&self, column: &str) -> bool {
        self.options.absent_if_empty.contains(&column)
    }
}

/// One row as a sample, or what is wrong with it (without its location).
pub fn to_sample(row: Value, keys: RowKeys) -> Result<Sample, String> {
    let Value::Object(mut row) = row else {
        return Err(format!(
            "the row is {}; expected an object with \"{}\" or \"{}\"",
            describe(&row),
            keys.messages,
            keys.prompt
        ));
    };
    if let Some(key) = keys.answer {
        let answer = column(&row, key, "data.answer_key", "the answer")?;
        row.insert("answer".to_string(), answer);
    }
    if let Some(key) = keys.tests {
        let tests = match column(&row, key, "data.tests_key", "the tests")? {
            // APPS keeps its cases as JSON text, and a CSV cell can only be text.
            Value::String(text) if text.trim_start().starts_with(['[', '{']) => {
                serde_json::from_str(&text).unwrap_or(Value::String(text))
            }
            tests => tests,
        };
        row.insert("tests".to_string(), tests);
    }
    if let Some(template) = keys.template {
        let content = render(template, &row)?;
        return Ok(Sample {
            messages: vec![Message {
                role: "user".into(),
                content,
                ..Default::default()
            }],
            metadata: Value::Object(row),
        });
    }
    // shift_remove keeps the other fields in the order the file has them.
    let messages = match row.shift_remove(keys.messages) {
        Some(Value::Null) | None => None,
        Some(messages) => Some(messages),
    };
    let messages = match messages {
        Some(messages) => parse_messages(messages, keys.messages)?,
        None => match row.get(keys.prompt) {
            Some(Value::String(prompt)) if !prompt.is_empty() => {
                let message = Message {
                    role: "user".into(),
                    content: prompt.clone(),
                    ..Default::default()
                };
                row.shift_remove(keys.prompt);
                vec![message]
            }
            Some(Value::String(_)) => {
                return Err(format!("\"{}\" is empty; expected the prompt", keys.prompt));
            }
            Some(Value::Null) | None => {
                return Err(format!(
                    "has neither \"{}\" nor \"{}\" (its fields: {}); set data.messages_key or data.prompt_key if the prompt is in another field, or data.prompt_template to build it from the row's columns",
                    keys.messages,
                    keys.prompt,
                    field_names(&row)
                ));
            }
            Some(other) => {
                return Err(format!(
                    "\"{}\" is {}; expected a string",
                    keys.prompt,
                    describe(other)
                ));
            }
        },
    };
    Ok(Sample {
        messages,
        metadata: Value::Object(row),
    })
}

/// The first fields of a row, for errors.
/// The value of the column `key` that `setting` names, which must be there and not null.
fn column(
    row: &serde_json::Map<String, Value>,
    key: &str,
    setting: &str,
    what: &str,
) -> Result<Value, String> {
    match row.get(key) {
        Some(Value::Null) | None => Err(format!(
            "has no \"{key}\" ({setting}), the column with {what}; its fields: {}",
            field_names(row)
        )),
        Some(value) => Ok(value.clone()),
    }
}

fn field_names(row: &serde_json::Map<String, Value>) -> String {
    let names: Vec<&str> = row.keys().map(String::as_str).take(8).collect();
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    }
}

/// `template` with each `{column}` replaced by the row's value there (text as it is,
/// numbers and booleans as JSON writes them). Only a name of letters, digits and `_` in
/// braces is a placeholder, so `\boxed{}` and `{1, 2}` stay as written; `{{` and `}}`
/// are a literal brace.
pub fn render(template: &str, row: &serde_json::Map<String, Value>) -> Result<String, String> {
    let mut out = String::with_capacity(template.len() + 64);
    let mut rest = template;
    while let Some(at) = rest.find(['{', '}']) {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        if tail.starts_with("{{") || tail.starts_with("}}") {
            out.push_str(&tail[..1]);
            rest = &tail[2..];
            continue;
        }
        if tail.starts_with('{')
            && let Some(end) = tail.find('}')
            && let name = &tail[1..end]
            && !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            match row.get(name) {
                Some(Value::String(text)) => out.push_str(text),
                Some(v @ (Value::Number(_) | Value::Bool(_))) => out.push_str(&v.to_string()),
                Some(other) => {
                    return Err(format!(
                        "data.prompt_template names {{{name}}}, which is {}; expected text or a number",
                        describe(other)
                    ));
                }
                None => {
                    return Err(format!(
                        "data.prompt_template names {{{name}}}, which the row lacks (its fields: {})",
                        field_names(row)
                    ));
                }
            }
            rest = &tail[end + 1..];
            continue;
        }
        out.push_str(&tail[..1]);
        rest = &tail[1..];
    }
    out.push_str(rest);
    if out.trim().is_empty() {
        return Err("data.prompt_template gives an empty prompt".into());
    }
    Ok(out)
}

/// A chat: a list of `{role, content}` objects, or JSON text holding one (CSV, parquet).
pub(crate) fn parse_messages(value: Value, key: &str) -> Result<Vec<Message>, String> {
    let value = match value {
        Value::String(text) => serde_json::from_str(&text).map_err(|e| {
            format!(
                "\"{key}\" is text but not JSON ({}); expected a list of {{\"role\", \"content\"}} objects",
                without_position(&e)
            )
        })?,
        value => value,
    };
    let Value::Array(items) = value else {
        return Err(format!(
            "\"{key}\" is {}; expected a list of {{\"role\", \"content\"}} objects",
            describe(&value)
        ));
    };
    if items.is_empty() {
        return Err(format!("\"{key}\" is empty; expected at least one message"));
    }
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            let Value::Object(mut item) = item else {
                return Err(format!(
                    "\"{key}\"[{i}] is {}; expected an object with \"role\" and \"content\"",
                    describe(&item)
                ));
            };
            let role = match item.shift_remove("role") {
                Some(Value::String(role)) if ROLES.contains(&role.as_str()) => role,
                Some(other) => {
                    return Err(format!(
                        "\"{key}\"[{i}].role is {}; expected system, user, assistant or tool",
                        describe(&other)
                    ));
                }
                None => return Err(format!("\"{key}\"[{i}] has no \"role\"")),
            };
            let content = match item.shift_remove("content") {
                Some(Value::String(content)) => content,
                Some(other) => {
                    return Err(format!(
                        "\"{key}\"[{i}].content is {}; expected a string",
                        describe(&other)
                    ));
                }
                None => return Err(format!("\"{key}\"[{i}] has no \"content\"")),
            };
            // An assistant message's calls and a tool message's call id, in the OpenAI
            // shape (`[{"id", "type": "function", "function": {"name", "arguments"}}]`).
            let tool_calls = match item.shift_remove("tool_calls") {
                None | Some(Value::Null) => Vec::new(),
                Some(calls) => serde_json::from_value(calls).map_err(|e| {
                    format!(
                        "\"{key}\"[{i}].tool_calls: {e}; expected a list of {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}"
                    )
                })?,
            };
            let tool_call_id = match item.shift_remove("tool_call_id") {
                None | Some(Value::Null) => None,
                Some(Value::String(id)) => Some(id),
                Some(other) => {
                    return Err(format!(
                        "\"{key}\"[{i}].tool_call_id is {}; expected a string",
                        describe(&other)
                    ));
                }
            };
            // Extra fields that are null are what a struct column holds for messages that
            // lack them (pyarrow unifies all dicts' keys); anything else would be dropped
            // silently, so it is refused.
            if let Some((extra, _)) = item.iter().find(|(_, v)| !v.is_null()) {
                return Err(format!(
                    "\"{key}\"[{i}] has \"{extra}\"; a message holds \"role\", \"content\", \"tool_calls\" and \"tool_call_id\""
                ));
            }
            Ok(Message {
                role,
                content,
                tool_calls,
                tool_call_id,
            })
        })
        .collect()
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::data::test_dir;
    use serde_json::json;
    use std::path::PathBuf;

    pub(crate) const KEYS: RowKeys = RowKeys {
        prompt: "prompt",
        messages: "messages",
        template: None,
        answer: None,
        tests: None,
    };

    /// GSM8K- and MATH-shaped rows work as they come: the prompt built from their
    /// columns by `data.prompt_template`, the answer column copied to `answer`; a missing
    /// column is an error naming it and the row's fields.
    #[test]
    fn a_template_builds_the_prompt_and_answer_key_names_the_answer() {
        let keys = RowKeys {
            template: Some("{question}\nPut your final answer within \\boxed{}. {{ok}}"),
            answer: Some("solution"),
            ..KEYS
        };
        let row = json!({"question": "What is 6 * 7?", "solution": "#### 42", "level": 3});
        let s = to_sample(row, keys).unwrap();
        assert_eq!(
            s.messages[0].content,
            "What is 6 * 7?\nPut your final answer within \\boxed{}. {ok}"
        );
        assert_eq!(s.metadata["answer"], "#### 42");
        assert_eq!(s.metadata["question"], "What is 6 * 7?");
        let n = to_sample(json!({"question": 7, "solution": 1}), keys).unwrap();
        assert!(n.messages[0].content.starts_with("7\n"));
        let e = to_sample(json!({"problem": "x", "solution": "1"}), keys).unwrap_err();
        assert!(
            e.contains("{question}") && e.contains("problem, solution"),
            "{e}"
        );
        let e = to_sample(json!({"question": "x"}), keys).unwrap_err();
        assert!(e.contains("\"solution\" (data.answer_key)"), "{e}");
        let e = to_sample(json!({"question": ["x"], "solution": "1"}), keys).unwrap_err();
        assert!(e.contains("expected text or a number"), "{e}");
    }

    /// MBPP-, HumanEval- and APPS-shaped rows: `data.tests_key` copies the tests column to
    /// `tests`, parsing APPS' JSON text; code that merely starts like text stays text.
    #[test]
    fn tests_key_copies_the_tests_and_parses_json_text() {
        let keys = RowKeys {
            tests: Some("input_output"),
            ..KEYS
        };
        let apps = json!({"prompt": "Add.", "input_output": "{\"inputs\": [\"1 2\\n\"], \"outputs\": [\"3\\n\"]}"});
        let s = to_sample(apps, keys).unwrap();
        assert_eq!(
            s.metadata["tests"],
            json!({"inputs": ["1 2\n"], "outputs": ["3\n"]})
        );
        assert!(
            s.metadata["input_output"].is_string(),
            "the column stays as it was"
        );
        let keys = RowKeys {
            tests: Some("test_list"),
            ..KEYS
        };
        let mbpp = json!({"prompt": "Add.", "test_list": ["assert add(1, 2) == 3"]});
        assert_eq!(
            to_sample(mbpp, keys).unwrap().metadata["tests"],
            json!(["assert add(1, 2) == 3"])
        );
        let odd = json!({"prompt": "p", "test_list": "[x for x in y]"});
        assert_eq!(
            to_sample(odd, keys).unwrap().metadata["tests"],
            "[x for x in y]"
        );
        let e = to_sample(json!({"prompt": "p", "test": "x"}), keys).unwrap_err();
        assert!(
            e.contains("\"test_list\" (data.tests_key)") && e.contains("prompt, test"),
            "{e}"
        );
    }

    pub(crate) fn options(on_bad_row: OnBadRow) -> ReadOptions<'static> {
        ReadOptions {
            keys: KEYS,
            on_bad_row,
            max_samples: None,
        }
    }

    pub(crate) fn read(path: &Path, format: Format) -> Result<Loaded> {
        read_file(path, format, &options(OnBadRow::Error))
    }

    pub(crate) fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    pub(crate) fn user(content: &str) -> Message {
        Message {
            role: "user".into(),
            content: content.into(),
            ..Default::default()
        }
    }

    #[test]
    fn every_bad_row_names_file_line_and_field() {
        let dir = test_dir("rows-bad");
        let cases = [
            (
                r#"{"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "x"}]}"#,
                r#"line3.jsonl:3: "messages"[1].role is "robot"; expected system, user, assistant or tool"#,
            ),
            (
                r#"{"messages": [{"role": 1, "content": "x"}]}"#,
                r#""messages"[0].role is 1; expected"#,
            ),
            (
                r#"{"messages": [{"role": "user"}]}"#,
                r#""messages"[0] has no "content""#,
            ),
            (
                r#"{"messages": [{"content": "x"}]}"#,
                r#""messages"[0] has no "role""#,
            ),
            (
                r#"{"messages": [{"role": "user", "content": 5}]}"#,
                r#""messages"[0].content is 5; expected a string"#,
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x", "name": "bob"}]}"#,
                r#""messages"[0] has "name"; a message holds "role", "content", "tool_calls" and "tool_call_id""#,
            ),
            (
                r#"{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]}]}"#,
                r#""messages"[0].tool_calls: missing field `function`"#,
            ),
            (
                r#"{"messages": [3]}"#,
                r#""messages"[0] is 3; expected an object"#,
            ),
            (r#"{"messages": []}"#, r#""messages" is empty"#),
            (
                r#"{"messages": {"role": "user"}}"#,
                r#""messages" is an object; expected a list"#,
            ),
            (
                r#"{"messages": "hello"}"#,
                r#""messages" is text but not JSON"#,
            ),
            (
                r#"{"question": "x", "answer": "y"}"#,
                r#"has neither "messages" nor "prompt" (its fields: question, answer); set data.messages_key"#,
            ),
            (r#"{"prompt": 3}"#, r#""prompt" is 3; expected a string"#),
            (r#"{"prompt": ""}"#, r#""prompt" is empty"#),
            (r#"["prompt"]"#, "the row is a list; expected an object"),
            (r#"{"prompt": "x""#, "not valid JSON at column 14"),
        ];
        for (line, expected) in cases {
            let path = write(
                &dir,
                "line3.jsonl",
                &format!("{{\"prompt\": \"fine\"}}\n\n{line}\n{{\"prompt\": \"fine\"}}\n"),
            );
            let err = read(&path, Format::Jsonl).unwrap_err().to_string();
            assert!(err.contains("line3.jsonl:3: "), "{line}: {err}");
            assert!(err.contains(expected), "{line}: {err}");
            assert!(err.contains("on_bad_row = \"skip\""), "{err}");
        }

        let array = write(&dir, "rows.json", r#"[{"prompt": "a"}, {"prompt": null}]"#);
        let err = read(&array, Format::Json).unwrap_err().to_string();
        assert!(err.contains("rows.json: row 1: has neither"), "{err}");

        let csv = write(
            &dir,
            "rows.csv",
            "prompt,answer\nfine,1\n\"two\nlines\",2\nwide,3,extra\n",
        );
        let err = read(&csv, Format::Csv).unwrap_err().to_string();
        assert!(
            err.contains("rows.csv:5: has 3 fields but the header has 2"),
            "{err}"
        );
        let csv = write(
            &dir,
            "chat.csv",
            "messages\n\"[{\"\"role\"\": \"\"user\"\", \"\"content\"\": \"\"a\"\"}]\"\n\"[{\"\"role\"\": \"\"robot\"\", \"\"content\"\": \"\"a\"\"}]\"\n",
        );
        let err = read(&csv, Format::Csv).unwrap_err().to_string();
        assert!(
            err.contains("chat.csv:3: \"messages\"[0].role is \"robot\""),
            "{err}"
        );
    }

    #[test]
    fn skip_counts_bad_rows_and_empty_is_an_error() {
        let dir = test_dir("rows-skip");
        let path = write(
            &dir,
            "mixed.jsonl",
            "{\"prompt\": \"a\"}\n{\"prompt\": 1}\n{\"prompt\": \"b\"}\nnot json\n{\"prompt\": \"c\"}\n",
        );
        let loaded = read_file(&path, Format::Jsonl, &options(OnBadRow::Skip)).unwrap();
        assert_eq!(loaded.samples.len(), 3);
        assert_eq!(loaded.skipped, 2);
        let first = loaded.first_error.unwrap();
        assert!(first.contains("mixed.jsonl:2: \"prompt\" is 1"), "{first}");

        let bad = write(&dir, "bad.jsonl", "{\"prompt\": 1}\n[]\n");
        let err = read_file(&bad, Format::Jsonl, &options(OnBadRow::Skip))
            .unwrap_err()
            .to_string();
        assert!(err.contains("has no good row: all 2 were skipped"), "{err}");
        let empty = write(&dir, "empty.jsonl", "\n\n");
        let err = read(&empty, Format::Jsonl).unwrap_err().to_string();
        assert!(err.contains("empty.jsonl has no rows"), "{err}");
        let err = format!(
            "{:#}",
            read(&dir.join("missing.csv"), Format::Csv).unwrap_err()
        );
        assert!(err.contains("cannot open dataset file"), "{err}");
    }

    #[test]
    fn max_samples_stops_early() {
        let dir = test_dir("rows-max");
        let path = write(
            &dir,
            "long.jsonl",
            "{\"prompt\": \"a\"}\n{\"prompt\": \"b\"}\n{\"prompt\": \"c\"}\nbroken\n",
        );
        let options = ReadOptions {
            max_samples: Some(2),
            ..options(OnBadRow::Error)
        };
        let loaded = read_file(&path, Format::Jsonl, &options).unwrap();
        assert_eq!(loaded.samples.len(), 2);
    }
}
