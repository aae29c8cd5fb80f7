//! Choosing the next token from logits: temperature, top-k, top-p, min-p, greedy.
//!
//! The log-prob returned with a token is `log softmax(logits / T)[token]` over the whole
//! vocabulary (T = 1 when greedy), i.e. the policy's probability at the sampling
//! temperature before top-k/top-p/min-p truncation. That is what the trainer recomputes
//! from the same weights, so importance ratios start at exactly 1 (verl and TRL use the
//! same convention).

use crate::model::LanguageModel;
use anyhow::{Context, Result};
use rand::RngExt;
use rand::rngs::StdRng;

/// The lowest temperature above 0 that is sampled at. Below it `1 / T` leaves f32's range
/// (1e-40 made every probability NaN, and the draw fell past the vocabulary), and the
/// trainer, which divides the logits by `T` too, could not score the tokens. 0 is greedy.
pub const MIN_TEMPERATURE: f32 = 1e-3;

/// How to pick tokens and when to stop.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens (0: off).
    pub top_k: usize,
    /// Keep the most likely tokens whose probabilities sum to at least p (1: off).
    pub top_p: f32,
    /// Keep tokens at least `min_p ×` the most likely one's probability (0: off).
    pub min_p: f32,
    pub max_new_tokens: usize,
    /// Token ids that end a sequence (kept as its last token), usually the EOS ids.
    pub stop_token_ids: Vec<u32>,
    /// Texts that end a sequence once they appear in its decoded output.
    pub stop_strings: Vec<String>,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            max_new_tokens: 256,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Whether a token drawn with `self` is drawn as with `other`: the same temperature
    /// and truncation (budgets, stops and seeds may differ), so both draw in one batch.
    pub fn draws_as(&self, other: &SamplingParams) -> bool {
        self.temperature == other.temperature
            && self.top_k == other.top_k
            && self.top_p == other.top_p
            && self.min_p == other.min_p
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        let t = self.temperature;
        if !(t == 0.0 || (t >= MIN_TEMPERATURE && t.is_finite())) {
            anyhow::bail!("temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {t}");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            anyhow::bail!("top_p must be in (0, 1], got {}", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            anyhow::bail!("min_p must be in [0, 1], got {}", self.min_p);
        }
        if self.stop_strings.iter().any(String::is_empty) {
            anyhow::bail!("stop strings must not be empty");
        }
        Ok(())
    }
}

/// Picks a token; returns it with its log-prob (see the module header).
pub fn sample(logits: &[f32], params: &SamplingParams, rng: &mut StdRng) -> (u32, f32) {
    let greedy = params.temperature <= 0.0;
    let inv_t = if greedy {
        1.0
    } else {
        1.0 / params.temperature
    };
    // log-sum-exp of the scaled logits, stable.
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .map(|&l| (((l - max) * inv_t) as f64).exp())
        .sum();
    let lse = max * inv_t + sum.ln() as f32;
    let logp = |i: usize| logits[i] * inv_t - lse;
    if greedy {
        let best = argmax(logits);
        return (best as u32, logp(best));
    }
    let prob = |i: usize| logp(i).exp();
    let candidates = candidates(logits, params, &prob);
    let total: f32 = candidates.iter().map(|&i| prob(i)).sum();
    let mut u = rng.random::<f32>() * total;
    for &i in &candidates {
        u -= prob(i);
        if u <= 0.0 {
            return (i as u32, logp(i));
        }
    }
    // Rounding left a sliver: the last candidate takes it.
    let last = *candidates.last().expect("at least one candidate");
    (last as u32, logp(last))
}

/// The `k` likeliest tokens with their log-probs `log softmax(logits / T)` (T = 1 when
/// greedy, as [`sample`] reports a drawn token's), most likely first; ties by id.
pub fn top_logprobs(logits: &[f32], k: usize, temperature: f32) -> Vec<(u32, f32)> {
    let inv_t = if temperature <= 0.0 {
        1.0
    } else {
        1.0 / temperature
    };
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .map(|&l| (((l - max) * inv_t) as f64).exp())
        .sum();
    let lse = max * inv_t + sum.ln() as f32;
    let by_logit_desc = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let k = k.min(logits.len());
    if k == 0 {
        return Vec::new();
    }
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, by_logit_desc);
        idx.truncate(k);
    }
    idx.sort_unstable_by(by_logit_desc);
    idx.into_iter()
        .map(|i| (i as u32, logits[i] * inv_t - lse))
        .collect()
}

fn argmax(xs: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best
}

/// The token ids that survive top-k, top-p and min-p, most likely first when any of them
/// is on. Avoids sorting the whole vocabulary: the `k` best are selected in linear time and
/// only they are sorted; for top-p, `k` grows until they hold enough mass.
pub(crate) fn candidates(
    logits: &[f32],
    params: &SamplingParams,
    prob: &dyn Fn(usize) -> f32,
) -> Vec<usize> {
    let v = logits.len();
    let top_k = if params.top_k == 0 {
        v
    } else {
        params.top_k.min(v)
    };
    if top_k == v && params.top_p >= 1.0 && params.min_p <= 0.0 {
        return (0..v).collect();
    }
    let by_logit_desc = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let mut k = if params.top_p < 1.0 {
        top_k.min(64)
    } else {
        top_k
    };
    let mut kept = loop {
        let mut idx: Vec<usize> = (0..v).collect();
        if k < v {
            idx.select_nth_unstable_by(k - 1, by_logit_desc);
            idx.truncate(k);
        }
        idx.sort_unstable_by(by_logit_desc);
        if params.top_p >= 1.0 || k == top_k {
            break idx;
        }
        let mass: f32 = idx.iter().map(|&i| prob(i)).sum();
        if mass >= params.top_p {
            break idx;
        }
        k = (k * 4).min(top_k);
    };
    if params.top_p < 1.0 {
        // Smallest prefix with mass >= top_p (mass of the top-k set, as transformers
        // applies top-k before top-p without renormalising in between).
        let mut acc = 0.0;
        let mut n = 0;
        for &i in &kept {
            acc += prob(i);
            n += 1;
            if acc >= params.top_p {
                break;
            }
        }
        kept.truncate(n.max(1));
    }
    if params.min_p > 0.0 {
        let floor = params.min_p * prob(kept[0]);
        kept.retain(|&i| prob(i) >= floor);
    }
    kept
}

/// A model's sampling defaults, from its `generation_config.json` (as transformers'
/// `generate` uses them), stopping at its EOS ids.
pub fn defaults(lm: &LanguageModel) -> Result<SamplingParams> {
    let mut p = SamplingParams {
        stop_token_ids: lm.eos_token_ids.clone(),
        ..SamplingParams::default()
    };
    let path = lm.dir.join("generation_config.json");
    if !path.is_file() {
        return Ok(p);
    }
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let num = |k: &str| -> Result<Option<f64>> {
        match v.get(k) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(x) => x
                .as_f64()
                .map(Some)
                .with_context(|| format!("{}: `{k}` must be a number, found {x}", path.display())),
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rand::SeedableRng;

    pub(crate) fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            ..SamplingParams::default()
        }
    }

    fn probs(logits: &[f32]) -> Vec<f32> {
        let m = logits.iter().copied().fold(f32::MIN, f32::max);
        let e: Vec<f32> = logits.iter().map(|l| (l - m).exp()).collect();
        let s: f32 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    #[test]
    fn filters_keep_what_their_definitions_say() {
        // probs ≈ [0.032, 0.087, 0.237, 0.644]
        let logits = [0.0, 1.0, 2.0, 3.0];
        let p = probs(&logits);
        let prob = |i: usize| p[i];
        let c = |pr| candidates(&logits, &pr, &prob);
        assert_eq!(c(params(1.0, 2, 1.0, 0.0)), vec![3, 2]);
        assert_eq!(c(params(1.0, 0, 0.6, 0.0)), vec![3]);
        assert_eq!(c(params(1.0, 0, 0.7, 0.0)), vec![3, 2]);
        assert_eq!(c(params(1.0, 0, 0.9, 0.0)), vec![3, 2, 1]);
        // min_p 0.1: floor 0.064 keeps 0.087 and up.
        assert_eq!(c(params(1.0, 0, 1.0, 0.1)), vec![3, 2, 1]);
        assert_eq!(c(params(1.0, 0, 1.0, 0.0)), vec![0, 1, 2, 3]);
    }

    #[test]
    fn top_p_over_a_large_vocabulary_grows_its_candidate_set() {
        // A flat distribution over 1000 tokens: top_p 0.5 needs 500 of them.
        let logits = vec![0.0f32; 1000];
        let p = probs(&logits);
        let kept = candidates(&logits, &params(1.0, 0, 0.5, 0.0), &|i| p[i]);
        assert!((499..=501).contains(&kept.len()), "{}", kept.len());
    }

    #[test]
    fn greedy_and_logprobs() {
        let logits = [0.5, 2.0, -1.0];
        let mut rng = StdRng::seed_from_u64(0);
        let (t, lp) = sample(&logits, &params(0.0, 0, 1.0, 0.0), &mut rng);
        assert_eq!(t, 1);
        assert!((lp - probs(&logits)[1].ln()).abs() < 1e-6);
        // At temperature 2 the log-prob is of softmax(logits / 2).
        let (t, lp) = sample(&logits, &params(2.0, 0, 1.0, 0.0), &mut rng);
        let half: Vec<f32> = logits.iter().map(|l| l / 2.0).collect();
        assert!((lp - probs(&half)[t as usize].ln()).abs() < 1e-6);
    }

    #[test]
    fn sampling_follows_the_distribution_and_is_seeded() {
        let logits = [0.0, 1.0, 2.0, 3.0];
        let p = probs(&logits);
        let mut counts = [0usize; 4];
        let mut rng = StdRng::seed_from_u64(7);
        let n = 40_000;
        for _ in 0..n {
            counts[sample(&logits, &params(1.0, 0, 1.0, 0.0), &mut rng).0 as usize] += 1;
        }
        for i in 0..4 {
            let f = counts[i] as f32 / n as f32;
            assert!((f - p[i]).abs() < 0.01, "token {i}: {f} vs {}", p[i]);
        }
        let draw = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..20)
                .map(|_| sample(&logits, &params(1.0, 0, 1.0, 0.0), &mut rng).0)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
        // top-k 1 is greedy whatever the temperature.
        let mut rng = StdRng::seed_from_u64(1);
        assert!((0..100).all(|_| sample(&logits, &params(5.0, 1, 1.0, 0.0), &mut rng).0 == 3));
    }

    #[test]
    fn invalid_params_are_refused() {
        assert!(params(-1.0, 0, 1.0, 0.0).validate().is_err());
        // 1e-40 is above 0 as an f32, and 1 / 1e-40 is not finite.
        assert!(params(1e-40, 0, 1.0, 0.0).validate().is_err());
        assert!(params(MIN_TEMPERATURE, 0, 1.0, 0.0).validate().is_ok());
        assert!(params(0.0, 0, 1.0, 0.0).validate().is_ok());
        assert!(params(1.0, 0, 0.0, 0.0).validate().is_err());
        assert!(params(1.0, 0, 1.0, 1.5).validate().is_err());
        assert!(params(0.7, 20, 0.8, 0.05).validate().is_ok());
    }

    #[test]
    fn a_models_generation_defaults_are_read() {
        let lm = LanguageModel::open(
            &crate::model::fixtures::model_dir("qwen3"),
            &crate::model::Placement::CPU,
        )
        .unwrap();
        let p = defaults(&lm).unwrap();
        assert_eq!((p.temperature, p.top_k, p.top_p), (0.7, 20, 0.8));
        assert_eq!(p.stop_token_ids, vec![507, 505]);
    }
}
