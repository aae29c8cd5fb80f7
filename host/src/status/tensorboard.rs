//! TensorBoard scalar event files, so that `tensorboard --logdir RUNS` shows a run's curves.
//!
//! Hand-written because the format is small and no maintained crate writes it
//! (tensorboard-rs is inactive and brings protobuf; syntaxdot-summary is unmaintained). We
//! write only scalars, which is two layers:
//!
//! ```text
//! file    = record*                        (events.out.tfevents.{secs}.{host}.{pid}.{n})
//! record  = len: u64 LE, masked_crc32c(len bytes): u32 LE, data, masked_crc32c(data): u32 LE
//! data    = tensorflow.Event   { 1: wall_time double, 2: step int64,
//!                                3: file_version string  (first record: "brain.Event:2")
//!                              | 5: summary Summary
//!                              | 6: session_log SessionLog { 1: status = START } }
//! Summary = { 1: repeated value Summary.Value }
//! Summary.Value = { 1: tag string, 2: simple_value float }
//! ```
//!
//! The protobuf is encoded by hand: three message types, five field kinds.

use anyhow::{Context, Result};
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// The first record of every event file; TensorBoard reads version 2 as "steps are real".
const FILE_VERSION: &str = "brain.Event:2";

/// Numbers the files this process creates, so two writers created in the same second
/// (say, a resumed run) get different names instead of clobbering each other.
static FILE_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Appends TensorBoard events to one new file. Buffered: call [`EventWriter::flush`] to
/// make what was written visible to a running TensorBoard (dropping also flushes, but
/// ignores errors).
pub struct EventWriter {
    file: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// Creates a new event file in `dir` (creating `dir`), writing the file-version record.
    pub fn create(dir: &Path) -> Result<EventWriter> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create TensorBoard directory {}", dir.display()))?;
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let n = FILE_COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!(
            "events.out.tfevents.{secs}.{}.{}.{n}",
            hostname(),
            std::process::id()
        );
        let path = dir.join(name);
        // create_new: never append to or truncate another writer's file.
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .with_context(|| format!("cannot create TensorBoard event file {}", path.display()))?;
        let mut w = EventWriter {
            file: BufWriter::new(file),
            path,
        };
        let mut event = Vec::new();
        put_event_header(&mut event, 0);
        put_bytes(&mut event, 3, FILE_VERSION.as_bytes());
        // Flushed at once, so even a run that dies before its first scalar leaves a valid file.
        w.write_record(&event)
            .and_then(|()| w.flush())
            .with_context(|| format!("cannot write TensorBoard event file {}", w.path.display()))?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One scalar; NaN/inf are written as they are (TensorBoard shows them).
    pub fn scalar(&mut self, tag: &str, step: u64, value: f64) -> io::Result<()> {
        self.write_summary(step, [(tag, value)])
    }

    /// Several scalars of one step in one event (one record).
    pub fn scalars(&mut self, step: u64, values: &[(String, f64)]) -> io::Result<()> {
        self.write_summary(step, values.iter().map(|(t, v)| (t.as_str(), *v)))
    }

    /// A `SessionLog` START event at `step`: TensorBoard then drops the points of earlier
    /// files at this step and after, as it does for a restarted TensorFlow job, so a run
    /// resumed from a checkpoint shows each step once.
    pub fn session_start(&mut self, step: u64) -> io::Result<()> {
        // SessionLog { 1: status = START (1) }
        let mut session_log = Vec::new();
        put_tag(&mut session_log, 1, WIRE_VARINT);
        session_log.push(1);
        let mut event = Vec::with_capacity(24);
        put_event_header(&mut event, step);
        put_bytes(&mut event, 6, &session_log);
        self.write_record(&event)?;
        self.flush()
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }

    fn write_summary<'a>(
        &mut self,
        step: u64,
        values: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> io::Result<()> {
        let mut summary = Vec::new();
        let mut value = Vec::new();
        for (tag, v) in values {
            value.clear();
            put_bytes(&mut value, 1, tag.as_bytes());
            put_tag(&mut value, 2, WIRE_FIXED32);
            // simple_value is a proto float: TensorBoard stores scalars as f32 anyway.
            value.extend_from_slice(&(v as f32).to_le_bytes());
            put_bytes(&mut summary, 1, &value);
        }
        let mut event = Vec::with_capacity(summary.len() + 24);
        put_event_header(&mut event, step);
        put_bytes(&mut event, 5, &summary);
        self.write_record(&event)
    }

    /// One TFRecord: the length and the data, each followed by its masked CRC.
    fn write_record(&mut self, data: &[u8]) -> io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.file.write_all(&len)?;
        self.file.write_all(&masked_crc32c(&len).to_le_bytes())?;
        self.file.write_all(data)?;
        self.file.write_all(&masked_crc32c(data).to_le_bytes())
    }
}

/// TFRecord's CRC: CRC-32C, rotated and offset. TensorFlow masks it because computing the
/// CRC of data that itself holds CRCs is error prone (`tensorflow/core/lib/hash/crc32c.h`).
fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// The host name for the file name, as TensorFlow puts it there; only characters that are
/// safe in a file name are kept.
fn hostname() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    let host: String = raw
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .collect();
    if host.is_empty() {
        "localhost".to_string()
    } else {
        host
    }
}

// Protobuf wire types used here.
const WIRE_VARINT: u8 = 0;
const WIRE_FIXED64: u8 = 1;
const WIRE_LEN: u8 = 2;
const WIRE_FIXED32: u8 = 5;

fn put_varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push(v as u8 | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

fn put_tag(buf: &mut Vec<u8>, field: u32, wire: u8) {
    put_varint(buf, (u64::from(field) << 3) | u64::from(wire));
}

/// A length-delimited field: strings and embedded messages alike.
fn put_bytes(buf: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_tag(buf, field, WIRE_LEN);
    put_varint(buf, bytes.len() as u64);
    buf.extend_from_slice(bytes);
}

/// The fields every Event starts with: wall_time (1) and step (2).
fn put_event_header(buf: &mut Vec<u8>, step: u64) {
    let wall_time = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    put_tag(buf, 1, WIRE_FIXED64);
    buf.extend_from_slice(&wall_time.to_le_bytes());
    // proto3 leaves out zeros; so do we, so that our bytes are exactly protobuf's.
    if step != 0 {
        put_tag(buf, 2, WIRE_VARINT);
        // int64 on the wire is the two's complement as u64; steps are never that large.
        put_varint(buf, step);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_matches_tensorflow() {
        // Reference from TensorBoard's own (pure Python) implementation:
        //   from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
        //   hex(masked_crc32c(b"123456789"))             # 0xc78ab0e5
        //   hex(masked_crc32c(b""))                      # 0xa282ead8
        //   hex(masked_crc32c((13).to_bytes(8, "little")))  # 0x34b8373c
        // (the `crc32c` package agrees: crc32c(b"123456789") == 0xe3069283, the CRC-32C
        // check value.)
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(masked_crc32c(b"123456789"), 0xc78a_b0e5);
        assert_eq!(masked_crc32c(b""), 0xa282_ead8);
        assert_eq!(masked_crc32c(&13u64.to_le_bytes()), 0x34b8_373c);
    }

    /// The records of a file, checking both CRCs of each.
    fn read_records(bytes: &[u8]) -> Vec<&[u8]> {
        let mut out = Vec::new();
        let mut rest = bytes;
        while !rest.is_empty() {
            let (len_bytes, r) = rest.split_at(8);
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            let (len_crc, r) = r.split_at(4);
            assert_eq!(
                u32::from_le_bytes(len_crc.try_into().unwrap()),
                masked_crc32c(len_bytes)
            );
            let (data, r) = r.split_at(len);
            let (data_crc, r) = r.split_at(4);
            assert_eq!(
                u32::from_le_bytes(data_crc.try_into().unwrap()),
                masked_crc32c(data)
            );
            out.push(data);
            rest = r;
        }
        out
    }

    /// A protobuf field as the tests need it.
    #[derive(Debug)]
    enum Field<'a> {
        Varint(u64),
        Fixed64([u8; 8]),
        Bytes(&'a [u8]),
        Fixed32([u8; 4]),
    }

    fn varint(buf: &mut &[u8]) -> u64 {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = buf[0];
            *buf = &buf[1..];
            v |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                break;
            }
        }
        v
    }

    fn fields(mut buf: &[u8]) -> Vec<(u32, Field<'_>)> {
        let mut out = Vec::new();
        while !buf.is_empty() {
            let key = varint(&mut buf);
            let field = match key & 7 {
                0 => Field::Varint(varint(&mut buf)),
                1 => {
                    let (v, r) = buf.split_at(8);
                    buf = r;
                    Field::Fixed64(v.try_into().unwrap())
                }
                2 => {
                    let n = varint(&mut buf) as usize;
                    let (v, r) = buf.split_at(n);
                    buf = r;
                    Field::Bytes(v)
                }
                5 => {
                    let (v, r) = buf.split_at(4);
                    buf = r;
                    Field::Fixed32(v.try_into().unwrap())
                }
                w => panic!("unexpected wire type {w}"),
            };
            out.push(((key >> 3) as u32, field));
        }
        out
    }

    /// (step, [(tag, value)]) of a summary event; None for the file-version event.
    fn decode_event(data: &[u8]) -> (u64, Option<Vec<(String, f32)>>) {
        let mut step = None;
        let mut wall_time = None;
        let mut summary = None;
        let mut version = None;
        for (n, f) in fields(data) {
            match (n, f) {
                (1, Field::Fixed64(b)) => wall_time = Some(f64::from_le_bytes(b)),
                (2, Field::Varint(v)) => step = Some(v),
                (3, Field::Bytes(b)) => version = Some(std::str::from_utf8(b).unwrap()),
                (5, Field::Bytes(b)) => summary = Some(b),
                (6, Field::Bytes(b)) => {
                    assert_eq!(b, [0x08, 0x01], "SessionLog {{ status: START }}");
                    version = Some("session start");
                }
                other => panic!("unexpected event field {other:?}"),
            }
        }
        assert!(wall_time.unwrap() > 1.6e9, "wall_time is unix seconds");
        let Some(summary) = summary else {
            assert!(matches!(version, Some(FILE_VERSION | "session start")));
            return (step.unwrap_or(0), None);
        };
        let mut values = Vec::new();
        for (n, f) in fields(summary) {
            let (1, Field::Bytes(value)) = (n, f) else {
                panic!("unexpected summary field")
            };
            let (mut tag, mut simple) = (None, None);
            for (n, f) in fields(value) {
                match (n, f) {
                    (1, Field::Bytes(b)) => tag = Some(String::from_utf8(b.to_vec()).unwrap()),
                    (2, Field::Fixed32(b)) => simple = Some(f32::from_le_bytes(b)),
                    other => panic!("unexpected value field {other:?}"),
                }
            }
            values.push((tag.unwrap(), simple.unwrap()));
        }
        (step.unwrap_or(0), Some(values))
    }

    #[test]
    fn round_trip() {
        let dir = std::env::temp_dir().join(format!("rlhost-tensorboard-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut w = EventWriter::create(&dir.join("run")).unwrap();
        let name = w.path().file_name().unwrap().to_str().unwrap().to_string();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        w.scalar("reward/mean", 1, 0.25).unwrap();
        // A step past one varint byte and a long tag (length prefix past one byte).
        let long_tag = "x".repeat(200);
        w.scalars(
            300,
            &[("loss".to_string(), 1.5), (long_tag.clone(), f64::NAN)],
        )
        .unwrap();
        w.scalar("kl", 1 << 40, f64::INFINITY).unwrap();
        w.scalar("reward/mean", 0, -2.0).unwrap();
        // A resumed run's restart marker: an event with only a step and a session log.
        w.session_start(7).unwrap();
        w.flush().unwrap();
        let path = w.path().to_path_buf();
        // A second writer in the same directory and second gets its own file.
        let w2 = EventWriter::create(&dir.join("run")).unwrap();
        assert_ne!(w2.path(), path);

        let bytes = std::fs::read(&path).unwrap();
        let events: Vec<_> = read_records(&bytes).into_iter().map(decode_event).collect();
        assert_eq!(events.len(), 6);
        assert_eq!(events[5], (7, None));
        assert_eq!(events[0], (0, None));
        assert_eq!(
            events[1],
            (1, Some(vec![("reward/mean".to_string(), 0.25)]))
        );
        let (step, values) = &events[2];
        let values = values.as_ref().unwrap();
        assert_eq!(*step, 300);
        assert_eq!(values.len(), 2);
        assert_eq!(values[0], ("loss".to_string(), 1.5));
        assert_eq!(values[1].0, long_tag);
        assert!(values[1].1.is_nan());
        assert_eq!(
            events[3],
            (1 << 40, Some(vec![("kl".to_string(), f32::INFINITY)]))
        );
        // Step 0 is left out on the wire, as protobuf does, and reads back as 0.
        assert_eq!(
            events[4],
            (0, Some(vec![("reward/mean".to_string(), -2.0)]))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
