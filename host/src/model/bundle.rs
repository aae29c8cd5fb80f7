//! A model directory opened as a whole: weights, tokenizer, chat template, EOS ids and
//! generation defaults, checked against each other.

use super::chat::ChatTemplate;
use super::decoder::Model;
use super::placement::Placement;
use super::tokenizer::{Tokenizer, eos_token_ids};
use crate::sampler::SamplingParams;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};

pub struct LanguageModel {
    pub dir: PathBuf,
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// `None` for base models shipped without a chat template.
    pub chat: Option<ChatTemplate>,
    pub eos_token_ids: Vec<u32>,
}

impl LanguageModel {
    pub fn open(dir: &Path, at: &Placement) -> Result<LanguageModel> {
        let model = Model::load(dir, at)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        // The tokenizer may be smaller than the embedding (vocabularies are padded to a
        // multiple of 64 or 128), never larger.
        if tokenizer.vocab_size() > model.cfg.vocab_size {
            bail!(
                "{}: tokenizer.json has {} tokens but config.json's vocab_size is {}: the files belong to different models",
                dir.display(),
                tokenizer.vocab_size(),
                model.cfg.vocab_size
            );
        }
        let chat = if has_template(dir) {
            Some(ChatTemplate::from_dir(dir)?)
        } else {
            None
        };
        let eos_token_ids = eos_token_ids(dir, &tokenizer)?;
        Ok(LanguageModel {
            dir: dir.to_owned(),
            model,
            tokenizer,
            chat,
            eos_token_ids,
        })
    }

    /// Never samples an id the tokenizer cannot decode: the head's rows past the tokenizer
    /// (vocabularies padded to a multiple of 64 or 128) get `-inf` before every draw, and
    /// log-probs are normalised over the tokenizer's rows ([`Model::limit_vocabulary`]).
    /// For the servers and `generate`, whose ids a client decodes; Tinker's adapters train
    /// the head (`train_unembed`), and a few steps gave those rows mass. A training run's
    /// policy stays the whole head, as in TRL and vLLM: its head does not train.
    pub fn sample_tokens_only(&mut self) {
        self.model.limit_vocabulary(self.tokenizer.vocab_size());
    }

    pub fn chat(&self) -> Result<&ChatTemplate> {
        self.chat.as_ref().with_context(|| {
            format!(
                "{} has no chat template (chat_template.jinja or `chat_template` in tokenizer_config.json)",
                self.dir.display()
            )
        })
    }

    /// Sampling defaults from `generation_config.json` (as transformers' `generate` uses
    /// them), stopping at the EOS ids.
    pub fn default_sampling(&self) -> Result<SamplingParams> {
        let mut p = SamplingParams {
            stop_token_ids: self.eos_token_ids.clone(),
            ..SamplingParams::default()
        };
        let path = self.dir.join("generation_config.json");
        if !path.is_file() {
            return Ok(p);
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        let num = |k: &str| -> Result<Option<f64>> {
            match v.get(k) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(x) => x.as_f64().map(Some).with_context(|| {
                    format!("{}: `{k}` must be a number, found {x}", path.display())
                }),
            }
        };
        if v.get("do_sample").and_then(|d| d.as_bool()) == Some(false) {
            p.temperature = 0.0;
        } else if let Some(t) = num("temperature")? {
            p.temperature = t as f32;
        }
        if let Some(k) = num("top_k")? {
            p.top_k = k as usize;
        }
        if let Some(tp) = num("top_p")? {
            p.top_p = tp as f32;
        }
        if let Some(mp) = num("min_p")? {
            p.min_p = mp as f32;
        }
        if let Some(n) = num("max_new_tokens")? {
            p.max_new_tokens = n as usize;
        }
        Ok(p)
    }
}

fn has_template(dir: &Path) -> bool {
    if dir.join("chat_template.jinja").is_file() {
        return true;
    }
    std::fs::read_to_string(dir.join("tokenizer_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|v| v.get("chat_template").is_some_and(|c| !c.is_null()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures;

    #[test]
    fn opens_a_fixture_with_its_generation_defaults() {
        let lm = LanguageModel::open(&fixtures::model_dir("qwen3"), &Placement::CPU).unwrap();
        assert_eq!(lm.eos_token_ids, vec![507, 505]);
        let p = lm.default_sampling().unwrap();
        assert_eq!((p.temperature, p.top_k, p.top_p), (0.7, 20, 0.8));
        assert!(lm.chat().is_ok());
    }
}
