//! Checkpoints: the adapter in PEFT's format, the optimizer's moments, and the trainer's
//! position (step, data cursor, seed), written to a temporary folder and renamed into
//! place, so an interrupted write never leaves a half checkpoint under a real name.
//!
//! ```text
//! RUN/checkpoints/step-000010/adapter_config.json, adapter_model.safetensors,
//!                             optimizer.safetensors, trainer_state.json
//! RUN/checkpoints/latest      the name of the newest complete checkpoint
//! ```

use super::optim::AdamW;
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

/// Writes a checkpoint for `state.step` under `out_dir/checkpoints`, points `latest` at
/// it, and keeps the newest `keep_last`.
pub fn save(
    out_dir: &Path,
    lm: &LanguageModel,
    opt: &AdamW,
    state: &TrainerState,
    keep_last: usize,
) -> Result<PathBuf> {
    let root = out_dir.join("checkpoints");
    let name = format!("step-{:06}", state.step);
    let tmp = root.join(format!(".tmp-{name}"));
    let dir = root.join(&name);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    peft::save_adapter(&lm.model, &tmp, Some(&lm.dir.display().to_string()))?;
    let tensors: Vec<(String, candle_core::Tensor)> = opt.state();
    candle_core::safetensors::save(
        &tensors
            .into_iter()
            .collect::<std::collections::HashMap<_, _>>(),
        tmp.join(OPTIMIZER_FILE),
    )?;
    write_atomic(
        &tmp.join(STATE_FILE),
        serde_json::to_string_pretty(state)?.as_bytes(),
    )?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::rename(&tmp, &dir)
        .with_context(|| format!("renaming {} into place", tmp.display()))?;
    write_atomic(&root.join(LATEST), name.as_bytes())?;
    let mut steps: Vec<PathBuf> = std::fs::read_dir(&root)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.is_dir()
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
        })
        .collect();
    steps.sort();
    if steps.len() > keep_last.max(1) {
        for old in &steps[..steps.len() - keep_last.max(1)] {
            let _ = std::fs::remove_dir_all(old);
        }
    }
    Ok(dir)
}

/// `latest` (the run's newest checkpoint) or a checkpoint folder.
pub fn resolve(out_dir: &Path, spec: &str) -> Result<PathBuf> {
    if spec == LATEST {
        let root = out_dir.join("checkpoints");
        let pointer = root.join(LATEST);
        let name = std::fs::read_to_string(&pointer).with_context(|| {
            format!(
                "--resume latest: no checkpoint in {} (the run has not saved one yet)",
                root.display()
            )
        })?;
        return Ok(root.join(name.trim()));
    }
    let dir = PathBuf::from(spec);
    if !dir.join(STATE_FILE).is_file() {
        bail!(
            "--resume {spec}: not a checkpoint folder (it has no {STATE_FILE}); pass `latest` or a checkpoints/step-N folder"
        );
    }
    Ok(dir)
}

/// Loads the checkpoint's adapter into `model` and returns the trainer's position.
pub fn load_into(dir: &Path, model: &mut Model) -> Result<TrainerState> {
    let path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let state: TrainerState = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a trainer state", path.display()))?;
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
