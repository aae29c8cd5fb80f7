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
use crate::task::{Message, Sample};
use anyhow::{Context, Result, bail};
use serde_json::{Map, Value};
use std::fs::File;
use std::io::{BufRead, BufReader};
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

/// Where a row is in its file.
#[derive(Debug, Clone, Copy)]
enum At {
    Line(u64),
    Row(u64),
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

/// The readers' view of what they read into: the items so far and the bad rows.
trait Sink {
    fn push(&mut self, at: At, row: Result<Value, String>) -> Result<()>;
    fn full(&self) -> bool;
    fn absent_if_empty(&self, column: &str) -> bool;
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

impl<T> Sink for Rows<'_, T> {
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

fn open(path: &Path) -> Result<File> {
    File::open(path).with_context(|| format!("cannot open dataset file {}", path.display()))
}

fn read_jsonl(path: &Path, rows: &mut dyn Sink) -> Result<()> {
    let reader = BufReader::new(open(path)?);
    for (i, line) in reader.lines().enumerate() {
        if rows.full() {
            break;
        }
        let number = i as u64 + 1;
        let line = line.with_context(|| format!("cannot read {}:{number}", path.display()))?;
        let line = line.trim_start_matches('\u{feff}');
        if line.trim().is_empty() {
            continue;
        }
        let row = serde_json::from_str(line).map_err(|e| {
            format!(
                "not valid JSON at column {}: {}; each line must be one JSON object",
                e.column(),
                without_position(&e)
            )
        });
        rows.push(At::Line(number), row)?;
    }
    Ok(())
}

fn read_json(path: &Path, rows: &mut dyn Sink) -> Result<()> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read dataset file {}", path.display()))?;
    let text = text.trim_start_matches('\u{feff}');
    if text.trim_start().starts_with('{') {
        return read_jsonl(path, rows);
    }
    let rows_json: Value = serde_json::from_str(text).map_err(|e| {
        anyhow::anyhow!(
            "{}:{}:{}: not valid JSON: {}",
            path.display(),
            e.line(),
            e.column(),
            without_position(&e)
        )
    })?;
    let Value::Array(items) = rows_json else {
        bail!(
            "{} is {}; expected an array of rows (or one JSON object per line)",
            path.display(),
            describe(&rows_json)
        );
    };
    for (i, row) in items.into_iter().enumerate() {
        if rows.full() {
            break;
        }
        rows.push(At::Row(i as u64), Ok(row))?;
    }
    Ok(())
}

fn read_csv(path: &Path, rows: &mut dyn Sink) -> Result<()> {
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(true)
        .from_reader(open(path)?);
    let headers = reader
        .headers()
        .with_context(|| format!("cannot read the header row of {}", path.display()))?
        .clone();
    for record in reader.records() {
        if rows.full() {
            break;
        }
        let record = match record {
            Ok(record) => record,
            // A row of the wrong width or bad UTF-8 is that row's fault; anything else
            // (an I/O error) is the file's.
            Err(e) => match e.position() {
                Some(pos) => {
                    let message = match e.kind() {
                        csv::ErrorKind::UnequalLengths {
                            expected_len, len, ..
                        } => format!("has {len} fields but the header has {expected_len}"),
                        _ => without_csv_position(&e),
                    };
                    rows.push(At::Line(pos.line()), Err(message))?;
                    continue;
                }
                None => {
                    return Err(e).with_context(|| format!("cannot read {}", path.display()));
                }
            },
        };
        let line = record.position().map_or(0, |p| p.line());
        let mut row = Map::new();
        for (name, cell) in headers.iter().zip(record.iter()) {
            if cell.is_empty() && rows.absent_if_empty(name) {
                continue;
            }
            row.insert(name.to_string(), Value::String(cell.to_string()));
        }
        rows.push(At::Line(line), Ok(Value::Object(row)))?;
    }
    Ok(())
}

fn read_parquet(path: &Path, rows: &mut dyn Sink) -> Result<()> {
    use parquet::file::reader::SerializedFileReader;
    let reader = SerializedFileReader::new(open(path)?)
        .with_context(|| format!("cannot read {} as parquet", path.display()))?;
    for (i, row) in reader.into_iter().enumerate() {
        if rows.full() {
            break;
        }
        let row = row.with_context(|| format!("cannot read {}: row {i}", path.display()))?;
        rows.push(At::Row(i as u64), Ok(row.to_json_value()))?;
    }
    Ok(())
}

fn read_arrow(path: &Path, rows: &mut dyn Sink) -> Result<()> {
    use arrow_ipc::reader::{FileReader, StreamReader};
    use std::io::{Read, Seek};
    let mut i = 0u64;
    for shard in arrow_shards(path)? {
        let cannot = || format!("cannot read {} as Arrow IPC", shard.display());
        let mut file = open(&shard)?;
        // The file format starts with `ARROW1`; the stream format with a message.
        let mut magic = [0u8; 6];
        let is_file = file.read_exact(&mut magic).is_ok() && &magic == b"ARROW1";
        file.rewind().with_context(cannot)?;
        let batches: Box<dyn Iterator<Item = _>> = if is_file {
            Box::new(FileReader::try_new(BufReader::new(file), None).with_context(cannot)?)
        } else {
            Box::new(StreamReader::try_new(BufReader::new(file), None).with_context(cannot)?)
        };
        for batch in batches {
            let batch =
                batch.with_context(|| format!("cannot read {}: row {i}", shard.display()))?;
            for row in json_rows(&batch)
                .with_context(|| format!("cannot read {}: row {i}", shard.display()))?
            {
                if rows.full() {
                    return Ok(());
                }
                rows.push(At::Row(i), Ok(row))?;
                i += 1;
            }
        }
    }
    Ok(())
}

/// The Arrow files of `path`: itself, or the shards of a `save_to_disk` folder in the
/// order its `state.json` lists them.
fn arrow_shards(path: &Path) -> Result<Vec<std::path::PathBuf>> {
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let state = path.join("state.json");
    let text = std::fs::read_to_string(&state)
        .with_context(|| format!("cannot read {}", state.display()))?;
    let parsed: Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", state.display()))?;
    let files = parsed["_data_files"].as_array().with_context(|| {
        format!(
            "{}: no `_data_files` list, as save_to_disk writes",
            state.display()
        )
    })?;
    files
        .iter()
        .map(|f| match f["filename"].as_str() {
            Some(name) if !name.contains(['/', '\\']) => Ok(path.join(name)),
            _ => bail!(
                "{}: `_data_files` holds {f}, expected {{\"filename\": NAME}}",
                state.display()
            ),
        })
        .collect()
}

/// A record batch's rows as JSON objects (nulls kept as `null`, so a missing `messages`
/// reads as absent, as in parquet).
fn json_rows(batch: &arrow_array::RecordBatch) -> Result<Vec<Value>> {
    let mut writer = arrow_json::WriterBuilder::new()
        .with_explicit_nulls(true)
        .build::<_, arrow_json::writer::JsonArray>(Vec::new());
    writer.write(batch)?;
    writer.finish()?;
    let bytes = writer.into_inner();
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    Ok(serde_json::from_slice(&bytes)?)
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

/// A value as an error message shows it: scalars as JSON (long strings cut), containers by kind.
pub(crate) fn describe(value: &Value) -> String {
    match value {
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "an object".into(),
        Value::String(s) if s.chars().count() > 40 => {
            let cut: String = s.chars().take(40).collect();
            format!("{}…", Value::String(cut))
        }
        scalar => scalar.to_string(),
    }
}

/// serde_json's message without its " at line L column C" (the caller places it).
fn without_position(e: &serde_json::Error) -> String {
    let text = e.to_string();
    match text.rfind(" at line ") {
        Some(cut) => text[..cut].to_string(),
        None => text,
    }
}

fn without_csv_position(e: &csv::Error) -> String {
    let text = e.to_string();
    match text.split_once("): ") {
        Some((_, rest)) if text.starts_with("CSV") => rest.to_string(),
        _ => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::test_dir;
    use serde_json::json;
    use std::path::PathBuf;

    const KEYS: RowKeys = RowKeys {
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

    fn options(on_bad_row: OnBadRow) -> ReadOptions<'static> {
        ReadOptions {
            keys: KEYS,
            on_bad_row,
            max_samples: None,
        }
    }

    fn read(path: &Path, format: Format) -> Result<Loaded> {
        read_file(path, format, &options(OnBadRow::Error))
    }

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn user(content: &str) -> Message {
        Message {
            role: "user".into(),
            content: content.into(),
            ..Default::default()
        }
    }

    fn arrow_fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/data")
            .join(name)
    }

    /// Arrow IPC as pyarrow writes it (scripts/make_arrow_fixtures.py): Feather v2 (lz4),
    /// the file format with zstd, `messages` as list<struct<role, content>>, nulls kept.
    #[test]
    fn arrow_files_from_pyarrow_in_every_compression() {
        for name in ["chat.feather", "chat_zstd.arrow"] {
            let path = arrow_fixture(name);
            assert_eq!(Format::of(&path, None).unwrap(), Format::Arrow);
            let l = read(&path, Format::Arrow).unwrap();
            assert_eq!(l.samples.len(), 3, "{name}");
            let a = &l.samples[0];
            assert_eq!(
                a.messages,
                [
                    Message {
                        role: "system".into(),
                        content: "Be brief.".into(),
                        ..Default::default()
                    },
                    user("2+2?")
                ]
            );
            assert_eq!(a.metadata, json!({"answer": "4", "level": 1}));
            assert_eq!(l.samples[2].metadata, json!({"answer": null, "level": 3}));
        }
    }

    /// `datasets`' `save_to_disk` folder: its shards (Arrow IPC streams) in `state.json`'s
    /// order, rows counted across them; MBPP's `test_list` arrives as a list for
    /// `data.tests_key`.
    #[test]
    fn a_save_to_disk_folder_reads_its_shards_in_order() {
        let path = arrow_fixture("mbpp_saved");
        assert_eq!(Format::of(&path, None).unwrap(), Format::Arrow);
        let keys = RowKeys {
            template: Some("{text}"),
            tests: Some("test_list"),
            ..KEYS
        };
        let options = ReadOptions {
            keys,
            ..options(OnBadRow::Error)
        };
        let l = read_file(&path, Format::Arrow, &options).unwrap();
        let ids: Vec<i64> = l
            .samples
            .iter()
            .map(|s| s.metadata["task_id"].as_i64().unwrap())
            .collect();
        assert_eq!(ids, [11, 12, 13, 14, 15, 16]);
        let tests = l.samples[0].metadata["tests"].as_array().unwrap();
        assert!(tests.len() == 3 && tests[0].as_str().unwrap().starts_with("assert sum_digits("));
        assert_eq!(l.origins.locate(4), format!("{}: row 4", path.display()));
    }

    /// A stream in two batches with a null prompt in row 2: the error names the row, as
    /// counted across batches; `skip` counts it.
    #[test]
    fn an_arrow_streams_bad_row_is_named_by_its_row() {
        let path = arrow_fixture("prompts.arrows");
        let e = read(&path, Format::Arrow).unwrap_err().to_string();
        assert!(e.contains("prompts.arrows: row 2: "), "{e}");
        let l = read_file(&path, Format::Arrow, &options(OnBadRow::Skip)).unwrap();
        assert_eq!((l.samples.len(), l.skipped), (3, 1));
        let dir = test_dir("arrow-bad");
        let junk = write(&dir, "junk.arrow", "not arrow at all");
        let e = format!("{:#}", read(&junk, Format::Arrow).unwrap_err());
        assert!(
            e.contains("cannot read") && e.contains("junk.arrow as Arrow IPC"),
            "{e}"
        );
    }

    #[test]
    fn jsonl_messages_prompt_and_metadata() {
        let dir = test_dir("rows-jsonl");
        let path = write(
            &dir,
            "train.jsonl",
            concat!(
                "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \"2+2?\"}], \"answer\": \"4\", \"level\": 1}\n",
                "\n",
                "{\"prompt\": \"3*3?\", \"answer\": 9, \"extra\": {\"source\": \"gsm8k\", \"tags\": [1, 2]}}\n",
                "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"prompt\": \"kept\", \"tools\": null}\n",
            ),
        );
        let loaded = read(&path, Format::Jsonl).unwrap();
        assert_eq!(loaded.skipped, 0);
        let [a, b, c] = &loaded.samples[..] else {
            panic!("{:?}", loaded.samples)
        };
        assert_eq!(a.messages.len(), 2);
        assert_eq!(a.messages[0].role, "system");
        assert_eq!(a.metadata, json!({"answer": "4", "level": 1}));
        assert_eq!(b.messages, vec![user("3*3?")]);
        assert_eq!(
            b.metadata,
            json!({"answer": 9, "extra": {"source": "gsm8k", "tags": [1, 2]}})
        );
        // messages wins over prompt; prompt and nulls stay in the metadata as they were.
        assert_eq!(c.messages, vec![user("hi")]);
        assert_eq!(c.metadata, json!({"prompt": "kept", "tools": null}));
        let keys: Vec<&String> = b.metadata.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["answer", "extra"], "metadata keeps the file's order");
    }

    #[test]
    fn json_array_and_json_lines_named_json() {
        let dir = test_dir("rows-json");
        let array = write(
            &dir,
            "a.json",
            r#"[{"prompt": "one", "answer": "1"},
                {"messages": [{"role": "user", "content": "two"}], "answer": "2"}]"#,
        );
        let loaded = read(&array, Format::Json).unwrap();
        assert_eq!(loaded.samples.len(), 2);
        assert_eq!(loaded.samples[1].messages, vec![user("two")]);
        let lines = write(
            &dir,
            "b.json",
            "{\"prompt\": \"one\"}\n{\"prompt\": \"two\"}\n",
        );
        assert_eq!(read(&lines, Format::Json).unwrap().samples.len(), 2);
        let scalar = write(&dir, "c.json", "3");
        let err = read(&scalar, Format::Json).unwrap_err().to_string();
        assert!(err.contains("expected an array of rows"), "{err}");
        let broken = write(&dir, "d.json", "[{\"prompt\": \"one\"},\n {\"prompt\" 2}]");
        let err = read(&broken, Format::Json).unwrap_err().to_string();
        assert!(err.contains("d.json:2:"), "{err}");
    }

    #[test]
    fn csv_prompt_and_messages_columns() {
        let dir = test_dir("rows-csv");
        let path = write(
            &dir,
            "train.csv",
            concat!(
                "prompt,messages,answer,level\n",
                "\"What is 2+2, exactly?\",,007,3\n",
                ",\"[{\"\"role\"\": \"\"user\"\", \"\"content\"\": \"\"hi\"\"}]\",x,\n",
            ),
        );
        let loaded = read(&path, Format::Csv).unwrap();
        let [a, b] = &loaded.samples[..] else {
            panic!("{:?}", loaded.samples)
        };
        assert_eq!(a.messages, vec![user("What is 2+2, exactly?")]);
        // Cells stay strings: "007" is not the number 7.
        assert_eq!(a.metadata, json!({"answer": "007", "level": "3"}));
        assert_eq!(b.messages, vec![user("hi")]);
        assert_eq!(b.metadata, json!({"answer": "x", "level": ""}));
    }

    /// Writes a parquet file as pyarrow writes a DataFrame whose `messages` column holds
    /// lists of `{role, content}` dicts: `list<struct<role: string, content: string>>`.
    fn write_parquet(
        path: &Path,
        chats: &[Vec<(&str, &str)>],
        answers: &[Option<&str>],
        levels: &[i64],
        compression: parquet::basic::Compression,
    ) {
        use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
        use parquet::file::properties::WriterProperties;
        use parquet::file::writer::SerializedFileWriter;
        use parquet::schema::parser::parse_message_type;
        use std::sync::Arc;

        let schema = parse_message_type(
            "message schema {
                optional group messages (LIST) {
                    repeated group list {
                        optional group element {
                            optional binary role (STRING);
                            optional binary content (STRING);
                        }
                    }
                }
                optional binary answer (STRING);
                required int64 level;
            }",
        )
        .unwrap();
        let props = WriterProperties::builder()
            .set_compression(compression)
            .build();
        let file = File::create(path).unwrap();
        let mut writer =
            SerializedFileWriter::new(file, Arc::new(schema), Arc::new(props)).unwrap();
        let mut group = writer.next_row_group().unwrap();
        // The leaf columns role and content: one value per message; repetition level 0
        // starts a row's list, 1 continues it; definition level 4 is a present string.
        for field in [0, 1] {
            let mut values = Vec::new();
            let (mut defs, mut reps) = (Vec::new(), Vec::new());
            for chat in chats {
                for (j, message) in chat.iter().enumerate() {
                    let text = if field == 0 { message.0 } else { message.1 };
                    values.push(ByteArray::from(text));
                    defs.push(4);
                    reps.push(i16::from(j > 0));
                }
            }
            let mut column = group.next_column().unwrap().unwrap();
            column
                .typed::<ByteArrayType>()
                .write_batch(&values, Some(&defs), Some(&reps))
                .unwrap();
            column.close().unwrap();
        }
        let values: Vec<ByteArray> = answers.iter().flatten().map(|&a| a.into()).collect();
        let defs: Vec<i16> = answers.iter().map(|a| i16::from(a.is_some())).collect();
        let mut column = group.next_column().unwrap().unwrap();
        column
            .typed::<ByteArrayType>()
            .write_batch(&values, Some(&defs), None)
            .unwrap();
        column.close().unwrap();
        let mut column = group.next_column().unwrap().unwrap();
        column
            .typed::<Int64Type>()
            .write_batch(levels, None, None)
            .unwrap();
        column.close().unwrap();
        group.close().unwrap();
        writer.close().unwrap();
    }

    #[test]
    fn parquet_list_of_structs_and_typed_metadata() {
        use parquet::basic::{Compression, ZstdLevel};
        let dir = test_dir("rows-parquet");
        let chats = [
            vec![("system", "Be brief."), ("user", "2+2?")],
            vec![("user", "3*3?")],
        ];
        for (name, compression) in [
            ("snappy.parquet", Compression::SNAPPY),
            ("zstd.parquet", Compression::ZSTD(ZstdLevel::default())),
        ] {
            let path = dir.join(name);
            write_parquet(&path, &chats, &[Some("4"), None], &[1, 2], compression);
            let loaded = read(&path, Format::Parquet).unwrap();
            let [a, b] = &loaded.samples[..] else {
                panic!("{:?}", loaded.samples)
            };
            assert_eq!(a.messages[0].role, "system");
            assert_eq!(a.messages[1], user("2+2?"));
            assert_eq!(a.metadata, json!({"answer": "4", "level": 1}));
            assert_eq!(b.messages, vec![user("3*3?")]);
            assert_eq!(b.metadata, json!({"answer": null, "level": 2}));
        }
        let bad = dir.join("bad.parquet");
        let chats = [vec![("user", "fine")], vec![("user", "a"), ("robot", "b")]];
        write_parquet(&bad, &chats, &[None, None], &[0, 0], Compression::SNAPPY);
        let err = read(&bad, Format::Parquet).unwrap_err().to_string();
        assert!(
            err.contains("bad.parquet: row 1: \"messages\"[1].role is \"robot\""),
            "{err}"
        );
        let not_parquet = write(&dir, "fake.parquet", "{\"prompt\": \"x\"}");
        let err = format!("{:#}", read(&not_parquet, Format::Parquet).unwrap_err());
        assert!(
            err.contains("cannot read") && err.contains("as parquet"),
            "{err}"
        );
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
