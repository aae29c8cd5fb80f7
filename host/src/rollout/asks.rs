//! Plugins' `model.generate` calls while a batch is sampled: each becomes a request on the
//! batch's sampler seam (the policy's in the trajectories' forward, the base model's in
//! one of its own, or a request to a vLLM server), answered through its own [`Sink`] and
//! never part of a trajectory: its tokens go back to the plugin only.
//!
//! An ask draws from a generator seeded by (the trajectory's seed, the call's index in the
//! trajectory) only, so a run repeats whatever else the batch holds.

use crate::model::bundle::LanguageModel;
use crate::model::tokenizer::Tokenizer;
use crate::plugin::model::{Answerer, GenerateCall, Generated, Prompt};
use crate::sampler::decode::{self, Finish};
use crate::sampler::draw::SamplingParams;
use crate::sampler::{Request, Sampler, Sampling, Sink, Token};
use crate::task::Sample;
use serde_json::{Map, Value as Json};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Mixed into an ask's seed so that its stream differs from its trajectory's own.
const ASK_STREAM: usize = 0x0061_736b;

/// Where an ask's answer goes: the plugin, once the sampler has finished it.
pub struct AskSink<'t> {
    tokenizer: &'t Tokenizer,
    stop_strings: Vec<String>,
    prompt_tokens: usize,
    reply: Option<tokio::sync::oneshot::Sender<Result<Generated, String>>>,
    /// Tokens sampled for asks, counted for the batch's figures.
    sampled: Arc<AtomicUsize>,
}

impl Sink for AskSink<'_> {
    fn token(&mut self, _: Token) -> bool {
        self.sampled.fetch_add(1, Ordering::Relaxed);
        // A plugin that went away (its call timed out) wants nothing more.
        self.reply.as_ref().is_some_and(|r| !r.is_closed())
    }

    /// The answer: the end-of-turn token and anything after a stop text are not part of
    /// it; its text is decoded without special tokens.
    fn done(&mut self, _: usize, c: decode::Completion) {
        let mut ids = c.tokens;
        if matches!(c.finish, Finish::StopToken(_)) {
            ids.pop();
        }
        let finish = match c.finish {
            Finish::Length => "length",
            Finish::StopToken(_) | Finish::StopString(_) => "stop",
        };
        let answer = self
            .tokenizer
            .decode(&ids, true)
            .map(|mut text| {
                if let Some(cut) = self
                    .stop_strings
                    .iter()
                    .filter_map(|s| text.find(s.as_str()))
                    .min()
                {
                    text.truncate(cut);
                }
                Generated {
                    text,
                    token_ids: ids,
                    finish_reason: finish.to_string(),
                    prompt_tokens: self.prompt_tokens,
                }
            })
            .map_err(|e| format!("the answer does not decode: {e:#}"));
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(answer);
        }
    }

    fn failed(&mut self, message: &str) {
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(Err(message.to_string()));
        }
    }
}

/// The call as a request on the sampler seam and the sink that answers it, or (having
/// answered the plugin with the reason) `None` when its prompt cannot be run. Sampled
/// tokens are counted in `sampled`.
pub fn ask<'t>(
    lm: &'t LanguageModel,
    template_kwargs: &Map<String, Json>,
    stop_token_ids: &[u32],
    call: GenerateCall,
    sampled: &Arc<AtomicUsize>,
) -> Option<(Request, AskSink<'t>)> {
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
            super::render::prompt_tokens(lm, template_kwargs, None, &sample)
                .map_err(|e| format!("the messages do not render with the chat template: {e:#}"))
        }
    };
    let vocab = lm.model.vocab();
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
    let params = SamplingParams {
        temperature: r.temperature,
        top_p: r.top_p,
        max_new_tokens: r.max_new_tokens as usize,
        stop_token_ids: stop_token_ids.to_vec(),
        stop_strings: r.stop.clone(),
        seed: trajectory_seed,
        ..SamplingParams::default()
    };
    let sink = AskSink {
        tokenizer: &lm.tokenizer,
        stop_strings: r.stop,
        prompt_tokens: ids.len(),
        reply: Some(reply),
        sampled: sampled.clone(),
    };
    // Seeded by `sample_seed(trajectory_seed, index, ASK_STREAM)`.
    let request = Request {
        index: index as usize,
        first_choice: ASK_STREAM,
        base: r.weights == Answerer::Base,
        ..Request::new(ids, 1, params)
    };
    Some((request, sink))
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
    let sampled = Arc::new(AtomicUsize::new(0));
    let mut sampler = Sampler::new(&lm.model, &lm.tokenizer, crate::model::lora::Mode::BASE);
    loop {
        // Block only when nothing decodes.
        let next = if sampler.is_empty() {
            rx.recv().ok()
        } else {
            rx.try_recv().ok()
        };
        if let Some(call) = next {
            if let Some((request, sink)) = ask(lm, &kwargs, &stop, call, &sampled) {
                sampler.admit(request, Box::new(sink));
            }
            continue;
        }
        if sampler.is_empty() {
            return;
        }
        let _ = Sampling::step(&mut sampler);
    }
}
