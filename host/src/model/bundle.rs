//! A model directory opened as a whole: weights, tokenizer, chat template, EOS ids and
//! generation defaults, checked against each other.

use super::chat::ChatTemplate;
use super::decoder::Model;
use super::placement::Placement;
use super::tokenizer::{Tokenizer, eos_token_ids};
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
        assert!(lm.chat().is_ok());
    }
}
