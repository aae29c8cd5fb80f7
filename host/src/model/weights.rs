//! Reading a model's `*.safetensors`: one file or shards listed in
//! `model.safetensors.index.json`, stored as bf16/f16/f32 and converted to the compute
//! dtype as they are read (one shard at a time, so a bf16 checkpoint never sits in memory
//! twice over).

use anyhow::{Context, Result, bail};
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// All tensors of a checkpoint by name, in the compute dtype, with the file each came from
/// (for error messages).
pub struct Weights {
    tensors: HashMap<String, Tensor>,
    dir: PathBuf,
}

impl Weights {
    /// Loads `model.safetensors`, or the shards named by `model.safetensors.index.json`.
    pub fn from_dir(dir: &Path, dtype: DType, device: &Device) -> Result<Weights> {
        let files = weight_files(dir)?;
        let mut tensors = HashMap::new();
        for file in &files {
            let raw = candle_core::safetensors::load(file, &Device::Cpu).with_context(|| {
                format!("{} is not a readable safetensors file", file.display())
            })?;
            for (name, t) in raw {
                // Integers (packed 4-bit codes, a quant state's JSON bytes) and a
                // bitsandbytes checkpoint's quantization constants keep their stored
                // dtype: rounding an f32 absmax or the NF4 levels to bf16 would change
                // the weights they decode.
                let keep = !t.dtype().is_float() || is_quant_state(&name);
                let t = if keep { Ok(t) } else { t.to_dtype(dtype) };
                let t = t
                    .and_then(|t| t.to_device(device))
                    .with_context(|| format!("converting {name} from {}", file.display()))?;
                tensors.insert(name, t);
            }
        }
        Ok(Weights {
            tensors,
            dir: dir.to_owned(),
        })
    }

    /// A tensor of the given shape; a missing name or a wrong shape is an error naming both.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.tensors.get(name).with_context(|| {
            format!(
                "tensor `{name}` missing from the safetensors in {} (does config.json match the weights?)",
                self.dir.display()
            )
        })?;
        if t.dims() != shape {
            bail!(
                "tensor `{name}` in {} has shape {:?}, config.json implies {shape:?}",
                self.dir.display(),
                t.dims()
            );
        }
        Ok(t.clone())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// A tensor as loaded (floating point weights in the compute dtype, the rest as
    /// stored), any shape; a missing name is an error.
    pub fn raw(&self, name: &str) -> Result<&Tensor> {
        self.tensors.get(name).with_context(|| {
            format!(
                "tensor `{name}` missing from the safetensors in {}",
                self.dir.display()
            )
        })
    }

    /// The folder the weights came from (for error messages).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// The weight files of a model directory, in a fixed order.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    if !dir.is_dir() {
        bail!("model directory {} does not exist", dir.display());
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("reading {}", index.display()))?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", index.display()))?;
        let map = value
            .get("weight_map")
            .and_then(|m| m.as_object())
            .with_context(|| format!("{} has no `weight_map` object", index.display()))?;
        let mut names = BTreeSet::new();
        for (tensor, file) in map {
            let file = file.as_str().with_context(|| {
                format!(
                    "{}: weight_map[{tensor:?}] must be a file name",
                    index.display()
                )
            })?;
            names.insert(file.to_owned());
        }
        let files: Vec<PathBuf> = names.into_iter().map(|n| dir.join(n)).collect();
        for f in &files {
            if !f.is_file() {
                bail!(
                    "{} names the shard {}, which does not exist",
                    index.display(),
                    f.display()
                );
            }
        }
        return Ok(files);
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    bail!(
        "no weights in {}: expected model.safetensors or model.safetensors.index.json with its shards",
        dir.display()
    )
}

/// bitsandbytes' per-weight quantization constants (`*.weight.absmax`, `.quant_map`,
/// `.nested_absmax`, `.nested_quant_map`, `.quant_state.*`).
fn is_quant_state(name: &str) -> bool {
    let Some((_, field)) = name.split_once(".weight.") else {
        return false;
    };
    field.starts_with("quant_state.")
        || matches!(
            field,
            "absmax" | "quant_map" | "nested_absmax" | "nested_quant_map"
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sharded_and_bf16_load_as_f32() {
        let root = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/models"
        ));
        let llama = Weights::from_dir(&root.join("llama"), DType::F32, &Device::Cpu).unwrap();
        assert!(llama.contains("lm_head.weight"));
        assert!(llama.contains("model.layers.1.mlp.down_proj.weight"));
        let qwen3 = Weights::from_dir(&root.join("qwen3"), DType::F32, &Device::Cpu).unwrap();
        let t = qwen3.get("model.norm.weight", &[64]).unwrap();
        assert_eq!(t.dtype(), DType::F32);
        let err = qwen3
            .get("model.norm.weight", &[65])
            .unwrap_err()
            .to_string();
        assert!(err.contains("[64]") && err.contains("[65]"), "{err}");
        let err = qwen3.get("nope", &[1]).unwrap_err().to_string();
        assert!(err.contains("`nope`"), "{err}");
    }

    #[test]
    fn missing_weights_and_shards_are_named() {
        let dir = std::env::temp_dir().join(format!("rlhost-weights-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = format!("{:#}", weight_files(&dir).unwrap_err());
        assert!(err.contains("model.safetensors"), "{err}");
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            r#"{"weight_map": {"a": "model-00001-of-00002.safetensors"}}"#,
        )
        .unwrap();
        let err = format!("{:#}", weight_files(&dir).unwrap_err());
        assert!(err.contains("model-00001-of-00002.safetensors"), "{err}");
        std::fs::write(dir.join("model.safetensors.index.json"), "{").unwrap();
        let err = format!("{:#}", weight_files(&dir).unwrap_err());
        assert!(err.contains("not valid JSON"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
