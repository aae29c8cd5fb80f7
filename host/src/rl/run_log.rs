//! The run directory's step records: `metrics.jsonl` (one JSON line per step) and a
//! TensorBoard event file per invocation. On resume, what a crash left is cleaned first:
//! rows past the checkpoint's step (written before it), a torn last line, temporary files
//! of interrupted writes; and TensorBoard is told to drop the older files' points from the
//! resumed step on.

use super::checkpoint;
use crate::status::figures::scalars;
use crate::status::tensorboard::EventWriter;
use crate::step::StepMetrics;
use anyhow::{Context, Result};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

pub struct RunLog {
    metrics: File,
    metrics_path: PathBuf,
    tensorboard: EventWriter,
    tensorboard_dir: PathBuf,
}

impl RunLog {
    /// Opens the records of `out_dir` for appending; `resumed_at` is the checkpoint's
    /// step when the run resumes.
    pub fn open(out_dir: &Path, resumed_at: Option<u64>) -> Result<RunLog> {
        std::fs::create_dir_all(out_dir)
            .with_context(|| format!("cannot create the run directory {}", out_dir.display()))?;
        let path = out_dir.join("metrics.jsonl");
        if let Some(step) = resumed_at {
            checkpoint::clean_temporaries(out_dir)?;
            trim_metrics(&path, step)?;
        }
        let metrics = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot write {}", path.display()))?;
        // One event file per invocation; TensorBoard merges a resumed run's files by step.
        let tensorboard_dir = out_dir.join("tensorboard");
        let mut tensorboard = EventWriter::create(&tensorboard_dir)?;
        if let Some(step) = resumed_at {
            tensorboard
                .session_start(step + 1)
                .with_context(|| format!("writing to {}", tensorboard_dir.display()))?;
        }
        Ok(RunLog {
            metrics,
            metrics_path: path,
            tensorboard,
            tensorboard_dir,
        })
    }

    /// One step's record, flushed (a crash loses no finished step's row; a torn one is
    /// dropped on resume). A failed write names its file.
    pub fn write(&mut self, m: &StepMetrics) -> Result<()> {
        self.write_row(m.step, m, &scalars(m))
    }

    /// One step's record of any trainer: `row` as its `metrics.jsonl` line, `scalars`
    /// to TensorBoard.
    pub fn write_row(
        &mut self,
        step: u64,
        row: &impl serde::Serialize,
        scalars: &[(String, f64)],
    ) -> Result<()> {
        let mut line = serde_json::to_string(row)?;
        line.push('\n');
        self.metrics
            .write_all(line.as_bytes())
            .and_then(|()| self.metrics.flush())
            .with_context(|| format!("writing {}", self.metrics_path.display()))?;
        self.tensorboard
            .scalars(step, scalars)
            .and_then(|()| self.tensorboard.flush())
            .with_context(|| format!("writing to {}", self.tensorboard_dir.display()))?;
        Ok(())
    }
}

/// Drops the rows of `metrics.jsonl` after `step` (a crash between writing a step's row
/// and its checkpoint leaves rows the resumed run takes again). A torn last line goes too.
fn trim_metrics(path: &Path, step: u64) -> Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let mut kept = String::with_capacity(text.len());
    for line in text.lines() {
        let row_step = serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|v| v.get("step").and_then(|s| s.as_u64()));
        if row_step.is_some_and(|s| s <= step) {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    if kept != text {
        crate::model::peft::write_atomic(path, kept.as_bytes())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full disk under `metrics.jsonl` (a link to /dev/full, where every write fails
    /// with ENOSPC): the error names the file and gives the OS error once.
    #[test]
    fn a_full_disk_names_the_metrics_file() {
        if !Path::new("/dev/full").exists() {
            return;
        }
        let dir = std::env::temp_dir().join(format!("rlhost-full-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("metrics.jsonl");
        let _ = std::fs::remove_file(&path);
        std::os::unix::fs::symlink("/dev/full", &path).unwrap();
        let mut log = RunLog::open(&dir, None).unwrap();
        let err = format!("{:#}", log.write(&StepMetrics::default()).unwrap_err());
        assert_eq!(
            err,
            format!(
                "writing {}: No space left on device (os error 28)",
                path.display()
            )
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Issue 19: after a crash, rows of steps past the checkpoint were taken again.
    #[test]
    fn rows_past_the_checkpoint_and_torn_lines_are_dropped() {
        let dir = std::env::temp_dir().join(format!("rlhost-trim-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("metrics.jsonl");
        std::fs::write(
            &path,
            "{\"step\":1,\"loss\":0.5}\n{\"step\":2}\n{\"step\":3}\n{\"step\":4}\n{\"st",
        )
        .unwrap();
        trim_metrics(&path, 2).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"step\":1,\"loss\":0.5}\n{\"step\":2}\n"
        );
        // Nothing to drop: the file is left as it is; no file: nothing to do.
        trim_metrics(&path, 2).unwrap();
        trim_metrics(&dir.join("none.jsonl"), 2).unwrap();
        assert!(!dir.join("none.jsonl").exists());
    }
}
