//! Batched, cached generation over sequences of different lengths.
//!
//! A [`Sequence`] owns its tokens, its KV cache and the logits for its next token. Its
//! cache always covers a prefix of its tokens; whatever follows (a freshly sampled token,
//! or several inserted ones such as tool output) is *pending* and goes through the model
//! in the next [`advance`] call, together with every other sequence's pending tokens in one
//! packed forward. Nothing is ever re-encoded: the ids the model saw are exactly the ids in
//! `tokens`.
//!
//! Group sampling: a prompt is prefilled once, then [`Sequence::fork`]ed; the forks share
//! the prompt's cache (no copy) and its next-token logits, and each draws from its own
//! seeded generator, so a sample's tokens do not depend on what else is in the batch.

use super::device_draw::{Draw, draw_rows, draw_table, draws};
use super::draw::{SamplingParams, sample};
use crate::model::decoder::Model;
use crate::model::kv_cache::KvCache;
use crate::model::lora::Mode;
use crate::model::tokenizer::IncrementalDecoder;
use anyhow::Result;
use candle_core::Tensor;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::sync::Arc;

/// Why a sequence stopped.
#[derive(Debug, Clone, PartialEq)]
pub enum Finish {
    /// Sampled one of the stop token ids (kept as the last token).
    StopToken(u32),
    /// The decoded output came to contain this stop string.
    StopString(String),
    /// `max_new_tokens` reached.
    Length,
}

/// One sequence being generated.
pub struct Sequence {
    /// Prompt, then sampled and inserted tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Per token after the prompt: the sampling log-prob, or `None` for inserted tokens.
    pub logprobs: Vec<Option<f32>>,
    pub finish: Option<Finish>,
    cache: KvCache,
    next_logits: Option<Next>,
    /// The token the model's next forward already read for this sequence where it was
    /// drawn, and that forward's logits after it ([`draw_ahead`]): they become the next
    /// logits when the host takes that token.
    ahead: Option<(u32, DeviceRow)>,
    rng: StdRng,
}

/// A sequence's next-token logits: copied to the host (a CPU model), or a row left on the
/// model's GPU for [`draw`], or the token `draw` took from it.
#[derive(Clone)]
enum Next {
    Host(Vec<f32>),
    Device(DeviceRow),
    Drawn(Draw),
}

/// Row `row` of a forward's `[B, vocab]` logits, left where they are: a decode step whose
/// sequences are drawn together in the forward's order reads the whole tensor at once
/// instead of a copy of its rows stacked again.
#[derive(Clone)]
struct DeviceRow {
    batch: Arc<Tensor>,
    row: usize,
}

impl DeviceRow {
    fn tensor(&self) -> candle_core::Result<Tensor> {
        self.batch.get(self.row)
    }
}

/// The `[n, vocab]` logits of `rows` in order: their forward's own tensor where they are
/// all its rows in its order, else a gather from it, else (rows of several forwards)
/// their rows stacked.
fn gather_rows(rows: &[&DeviceRow]) -> candle_core::Result<Tensor> {
    let Some(first) = rows.first() else {
        candle_core::bail!("no rows to draw");
    };
    let batch = &first.batch;
    if rows.iter().all(|r| Arc::ptr_eq(&r.batch, batch)) {
        if rows.len() == batch.dim(0)? && rows.iter().enumerate().all(|(i, r)| r.row == i) {
            return Ok((**batch).clone());
        }
        let index: Vec<u32> = rows.iter().map(|r| r.row as u32).collect();
        return batch.index_select(&Tensor::new(index.as_slice(), batch.device())?, 0);
    }
    let rows: Vec<Tensor> = rows
        .iter()
        .map(|r| r.tensor())
        .collect::<candle_core::Result<_>>()?;
    Tensor::stack(&rows, 0)
}

impl Sequence {
    pub fn new(model: &Model, prompt: Vec<u32>, seed: u64) -> Sequence {
        Sequence {
            prompt_len: prompt.len(),
            tokens: prompt,
            logprobs: Vec::new(),
            finish: None,
            cache: model.new_cache(),
            next_logits: None,
            ahead: None,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// A copy sharing everything computed so far (cache prefix and next-token logits),
    /// drawing from its own generator.
    pub fn fork(&mut self, seed: u64) -> Sequence {
        // A token already drawn would be taken by both: forks are made before drawing.
        debug_assert!(!matches!(self.next_logits, Some(Next::Drawn(_))));
        Sequence {
            tokens: self.tokens.clone(),
            prompt_len: self.prompt_len,
            logprobs: self.logprobs.clone(),
            finish: self.finish.clone(),
            cache: self.cache.fork(),
            next_logits: self.next_logits.clone(),
            ahead: None,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// Tokens after the prompt.
    pub fn completion(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Appends tokens the model did not sample (tool output, a chat turn); they are fed
    /// to the model by the next [`advance`].
    pub fn append(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
        self.logprobs.extend(tokens.iter().map(|_| None));
        self.next_logits = None;
    }

    /// Tokens not yet in the cache.
    pub fn pending(&self) -> &[u32] {
        // Empty too between a forward ahead and the host's taking of the token it read.
        self.tokens.get(self.cache.len()..).unwrap_or(&[])
    }

    /// Whether the next token can be sampled (the model has seen everything).
    pub fn ready(&self) -> bool {
        self.next_logits.is_some()
    }

    /// The `k` likeliest next tokens and their log-probs at `temperature` (as
    /// [`sample`] reports a drawn token's), most likely first. Call after [`advance`] and
    /// before [`draw`].
    pub fn top_logprobs(&self, k: usize, temperature: f32) -> Result<Vec<(u32, f32)>> {
        let logits = match &self.next_logits {
            Some(Next::Host(l)) => std::borrow::Cow::Borrowed(l.as_slice()),
            Some(Next::Device(row)) => std::borrow::Cow::Owned(
                row.tensor()?
                    .to_dtype(candle_core::DType::F32)?
                    .to_vec1::<f32>()?,
            ),
            Some(Next::Drawn(_)) | None => {
                anyhow::bail!("top_logprobs needs the logits: call it after advance, before draw")
            }
        };
        Ok(super::draw::top_logprobs(&logits, k, temperature))
    }

    /// Appends a token another sampler drew (a vLLM server), with its log-prob there.
    pub fn push_sampled(&mut self, token: u32, logp: f32) {
        self.tokens.push(token);
        self.logprobs.push(Some(logp));
        self.next_logits = None;
    }

    /// Samples the next token from the stored logits and appends it. Call after
    /// [`advance`]; the token becomes pending.
    pub fn sample_next(&mut self, params: &SamplingParams) -> Result<(u32, f32)> {
        let next = self.next_logits.take().ok_or_else(|| {
            anyhow::anyhow!("sample_next before advance: the model has not seen the last tokens")
        })?;
        let (tok, logp) = match next {
            Next::Host(logits) => sample(&logits, params, &mut self.rng),
            Next::Drawn(d) => (d.token, d.logp),
            Next::Device(row) => {
                self.next_logits = Some(Next::Device(row));
                draw(&mut [&mut *self], params)?;
                return self.sample_next(params);
            }
        };
        self.tokens.push(tok);
        self.logprobs.push(Some(logp));
        if let Some((read, row)) = self.ahead.take() {
            if read == tok {
                // The next forward already read this token: its logits are the next ones.
                self.next_logits = Some(Next::Device(row));
            } else {
                // Sampled on the host after all (the draw missed the kept tokens): the
                // forward ahead read another token, which the cache forgets; this one
                // is pending.
                self.cache.forget_last()?;
            }
        }
        Ok((tok, logp))
    }
}

/// Runs every sequence's pending tokens through the model in one packed forward and stores
/// each one's next-token logits. Sequences with nothing pending are left alone.
pub fn advance(model: &Model, seqs: &mut [&mut Sequence], mode: Mode) -> Result<()> {
    advance_mixed(model, seqs, None, mode)
}

/// [`advance`] with an adapter set per sequence (`None`: the base model), read in place of
/// `mode`'s: sequences of different adapters run in the same packed forward.
pub fn advance_mixed(
    model: &Model,
    seqs: &mut [&mut Sequence],
    adapters: Option<&[Option<&crate::model::lora::AdapterSnapshot>]>,
    mode: Mode,
) -> Result<()> {
    let _p = crate::model::profile::span("advance", model.device());
    let mut idx = Vec::new();
    for (i, s) in seqs.iter().enumerate() {
        if !s.pending().is_empty() {
            idx.push(i);
        }
    }
    if idx.is_empty() {
        return Ok(());
    }
    let pending: Vec<Vec<u32>> = idx.iter().map(|&i| seqs[i].pending().to_vec()).collect();
    let toks: Vec<&[u32]> = pending.iter().map(Vec::as_slice).collect();
    let segments = adapters.map(|a| {
        crate::model::lora::segments(idx.iter().zip(&toks).map(|(&i, t)| (t.len(), a[i])))
    });
    let mode = match &segments {
        Some(s) => Mode {
            segments: Some(s),
            ..mode
        },
        None => mode,
    };
    let logits = {
        let mut caches: Vec<&mut KvCache> = Vec::with_capacity(idx.len());
        // Disjoint mutable borrows of the selected sequences' caches.
        let mut rest: &mut [&mut Sequence] = seqs;
        let mut base = 0;
        for &i in &idx {
            let (_, tail) = rest.split_at_mut(i - base);
            let (head, tail) = tail.split_at_mut(1);
            caches.push(&mut head[0].cache);
            rest = tail;
            base = i + 1;
        }
        model.forward_cached(&mut caches, &toks, mode, false)?
    };
    if !stays_on_device(logits.device()) {
        let rows = logits.to_vec2::<f32>()?;
        for (&i, row) in idx.iter().zip(rows) {
            seqs[i].next_logits = Some(Next::Host(row));
        }
    } else {
        // On a GPU the logits stay there: `draw` samples every row at once.
        let batch = Arc::new(logits);
        for (k, &i) in idx.iter().enumerate() {
            seqs[i].next_logits = Some(Next::Device(DeviceRow {
                batch: batch.clone(),
                row: k,
            }));
        }
    }
    Ok(())
}

/// Whether next-token logits stay where the model computed them (a GPU) for [`draw`].
#[cfg(not(test))]
fn stays_on_device(device: &candle_core::Device) -> bool {
    !device.is_cpu()
}

#[cfg(test)]
thread_local! {
    static AS_ON_A_GPU: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// In tests, [`as_on_a_gpu`] makes the CPU keep its logits as a GPU does.
#[cfg(test)]
fn stays_on_device(device: &candle_core::Device) -> bool {
    !device.is_cpu() || AS_ON_A_GPU.with(|c| c.get())
}

/// Whether a decode step on `device` draws with [`draw_ahead`]: where the logits stay on
/// the device (a GPU), unless `RLHOST_DECODE_AHEAD=off` asks to wait for each step's
/// tokens before queueing the next (the benchmark's before-row).
pub fn goes_ahead(device: &candle_core::Device) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| {
        std::env::var("RLHOST_DECODE_AHEAD").is_ok_and(|v| v.eq_ignore_ascii_case("off"))
    });
    #[cfg(test)]
    let off = off || NOT_AHEAD.with(|c| c.get());
    !off && stays_on_device(device)
}

#[cfg(test)]
thread_local! {
    static NOT_AHEAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// In tests: runs `f` with [`goes_ahead`] off.
#[cfg(test)]
pub(crate) fn not_ahead<R>(f: impl FnOnce() -> R) -> R {
    with_flag(&NOT_AHEAD, f)
}

/// Runs `f` with logits kept as tensors and sampled by [`draw`], as on a GPU.
#[cfg(test)]
pub(crate) fn as_on_a_gpu<R>(f: impl FnOnce() -> R) -> R {
    with_flag(&AS_ON_A_GPU, f)
}

/// Runs `f` with a test's thread-local `flag` set, cleared after (also when `f` panics).
#[cfg(test)]
fn with_flag<R>(
    flag: &'static std::thread::LocalKey<std::cell::Cell<bool>>,
    f: impl FnOnce() -> R,
) -> R {
    flag.with(|c| c.set(true));
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    flag.with(|c| c.set(false));
    out.unwrap_or_else(|e| std::panic::resume_unwind(e))
}

/// Samples, where the logits are on a GPU, the next token of every sequence in `seqs`
/// whose logits are there, in one batched draw (one small copy back), drawing each
/// sequence's uniform from its own generator; [`Sequence::sample_next`] then takes it.
/// Sequences with host logits, or none, are left alone. Call before the `sample_next`s
/// of a decode step.
pub fn draw(seqs: &mut [&mut Sequence], params: &SamplingParams) -> Result<()> {
    let _p = seqs.first().and_then(|s| match &s.next_logits {
        Some(Next::Device(row)) => Some(crate::model::profile::span("draw", row.batch.device())),
        _ => None,
    });
    let on_device: Vec<usize> = (0..seqs.len())
        .filter(|&i| matches!(seqs[i].next_logits, Some(Next::Device(_))))
        .collect();
    if on_device.is_empty() {
        return Ok(());
    }
    let (rows, logits) = device_logits(seqs, &on_device)?;
    let u = uniforms(seqs, &on_device, params);
    let draws = draw_rows(&logits, &u, params)?;
    for ((&i, d), row) in on_device.iter().zip(draws).zip(&rows) {
        seqs[i].next_logits = Some(drawn(d, row)?);
    }
    Ok(())
}

/// The device rows of the sequences `on` (whose logits are there) and those logits as
/// one `[on, vocab]` tensor.
fn device_logits(seqs: &[&mut Sequence], on: &[usize]) -> Result<(Vec<DeviceRow>, Tensor)> {
    let rows: Vec<DeviceRow> = on
        .iter()
        .map(|&i| match &seqs[i].next_logits {
            Some(Next::Device(row)) => row.clone(),
            _ => unreachable!("only sequences with logits on the device"),
        })
        .collect();
    let logits = gather_rows(&rows.iter().collect::<Vec<_>>())?;
    Ok((rows, logits))
}

/// A row's next logits after its draw: the draw, or where rounding put it off the kept
/// tokens, the row's logits for the host to sample (with a fresh uniform).
fn drawn(d: Option<Draw>, row: &DeviceRow) -> Result<Next> {
    Ok(match d {
        Some(d) => Next::Drawn(d),
        None => Next::Host(row.tensor()?.to_vec1::<f32>()?),
    })
}

/// One uniform per sequence `on` draws for, from its own generator, as the host sampler
/// draws it (none used when greedy).
fn uniforms(seqs: &mut [&mut Sequence], on: &[usize], params: &SamplingParams) -> Vec<f32> {
    let greedy = params.temperature <= 0.0;
    on.iter()
        .map(|&i| {
            if greedy {
                0.0
            } else {
                seqs[i].rng.random::<f32>()
            }
        })
        .collect()
}

/// [`draw`] with the next decode step queued behind it, where every sequence's logits
/// are on the device: the drawn tokens go into the model's next forward (with `mode`)
/// there, and the host waits for the copy of the draws alone, so that it takes the
/// tokens, tells the sinks and checks the stops while that forward runs (on a GPU; on
/// the CPU the same steps run one after the other). [`Sequence::sample_next`] then takes
/// each token, and with it the forward's logits after it: a sequence that goes on needs
/// no forward of its own at the next step. A sequence that stops has had one token read
/// that it never uses. Tokens, log-probs and generators are those [`draw`] gives.
/// Returns whether it went ahead (it draws as [`draw`] does where some sequence's logits
/// are not on the device).
pub fn draw_ahead(
    model: &Model,
    seqs: &mut [&mut Sequence],
    params: &SamplingParams,
    mode: Mode,
) -> Result<bool> {
    if seqs.is_empty()
        || !seqs
            .iter()
            .all(|s| matches!(s.next_logits, Some(Next::Device(_))) && s.ahead.is_none())
    {
        return draw(seqs, params).map(|()| false);
    }
    let _p = crate::model::profile::span("draw_ahead", model.device());
    let all: Vec<usize> = (0..seqs.len()).collect();
    let (rows, logits) = device_logits(seqs, &all)?;
    let u = uniforms(seqs, &all, params);
    let table = draw_table(&logits, &u, params)?;
    // The copy first, then the forward: on the stream the copy does not wait for it.
    let copy = crate::model::compute::start_host_copy(&table)?;
    let ids = table.narrow(1, 0, 1)?.squeeze(1)?;
    let next = {
        let mut caches: Vec<&mut KvCache> = seqs.iter_mut().map(|s| &mut s.cache).collect();
        Arc::new(model.forward_cached_ids(&mut caches, &ids, mode)?)
    };
    let table = copy.wait()?;
    // The token the forward read, also where the draw missed the kept tokens.
    let read: Vec<u32> = table.iter().map(|r| r[0] as u32).collect();
    for (k, ((s, d), row)) in seqs.iter_mut().zip(draws(table)).zip(&rows).enumerate() {
        s.next_logits = Some(drawn(d, row)?);
        let row = DeviceRow {
            batch: next.clone(),
            row: k,
        };
        s.ahead = Some((read[k], row));
    }
    Ok(true)
}

/// What [`generate`](super::generate) returns per sample, and the sampler per finished
/// choice.
#[derive(Debug, Clone)]
pub struct Completion {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    /// Decoded completion (special tokens kept; cut after a stop string).
    pub text: String,
    pub finish: Finish,
}

impl Completion {
    /// A finished choice: its text (`text`, decoded with special tokens kept) is cut after
    /// the stop string that ended it, as the sampler's stop check found it.
    pub fn new(tokens: Vec<u32>, logprobs: Vec<f32>, mut text: String, finish: Finish) -> Self {
        if let Finish::StopString(stop) = &finish
            && let Some(at) = text.find(stop.as_str())
        {
            text.truncate(at + stop.len());
        }
        Completion {
            tokens,
            logprobs,
            text,
            finish,
        }
    }
}

/// Why a choice stops after `tok`, its `sampled`-th token (the decoder has taken it), if it
/// does: the local sampler's rule, and the one the gateway replays a vLLM server's tokens by.
pub fn stop_check(
    sampled: usize,
    dec: &IncrementalDecoder,
    tok: u32,
    params: &SamplingParams,
) -> Option<Finish> {
    if params.stop_token_ids.contains(&tok) {
        return Some(Finish::StopToken(tok));
    }
    // Only the tail can hold a new match: the text before it was checked already.
    let text = dec.text();
    let longest = params
        .stop_strings
        .iter()
        .map(String::len)
        .max()
        .unwrap_or(0);
    let mut from = text.len().saturating_sub(longest + 16);
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    if let Some(stop) = params
        .stop_strings
        .iter()
        .find(|st| text[from..].contains(st.as_str()))
    {
        return Some(Finish::StopString(stop.clone()));
    }
    if sampled >= params.max_new_tokens {
        return Some(Finish::Length);
    }
    None
}

/// A per-sample seed that depends only on the run's seed and the sample's place.
pub fn sample_seed(seed: u64, prompt: usize, sample: usize) -> u64 {
    // SplitMix64's finaliser over the three numbers: nearby indices give unrelated seeds.
    crate::rng::mix(
        seed ^ (prompt as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (sample as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fixtures::{self, Reference};
    use crate::model::tokenizer::Tokenizer;
    use crate::sampler::generate;

    fn setup() -> (Model, Tokenizer) {
        let dir = fixtures::model_dir("qwen2");
        (fixtures::load("qwen2"), Tokenizer::from_dir(&dir).unwrap())
    }

    fn params(seed: u64) -> SamplingParams {
        SamplingParams {
            temperature: 1.0,
            max_new_tokens: 12,
            seed,
            ..SamplingParams::default()
        }
    }

    /// A step's rows in their forward's order are its logits tensor itself (no copy);
    /// others are gathered or stacked, row for row.
    #[test]
    fn device_rows_are_read_in_place_where_they_can_be() {
        let dev = candle_core::Device::Cpu;
        let a = Arc::new(
            Tensor::arange(0f32, 12.0, &dev)
                .unwrap()
                .reshape((3, 4))
                .unwrap(),
        );
        let b = Arc::new(
            Tensor::arange(100f32, 104.0, &dev)
                .unwrap()
                .reshape((1, 4))
                .unwrap(),
        );
        let row = |batch: &Arc<Tensor>, row| DeviceRow {
            batch: batch.clone(),
            row,
        };
        let all = [row(&a, 0), row(&a, 1), row(&a, 2)];
        let whole = gather_rows(&all.iter().collect::<Vec<_>>()).unwrap();
        assert_eq!(whole.id(), a.id());
        let some = [row(&a, 2), row(&a, 0)];
        let got = gather_rows(&some.iter().collect::<Vec<_>>()).unwrap();
        assert_eq!(got.to_vec2::<f32>().unwrap()[0], [8.0, 9.0, 10.0, 11.0]);
        assert_eq!(got.to_vec2::<f32>().unwrap()[1], [0.0, 1.0, 2.0, 3.0]);
        let mixed = [row(&a, 1), row(&b, 0)];
        let got = gather_rows(&mixed.iter().collect::<Vec<_>>()).unwrap();
        assert_eq!(
            got.to_vec2::<f32>().unwrap(),
            [[4.0, 5.0, 6.0, 7.0], [100.0, 101.0, 102.0, 103.0]]
        );
    }

    /// Sampling as on a GPU (logits kept as tensors, every sequence's token drawn in one
    /// batched `draw`) gives the host's tokens and log-probs: greedy, and at T = 1 with no
    /// truncation (the same uniforms walk the same order); with top-k/top-p it still runs
    /// to the end with finite log-probs.
    #[test]
    fn drawing_as_on_a_gpu_gives_the_host_tokens() {
        let (model, tok) = setup();
        let prompts = Reference::load("qwen2").rows();
        for (temperature, top_k, top_p) in [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.9, 20, 0.8)] {
            let p = SamplingParams {
                temperature,
                top_k,
                top_p,
                ..params(5)
            };
            let host = generate(&model, &tok, &prompts, 3, &p, Mode::INFERENCE).unwrap();
            let gpu =
                as_on_a_gpu(|| generate(&model, &tok, &prompts, 3, &p, Mode::INFERENCE)).unwrap();
            for (h, g) in host.iter().flatten().zip(gpu.iter().flatten()) {
                assert!(g.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0));
                if top_k == 0 {
                    assert_eq!(h.tokens, g.tokens, "T = {temperature}");
                    for (a, b) in h.logprobs.iter().zip(&g.logprobs) {
                        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
                    }
                }
            }
        }
    }

    /// Shared-prefix group sampling gives the same tokens as prefilling each sample alone,
    /// and batching several prompts changes nothing either.
    #[test]
    fn group_sampling_equals_separate_prefill() {
        let (model, tok) = setup();
        let r = Reference::load("qwen2");
        let prompts = r.rows();
        let p = params(11);
        let grouped = generate(&model, &tok, &prompts, 3, &p, Mode::INFERENCE).unwrap();
        for (i, (prompt, group)) in prompts.iter().zip(&grouped).enumerate() {
            for (j, sample) in group.iter().enumerate() {
                let mut s = Sequence::new(&model, prompt.clone(), sample_seed(p.seed, i, j));
                let mut out = Vec::new();
                for _ in 0..p.max_new_tokens {
                    advance(&model, &mut [&mut s], Mode::INFERENCE).unwrap();
                    out.push(s.sample_next(&p).unwrap().0);
                }
                assert_eq!(sample.tokens, out, "prompt {i} sample {j}");
            }
        }
        // Samples of a group differ (with overwhelming probability at T = 1).
        assert_ne!(grouped[0][0].tokens, grouped[0][1].tokens);
    }

    /// Sampled log-probs equal a full-sequence recomputation by the batch path, and an
    /// inserted chunk resumes decoding exactly where a fresh forward would be.
    #[test]
    fn logprobs_and_resume_match_a_full_forward() {
        let (model, _) = setup();
        let r = Reference::load("qwen2");
        let prompt = r.rows()[1].clone();
        let p = params(5);
        let mut s = Sequence::new(&model, prompt.clone(), 9);
        for step in 0..10 {
            advance(&model, &mut [&mut s], Mode::INFERENCE).unwrap();
            s.sample_next(&p).unwrap();
            if step == 4 {
                s.append(&[508, 17, 18, 509]);
            }
        }
        let ids = candle_core::Tensor::new(s.tokens.as_slice(), model.device())
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let t = s.tokens.len();
        let mask = ids.ones_like().unwrap();
        let pos = candle_core::Tensor::arange(0u32, t as u32, model.device())
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let h = model
            .forward_batch(&ids, &mask, &pos, Mode::INFERENCE)
            .unwrap();
        let (logp, _) = model
            .logprobs(
                &h.narrow(1, 0, t - 1).unwrap(),
                &ids.narrow(1, 1, t - 1).unwrap(),
            )
            .unwrap();
        let logp = logp.squeeze(0).unwrap().to_vec1::<f32>().unwrap();
        let mut checked = 0;
        for (k, lp) in s.logprobs.iter().enumerate() {
            if let Some(lp) = lp {
                let full = logp[s.prompt_len + k - 1];
                assert!((lp - full).abs() < 1e-4, "token {k}: {lp} vs {full}");
                checked += 1;
            }
        }
        assert_eq!(checked, 10);
        assert_eq!(s.logprobs.iter().filter(|l| l.is_none()).count(), 4);
    }

    /// A head with rows past the tokenizer's vocabulary (a padded head; here the padding
    /// rows are made to dominate, as training the head once made them win draws): no draw
    /// lands there, on the host or as on a GPU, and each sampled log-prob is the trainer's,
    /// whose log-softmax leaves those rows out too.
    #[test]
    fn rows_past_the_vocabulary_are_never_drawn_and_never_normalised_over() {
        let (mut model, tok) = setup();
        let (v, limit) = (model.cfg.vocab_size, 400);
        let head = model.lm_head.clone();
        model.lm_head = Tensor::cat(
            &[
                head.narrow(0, 0, limit).unwrap(),
                (head.narrow(0, limit, v - limit).unwrap() * 8.0).unwrap(),
            ],
            0,
        )
        .unwrap();
        // Prompts of tokens (a tokenizer of `limit` ids writes no others).
        let prompts: Vec<Vec<u32>> = Reference::load("qwen2")
            .rows()
            .into_iter()
            .map(|r| r.into_iter().map(|t| t % limit as u32).collect())
            .collect();
        let p = params(3);
        let past = |model: &Model| -> usize {
            let out = generate(model, &tok, &prompts, 2, &p, Mode::INFERENCE).unwrap();
            out.iter()
                .flatten()
                .flat_map(|s| &s.tokens)
                .filter(|&&t| t as usize >= limit)
                .count()
        };
        // Unlimited, the padding wins most draws: the check below can fail.
        assert!(past(&model) > 20, "{}", past(&model));
        model.limit_vocabulary(limit);
        assert_eq!(model.vocab(), limit);
        for gpu in [false, true] {
            let run = || generate(&model, &tok, &prompts, 2, &p, Mode::INFERENCE).unwrap();
            let out = if gpu { as_on_a_gpu(run) } else { run() };
            for (prompt, sample) in prompts
                .iter()
                .zip(&out)
                .flat_map(|(p, g)| g.iter().map(move |s| (p, s)))
            {
                assert!(
                    sample.tokens.iter().all(|&t| (t as usize) < limit),
                    "{:?}",
                    sample.tokens
                );
                let ids: Vec<u32> = prompt.iter().chain(&sample.tokens).copied().collect();
                let t = ids.len();
                let ids = Tensor::new(ids.as_slice(), model.device())
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap();
                let pos = Tensor::arange(0u32, t as u32, model.device())
                    .unwrap()
                    .unsqueeze(0)
                    .unwrap();
                let h = model
                    .forward_batch(&ids, &ids.ones_like().unwrap(), &pos, Mode::INFERENCE)
                    .unwrap();
                let (logp, _) = model
                    .logprobs(
                        &h.narrow(1, 0, t - 1).unwrap(),
                        &ids.narrow(1, 1, t - 1).unwrap(),
                    )
                    .unwrap();
                let logp = logp.squeeze(0).unwrap().to_vec1::<f32>().unwrap();
                for (k, lp) in sample.logprobs.iter().enumerate() {
                    let trainer = logp[prompt.len() + k - 1];
                    assert!(
                        (lp - trainer).abs() < 1e-4,
                        "gpu {gpu}, token {k}: {lp} vs {trainer}"
                    );
                }
            }
        }
    }

    /// Drawing with the next step queued behind the draw gives, token for token and
    /// log-prob for log-prob, what drawing step by step gives, as on a GPU with decode
    /// steps pooled or not: several prompts of several choices, sampled and greedy,
    /// stopped by tokens and by budgets at different steps.
    #[test]
    fn drawing_ahead_gives_the_step_by_step_tokens() {
        let (model, tok) = setup();
        let prompts = Reference::load("qwen2").rows();
        let free = generate(&model, &tok, &prompts, 1, &params(2), Mode::INFERENCE).unwrap();
        for (temperature, stop) in [
            (1.0, vec![]),
            (0.0, vec![]),
            (1.0, vec![free[0][0].tokens[3]]),
        ] {
            let p = SamplingParams {
                temperature,
                stop_token_ids: stop,
                ..params(7)
            };
            for pooled in [false, true] {
                let run = || {
                    crate::model::kv_cache::with_pooling(pooled, || {
                        as_on_a_gpu(|| generate(&model, &tok, &prompts, 3, &p, Mode::INFERENCE))
                    })
                    .unwrap()
                };
                let ahead = run();
                let stepwise = not_ahead(run);
                // Equal on the CPU; on a GPU (`RLHOST_TEST_DEVICE=cuda`) a forward of more
                // rows may round its products otherwise, by the last bits.
                for (a, b) in ahead.iter().flatten().zip(stepwise.iter().flatten()) {
                    assert_eq!(a.tokens, b.tokens, "T {temperature}, pooled {pooled}");
                    for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                        assert!((x - y).abs() <= 1e-4, "{x} vs {y}");
                    }
                    assert_eq!(a.finish, b.finish);
                }
            }
        }
    }

    /// A token the host samples otherwise than the draw the forward ahead read (a draw
    /// that missed the kept tokens) is forgotten by the cache and read again: the next
    /// logits are those of a sequence that never went ahead.
    #[test]
    fn a_token_taken_otherwise_than_read_ahead_is_read_again() {
        let (model, _) = setup();
        let prompt = Reference::load("qwen2").rows()[0].clone();
        let p = params(3);
        as_on_a_gpu(|| {
            crate::model::kv_cache::with_pooling(true, || {
                let mut a = Sequence::new(&model, prompt.clone(), 9);
                let mut b = Sequence::new(&model, prompt.clone(), 9);
                for s in [&mut a, &mut b] {
                    advance(&model, &mut [s], Mode::INFERENCE).unwrap();
                }
                draw_ahead(&model, &mut [&mut a], &p, Mode::INFERENCE).unwrap();
                // The forward ahead read another token than the one the host takes.
                let (read, row) = a.ahead.take().unwrap();
                a.ahead = Some((read + 1, row));
                let (tok_a, _) = a.sample_next(&p).unwrap();
                assert_eq!(a.pending(), [tok_a]);
                assert_eq!(a.cache.len() + 1, a.tokens.len());
                // b: the same draw without going ahead.
                draw(&mut [&mut b], &p).unwrap();
                let (tok_b, _) = b.sample_next(&p).unwrap();
                assert_eq!(tok_a, tok_b);
                for s in [&mut a, &mut b] {
                    advance(&model, &mut [s], Mode::INFERENCE).unwrap();
                }
                let logits = |s: &Sequence| match &s.next_logits {
                    Some(Next::Device(row)) => row.tensor().unwrap(),
                    _ => panic!("logits on the device"),
                };
                assert!(fixtures::max_diff(&logits(&a), &logits(&b)) <= 1e-5);
            })
        });
    }

    #[test]
    fn stops_on_tokens_strings_and_length() {
        let (model, tok) = setup();
        let prompt = vec![
            tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
                .unwrap(),
        ];
        // Greedy: find what the model says, then stop on parts of it.
        let greedy = SamplingParams {
            temperature: 0.0,
            max_new_tokens: 8,
            ..SamplingParams::default()
        };
        let free = generate(&model, &tok, &prompt, 1, &greedy, Mode::INFERENCE).unwrap();
        let c = &free[0][0];
        assert_eq!(c.finish, Finish::Length);
        assert_eq!(c.tokens.len(), 8);
        let third = c.tokens[2];
        let by_token = SamplingParams {
            stop_token_ids: vec![third],
            ..greedy.clone()
        };
        let out = generate(&model, &tok, &prompt, 1, &by_token, Mode::INFERENCE).unwrap();
        let first_at = c.tokens.iter().position(|&t| t == third).unwrap();
        assert_eq!(out[0][0].tokens, c.tokens[..=first_at]);
        assert_eq!(out[0][0].finish, Finish::StopToken(third));
        let piece: String = c.text.chars().skip(2).take(2).collect();
        let by_string = SamplingParams {
            stop_strings: vec![piece.clone()],
            ..greedy
        };
        let out = generate(&model, &tok, &prompt, 1, &by_string, Mode::INFERENCE).unwrap();
        assert_eq!(out[0][0].finish, Finish::StopString(piece.clone()));
        assert!(
            out[0][0].text.ends_with(&piece),
            "{:?} / {piece:?}",
            out[0][0].text
        );
        assert!(
            out[0][0].tokens.len() < 8
                || c.text.find(&piece).unwrap() + piece.len() == c.text.len()
        );
    }
}
