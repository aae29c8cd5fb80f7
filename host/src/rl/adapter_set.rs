//! An adapter read from a folder and applied in place of the run's own, on the same
//! weights: a reward model's (`[[rewards]] model`) and a distillation teacher's
//! (`[distill] teacher`). No second copy of the model is made; a forward reads the set
//! through [`Mode::adapter`](crate::model::Mode).

use crate::model::lora::AdapterSnapshot;
use crate::model::{Model, peft};
use anyhow::{Result, bail};
use candle_core::{DType, Tensor};
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// `(A, B)` pairs by module path, on the model's device, with the adapter's scaling.
pub struct AdapterSet {
    pairs: HashMap<String, (Tensor, Tensor)>,
    scaling: f64,
    rank: usize,
}

impl AdapterSet {
    /// The projections' pairs of an adapter as [`peft`] read them.
    pub fn new(read: peft::ReadAdapter) -> AdapterSet {
        AdapterSet {
            rank: read.cfg.r,
            scaling: read.cfg.scaling(),
            pairs: read
                .pairs
                .into_iter()
                .map(|(m, a, b)| (m, (a, b)))
                .collect(),
        }
    }

    /// The set a forward of `model` reads, keyed by the run's live adapter as it is now
    /// (built per call: a resumed run's adapter is new tensors). A projection the run
    /// adapts and the set does not gets a zero pair (the base projection); a set that
    /// adapts a projection the run does not is refused, since the forward would drop it.
    pub fn snapshot(&self, model: &Model) -> Result<AdapterSnapshot> {
        let mut live_paths = HashSet::new();
        let mut set = Vec::new();
        for (path, _, lin) in model.projections() {
            let Some(live) = &lin.lora else { continue };
            let (a, b) = match self.pairs.get(&path) {
                Some((a, b)) => (a.clone(), b.clone()),
                None => (
                    Tensor::zeros((self.rank, lin.in_features()), DType::F32, model.device())?,
                    Tensor::zeros((lin.out_features(), self.rank), DType::F32, model.device())?,
                ),
            };
            set.push((live.lora_a.as_tensor().id(), a, b));
            live_paths.insert(path);
        }
        let mut missing: Vec<&str> = self
            .pairs
            .keys()
            .filter(|p| !live_paths.contains(*p))
            .map(String::as_str)
            .collect();
        missing.sort_unstable();
        if !missing.is_empty() {
            bail!(
                "it adapts projections this run's adapter does not ({}{}): the run's [lora] target_modules must include its own",
                missing[..missing.len().min(3)].join(", "),
                if missing.len() > 3 { ", ..." } else { "" }
            );
        }
        // Tensors read from the folder (or zeros), never written: a frozen set keeps
        // what a GPU forward derives from them for the snapshot's micro-batches.
        Ok(AdapterSnapshot::from_pairs(0, set)
            .with_scaling(Some(self.scaling))
            .frozen())
    }
}

/// The adapter folder `dir` names: its `adapter/` (where `rlhost rm`, `dpo` and `sft`
/// write one) or `dir` itself, whichever holds an adapter config.
pub fn adapter_folder(dir: &Path) -> Option<std::path::PathBuf> {
    [dir.join("adapter"), dir.to_path_buf()]
        .into_iter()
        .find(|d| d.join(peft::CONFIG_FILE).is_file())
}

/// Whether the adapter in `folder` was trained on `base`: its config's
/// `base_model_name_or_path`, when it is an absolute path to a folder that exists (as
/// `rlhost train`, `rm` and `dpo` write it), must be that one. A relative path or a hub
/// name says too little to refuse on.
pub fn check_base(folder: &Path, base: &Path, what: &str) -> Result<()> {
    let path = folder.join(peft::CONFIG_FILE);
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)
        .map_err(|e| anyhow::anyhow!("{} is not valid JSON: {e}", path.display()))?;
    let Some(recorded) = v
        .get("base_model_name_or_path")
        .and_then(|b| b.as_str())
        .filter(|b| Path::new(b).is_absolute())
    else {
        return Ok(());
    };
    let (Ok(recorded_dir), Ok(base_dir)) =
        (std::fs::canonicalize(recorded), std::fs::canonicalize(base))
    else {
        return Ok(());
    };
    if recorded_dir != base_dir {
        bail!(
            "{} was trained on {}, and this run's model is {}: {what} reads its adapter over the base it was trained on",
            folder.display(),
            recorded_dir.display(),
            base_dir.display()
        );
    }
    Ok(())
}
