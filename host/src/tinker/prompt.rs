//! What a sampling request asks about its own prompt, scored in one forward over it:
//! each token's log-prob (`prompt_logprobs`, the last N only with `prompt_logprobs_last_n`),
//! the likeliest tokens at each position (`topk_prompt_logprobs`), the log-probs of given
//! tokens at each position (`target_prompt_logprobs`), and tokens drawn at each position
//! at the request's temperature (`prompt_alt_tokens_k`). Row `i` of the forward's logits
//! predicts prompt token `i + 1`: the first token has nothing to be scored against.

use super::proto;
use crate::model::LanguageModel;
use crate::model::lora::Mode;
use anyhow::Result;
use candle_core::{D, DType, Tensor};
use rand::{RngExt, SeedableRng};

/// The prompt figures a request asks for.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Ask {
    pub logprobs: bool,
    /// The likeliest tokens at each position (0: none).
    pub topk: usize,
    /// Only the last this many positions are scored.
    pub last_n: Option<usize>,
    /// `[len - 1, k]` token ids (−1: none) whose log-probs to return.
    pub targets: Option<Targets>,
    /// Tokens drawn at each position after the first (0: none).
    pub alt: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Targets {
    pub k: usize,
    /// Row-major, `len - 1` rows of `k`.
    pub ids: Vec<i64>,
}

impl Ask {
    pub fn any(&self) -> bool {
        self.logprobs || self.topk > 0 || self.targets.is_some() || self.alt > 0
    }

    /// The whole logits are needed (not only each token's log-prob).
    fn whole(&self) -> bool {
        self.topk > 0 || self.targets.is_some() || self.alt > 0
    }
}

/// A prompt's figures, per position (the first position NaN or empty).
#[derive(Debug, Clone, Default)]
pub struct Scores {
    pub logprobs: Vec<f32>,
    pub top: Vec<Option<Vec<(u32, f32)>>>,
    /// `[len - 1, k]` log-probs of the asked tokens, 0 where none was asked.
    pub targets: Vec<f32>,
    /// `[len - 1, alt]` drawn ids and the model's log-probs of them.
    pub alt: (Vec<i64>, Vec<f32>),
}

impl Scores {
    /// Keeps the last `n` positions' log-probs and top-k (the others NaN and `None`).
    pub fn keep_last(&mut self, n: usize) {
        let cut = self.logprobs.len().saturating_sub(n);
        self.logprobs[..cut].fill(f32::NAN);
        let cut = cut.min(self.top.len());
        self.top[..cut].fill(None);
    }

    /// The figures `ask` asked for, as the SDK reads them.
    pub fn write(&self, ask: &Ask, into: &mut proto::SampleResponse) {
        let rows = self.logprobs.len().saturating_sub(1) as i64;
        if ask.logprobs {
            into.prompt_logprobs = Some(proto::f32_bytes(&self.logprobs));
        }
        if ask.topk > 0 {
            into.topk_prompt_logprobs = Some(proto::TopkLogprobs::from_rows(&self.top, ask.topk));
        }
        if let Some(t) = &ask.targets {
            into.target_prompt_logprobs =
                Some(proto::Tensor::f32(&self.targets, vec![rows, t.k as i64]));
        }
        if ask.alt > 0 {
            into.prompt_alt_tokens = Some(proto::PromptAltTokens {
                tokens: Some(proto::Tensor::i64(&self.alt.0, vec![rows, ask.alt as i64])),
                logprobs: Some(proto::Tensor::f32(&self.alt.1, vec![rows, ask.alt as i64])),
            });
        }
    }
}

/// Scores `prompt` under `mode` for `ask`; draws at `temperature` from a generator seeded
/// by `seed`.
pub fn score(
    lm: &LanguageModel,
    mode: Mode,
    prompt: &[u32],
    ask: &Ask,
    temperature: f32,
    seed: u64,
) -> Result<Scores> {
    let model = &lm.model;
    let device = model.device();
    let n = prompt.len();
    let mut s = Scores {
        logprobs: vec![f32::NAN; n],
        top: vec![None; n],
        ..Scores::default()
    };
    if n < 2 {
        return Ok(s);
    }
    let ids = Tensor::new(&prompt[..n - 1], device)?.unsqueeze(0)?;
    let mask = Tensor::ones((1, n - 1), DType::U32, device)?;
    let pos = Tensor::arange(0u32, (n - 1) as u32, device)?.unsqueeze(0)?;
    let targets = Tensor::new(&prompt[1..], device)?.unsqueeze(0)?;
    let hidden = model.forward_batch(&ids, &mask, &pos, mode)?;
    let lp = super::adapter::target_logprobs(model, &hidden, &targets, mode.adapter)?;
    let lp = lp.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    s.logprobs[1..].copy_from_slice(&lp);
    if !ask.whole() {
        return Ok(s);
    }
    let h = hidden.squeeze(0)?;
    let mut logits = model.logits(&h)?;
    if let Some((a, b, sc)) = mode.adapter.and_then(|set| set.head()) {
        logits = (logits + crate::model::compute::head_delta(&h, a, b, sc)?)?;
    }
    let rows = candle_nn::ops::log_softmax(&logits, D::Minus1)?.to_vec2::<f32>()?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x7a11_70c5);
    for (i, row) in rows.iter().enumerate() {
        if ask.topk > 0 {
            // A row of log-probs is its own log-softmax: the sampler's top-k reads it as is.
            s.top[i + 1] = Some(crate::sampler::draw::top_logprobs(row, ask.topk, 1.0));
        }
        if let Some(t) = &ask.targets {
            for j in 0..t.k {
                let id = t.ids[i * t.k + j];
                s.targets.push(match usize::try_from(id) {
                    Ok(id) if id < row.len() => row[id],
                    _ => 0.0,
                });
            }
        }
        for _ in 0..ask.alt {
            // Drawn at the temperature; reported with the model's own log-prob (the SDK's
            // `PromptAltTokens.logprobs`).
            let (id, _) = draw(row, temperature, &mut rng);
            s.alt.0.push(id as i64);
            s.alt.1.push(row[id]);
        }
    }
    Ok(s)
}

/// A token drawn from `softmax(logp / T)` and its log-prob there (`T` = 0: the likeliest,
/// log-prob 0).
fn draw(logp: &[f32], temperature: f32, rng: &mut rand::rngs::StdRng) -> (usize, f32) {
    if temperature <= 0.0 {
        let best = (0..logp.len())
            .max_by(|a, b| logp[*a].total_cmp(&logp[*b]))
            .unwrap_or(0);
        return (best, 0.0);
    }
    let scaled: Vec<f64> = logp
        .iter()
        .map(|&l| l as f64 / temperature as f64)
        .collect();
    let max = scaled.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + scaled.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    let mut u: f64 = rng.random();
    for (i, x) in scaled.iter().enumerate() {
        let p = (x - lse).exp();
        if u < p {
            return (i, (x - lse) as f32);
        }
        u -= p;
    }
    let last = scaled.len() - 1;
    (last, (scaled[last] - lse) as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_follow_the_tempered_distribution_and_top_k_is_ordered() {
        let logp: Vec<f32> = [0.5f64, 0.3, 0.2].iter().map(|p| p.ln() as f32).collect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut counts = [0usize; 3];
        for _ in 0..20_000 {
            let (i, lp) = draw(&logp, 1.0, &mut rng);
            counts[i] += 1;
            assert!((lp - logp[i]).abs() < 1e-5);
        }
        for (c, p) in counts.iter().zip([0.5, 0.3, 0.2]) {
            assert!((*c as f64 / 20_000.0 - p).abs() < 0.02, "{counts:?}");
        }
        // At T = 0.5 the tempered probabilities are p² normalised: 25/38, 9/38, 4/38.
        let (_, lp) = draw(&logp, 0.5, &mut rng);
        assert!(
            [25.0f64 / 38.0, 9.0 / 38.0, 4.0 / 38.0]
                .iter()
                .any(|p| (p.ln() as f32 - lp).abs() < 1e-5)
        );
        assert_eq!(draw(&logp, 0.0, &mut rng), (0, 0.0));
        assert_eq!(
            crate::sampler::draw::top_logprobs(&logp, 2, 1.0)
                .iter()
                .map(|t| t.0)
                .collect::<Vec<_>>(),
            vec![0, 1]
        );
    }

    #[test]
    fn only_the_last_positions_are_kept_when_asked() {
        let mut s = Scores {
            logprobs: vec![f32::NAN, -1.0, -2.0, -3.0],
            top: vec![
                None,
                Some(vec![(1, -1.0)]),
                Some(vec![(2, -2.0)]),
                Some(vec![(3, -3.0)]),
            ],
            ..Scores::default()
        };
        s.keep_last(2);
        assert!(s.logprobs[1].is_nan() && s.logprobs[2] == -2.0 && s.logprobs[3] == -3.0);
        assert_eq!(s.top[1], None);
        assert_eq!(s.top[3], Some(vec![(3, -3.0)]));
    }
}
