//! Supervised fine-tuning of the adapter: next-token cross-entropy on the tokens a mask
//! selects (the assistant's), AdamW on the LoRA parameters only.
//!
//! loss = −Σ_t mask_t · log p(x_t | x_<t) / Σ_t mask_t   (token mean over the batch)
//!
//! Conversations become tokens the way rollouts produce them ([`conversation_row`]): the
//! prompt rendered with a generation prompt, then each assistant turn's content encoded on
//! its own followed by the stop token (trained on), then the template's continuation up
//! to the next assistant header (not trained on). What SFT teaches is therefore exactly
//! the token sequence the sampler will see.

use super::optim::{Accumulator, AdamW as Optim, AdamWConfig, clip_grad_norm, lr_at};
use super::packing::{self, Layout};
use crate::model::{LanguageModel, Mode, Model};
use crate::rollout::render::escaped;
use crate::rollout::turns::TurnFormat;
use crate::task::Message;
use anyhow::{Context, Result, bail};
use candle_core::{Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use serde_json::{Map, Value as Json};

/// One training sequence: its tokens and, per token, whether the model learns to
/// predict it (1) or only reads it (0, e.g. the prompt or tool output).
#[derive(Debug, Clone)]
pub struct SftRow {
    pub tokens: Vec<u32>,
    pub loss_mask: Vec<u8>,
}

#[derive(Debug, Clone)]
pub struct SftOptions {
    pub steps: usize,
    pub lr: f64,
    /// Stop early once the loss is below this.
    pub target_loss: f32,
    /// Pack the rows into lanes ([`packing`]) rather than one row a lane; the same loss
    /// up to rounding (`train.pack_sequences`).
    pub pack_sequences: bool,
}

/// The batch tensors of `rows` as `layout` packs them ([`packing`]): inputs, targets
/// (shifted by one), sequence ids (the attention mask), positions and loss weights, all
/// `[L, T]`.
pub(super) struct SftBatch {
    pub input: Tensor,
    pub target: Tensor,
    pub attn: Tensor,
    pub pos: Tensor,
    pub weight: Tensor,
    pub tokens: f32,
}

/// Each row's `(index, tokens − 1)`, the rows checked (a row of one token has nothing
/// to predict and takes no room).
pub(super) fn sized(rows: &[SftRow]) -> Result<Vec<(usize, usize)>> {
    let sized = rows
        .iter()
        .enumerate()
        .map(|(i, r)| {
            if r.loss_mask.len() != r.tokens.len() {
                bail!(
                    "SFT row {i} has {} tokens but {} mask entries",
                    r.tokens.len(),
                    r.loss_mask.len()
                );
            }
            Ok((i, r.tokens.len().saturating_sub(1)))
        })
        .collect::<Result<Vec<_>>>()?;
    if sized.iter().all(|r| r.1 == 0) {
        bail!("SFT rows need at least two tokens");
    }
    Ok(sized)
}

pub(super) fn batch(rows: &[SftRow], layout: &Layout, device: &Device) -> Result<SftBatch> {
    let shape = (layout.lanes, layout.width);
    let weight = layout.place(|s, k| f32::from(rows[s.row].loss_mask[k + 1]));
    let tokens: f32 = weight.iter().sum();
    let ids = |v: Vec<u32>| Tensor::from_vec(v, shape, device);
    Ok(SftBatch {
        input: ids(layout.place(|s, k| rows[s.row].tokens[k]))?,
        target: ids(layout.place(|s, k| rows[s.row].tokens[k + 1]))?,
        attn: ids(layout.sequence_ids())?,
        pos: ids(layout.positions())?,
        weight: Tensor::from_vec(weight, shape, device)?,
        tokens,
    })
}

/// Fits the model's adapter to `rows` (one full batch per step); returns the loss of each
/// step taken.
pub fn fit(model: &Model, rows: &[SftRow], opts: &SftOptions) -> Result<Vec<f32>> {
    let vars: Vec<_> = model.lora_vars().into_iter().map(|(_, v)| v).collect();
    if vars.is_empty() {
        bail!("the model has no adapter to train: attach one first");
    }
    let layout = packing::micro_batches(&sized(rows)?, opts.pack_sequences, usize::MAX).remove(0);
    let b = batch(rows, &layout, model.device())?;
    if b.tokens == 0.0 {
        bail!("no SFT row has a token to learn (all loss masks are 0)");
    }
    let mut opt = AdamW::new(
        vars,
        ParamsAdamW {
            lr: opts.lr,
            weight_decay: 0.0,
            ..Default::default()
        },
    )?;
    let mode = Mode::TRAIN;
    let mut losses = Vec::new();
    for _ in 0..opts.steps {
        let hidden = model.forward_batch(&b.input, &b.attn, &b.pos, mode)?;
        let (logp, _) = model.logprobs(&hidden, &b.target)?;
        let loss = ((logp * &b.weight)?.sum_all()? / -(b.tokens as f64))?;
        let value = loss.to_scalar::<f32>()?;
        losses.push(value);
        if value < opts.target_loss {
            break;
        }
        opt.backward_step(&loss)?;
    }
    Ok(losses)
}

/// A conversation as training tokens: loss on the assistant turns (content and stop
/// token) only. The conversation must contain at least one assistant message, and only
/// system/user/tool messages before the first.
pub fn conversation_row(
    lm: &LanguageModel,
    messages: &[Message],
    kwargs: &Map<String, Json>,
) -> Result<SftRow> {
    let first = messages
        .iter()
        .position(|m| m.role == "assistant")
        .context("the conversation has no assistant message to learn")?;
    if first == 0 {
        bail!("the conversation starts with an assistant message; it needs a prompt first");
    }
    learned_from(lm, messages, first, kwargs)
}

/// A prompt and its completion as training tokens: loss on the completion's assistant
/// turns only, whatever the prompt holds (earlier assistant turns of a multi-turn prompt
/// included). The completion starts with an assistant message. A preference pair's
/// completions are scored this way ([`super::dpo`]).
pub fn completion_row(
    lm: &LanguageModel,
    prompt: &[Message],
    completion: &[Message],
    kwargs: &Map<String, Json>,
) -> Result<SftRow> {
    if prompt.is_empty() {
        bail!("the completion has no prompt before it");
    }
    if completion.first().is_none_or(|m| m.role != "assistant") {
        bail!("a completion starts with an assistant message");
    }
    let messages: Vec<Message> = prompt.iter().chain(completion).cloned().collect();
    learned_from(lm, &messages, prompt.len(), kwargs)
}

/// The tokens of `messages`, rendered as the prompt up to `first` (an assistant message)
/// and turn by turn from there, the assistant turns learned.
fn learned_from(
    lm: &LanguageModel,
    messages: &[Message],
    first: usize,
    kwargs: &Map<String, Json>,
) -> Result<SftRow> {
    let chat = lm.chat()?;
    let eos = *lm
        .eos_token_ids
        .first()
        .context("the model has no EOS token to end a turn with")?;
    let eos_text = lm.tokenizer.decode(&[eos], false)?;
    let turns = TurnFormat::new(chat, kwargs.clone(), None)?;
    // As in rollouts: message contents are data, so a special-token string in them stays
    // plain text, and only the template writes special tokens.
    let tok = &lm.tokenizer;
    let escaped = escaped(tok, messages);
    let prompt: Vec<Json> = escaped[..first]
        .iter()
        .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
        .collect();
    let mut tokens = tok.encode_escaped(&chat.render_with_kwargs(&prompt, None, true, kwargs)?)?;
    let mut loss_mask = vec![0u8; tokens.len()];
    let mut k = first;
    while k < messages.len() {
        let m = &messages[k];
        if m.role != "assistant" {
            bail!(
                "message {k} ({}) follows another non-assistant message mid-conversation; merge them",
                m.role
            );
        }
        let content = tok.encode_plain(&m.content)?;
        loss_mask.extend(std::iter::repeat_n(1u8, content.len() + 1));
        tokens.extend(content);
        tokens.push(eos);
        // The environment's (or user's) messages up to the next assistant turn.
        let next = messages[k + 1..]
            .iter()
            .position(|m| m.role == "assistant")
            .map_or(messages.len(), |p| k + 1 + p);
        if next > k + 1 && next < messages.len() {
            let text = turns.continuation(&escaped[..=k], &escaped[k + 1..next], &eos_text)?;
            let ids = tok.encode_escaped(&text)?;
            loss_mask.extend(std::iter::repeat_n(0u8, ids.len()));
            tokens.extend(ids);
        }
        k = next;
    }
    Ok(SftRow { tokens, loss_mask })
}

/// Epochs over `rows` in minibatches.
#[derive(Debug, Clone)]
pub struct SftSchedule {
    pub epochs: usize,
    pub batch_rows: usize,
    pub lr: f64,
    pub warmup_steps: u64,
    pub max_grad_norm: f64,
    /// Most tokens (lanes × longest lane) per forward/backward; a minibatch is split to
    /// fit.
    pub micro_batch_tokens: usize,
    /// Several rows a lane ([`packing`]) instead of one padded to the longest.
    pub pack_sequences: bool,
    pub seed: u64,
}

/// Trains the adapter over `rows` for `schedule.epochs` (rows shuffled each epoch by the
/// seed); calls `on_step(step, total, loss)` after each optimizer step and returns the
/// losses. An error from `on_step` (a warm start's probe between steps) ends it.
pub fn train(
    model: &Model,
    rows: &[SftRow],
    schedule: &SftSchedule,
    mut on_step: impl FnMut(u64, u64, f32) -> Result<()>,
) -> Result<Vec<f32>> {
    if rows.is_empty() {
        bail!("no SFT rows");
    }
    let mut opt = Optim::new(model.lora_vars(), AdamWConfig::default())?;
    if opt.params().is_empty() {
        bail!("the model has no adapter to train: attach one first");
    }
    let bs = schedule.batch_rows.max(1);
    let per_epoch = rows.len().div_ceil(bs) as u64;
    let total = per_epoch * schedule.epochs as u64;
    let mode = Mode::TRAIN;
    let params = opt.params().to_vec();
    let mut losses = Vec::new();
    let mut step = 0u64;
    for epoch in 0..schedule.epochs {
        let ids: Vec<u64> = (0..rows.len() as u64).collect();
        let order = crate::data::order::epoch_order(&ids, schedule.seed, epoch as u64, true);
        for chunk in order.chunks(bs) {
            let batch_rows: Vec<SftRow> = chunk.iter().map(|&i| rows[i as usize].clone()).collect();
            let sized = sized(&batch_rows)?;
            let total_tokens: f32 = batch_rows
                .iter()
                .map(|r| r.loss_mask.iter().skip(1).map(|&m| m as f32).sum::<f32>())
                .sum();
            let mut acc = Accumulator::new(params.len());
            let mut loss_sum = 0.0f64;
            // Micro-batches of rows that fit; each loss is a share of the
            // minibatch's token mean, so accumulated gradients are the minibatch's.
            let pack = schedule.pack_sequences;
            for layout in packing::micro_batches(&sized, pack, schedule.micro_batch_tokens) {
                let b = batch(&batch_rows, &layout, model.device())?;
                let hidden = model.forward_batch(&b.input, &b.attn, &b.pos, mode)?;
                let (logp, _) = model.logprobs(&hidden, &b.target)?;
                let loss = ((logp * &b.weight)?.sum_all()? / -(total_tokens.max(1.0) as f64))?;
                loss_sum += loss.to_scalar::<f32>()? as f64;
                acc.add(&params, &loss.backward()?)?;
            }
            let mut grads = acc.take(&params)?;
            clip_grad_norm(&mut grads, schedule.max_grad_norm)?;
            let lr = lr_at(step, total, schedule.warmup_steps, schedule.lr, 0.0);
            opt.update(&grads, lr)?;
            step += 1;
            losses.push(loss_sum as f32);
            on_step(step, total, loss_sum as f32)?;
        }
    }
    Ok(losses)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Placement, fixtures};

    fn msg(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
            ..Default::default()
        }
    }

    /// Packed rows score as padded ones: the same token-mean loss from one lane a row
    /// and from rows packed into fewer lanes.
    #[test]
    fn packed_sft_rows_give_the_padded_loss() {
        let model = fixtures::load("qwen2");
        let row = |n: u32, mask_from: usize| SftRow {
            tokens: (0..n).map(|t| 3 + 7 * t % 50).collect(),
            loss_mask: (0..n as usize).map(|k| u8::from(k >= mask_from)).collect(),
        };
        let rows = [row(17, 5), row(6, 2), row(9, 3), row(4, 1)];
        let sized = sized(&rows).unwrap();
        let loss = |pack: bool| {
            let layout = packing::micro_batches(&sized, pack, usize::MAX).remove(0);
            let b = batch(&rows, &layout, model.device()).unwrap();
            let hidden = model
                .forward_batch(&b.input, &b.attn, &b.pos, Mode::INFERENCE)
                .unwrap();
            let (logp, _) = model.logprobs(&hidden, &b.target).unwrap();
            let sum = (logp * &b.weight).unwrap().sum_all().unwrap();
            (layout.lanes, sum.to_scalar::<f32>().unwrap() / -b.tokens)
        };
        let ((lanes_padded, padded), (lanes_packed, packed)) = (loss(false), loss(true));
        assert_eq!((lanes_padded, lanes_packed), (4, 2));
        assert!((padded - packed).abs() < 1e-5, "{padded} vs {packed}");
    }

    /// The row decodes to the template's rendering of the conversation, and the mask
    /// covers exactly each assistant turn's content and its stop token.
    #[test]
    fn conversation_rows_render_like_the_template_and_mask_assistant_turns() {
        let lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
        let conv = vec![
            msg("user", "Guess my number."),
            msg("assistant", "50"),
            msg("user", "Lower."),
            msg("assistant", "25"),
        ];
        let row = conversation_row(&lm, &conv, &Map::new()).unwrap();
        let json: Vec<Json> = conv
            .iter()
            .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
            .collect();
        let rendered = lm.chat().unwrap().render(&json, None, false).unwrap();
        let decoded = lm.tokenizer.decode(&row.tokens, false).unwrap();
        assert_eq!(format!("{decoded}\n"), rendered);
        let learned: Vec<u32> = row
            .tokens
            .iter()
            .zip(&row.loss_mask)
            .filter(|(_, m)| **m == 1)
            .map(|(t, _)| *t)
            .collect();
        assert_eq!(
            lm.tokenizer.decode(&learned, false).unwrap(),
            "50<|im_end|>25<|im_end|>"
        );
        assert!(conversation_row(&lm, &conv[..1], &Map::new()).is_err());
    }
}
