//! LoRA adapters in Hugging Face PEFT's on-disk format, and merged model export.
//!
//! An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` with
//! keys `base_model.model.<module path>.lora_A.weight` (`[r, in]`) and `.lora_B.weight`
//! (`[out, r]`), exactly what `PeftModel.from_pretrained` reads and `save_pretrained`
//! writes; vLLM loads the same files. PEFT options that change the maths and that we do not
//! implement (DoRA, per-module rank or alpha patterns, bias training, extra trainable
//! modules) are refused by name instead of being ignored.

use super::decoder::Model;
use super::lora::{LoraConfig, TARGETS};
use anyhow::{Context, Result, bail};
use candle_core::{DType, Tensor, Var};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::Path;

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
pub const KEY_PREFIX: &str = "base_model.model.";

/// Reads `adapter_config.json` into a [`LoraConfig`], refusing options we do not implement.
pub fn read_config(dir: &Path) -> Result<LoraConfig> {
    let (path, v) = config_json(dir)?;
    parse_config(&v).with_context(|| format!("in {}", path.display()))
}

/// `adapter_config.json` of `dir` as JSON, and its path.
fn config_json(dir: &Path) -> Result<(std::path::PathBuf, Value)> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "reading {}: an adapter directory needs PEFT's adapter_config.json",
            path.display()
        )
    })?;
    let v: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    Ok((path, v))
}

/// [`read_config`] for an adapter that may also train the output head (`lm_head` among
/// its target modules, as PEFT writes it): the config of the other modules and whether
/// the head is one.
pub fn read_config_with_head(dir: &Path) -> Result<(LoraConfig, bool)> {
    let (path, v) = config_json(dir)?;
    config_with_head(&path, v)
}

/// [`read_config_with_head`] of a config already read from `path`.
fn config_with_head(path: &Path, mut v: Value) -> Result<(LoraConfig, bool)> {
    let mut head = false;
    if let Some(Value::Array(items)) = v.get_mut("target_modules") {
        let before = items.len();
        items.retain(|m| m.as_str() != Some(HEAD));
        head = items.len() < before;
        if head && items.is_empty() {
            // Only the head: the other modules' config is still read (rank, alpha, …).
            items.push(Value::String(TARGETS[0].into()));
            let mut cfg = parse_config(&v).with_context(|| format!("in {}", path.display()))?;
            cfg.target_modules.clear();
            return Ok((cfg, true));
        }
    }
    let cfg = parse_config(&v).with_context(|| format!("in {}", path.display()))?;
    Ok((cfg, head))
}

/// The output head's module name in PEFT's files.
pub const HEAD: &str = "lm_head";

fn parse_config(v: &Value) -> Result<LoraConfig> {
    let get = |k: &str| v.get(k).filter(|x| !x.is_null());
    match get("peft_type").and_then(Value::as_str) {
        Some("LORA") => {}
        other => bail!("field `peft_type` is {other:?}: only \"LORA\" adapters are supported"),
    }
    let r = get("r")
        .and_then(Value::as_u64)
        .context("field `r` must be a positive integer")? as usize;
    let alpha = match get("lora_alpha") {
        None => 8.0, // PEFT's default
        Some(a) => a.as_f64().context("field `lora_alpha` must be a number")?,
    };
    let dropout = match get("lora_dropout") {
        None => 0.0,
        Some(d) => d
            .as_f64()
            .context("field `lora_dropout` must be a number")?,
    };
    let flag = |k: &str| get(k).and_then(Value::as_bool).unwrap_or(false);
    for k in ["use_dora", "fan_in_fan_out", "lora_bias"] {
        if flag(k) {
            bail!("field `{k}` is true: not supported by rlhost");
        }
    }
    if let Some(b) = get("bias").and_then(Value::as_str)
        && b != "none"
    {
        bail!("field `bias` is {b:?}: only \"none\" is supported");
    }
    for k in ["rank_pattern", "alpha_pattern"] {
        if get(k)
            .and_then(Value::as_object)
            .is_some_and(|m| !m.is_empty())
        {
            bail!("field `{k}` is not empty: per-module ranks and alphas are not supported");
        }
    }
    for k in [
        "modules_to_save",
        "layers_to_transform",
        "layer_replication",
        "trainable_token_indices",
    ] {
        if get(k).is_some_and(|x| !x.as_array().is_some_and(|a| a.is_empty())) {
            bail!("field `{k}` is set: not supported by rlhost");
        }
    }
    let target_modules = match get("target_modules") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|m| {
                m.as_str()
                    .map(str::to_owned)
                    .context("field `target_modules` must list module names")
            })
            .collect::<Result<Vec<_>>>()?,
        Some(Value::String(s)) if s == "all-linear" => {
            TARGETS.iter().map(|s| s.to_string()).collect()
        }
        Some(Value::String(s)) if TARGETS.contains(&s.as_str()) => vec![s.clone()],
        Some(other) => bail!(
            "field `target_modules` = {other}: give a list of module names from {TARGETS:?} (regular expressions are not supported)"
        ),
        None => bail!("missing field `target_modules`"),
    };
    let cfg = LoraConfig {
        r,
        alpha,
        dropout,
        use_rslora: flag("use_rslora"),
        target_modules,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Attaches the adapter in `dir` to `model`, replacing any adapter it has.
pub fn load_adapter(model: &mut Model, dir: &Path) -> Result<()> {
    if read_config_with_head(dir)?.1 {
        bail!(
            "{}: the adapter trains the output head ({HEAD} among its target_modules); rlhost \
             loads adapters of the projections only here (`rlhost serve --tinker` loads it)",
            dir.display()
        );
    }
    let ReadAdapter { cfg, pairs, .. } = read_pairs(model, dir)?;
    let mut pairs: HashMap<String, (Tensor, Tensor)> =
        pairs.into_iter().map(|(m, a, b)| (m, (a, b))).collect();
    let paths: Vec<String> = model.projections().into_iter().map(|(p, _, _)| p).collect();
    for module in paths {
        let lin = model
            .projection_mut(&module)
            .expect("listed by projections()");
        lin.lora = match pairs.remove(&module) {
            None => None,
            Some((a, b)) => Some(super::lora::Lora {
                lora_a: Var::from_tensor(&a)?,
                lora_b: Var::from_tensor(&b)?,
                scaling: cfg.scaling(),
                dropout: cfg.dropout,
            }),
        };
    }
    model.lora = Some(cfg);
    Ok(())
}

/// An adapter as read from its directory.
pub struct ReadAdapter {
    /// The config of its projections (`lm_head` left out of `target_modules`).
    pub cfg: LoraConfig,
    /// For each projection it targets, the module path, `A: [r, in]`, `B: [out, r]`.
    pub pairs: Vec<(String, Tensor, Tensor)>,
    /// Its output head pair, `A: [r, hidden]`, `B: [vocab, r]`, if it trains the head.
    pub head: Option<(Tensor, Tensor)>,
}

/// The adapter in `dir`, its tensors in f32 on the model's device, checked against the
/// model's shapes.
pub fn read_pairs(model: &Model, dir: &Path) -> Result<ReadAdapter> {
    let (path, v) = config_json(dir)?;
    let (read, _) = read_pairs_saving(model, dir, &path, v, None)?;
    Ok(read)
}

/// [`read_pairs`] of a sequence classifier's adapter, as `rlhost rm` and TRL's
/// `RewardTrainer` write one: `modules_to_save = [module]` (`score`), whose weight
/// (`base_model.model.score.weight`) comes back beside the pairs.
pub fn read_pairs_with_saved(
    model: &Model,
    dir: &Path,
    module: &str,
) -> Result<(ReadAdapter, Tensor)> {
    let (path, mut v) = config_json(dir)?;
    let saved = v.get("modules_to_save").cloned().unwrap_or(Value::Null);
    if saved != serde_json::json!([module]) {
        bail!(
            "{}: no `{module}` head: modules_to_save is {saved}, where a reward model lists it as [\"{module}\"] (rlhost rm and TRL's RewardTrainer write it so); an adapter alone is not a reward model",
            path.display()
        );
    }
    v["modules_to_save"] = Value::Null;
    let (read, saved) = read_pairs_saving(model, dir, &path, v, Some(module))?;
    Ok((read, saved.expect("asked for")))
}

fn read_pairs_saving(
    model: &Model,
    dir: &Path,
    config_path: &Path,
    config: Value,
    saved: Option<&str>,
) -> Result<(ReadAdapter, Option<Tensor>)> {
    let (cfg, with_head) = config_with_head(config_path, config)?;
    let path = dir.join(WEIGHTS_FILE);
    if !path.is_file() {
        bail!(
            "{} not found (PEFT adapters keep their weights there)",
            path.display()
        );
    }
    let mut tensors = candle_core::safetensors::load(&path, model.device())
        .with_context(|| format!("{} is not a readable safetensors file", path.display()))?;
    // A module's pair, `A: [r, in]` and `B: [out, r]`, taken out of the file's tensors.
    let mut take = |module: &str, (out_f, in_f): (usize, usize)| -> Result<(Tensor, Tensor)> {
        let mut one = |which: &str, shape: [usize; 2]| -> Result<Tensor> {
            let key = format!("{KEY_PREFIX}{module}.{which}.weight");
            let t = tensors
                .remove(&key)
                .with_context(|| format!("{} has no tensor `{key}`", path.display()))?;
            if t.dims() != shape {
                bail!(
                    "{}: `{key}` has shape {:?}, expected {shape:?} (r = {})",
                    path.display(),
                    t.dims(),
                    cfg.r
                );
            }
            Ok(t.to_dtype(DType::F32)?)
        };
        Ok((
            one("lora_A", [cfg.r, in_f])?,
            one("lora_B", [out_f, cfg.r])?,
        ))
    };
    let mut pairs = Vec::new();
    for (module, name, lin) in model.projections() {
        if cfg.targets(name) {
            let (a, b) = take(&module, (lin.out_features(), lin.in_features()))?;
            pairs.push((module, a, b));
        }
    }
    let head = match with_head {
        true => Some(take(HEAD, model.lm_head.dims2()?)?),
        false => None,
    };
    let saved = match saved {
        Some(module) => {
            let key = format!("{KEY_PREFIX}{module}.weight");
            let t = tensors.remove(&key).with_context(|| {
                format!(
                    "{} has no `{key}`, the weight of the module its config saves",
                    path.display()
                )
            })?;
            Some(t.to_dtype(DType::F32)?)
        }
        None => None,
    };
    if let Some(extra) = tensors.keys().min() {
        bail!(
            "{} has tensor `{extra}` that matches no LoRA module of this model (a different base model?)",
            path.display()
        );
    }
    Ok((ReadAdapter { cfg, pairs, head }, saved))
}

/// Writes `model`'s adapter to `dir` in PEFT's format. Each file is written to a temporary
/// name and renamed, so a crash never leaves a half-written adapter under the real name.
pub fn save_adapter(model: &Model, dir: &Path, base_model: Option<&str>) -> Result<()> {
    save_adapter_as(model, None, dir, base_model)
}

/// [`save_adapter`] with the tensors of `snapshot` (a version the trainer published)
/// where given, else the live adapter's.
pub fn save_adapter_as(
    model: &Model,
    snapshot: Option<&super::lora::AdapterSnapshot>,
    dir: &Path,
    base_model: Option<&str>,
) -> Result<()> {
    let cfg = model
        .lora
        .as_ref()
        .context("the model has no adapter to save")?;
    let mut pairs = Vec::new();
    for (module, _, lin) in model.projections() {
        if let Some(l) = &lin.lora {
            let (a, b) = l.pair(snapshot);
            pairs.push((module, a.clone(), b.clone()));
        }
    }
    save_pairs(pairs, cfg, dir, base_model)
}

/// Writes an adapter given as `(module path, A, B)` triples with its config to `dir` in
/// PEFT's format, each file atomically.
pub fn save_pairs(
    pairs: Vec<(String, Tensor, Tensor)>,
    cfg: &LoraConfig,
    dir: &Path,
    base_model: Option<&str>,
) -> Result<()> {
    save_pairs_as(pairs, cfg, dir, base_model, None)
}

/// A reward model's adapter: the live adapter and a trained head saved whole beside it,
/// as PEFT writes a `task_type = "SEQ_CLS"` adapter with `modules_to_save = ["score"]`
/// (the head under `base_model.model.score.weight`: PEFT drops the
/// `modules_to_save.default` of its in-memory name when saving).
pub fn save_adapter_with_head(
    model: &Model,
    dir: &Path,
    base_model: Option<&str>,
    (name, head): (&str, &Tensor),
) -> Result<()> {
    let cfg = model
        .lora
        .as_ref()
        .context("the model has no adapter to save")?;
    let pairs = model
        .projections()
        .into_iter()
        .filter_map(|(module, _, lin)| {
            lin.lora.as_ref().map(|l| {
                let (a, b) = l.pair(None);
                (module, a.clone(), b.clone())
            })
        })
        .collect();
    save_pairs_as(pairs, cfg, dir, base_model, Some((name, head)))
}

fn save_pairs_as(
    pairs: Vec<(String, Tensor, Tensor)>,
    cfg: &LoraConfig,
    dir: &Path,
    base_model: Option<&str>,
    head: Option<(&str, &Tensor)>,
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for (module, a, b) in pairs {
        tensors.push((format!("{KEY_PREFIX}{module}.lora_A.weight"), a));
        tensors.push((format!("{KEY_PREFIX}{module}.lora_B.weight"), b));
    }
    if let Some((name, t)) = head {
        tensors.push((format!("{KEY_PREFIX}{name}"), t.clone()));
    }
    write_safetensors(&dir.join(WEIGHTS_FILE), tensors)?;
    // The module a saved head belongs to: `score` of `score.weight`.
    let saved_modules = head.map(|(name, _)| vec![name.trim_end_matches(".weight")]);
    let mut targets = cfg.target_modules.clone();
    targets.sort();
    let config = json!({
        "peft_type": "LORA",
        "task_type": if head.is_some() { "SEQ_CLS" } else { "CAUSAL_LM" },
        "base_model_name_or_path": base_model,
        "r": cfg.r,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "use_rslora": cfg.use_rslora,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": false,
        "use_dora": false,
        "init_lora_weights": true,
        "inference_mode": true,
        "modules_to_save": saved_modules,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": null,
    });
    write_atomic(
        &dir.join(CONFIG_FILE),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )
}

/// Writes a merged model (adapter folded into the base weights) as a Hugging Face model
/// directory: `model.safetensors` in `dtype`, the source's `config.json` with its dtype
/// updated, and the tokenizer, chat template and generation files copied.
pub fn export_merged(model: &Model, source_dir: &Path, out_dir: &Path, dtype: DType) -> Result<()> {
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let tensors = model
        .named_tensors(true)?
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_dtype(dtype)?)))
        .collect::<candle_core::Result<Vec<_>>>()?;
    write_safetensors(&out_dir.join("model.safetensors"), tensors)?;
    let dtype_name = match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    };
    let config_path = source_dir.join("config.json");
    let mut config: Value = serde_json::from_str(
        &std::fs::read_to_string(&config_path)
            .with_context(|| format!("reading {}", config_path.display()))?,
    )
    .with_context(|| format!("{} is not valid JSON", config_path.display()))?;
    if let Some(obj) = config.as_object_mut() {
        let key = if obj.contains_key("torch_dtype") {
            "torch_dtype"
        } else {
            "dtype"
        };
        obj.insert(key.into(), dtype_name.into());
    }
    write_atomic(
        &out_dir.join("config.json"),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
    ] {
        let src = source_dir.join(name);
        if src.is_file() {
            let bytes =
                std::fs::read(&src).with_context(|| format!("reading {}", src.display()))?;
            write_atomic(&out_dir.join(name), &bytes)?;
        }
    }
    Ok(())
}

/// `safetensors` with the `{"format": "pt"}` metadata transformers and PEFT expect.
fn write_safetensors(path: &Path, mut tensors: Vec<(String, Tensor)>) -> Result<()> {
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let tmp = tmp_path(path);
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let contiguous = tensors
        .into_iter()
        .map(|(n, t)| Ok((n, t.contiguous()?)))
        .collect::<candle_core::Result<Vec<_>>>()?;
    safetensors::serialize_to_file(contiguous, Some(meta), &tmp)
        .map_err(|e| innermost(&e))
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

/// `e` as the last error of its chain alone. safetensors' and candle's I/O errors print
/// the OS error and carry it again as their source, so a full disk read "I/O error: No
/// space left on device (os error 28): No space left on device (os error 28)".
pub fn innermost(e: &(dyn std::error::Error + 'static)) -> anyhow::Error {
    let mut cause = e;
    while let Some(next) = cause.source() {
        cause = next;
    }
    anyhow::anyhow!("{cause}")
}

/// Temp file + rename in the same directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = tmp_path(path);
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

fn tmp_path(path: &Path) -> std::path::PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Placement;

    #[test]
    fn config_refuses_what_we_do_not_implement() {
        let base =
            json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]});
        assert_eq!(parse_config(&base).unwrap().scaling(), 2.0);
        for (k, v, want) in [
            ("use_dora", json!(true), "use_dora"),
            ("rank_pattern", json!({"q_proj": 8}), "rank_pattern"),
            ("modules_to_save", json!(["lm_head"]), "modules_to_save"),
            ("bias", json!("all"), "bias"),
            ("target_modules", json!(".*proj"), "regular expressions"),
            ("peft_type", json!("IA3"), "LORA"),
            ("target_modules", json!(["c_attn"]), "c_attn"),
        ] {
            let mut v2 = base.clone();
            v2[k] = v;
            let err = format!("{:#}", parse_config(&v2).unwrap_err());
            assert!(err.contains(want), "{k}: {err}");
        }
        let mut all = base.clone();
        all["target_modules"] = json!("all-linear");
        assert_eq!(parse_config(&all).unwrap().target_modules.len(), 7);
    }

    use crate::model::Mode;
    use crate::model::fixtures::{self, MODELS, Reference, masked_max_diff, max_diff};
    use candle_core::Device;

    fn with_adapter(name: &str) -> Model {
        let mut model = fixtures::load(name);
        load_adapter(&mut model, &fixtures::model_dir(name).join("adapter")).unwrap();
        model
    }

    fn temp(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("rlhost-peft-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// PEFT's adapter gives PEFT's logits; switched off, the base model's.
    #[test]
    fn adapter_logits_match_peft() {
        for name in MODELS {
            let model = with_adapter(name);
            let r = Reference::load(name);
            let mask = r.attention_mask();
            let on = r.logits(&model, Mode::INFERENCE);
            let d = masked_max_diff(&on, r.get("lora_logits"), &mask);
            eprintln!("{name}: LoRA logits vs PEFT, max abs diff {d:.2e}");
            assert!(d <= 1e-4, "{name}: lora logits diff {d}");
            let off = r.logits(&model, Mode::BASE);
            let d = masked_max_diff(&off, r.get("lora_disabled_logits"), &mask);
            assert!(d <= 1e-4, "{name}: disabled adapter diff {d}");
        }
    }

    /// The loss of the fixture and the gradient of every lora_A / lora_B match PEFT's
    /// autograd (relative to the largest entry of each reference gradient).
    #[test]
    fn lora_gradients_match_peft() {
        for name in MODELS {
            let model = with_adapter(name);
            let r = Reference::load(name);
            let mode = Mode::TRAIN;
            let loss = r.lora_loss(&model, mode);
            let want = r.get("lora_loss").to_scalar::<f32>().unwrap();
            let got = loss.to_scalar::<f32>().unwrap();
            assert!(
                (got - want).abs() <= 1e-5 * want.abs(),
                "{name}: loss {got} vs {want}"
            );
            let grads = loss.backward().unwrap();
            assert!(model.missing_grads(&grads).is_empty());
            assert_eq!(model.lora_vars().len(), 28);
            let worst =
                fixtures::worst_lora_grad_diff(&model, &grads, |k| r.get(&format!("grad.{k}")));
            eprintln!(
                "{name}: LoRA gradients vs PEFT, worst relative diff {worst:.2e}; loss {got} vs {want}"
            );
            assert!(
                worst <= 1e-4,
                "{name}: worst relative gradient diff {worst}"
            );
        }
    }

    /// Our saved adapter has PEFT's key names and shapes and reloads to the same logits.
    #[test]
    fn saved_adapter_round_trips_with_peft_names() {
        let model = with_adapter("llama");
        let dir = temp("save");
        save_adapter(&model, &dir, Some("llama")).unwrap();
        let ours = candle_core::safetensors::load(dir.join(WEIGHTS_FILE), &Device::Cpu).unwrap();
        let theirs = candle_core::safetensors::load(
            fixtures::model_dir("llama")
                .join("adapter")
                .join(WEIGHTS_FILE),
            &Device::Cpu,
        )
        .unwrap();
        let mut a: Vec<_> = ours.keys().collect();
        let mut b: Vec<_> = theirs.keys().collect();
        a.sort();
        b.sort();
        assert_eq!(a, b);
        for (k, t) in &theirs {
            assert_eq!(max_diff(&ours[k], t), 0.0, "{k}");
        }
        assert_eq!(read_config(&dir).unwrap(), model.lora.clone().unwrap());
        let mut again = fixtures::load("llama");
        load_adapter(&mut again, &dir).unwrap();
        let r = Reference::load("llama");
        let d = masked_max_diff(
            &r.logits(&again, Mode::INFERENCE),
            r.get("lora_logits"),
            &r.attention_mask(),
        );
        assert!(d <= 1e-4);
        // No temp files left behind.
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `merge_and_unload` equivalent: the exported directory loads as a plain model with
    /// PEFT's merged logits.
    #[test]
    fn merged_export_matches_peft_merge() {
        let model = with_adapter("qwen2");
        let dir = temp("merge");
        export_merged(&model, &fixtures::model_dir("qwen2"), &dir, DType::F32).unwrap();
        assert!(dir.join("tokenizer.json").is_file() && dir.join("chat_template.jinja").is_file());
        let merged = Model::load(&dir, &Placement::CPU).unwrap();
        assert!(merged.cfg.tie_word_embeddings);
        let r = Reference::load("qwen2");
        let d = masked_max_diff(
            &r.logits(&merged, Mode::BASE),
            r.get("merged_logits"),
            &r.attention_mask(),
        );
        eprintln!("qwen2: merged export vs PEFT merge_and_unload, max abs diff {d:.2e}");
        assert!(d <= 1e-4, "merged diff {d}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn adapter_for_another_model_is_refused() {
        let mut model = fixtures::load("qwen2");
        let dir = temp("wrong");
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = std::fs::read(
            fixtures::model_dir("qwen2")
                .join("adapter")
                .join(CONFIG_FILE),
        )
        .unwrap();
        std::fs::write(dir.join(CONFIG_FILE), cfg).unwrap();
        let err = format!("{:#}", load_adapter(&mut model, &dir).unwrap_err());
        assert!(err.contains(WEIGHTS_FILE), "{err}");
        let mut t = HashMap::new();
        t.insert(
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight".to_string(),
            Tensor::zeros((8, 64), DType::F32, &Device::Cpu).unwrap(),
        );
        candle_core::safetensors::save(&t, dir.join(WEIGHTS_FILE)).unwrap();
        let err = format!("{:#}", load_adapter(&mut model, &dir).unwrap_err());
        assert!(
            err.contains("shape [8, 64]") && err.contains("r = 4"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
