//! Checkpoints: the adapter in PEFT's format, the optimizer's moments, and the trainer's
//! position (step, data cursor, seed), written to a temporary folder and renamed into
//! place, so an interrupted write never leaves a half checkpoint under a real name.
//!
//! ```text
//! RUN/checkpoints/step-000010/adapter_config.json, adapter_model.safetensors,
//!                             optimizer.safetensors, trainer_state.json,
//!                             value_head.safetensors (PPO runs: the critic's head),
//!                             score.safetensors (`rlhost rm`: the reward model's head)
//! RUN/checkpoints/latest      the name of the newest complete checkpoint
//! ```

use super::optim::AdamW;
use super::value_head::ValueHead;
use crate::data::Cursor;
use crate::model::peft::{self, write_atomic};
use crate::model::{LanguageModel, Model};
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

const STATE_FILE: &str = "trainer_state.json";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const LATEST: &str = "latest";

/// Where the trainer stands after a checkpoint's step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Steps completed.
    pub step: u64,
    pub optimizer_step: u64,
    pub cursor: Cursor,
    pub seed: u64,
}

/// Trained tensors a checkpoint holds beside the adapter: a head of the trainer's own
/// (PPO's value head, a reward model's score head).
pub trait Head {
    /// Writes the head's file into the checkpoint folder `dir`.
    fn save(&self, dir: &Path) -> Result<()>;
}

impl Head for ValueHead {
    fn save(&self, dir: &Path) -> Result<()> {
        ValueHead::save(self, dir)
    }
}

/// Writes a checkpoint for `state.step` under `out_dir/checkpoints`, points `latest` at
/// it, and keeps the newest `keep_last`.
pub fn save(
    out_dir: &Path,
    lm: &LanguageModel,
    head: Option<&dyn Head>,
    opt: &AdamW,
    state: &TrainerState,
    keep_last: usize,
) -> Result<PathBuf> {
    let root = out_dir.join("checkpoints");
    let name = format!("step-{:06}", state.step);
    let tmp = root.join(format!(".tmp-{name}"));
    let dir = root.join(&name);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).with_context(|| format!("removing {}", tmp.display()))?;
    }
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    peft::save_adapter(&lm.model, &tmp, Some(&lm.dir.display().to_string()))?;
    if let Some(head) = head {
        head.save(&tmp)?;
    }
    let tensors: Vec<(String, candle_core::Tensor)> = opt.state()?;
    let path = tmp.join(OPTIMIZER_FILE);
    candle_core::safetensors::save(
        &tensors
            .into_iter()
            .collect::<std::collections::HashMap<_, _>>(),
        &path,
    )
    .map_err(|e| peft::innermost(&e))
    .with_context(|| format!("writing {}", path.display()))?;
    write_atomic(
        &tmp.join(STATE_FILE),
        serde_json::to_string_pretty(state)?.as_bytes(),
    )?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::rename(&tmp, &dir)
        .with_context(|| format!("renaming {} into place", tmp.display()))?;
    write_atomic(&root.join(LATEST), name.as_bytes())?;
    // By step number, not by name (a name sorts wrongly past step 999999), and never the
    // checkpoint just written, whatever else the folder holds.
    let mut steps = complete_steps(&root)?;
    steps.retain(|(n, _)| *n != state.step);
    let keep_others = keep_last.max(1) - 1;
    if steps.len() > keep_others {
        for (_, old) in &steps[..steps.len() - keep_others] {
            let _ = std::fs::remove_dir_all(old);
        }
    }
    Ok(dir)
}

/// The checkpoint a `--resume` argument names, and a warning to show when `latest` could
/// not be followed and an older complete checkpoint was taken instead.
#[derive(Debug)]
pub struct Resolved {
    pub dir: PathBuf,
    pub warning: Option<String>,
}

/// `latest` (the run's newest checkpoint) or a checkpoint folder. A `latest` that is
/// missing, unreadable or names no complete checkpoint falls back to the newest complete
/// `step-N` folder: the pointer is written after its folder, so a crash between the two,
/// or a damaged pointer, must not hide intact checkpoints.
pub fn resolve(out_dir: &Path, spec: &str) -> Result<Resolved> {
    if spec != LATEST {
        let dir = PathBuf::from(spec);
        if !dir.join(STATE_FILE).is_file() {
            bail!(
                "--resume {spec}: not a checkpoint folder (it has no {STATE_FILE}); pass `latest` or a checkpoints/step-N folder"
            );
        }
        return Ok(Resolved { dir, warning: None });
    }
    let root = out_dir.join("checkpoints");
    let pointer = root.join(LATEST);
    let problem = match std::fs::read(&pointer) {
        Ok(bytes) => match std::str::from_utf8(&bytes).map(str::trim) {
            Ok(name) if step_number(name).is_some() && is_complete(&root.join(name)) => {
                return Ok(Resolved {
                    dir: root.join(name),
                    warning: None,
                });
            }
            Ok(name) if step_number(name).is_some() => {
                format!("names {name}, which is not a complete checkpoint")
            }
            _ => "is damaged (it does not name a step-N folder)".to_string(),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => "is missing".to_string(),
        Err(e) => format!("cannot be read ({e})"),
    };
    let steps = if root.is_dir() {
        complete_steps(&root)?
    } else {
        Vec::new()
    };
    match steps.last() {
        Some((_, dir)) => Ok(Resolved {
            dir: dir.clone(),
            warning: Some(format!(
                "{} {problem}; resuming from {}, the newest complete checkpoint",
                pointer.display(),
                dir.file_name().unwrap_or_default().to_string_lossy()
            )),
        }),
        None => bail!(
            "--resume latest: no checkpoint in {} (the run has not saved one yet): start it again without --resume, with --overwrite to delete what it wrote, or choose another directory with --out",
            root.display()
        ),
    }
}

/// `step-000012` → 12.
fn step_number(name: &str) -> Option<u64> {
    name.strip_prefix("step-")?.parse().ok()
}

/// A checkpoint folder is complete once it is in place under its own name: it was renamed
/// there after its last file was written. The state file is checked as well, so a folder
/// someone emptied by hand is not taken.
fn is_complete(dir: &Path) -> bool {
    dir.join(STATE_FILE).is_file() && dir.join(OPTIMIZER_FILE).is_file()
}

/// The complete `step-N` folders under `root`, by step.
fn complete_steps(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut steps: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
        .with_context(|| format!("cannot list {}", root.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let n = step_number(&e.file_name().to_string_lossy())?;
            let path = e.path();
            is_complete(&path).then_some((n, path))
        })
        .collect();
    steps.sort();
    Ok(steps)
}

/// Removes what an interrupted write left behind: `.tmp-step-N` folders and `.NAME.tmp-PID`
/// files in the run directory and its checkpoint folder. Called before a run resumes.
pub fn clean_temporaries(out_dir: &Path) -> Result<()> {
    for dir in [out_dir.to_path_buf(), out_dir.join("checkpoints")] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.filter_map(|e| e.ok()) {
            let name = e.file_name().to_string_lossy().into_owned();
            // `.tmp-step-N` folders and `.NAME.tmp-PID` files.
            if name.starts_with('.') && name.contains(".tmp-") {
                let path = e.path();
                remove(&path)
                    .with_context(|| format!("cannot remove the leftover {}", path.display()))?;
            }
        }
    }
    Ok(())
}

/// Removes a file or a folder with what it holds; one that is not there is no error.
pub fn remove(path: &Path) -> std::io::Result<()> {
    let removed = if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    match removed {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// Whether `out_dir` holds a run already: metrics rows or checkpoints.
pub fn holds_a_run(out_dir: &Path) -> bool {
    let metrics = out_dir.join("metrics.jsonl");
    let has_rows = std::fs::metadata(&metrics).is_ok_and(|m| m.len() > 0);
    let root = out_dir.join("checkpoints");
    let has_checkpoints = std::fs::read_dir(&root).is_ok_and(|mut entries| {
        entries.any(|e| {
            e.is_ok_and(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                name == LATEST || step_number(&name).is_some()
            })
        })
    });
    has_rows || has_checkpoints
}

/// The trainer's position recorded in a checkpoint.
pub fn read_state(dir: &Path) -> Result<TrainerState> {
    let path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{} is not a trainer state", path.display()))
}

/// Loads the checkpoint's adapter into `model` and returns the trainer's position.
pub fn load_into(dir: &Path, model: &mut Model) -> Result<TrainerState> {
    let state = read_state(dir)?;
    peft::load_adapter(model, dir)
        .with_context(|| format!("loading the adapter of {}", dir.display()))?;
    Ok(state)
}

/// Restores the optimizer's moments.
pub fn load_optimizer(dir: &Path, opt: &mut AdamW, step: u64) -> Result<()> {
    let path = dir.join(OPTIMIZER_FILE);
    let tensors = candle_core::safetensors::load(&path, &candle_core::Device::Cpu)
        .with_context(|| format!("cannot read {}", path.display()))?;
    opt.load_state(&tensors, step)
        .with_context(|| format!("{}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_dir(name: &str, steps: &[u64]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rlhost-ckpt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for s in steps {
            let d = dir.join("checkpoints").join(format!("step-{s:06}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join(STATE_FILE), "{}").unwrap();
            std::fs::write(d.join(OPTIMIZER_FILE), "").unwrap();
        }
        dir
    }

    /// Issue 19: a garbage or missing `latest` hid intact checkpoints.
    #[test]
    fn a_damaged_latest_falls_back_to_the_newest_complete_checkpoint() {
        let dir = run_dir("latest", &[4, 5, 6]);
        let root = dir.join("checkpoints");
        // An incomplete folder (no state file) is never taken.
        std::fs::create_dir_all(root.join("step-000007")).unwrap();
        std::fs::write(root.join(LATEST), "step-000005").unwrap();
        let r = resolve(&dir, "latest").unwrap();
        assert_eq!((r.dir, r.warning), (root.join("step-000005"), None));
        for (pointer, problem) in [
            (Some(&b"\xff\x00garbage"[..]), "is damaged"),
            (Some(b"step-000007"), "not a complete checkpoint"),
            (Some(b"step-000099"), "not a complete checkpoint"),
            (None, "is missing"),
        ] {
            match pointer {
                Some(bytes) => std::fs::write(root.join(LATEST), bytes).unwrap(),
                None => std::fs::remove_file(root.join(LATEST)).unwrap(),
            }
            let r = resolve(&dir, "latest").unwrap();
            assert_eq!(r.dir, root.join("step-000006"));
            let w = r.warning.unwrap();
            assert!(w.contains(problem) && w.contains("step-000006"), "{w}");
        }
        let empty = run_dir("latest-empty", &[]);
        let e = resolve(&empty, "latest").unwrap_err().to_string();
        // Issue 51: it says how to start again, as the fresh start's refusal does.
        assert!(
            e.contains("no checkpoint in") && e.contains("--overwrite") && e.contains("--out"),
            "{e}"
        );
    }

    #[test]
    fn leftovers_are_cleaned_and_runs_are_recognised() {
        let dir = run_dir("leftovers", &[2]);
        assert!(holds_a_run(&dir));
        let root = dir.join("checkpoints");
        std::fs::create_dir_all(root.join(".tmp-step-000003")).unwrap();
        std::fs::write(root.join(".latest.tmp-1234"), "step-000003").unwrap();
        std::fs::write(dir.join(".metrics.jsonl.tmp-99"), "").unwrap();
        std::fs::write(dir.join("notes.txt"), "mine").unwrap();
        clean_temporaries(&dir).unwrap();
        let mut left: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .chain(std::fs::read_dir(&dir).unwrap())
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["checkpoints", "notes.txt", "step-000002"]);
        let fresh = run_dir("fresh", &[]);
        std::fs::create_dir_all(&fresh).unwrap();
        assert!(!holds_a_run(&fresh));
        std::fs::write(fresh.join("metrics.jsonl"), "{\"step\":1}\n").unwrap();
        assert!(holds_a_run(&fresh));
    }

    #[test]
    fn steps_sort_by_number_not_by_name() {
        let dir = run_dir("order", &[999_999, 1_000_000, 2]);
        let steps: Vec<u64> = complete_steps(&dir.join("checkpoints"))
            .unwrap()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(steps, [2, 999_999, 1_000_000]);
    }
}
