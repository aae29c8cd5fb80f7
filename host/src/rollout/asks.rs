//! Plugins' `model.generate` calls while a batch is sampled: each becomes an [`Ask`], a
//! sequence the engine decodes beside its trajectories (in the same packed forward when
//! the policy answers, in one of their own when the base model does) or sends to a vLLM
//! server, and that is never part of a trajectory: its tokens go back to the plugin only.
//!
//! An ask draws from a generator seeded by (the trajectory's seed, the call's index in the
//! trajectory) only, so a run repeats whatever else the batch holds.

use crate::model::bundle::LanguageModel;
use crate::model::generate::{Sequence, sample_seed};
use crate::model::sample::SamplingParams;
use crate::model::tokenizer::IncrementalDecoder;
use crate::plugin::model::{Completion, GenerateCall, Prompt, Weights};
use crate::sample::Sample;
use serde_json::{Map, Value as Json};

/// Mixed into an ask's seed so that its stream differs from its trajectory's own.
const ASK_STREAM: usize = 0x0061_736b;

/// One call being answered.
pub struct Ask<'t> {
    pub weights: Weights,
    pub seq: Sequence,
    dec: IncrementalDecoder<'t>,
    pub params: SamplingParams,
    /// Tokens sampled so far.
    produced: usize,
    reply: Option<tokio::sync::oneshot::Sender<Result<Completion, String>>>,
    /// With vLLM servers: a request for it is in flight.
    pub sent: bool,
}

impl<'t> Ask<'t> {
    /// The call as a sequence to decode, or (having answered the plugin with the reason)
    /// `None` when its prompt cannot be run.
    pub fn new(
        lm: &'t LanguageModel,
        template_kwargs: &Map<String, Json>,
        stop_token_ids: &[u32],
        call: GenerateCall,
    ) -> Option<Ask<'t>> {
        let GenerateCall {
            plugin,
            request: r,
            max_prompt_tokens,
            trajectory_seed,
            index,
            reply,
        } = call;
        let ids = match r.prompt {
            Prompt::TokenIds(ids) => Ok(ids),
            Prompt::Messages(messages) => {
                let sample = Sample {
                    messages,
                    metadata: Json::Object(Map::new()),
                };
                super::render::prompt_tokens(lm, template_kwargs, None, &sample).map_err(|e| {
                    format!("the messages do not render with the chat template: {e:#}")
                })
            }
        };
        let vocab = lm.model.cfg.vocab_size;
        let max_len = lm.model.cfg.max_position_embeddings;
        let checked = ids.and_then(|ids| {
            if ids.is_empty() {
                Err("the prompt is empty".to_string())
            } else if ids.len() > max_prompt_tokens {
                Err(format!(
                    "the prompt has {} tokens, over the grant's {max_prompt_tokens} (generate.max_prompt_tokens)",
                    ids.len()
                ))
            } else if ids.len() + r.max_new_tokens as usize > max_len {
                Err(format!(
                    "the prompt's {} tokens and {} new ones are over the model's context of {max_len}",
                    ids.len(),
                    r.max_new_tokens
                ))
            } else if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                Err(format!("token id {bad} is not in the model's vocabulary of {vocab}"))
            } else {
                Ok(ids)
            }
        });
        let ids = match checked {
            Ok(ids) => ids,
            Err(e) => {
                tracing::debug!(plugin = %plugin, "model.generate not run: {e}");
                let _ = reply.send(Err(e));
                return None;
            }
        };
        let seed = sample_seed(trajectory_seed, index as usize, ASK_STREAM);
        let params = SamplingParams {
            temperature: r.temperature,
            top_p: r.top_p,
            max_new_tokens: r.max_new_tokens as usize,
            stop_token_ids: stop_token_ids.to_vec(),
            stop_strings: r.stop,
            seed,
            ..SamplingParams::default()
        };
        Some(Ask {
            weights: r.weights,
            seq: Sequence::new(&lm.model, ids, seed),
            dec: IncrementalDecoder::new(&lm.tokenizer, true),
            params,
            produced: 0,
            reply: Some(reply),
            sent: false,
        })
    }

    /// Acts on the token just appended: `true` once the ask is answered (an end of turn,
    /// a stop text, or its length reached).
    pub fn took(&mut self, tok: u32) -> bool {
        self.produced += 1;
        if self.params.stop_token_ids.contains(&tok) {
            return self.answer("stop", true);
        }
        if let Err(e) = self.dec.push(tok) {
            return self.fail(format!("the answer does not decode: {e:#}"));
        }
        if self
            .params
            .stop_strings
            .iter()
            .any(|s| self.dec.text().contains(s.as_str()))
        {
            return self.answer("stop", false);
        }
        if self.produced >= self.params.max_new_tokens {
            return self.answer("length", false);
        }
        false
    }

    /// Answers with what was sampled: the end-of-turn token (`eot`) and anything after a
    /// stop text are not part of the answer.
    fn answer(&mut self, finish: &str, eot: bool) -> bool {
        let mut ids = self.seq.completion().to_vec();
        if eot {
            ids.pop();
        }
        let mut text = self.dec.text().to_string();
        if let Some(cut) = self
            .params
            .stop_strings
            .iter()
            .filter_map(|s| text.find(s.as_str()))
            .min()
        {
            text.truncate(cut);
        }
        let completion = Completion {
            text,
            token_ids: ids,
            finish_reason: finish.to_string(),
            prompt_tokens: self.seq.prompt_len,
        };
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(Ok(completion));
        }
        true
    }

    /// Answers with what a server sampled, which ended for `finish` (`stop` or `length`)
    /// without a stop this side saw (the server cut the stop text).
    pub fn end(&mut self, finish: &str) {
        let finish = if finish == "stop" { "stop" } else { "length" };
        self.answer(finish, false);
    }

    /// Answers with an error (a server could not answer).
    pub fn fail(&mut self, message: String) -> bool {
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(Err(message));
        }
        true
    }
}

/// Answers `model.generate` calls with no rollout around them (`plugin test`, `plugin
/// call`): a thread of its own that owns `lm` and decodes the calls that have come
/// together, as the engine does, until none is left. The base model answers both
/// `policy` and `base` (there is no adapter here).
pub fn standalone(lm: LanguageModel) -> crate::plugin::model::ModelServer {
    let (tx, rx) = std::sync::mpsc::channel::<GenerateCall>();
    let context = lm.model.cfg.max_position_embeddings;
    std::thread::Builder::new()
        .name("rlhost-model".into())
        .spawn(move || serve(&lm, &rx))
        .expect("cannot start the model thread");
    std::sync::Arc::new(move |seed| {
        let tx = tx.clone();
        crate::plugin::model::ModelLink::new(seed, move |call| {
            tx.send(call)
                .map_err(|_| "the model thread has stopped".to_string())
        })
        .within(context)
    })
}

fn serve(lm: &LanguageModel, rx: &std::sync::mpsc::Receiver<GenerateCall>) {
    let stop = lm.eos_token_ids.clone();
    let kwargs = Map::new();
    let mut asks: Vec<Ask> = Vec::new();
    loop {
        // Block only when nothing decodes.
        let next = if asks.is_empty() {
            rx.recv().ok()
        } else {
            rx.try_recv().ok()
        };
        if let Some(call) = next {
            asks.extend(Ask::new(lm, &kwargs, &stop, call));
            continue;
        }
        if asks.is_empty() {
            return;
        }
        let mut seqs: Vec<&mut Sequence> = asks
            .iter_mut()
            .filter(|a| !a.seq.ready())
            .map(|a| &mut a.seq)
            .collect();
        if let Err(e) =
            crate::model::generate::advance(&lm.model, &mut seqs, crate::model::lora::Mode::BASE)
        {
            for a in &mut asks {
                a.fail(format!("the model failed: {e:#}"));
            }
            asks.clear();
            continue;
        }
        asks.retain_mut(|a| match a.seq.sample_next(&a.params) {
            Ok((tok, _)) => !a.took(tok),
            Err(e) => !a.fail(format!("the model failed: {e:#}")),
        });
    }
}
