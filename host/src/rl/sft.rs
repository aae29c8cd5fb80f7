//! Supervised fine-tuning of the adapter: next-token cross-entropy on the tokens a mask
//! selects (the assistant's), AdamW on the LoRA parameters only.
//!
//! loss = −Σ_t mask_t · log p(x_t | x_<t) / Σ_t mask_t   (token mean over the batch)

use crate::model::{Mode, Model};
use anyhow::{Result, bail};
use candle_core::{Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};

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
}

/// The padded batch tensors for `rows`: inputs, targets (shifted by one), attention
/// mask, positions and loss weights, all `[B, T-1]`.
struct Batch {
    input: Tensor,
    target: Tensor,
    attn: Tensor,
    pos: Tensor,
    weight: Tensor,
    tokens: f32,
}

fn batch(rows: &[SftRow], device: &Device) -> Result<Batch> {
    let t = rows.iter().map(|r| r.tokens.len()).max().unwrap_or(0);
    if t < 2 {
        bail!("SFT rows need at least two tokens");
    }
    let t = t - 1;
    let (mut input, mut target, mut attn, mut pos, mut weight) =
        (vec![], vec![], vec![], vec![], vec![]);
    for r in rows {
        if r.loss_mask.len() != r.tokens.len() {
            bail!(
                "an SFT row has {} tokens but {} mask entries",
                r.tokens.len(),
                r.loss_mask.len()
            );
        }
        let n = r.tokens.len() - 1;
        for i in 0..t {
            let real = i < n;
            input.push(if real { r.tokens[i] } else { 0 });
            target.push(if real { r.tokens[i + 1] } else { 0 });
            attn.push(u32::from(real));
            pos.push(i as u32);
            weight.push(if real {
                f32::from(r.loss_mask[i + 1])
            } else {
                0.0
            });
        }
    }
    let tokens: f32 = weight.iter().sum();
    if tokens == 0.0 {
        bail!("no SFT row has a token to learn (all loss masks are 0)");
    }
    let b = rows.len();
    Ok(Batch {
        input: Tensor::from_vec(input, (b, t), device)?,
        target: Tensor::from_vec(target, (b, t), device)?,
        attn: Tensor::from_vec(attn, (b, t), device)?,
        pos: Tensor::from_vec(pos, (b, t), device)?,
        weight: Tensor::from_vec(weight, (b, t), device)?,
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
    let b = batch(rows, model.device())?;
    let mut opt = AdamW::new(
        vars,
        ParamsAdamW {
            lr: opts.lr,
            weight_decay: 0.0,
            ..Default::default()
        },
    )?;
    let mode = Mode {
        adapters: true,
        grad: true,
        dropout_rng: None,
    };
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
