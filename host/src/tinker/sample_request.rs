//! What a client's request is checked against before the model's thread sees it: the
//! base model's facts ([`Base`]), and the sampling request ([`sample_job`]): its prompt's
//! chunks in the vocabulary, its parameters as the sampler takes them, and every size the
//! client picks bounded before anything is allocated for it.

use super::wire;
use super::worker::{SampleJob, SamplerWeights};
use crate::sampler::draw::SamplingParams;
use serde_json::Value;

/// The most samples one `asample` may ask for.
pub const MAX_SAMPLES: usize = 256;
/// The most alternatives one `topk_prompt_logprobs` or `topk_sample_logprobs` may ask
/// for at a position (vLLM's default `max_logprobs` is 20).
pub const MAX_TOPK: usize = 256;
/// The most (position, alternative) pairs one request's top-k and alt-token answers may
/// hold in all: 4 Mi, 32 MiB as (id, log-prob) pairs. Checked before anything is
/// allocated, so that no request sizes the server's memory.
pub const MAX_TOPK_ENTRIES: usize = 1 << 22;

/// What the server serves: the base model's facts the handlers check requests against.
#[derive(Debug, Clone)]
pub struct Base {
    /// The name clients pass as `base_model` (the run config's `model.path`).
    pub name: String,
    /// Other names accepted for it (its directory).
    pub aliases: Vec<String>,
    pub arch: String,
    /// The directory `get_tokenizer()` loads (absolute; the SDK cuts it at a `:`).
    pub tokenizer_dir: String,
    pub vocab: usize,
    pub context: usize,
    pub eos: Vec<u32>,
}

#[cfg(test)]
impl Base {
    /// The built-in multiply model's facts, for tests of the checks.
    pub(crate) fn for_tests() -> Base {
        Base {
            name: "builtin:multiply".into(),
            aliases: vec![],
            arch: "llama".into(),
            tokenizer_dir: "/nowhere".into(),
            vocab: 289,
            context: 512,
            eos: vec![2],
        }
    }
}

/// The sampling request, checked: text chunks with ids in the vocabulary, parameters the
/// sampler takes, and none of the API's options rlhost does not serve.
pub fn sample_job(
    req: &wire::Sample,
    request: &str,
    weights: SamplerWeights,
    base: &Base,
) -> Result<SampleJob, String> {
    if req.prompt_alt_tokens_k > MAX_SAMPLES {
        return Err(format!(
            "prompt_alt_tokens_k is {}; at most {MAX_SAMPLES} draws a position are served",
            req.prompt_alt_tokens_k
        ));
    }
    let mut prompt = Vec::new();
    for (c, ch) in req.prompt.chunks.iter().enumerate() {
        let kind = ch
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("encoded_text");
        if kind != "encoded_text" {
            return Err(format!(
                "prompt chunk {c} is {kind:?}; rlhost serves text models (encoded_text chunks only)"
            ));
        }
        let tokens = ch
            .get("tokens")
            .and_then(Value::as_array)
            .ok_or_else(|| format!("prompt chunk {c} has no `tokens` list"))?;
        for (p, v) in tokens.iter().enumerate() {
            match v.as_u64() {
                Some(id) if (id as usize) < base.vocab => prompt.push(id as u32),
                _ => {
                    return Err(format!(
                        "prompt chunk {c}: token {v} at position {p} is outside the vocabulary (0..{})",
                        base.vocab
                    ));
                }
            }
        }
    }
    if prompt.is_empty() {
        return Err("the prompt has no tokens".into());
    }
    if prompt.len() >= base.context {
        return Err(format!(
            "the prompt has {} tokens and the model's context is {}: no room to sample",
            prompt.len(),
            base.context
        ));
    }
    let sp = &req.sampling_params;
    let room = base.context - prompt.len();
    let max_new_tokens = match sp.max_tokens {
        None => room,
        Some(0) => return Err("sampling_params.max_tokens must be at least 1".into()),
        Some(m) => m.min(room),
    };
    // Every client-chosen size is bounded before the model's thread allocates for it.
    for (name, k) in [
        ("topk_prompt_logprobs", req.topk_prompt_logprobs),
        ("topk_sample_logprobs", req.topk_sample_logprobs),
    ] {
        if k > MAX_TOPK.min(base.vocab) {
            return Err(format!(
                "{name} is {k}; at most {} alternatives a position are served",
                MAX_TOPK.min(base.vocab)
            ));
        }
    }
    let prompt_entries = (req.topk_prompt_logprobs + req.prompt_alt_tokens_k) * prompt.len();
    let sample_entries = req
        .topk_sample_logprobs
        .saturating_mul(max_new_tokens)
        .saturating_mul(req.num_samples);
    if prompt_entries > MAX_TOPK_ENTRIES || sample_entries > MAX_TOPK_ENTRIES {
        return Err(format!(
            "the top-k answers asked for hold {} (position, token) pairs; at most \
             {MAX_TOPK_ENTRIES} are served a request (lower topk_*_logprobs, \
             prompt_alt_tokens_k, num_samples or sampling_params.max_tokens)",
            prompt_entries.max(sample_entries)
        ));
    }
    let top_k = match sp.top_k {
        -1 => 0,
        k if k >= 1 => k as usize,
        k => {
            return Err(format!(
                "sampling_params.top_k must be -1 (no limit) or at least 1, got {k}"
            ));
        }
    };
    let (stop_token_ids, stop_strings) = match &sp.stop {
        None | Some(Value::Null) => (base.eos.clone(), Vec::new()),
        Some(Value::String(s)) => (Vec::new(), vec![s.clone()]),
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => (
            Vec::new(),
            items
                .iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect(),
        ),
        Some(Value::Array(items)) if items.iter().all(|v| v.as_u64().is_some()) => (
            items
                .iter()
                .filter_map(|v| v.as_u64().map(|x| x as u32))
                .collect(),
            Vec::new(),
        ),
        Some(other) => {
            return Err(format!(
                "sampling_params.stop must be a string, strings or token ids, got {other}"
            ));
        }
    };
    let params = SamplingParams {
        temperature: sp.temperature,
        top_k,
        top_p: sp.top_p,
        min_p: 0.0,
        max_new_tokens,
        stop_token_ids,
        stop_strings,
        seed: match sp.seed {
            Some(s) => s as u64,
            None => rand::random(),
        },
    };
    params
        .validate()
        .map_err(|e| format!("sampling_params: {e:#}"))?;
    let targets = match &req.target_prompt_logprobs {
        Some(t) => Some(prompt_targets(t, prompt.len(), base.vocab)?),
        None => None,
    };
    Ok(SampleJob {
        request: request.to_string(),
        weights,
        prompt,
        n: req.num_samples,
        params,
        ask: super::prompt::Ask {
            logprobs: req.prompt_logprobs,
            topk: req.topk_prompt_logprobs,
            last_n: req.prompt_logprobs_last_n,
            targets,
            alt: req.prompt_alt_tokens_k,
        },
        topk_sample: req.topk_sample_logprobs,
    })
}

/// `target_prompt_logprobs` (a TensorData of int64 ids, `[len(prompt) - 1, k]`, −1 for
/// none), checked.
fn prompt_targets(
    t: &Value,
    prompt_len: usize,
    vocab: usize,
) -> Result<super::prompt::Targets, String> {
    let what = "target_prompt_logprobs";
    if t.get("sparse_crow_indices").is_some_and(|v| !v.is_null()) {
        return Err(format!(
            "{what} in sparse CSR layout is not served: send it dense"
        ));
    }
    let shape: Vec<usize> = t
        .get("shape")
        .and_then(Value::as_array)
        .map(|s| {
            s.iter()
                .filter_map(|d| d.as_u64().map(|d| d as usize))
                .collect()
        })
        .unwrap_or_default();
    let rows = prompt_len.saturating_sub(1);
    let [r, k] = shape[..] else {
        return Err(format!(
            "{what} needs a shape [{rows}, K], got {:?}",
            t.get("shape")
        ));
    };
    if r != rows {
        return Err(format!(
            "{what} has {r} rows; a prompt of {prompt_len} tokens has {rows} positions to score"
        ));
    }
    let data = t
        .get("data")
        .and_then(Value::as_array)
        .ok_or_else(|| format!("{what} has no `data` list"))?;
    // `r` is the prompt's, so `k` alone bounds the answer; checked before `r * k`, which a
    // hostile shape can make wrap.
    if k > MAX_TOPK.min(vocab) {
        return Err(format!(
            "{what} asks for {k} tokens a position; at most {} are served",
            MAX_TOPK.min(vocab)
        ));
    }
    if data.len() != r * k {
        return Err(format!(
            "{what} has {} values for the shape [{r}, {k}]",
            data.len()
        ));
    }
    let ids = data
        .iter()
        .enumerate()
        .map(|(i, v)| match v.as_i64() {
            Some(id) if id >= -1 && id < vocab as i64 => Ok(id),
            _ => Err(format!(
                "{what}[{}][{}] = {v} is neither -1 nor a token of the vocabulary (0..{vocab})",
                i / k.max(1),
                i % k.max(1)
            )),
        })
        .collect::<Result<Vec<i64>, String>>()?;
    Ok(super::prompt::Targets { k, ids })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample(extra: Value) -> wire::Sample {
        let mut v = json!({
            "num_samples": 1,
            "base_model": "builtin:multiply",
            "prompt": {"chunks": [{"tokens": [5, 6, 7]}]},
            "sampling_params": {"max_tokens": 8},
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    fn job(extra: Value) -> Result<SampleJob, String> {
        sample_job(
            &sample(extra),
            "req-x",
            SamplerWeights::Base,
            &Base::for_tests(),
        )
    }

    /// Issue 68, points 1 and 4: sizes the client picks are refused before the model's
    /// thread allocates for them (10^9 alternatives were allocated, then the server was
    /// killed for memory; a shape whose product wraps passed the size check and panicked).
    #[test]
    fn client_chosen_sizes_are_refused_before_anything_is_allocated() {
        for (extra, words) in [
            (
                json!({"topk_sample_logprobs": 1_000_000_000u64}),
                "topk_sample_logprobs is 1000000000",
            ),
            (
                json!({"topk_prompt_logprobs": 1_000_000_000u64}),
                "topk_prompt_logprobs is 1000000000",
            ),
            (
                json!({"topk_sample_logprobs": 256, "num_samples": 256, "sampling_params": {"max_tokens": 500}}),
                "pairs",
            ),
            (
                json!({"target_prompt_logprobs": {"data": [], "dtype": "int64", "shape": [2, 9223372036854775808u64]}}),
                "target_prompt_logprobs asks for 9223372036854775808 tokens",
            ),
            (
                json!({"sampling_params": {"temperature": 1e-40}}),
                "temperature must be 0 (greedy) or at least",
            ),
        ] {
            let e = job(extra.clone())
                .err()
                .unwrap_or_else(|| panic!("{extra} was accepted"));
            assert!(e.contains(words), "{extra}: {e}");
        }
        assert!(job(json!({"topk_sample_logprobs": 20})).is_ok());
    }
}
