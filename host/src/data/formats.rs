//! The file formats a dataset is read from, each as rows of JSON objects handed to a
//! [`RowSink`] with where each is in its file (JSONL and CSV by line, JSON, Parquet and Arrow
//! by row); `rows.rs` makes samples of them. What each format's cells become is said in
//! `rows.rs`'s header.

use anyhow::{Context, Result, bail};
use serde_json::{Map, Value};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

/// Where a row is in its file.
#[derive(Debug, Clone, Copy)]
pub(super) enum At {
    Line(u64),
    Row(u64),
}

/// The readers' view of what they read into: the items so far and the bad rows.
pub(super) trait RowSink {
    fn push(&mut self, at: At, row: Result<Value, String>) -> Result<()>;
    fn full(&self) -> bool;
    fn absent_if_empty(&self, column: &str) -> bool;
}

fn open(path: &Path) -> Result<File> {
    File::open(path).with_context(|| format!("cannot open dataset file {}", path.display()))
}

pub(super) fn read_jsonl(path: &Path, rows: &mut dyn RowSink) -> Result<()> {
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

pub(super) fn read_json(path: &Path, rows: &mut dyn RowSink) -> Result<()> {
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

pub(super) fn read_csv(path: &Path, rows: &mut dyn RowSink) -> Result<()> {
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

pub(super) fn read_parquet(path: &Path, rows: &mut dyn RowSink) -> Result<()> {
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

pub(super) fn read_arrow(path: &Path, rows: &mut dyn RowSink) -> Result<()> {
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

fn without_csv_position(e: &csv::Error) -> String {
    let text = e.to_string();
    match text.split_once("): ") {
        Some((_, rest)) if text.starts_with("CSV") => rest.to_string(),
        _ => text,
    }
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
pub(super) fn without_position(e: &serde_json::Error) -> String {
    let text = e.to_string();
    match text.rfind(" at line ") {
        Some(cut) => text[..cut].to_string(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::super::config::{Format, OnBadRow};
    use super::super::rows::tests::{KEYS, options, read, user, write};
    use super::super::rows::{ReadOptions, RowKeys, read_file};
    use crate::data::test_dir;
    use crate::task::Message;
    use serde_json::json;
    use std::fs::File;
    use std::path::{Path, PathBuf};

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
}
