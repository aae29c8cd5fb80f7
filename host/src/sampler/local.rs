//! Continuous batching: a [`Sampler`] takes requests whenever they come and decodes every
//! live one in the same forward, one token a step. A request joins at the next step
//! (its prompt prefilled in the same packed forward as the others' next tokens), its `n`
//! choices fork the prompt's cache, and each token goes to the request's [`Sink`] as it
//! is drawn, so a caller can stream it or stop listening (the choice is dropped at the
//! next step: a client that hangs up costs nothing more).
//!
//! This sampler is the in-process side of the seam ([`Sampling`], in `seam.rs`); vLLM
//! servers are the other (`servers.rs`). A caller that acts between tokens (a trajectory
//! whose tool fires at a stop pattern) releases a choice where it is and later resumes it
//! with ids appended: here the choice's KV cache is kept meanwhile, so nothing is
//! prefilled twice.
//!
//! Choice `j` of a request draws from a generator seeded by `(params.seed, request.index,
//! request.first_choice + j)` only, so its tokens do not depend on what else is in the
//! batch; a resumed choice goes on drawing from its own generator.

use super::decode::{
    Completion, Finish, Sequence, advance, advance_mixed, draw, draw_ahead, goes_ahead, stop_check,
};
use super::draw::SamplingParams;
use super::seam::{Held, Request, Sampling, Sink, Ticket, Token};
use crate::model::decoder::Model;
use crate::model::lora::{AdapterSnapshot, Mode};
use crate::model::tokenizer::{IncrementalDecoder, Tokenizer};
use anyhow::Result;
use std::sync::Mutex;

/// A token's likeliest alternatives, with their log-probs.
type Tops = Vec<(u32, f32)>;

/// A request being sampled.
struct Live<'t> {
    ticket: Ticket,
    request: Request,
    sink: Box<dyn Sink + 't>,
    /// Until its prompt is prefilled, one head; then its `n` choices.
    head: Option<Sequence>,
    choices: Vec<Choice<'t>>,
}

struct Choice<'t> {
    index: usize,
    /// Where this part of the sequence began (after the prompt, or where it resumed).
    start: usize,
    seq: Sequence,
    dec: IncrementalDecoder<'t>,
    /// Dropped: the sink stopped listening.
    gone: bool,
}

/// The continuous-batching sampler over one model.
pub struct Sampler<'t> {
    model: &'t Model,
    tokenizer: &'t Tokenizer,
    mode: Mode<'t>,
    live: Vec<Live<'t>>,
    /// Finished choices of requests with `hold`, until released.
    held: Vec<(Ticket, usize, Sequence)>,
    next_ticket: u64,
    /// Forwards run so far (each step's packed forward, and the base model's).
    pub forwards: u64,
    /// Seconds in the base model's forwards.
    base_s: f64,
}

impl<'t> Sampler<'t> {
    pub fn new(model: &'t Model, tokenizer: &'t Tokenizer, mode: Mode<'t>) -> Sampler<'t> {
        Sampler {
            model,
            tokenizer,
            mode,
            live: Vec::new(),
            held: Vec::new(),
            next_ticket: 0,
            forwards: 0,
            base_s: 0.0,
        }
    }

    fn ticket(&mut self) -> Ticket {
        self.next_ticket += 1;
        Ticket(self.next_ticket)
    }

    /// Why a request cannot be sampled, if it cannot.
    fn refusal(&self, request: &Request) -> Option<String> {
        let context = self.model.cfg.max_position_embeddings;
        if request.prompt.is_empty() {
            Some("the prompt is empty".to_string())
        } else if request.n == 0 {
            Some("n must be at least 1".to_string())
        } else if request.prompt.len() >= context {
            Some(format!(
                "the prompt has {} tokens and the model's context is {context}: no room to sample",
                request.prompt.len()
            ))
        } else {
            request.params.validate().err().map(|e| e.to_string())
        }
    }

    /// Takes a request; it joins the next [`step`](Self::step). A request that cannot be
    /// sampled (empty prompt, bad parameters, no room in the context) fails at once
    /// through its sink. One for no new tokens (`max_new_tokens` 0) is prefilled and
    /// ends, to be resumed from its cache.
    pub fn admit(&mut self, request: Request, mut sink: Box<dyn Sink + 't>) -> Ticket {
        let ticket = self.ticket();
        if let Some(why) = self.refusal(&request) {
            sink.failed(&why);
            return ticket;
        }
        let head = Sequence::new(self.model, request.prompt.clone(), 0);
        self.live.push(Live {
            ticket,
            request,
            sink,
            head: Some(head),
            choices: Vec::new(),
        });
        ticket
    }

    /// [`Sampling::resume`]: the held sequence goes on from its cache when its ids are a
    /// prefix of the request's prompt (the rest is appended, to be read by the next
    /// forward); otherwise the prompt is prefilled afresh.
    pub fn resume(&mut self, held: Held, request: Request, mut sink: Box<dyn Sink + 't>) -> Ticket {
        let seq = match held {
            Held::Sequence(seq)
                if request.n == 1
                    && seq.tokens.len() <= request.prompt.len()
                    && request.prompt.starts_with(&seq.tokens) =>
            {
                seq
            }
            _ => return self.admit(request, sink),
        };
        let ticket = self.ticket();
        if let Some(why) = self.refusal(&request) {
            sink.failed(&why);
            return ticket;
        }
        let mut seq = *seq;
        let new = &request.prompt[seq.tokens.len()..];
        // Appending nothing keeps the logits a fork (or a prefill) left.
        if !new.is_empty() {
            seq.append(new);
        }
        // The part sampled now starts here: its length is counted from here.
        seq.finish = None;
        let choice = Choice {
            index: request.first_choice,
            start: seq.tokens.len(),
            seq,
            dec: IncrementalDecoder::new(self.tokenizer, false),
            gone: false,
        };
        self.live.push(Live {
            ticket,
            request,
            sink,
            head: None,
            choices: vec![choice],
        });
        ticket
    }

    /// [`Sampling::release`].
    pub fn release(&mut self, ticket: Ticket, choice: usize) -> Option<Held> {
        if let Some(at) = self
            .held
            .iter()
            .position(|(t, c, _)| *t == ticket && *c == choice)
        {
            return Some(Held::Sequence(Box::new(self.held.swap_remove(at).2)));
        }
        let k = self.live.iter().position(|l| l.ticket == ticket)?;
        let l = &mut self.live[k];
        let at = l
            .choices
            .iter()
            .position(|c| c.index == choice && !c.gone)?;
        let seq = l.choices.remove(at).seq;
        if l.choices.is_empty() && l.head.is_none() {
            self.live.remove(k);
        }
        Some(Held::Sequence(Box::new(seq)))
    }

    /// Requests not yet finished.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// One step: one packed forward over every new prompt and every live choice's last
    /// token, then one token drawn for each choice and handed to its sink. A model error
    /// fails every request that was in the forward (their sinks are told) and is returned.
    pub fn step(&mut self) -> Result<()> {
        self.live
            .retain(|l| l.head.is_some() || !l.choices.is_empty());
        if self.live.is_empty() {
            return Ok(());
        }
        let forward = {
            let mut seqs: Vec<&mut Sequence> = Vec::new();
            let mut sets: Vec<Option<&AdapterSnapshot>> = Vec::new();
            let mut base: Vec<&mut Sequence> = Vec::new();
            for l in self.live.iter_mut() {
                let set = l.request.adapter.as_deref();
                let live = l
                    .head
                    .iter_mut()
                    .chain(l.choices.iter_mut().filter(|c| !c.gone).map(|c| &mut c.seq));
                if l.request.base {
                    base.extend(live);
                } else {
                    for seq in live {
                        seqs.push(seq);
                        sets.push(set);
                    }
                }
            }
            // Sequences resumed from a fork have nothing to read: no forward for them.
            let reads = |s: &Vec<&mut Sequence>| s.iter().any(|s| !s.pending().is_empty());
            let policy = if !reads(&seqs) {
                Ok(())
            } else if sets.iter().any(Option::is_some) {
                self.forwards += 1;
                advance_mixed(self.model, &mut seqs, Some(&sets), self.mode)
            } else {
                self.forwards += 1;
                advance(self.model, &mut seqs, self.mode)
            };
            // The base model's requests (plugins' `model.generate` with `base` weights)
            // take a forward of their own: adapters off.
            policy.and_then(|()| {
                if !reads(&base) {
                    return Ok(());
                }
                let t0 = std::time::Instant::now();
                self.forwards += 1;
                let r = advance(self.model, &mut base, Mode::BASE);
                self.base_s += t0.elapsed().as_secs_f64();
                r
            })
        };
        if let Err(e) = forward {
            let message = format!("the model failed: {e:#}");
            for l in self.live.drain(..) {
                let mut sink = l.sink;
                sink.failed(&message);
            }
            return Err(e);
        }
        let (model, tokenizer) = (self.model, self.tokenizer);
        let context = model.cfg.max_position_embeddings;
        for l in self.live.iter_mut() {
            if let Some(mut head) = l.head.take() {
                let r = &l.request;
                l.choices = (r.first_choice..r.first_choice + r.n)
                    .map(|j| Choice {
                        index: j,
                        start: head.tokens.len(),
                        seq: head.fork(r.seed(j)),
                        dec: IncrementalDecoder::new(tokenizer, false),
                        gone: false,
                    })
                    .collect();
            }
            // A request for no new tokens has its prompt prefilled (and its choices
            // forked): its choices end here, before any draw, to be resumed from their
            // caches.
            if l.request.params.max_new_tokens == 0 {
                for mut c in l.choices.drain(..) {
                    c.seq.finish = Some(Finish::Length);
                    let empty =
                        Completion::new(Vec::new(), Vec::new(), String::new(), Finish::Length);
                    l.sink.done(c.index, empty);
                    if l.request.hold {
                        self.held.push((l.ticket, c.index, c.seq));
                    }
                }
            }
        }
        self.live.retain(|l| !l.choices.is_empty());
        // The likeliest tokens are read before the draw takes the logits.
        let mut tops: Vec<Result<Vec<Tops>>> = Vec::with_capacity(self.live.len());
        for l in &self.live {
            let (k, t) = (l.request.top_logprobs, l.request.params.temperature);
            tops.push(
                l.choices
                    .iter()
                    .map(|c| {
                        if k == 0 {
                            Ok(Vec::new())
                        } else {
                            c.seq.top_logprobs(k, t)
                        }
                    })
                    .collect(),
            );
        }
        // Where the logits are on a GPU, one draw for every request that draws alike
        // (a batch's trajectories differ only in their budgets and stops: one draw a
        // step). Where every request draws alike and reads the sampler's own adapter,
        // the next step's forward is queued behind the draw ([`draw_ahead`]): the tokens
        // are taken and the stops checked below while it runs.
        let ahead = self.live.first().is_some_and(|first| {
            goes_ahead(model.device())
                && self.live.iter().all(|l| {
                    !l.request.base
                        && l.request.adapter.is_none()
                        && l.request.params.draws_as(&first.request.params)
                })
        });
        let mut drawn = vec![false; self.live.len()];
        for i in 0..self.live.len() {
            if drawn[i] {
                continue;
            }
            let params = self.live[i].request.params.clone();
            let mut seqs: Vec<&mut Sequence> = Vec::new();
            for (l, d) in self.live.iter_mut().zip(drawn.iter_mut()) {
                if !*d && l.request.params.draws_as(&params) {
                    *d = true;
                    seqs.extend(l.choices.iter_mut().map(|c| &mut c.seq));
                }
            }
            // Going ahead, every request draws alike: this one group is all of them.
            let result = if ahead {
                draw_ahead(model, &mut seqs, &params, self.mode)
                    .map(|went| self.forwards += went as u64)
            } else {
                draw(&mut seqs, &params)
            };
            if let Err(e) = result {
                let message = format!("sampling failed: {e:#}");
                for l in self
                    .live
                    .iter_mut()
                    .filter(|l| l.request.params.draws_as(&params))
                {
                    l.sink.failed(&message);
                    l.choices.clear();
                }
            }
        }
        for (l, tops) in self.live.iter_mut().zip(tops) {
            if l.choices.is_empty() {
                continue;
            }
            if let Err(e) = tops.and_then(|tops| Self::take(l, tops, context, &mut self.held)) {
                l.sink.failed(&format!("sampling failed: {e:#}"));
                l.choices.clear();
            }
        }
        self.live.retain(|l| !l.choices.is_empty());
        Ok(())
    }

    /// Takes the drawn token of each of a request's choices, tells its sink, and ends
    /// the choices that stop.
    fn take(
        l: &mut Live<'t>,
        tops: Vec<Tops>,
        context: usize,
        held: &mut Vec<(Ticket, usize, Sequence)>,
    ) -> Result<()> {
        let params = &l.request.params;
        for (c, top) in l.choices.iter_mut().zip(tops) {
            let (id, logp) = c.seq.sample_next(params)?;
            let text = c.dec.push(id)?.unwrap_or_default();
            let sampled = c.seq.tokens.len() - c.start;
            let mut finish = stop_check(sampled, &c.dec, id, params);
            if finish.is_none() && c.seq.tokens.len() >= context {
                finish = Some(Finish::Length);
            }
            let token = Token {
                choice: c.index,
                id,
                logp,
                text,
                top,
            };
            if !l.sink.token(token) {
                c.gone = true;
                continue;
            }
            if let Some(finish) = finish {
                c.seq.finish = Some(finish);
                c.dec.flush()?;
                let completion = completion_of(&c.seq, c.start, &c.dec);
                l.sink.done(c.index, completion);
                c.gone = true;
            }
        }
        if l.request.hold {
            // Finished (not dropped) choices wait for their caller's release.
            let ticket = l.ticket;
            held.extend(
                l.choices
                    .extract_if(.., |c| c.gone && c.seq.finish.is_some())
                    .map(|c| (ticket, c.index, c.seq)),
            );
        }
        l.choices.retain(|c| !c.gone);
        Ok(())
    }
}

impl<'t> Sampling<'t> for Sampler<'t> {
    fn admit(&mut self, request: Request, sink: Box<dyn Sink + 't>) -> Ticket {
        Sampler::admit(self, request, sink)
    }

    fn resume(&mut self, held: Held, request: Request, sink: Box<dyn Sink + 't>) -> Ticket {
        Sampler::resume(self, held, request, sink)
    }

    fn release(&mut self, ticket: Ticket, choice: usize) -> Option<Held> {
        Sampler::release(self, ticket, choice)
    }

    fn step(&mut self) -> Result<bool> {
        if self.is_empty() {
            return Ok(false);
        }
        // A model error has failed the requests it touched (their sinks were told); the
        // sampler itself goes on.
        if let Err(e) = Sampler::step(self) {
            tracing::debug!("a decode step failed: {e:#}");
        }
        Ok(true)
    }

    fn pending(&self) -> usize {
        self.len()
    }

    fn forwards(&self) -> u64 {
        self.forwards
    }

    fn base_s(&self) -> f64 {
        self.base_s
    }
}

/// Samples `n` completions for each prompt: every prompt is prefilled once (all prompts in
/// one packed forward) and its cache shared by its `n` samples; then all samples decode
/// together until each stops. Sample `j` of prompt `i` draws from a generator seeded by
/// `(params.seed, i, j)` only.
pub fn generate(
    model: &Model,
    tokenizer: &Tokenizer,
    prompts: &[Vec<u32>],
    n: usize,
    params: &SamplingParams,
    mode: Mode,
) -> Result<Vec<Vec<Completion>>> {
    params.validate()?;
    if let Some(i) = prompts.iter().position(Vec::is_empty) {
        anyhow::bail!("prompt {i} is empty");
    }
    let outs: Vec<Mutex<Vec<Option<Completion>>>> =
        prompts.iter().map(|_| Mutex::new(vec![None; n])).collect();
    let failed = Mutex::new(None);
    let mut sampler = Sampler::new(model, tokenizer, mode);
    for (i, prompt) in prompts.iter().enumerate() {
        let request = Request {
            index: i,
            ..Request::new(prompt.clone(), n, params.clone())
        };
        let sink = Collect {
            out: &outs[i],
            failed: &failed,
        };
        sampler.admit(request, Box::new(sink));
    }
    while !sampler.is_empty() {
        sampler.step()?;
    }
    drop(sampler);
    if let Some(why) = failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        anyhow::bail!("{why}");
    }
    Ok(outs
        .into_iter()
        .map(|out| {
            out.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .into_iter()
                .map(|c| c.expect("every choice of a request that did not fail is done"))
                .collect()
        })
        .collect())
}

/// A finished choice as [`generate`](generate) returns it: what was sampled from `start`
/// on (the prompt's end, or where a resumed choice went on).
pub(crate) fn completion_of(seq: &Sequence, start: usize, dec: &IncrementalDecoder) -> Completion {
    let from = start - seq.prompt_len;
    Completion::new(
        seq.tokens[start..].to_vec(),
        seq.logprobs[from..]
            .iter()
            .map(|l| l.unwrap_or(f32::NAN))
            .collect(),
        dec.text().to_string(),
        seq.finish.clone().unwrap_or(Finish::Length),
    )
}

/// A sink that keeps finished choices in order (for [`generate`](generate)).
pub(crate) struct Collect<'a> {
    pub out: &'a std::sync::Mutex<Vec<Option<Completion>>>,
    pub failed: &'a std::sync::Mutex<Option<String>>,
}

impl Sink for Collect<'_> {
    fn token(&mut self, _: Token) -> bool {
        true
    }

    fn done(&mut self, choice: usize, completion: Completion) {
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        out[choice] = Some(completion);
    }

    fn failed(&mut self, message: &str) {
        let mut failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        failed.get_or_insert_with(|| message.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Model;
    use crate::model::fixtures;
    use crate::sampler::decode::sample_seed;
    use crate::sampler::generate;
    use std::sync::Arc;
    use std::sync::Mutex;

    /// Tokens, finished choices and the failure a sink saw.
    type Log = (Vec<Token>, Vec<Completion>, Option<String>);

    /// What a sink saw; with `listen` false its probe hangs up after one token.
    #[derive(Clone, Default)]
    struct Seen(Arc<Mutex<Log>>);

    struct Probe {
        seen: Seen,
        listen: bool,
    }

    impl Sink for Probe {
        fn token(&mut self, t: Token) -> bool {
            self.seen.0.lock().unwrap().0.push(t);
            self.listen
        }
        fn done(&mut self, _: usize, c: Completion) {
            self.seen.0.lock().unwrap().1.push(c);
        }
        fn failed(&mut self, m: &str) {
            self.seen.0.lock().unwrap().2 = Some(m.to_string());
        }
    }

    fn request(prompt: Vec<u32>, seed: u64, top: usize) -> Request {
        let params = SamplingParams {
            temperature: 1.0,
            max_new_tokens: 10,
            seed,
            ..SamplingParams::default()
        };
        Request {
            top_logprobs: top,
            ..Request::new(prompt, 1, params)
        }
    }

    /// A request that joins while another decodes samples what it samples alone, and
    /// the first is not disturbed; one whose listener hangs up is dropped; its likeliest
    /// tokens' log-probs hold the drawn token's when it is among them.
    #[test]
    fn requests_join_and_leave_a_running_batch() {
        let dir = fixtures::model_dir("qwen2");
        let (model, tok) = (fixtures::load("qwen2"), Tokenizer::from_dir(&dir).unwrap());
        let (a, b) = (vec![1, 2, 3, 4], vec![7, 8]);
        let alone = |p: &Vec<u32>, seed| {
            let params = request(p.clone(), seed, 0).params;
            generate(
                &model,
                &tok,
                std::slice::from_ref(p),
                1,
                &params,
                Mode::INFERENCE,
            )
            .unwrap()
            .remove(0)
            .remove(0)
        };
        let mut sampler = Sampler::new(&model, &tok, Mode::INFERENCE);
        let (sa, sb, sc) = (Seen::default(), Seen::default(), Seen::default());
        let probe = |seen: &Seen, listen| {
            Box::new(Probe {
                seen: seen.clone(),
                listen,
            })
        };
        sampler.admit(request(a.clone(), 11, 3), probe(&sa, true));
        sampler.admit(request(a.clone(), 5, 0), probe(&sc, false));
        for _ in 0..3 {
            sampler.step().unwrap();
        }
        assert_eq!(
            sc.0.lock().unwrap().0.len(),
            1,
            "a hung-up request decodes on"
        );
        sampler.admit(request(b.clone(), 12, 0), probe(&sb, true));
        while !sampler.is_empty() {
            sampler.step().unwrap();
        }
        for (seen, prompt, seed) in [(&sa, &a, 11), (&sb, &b, 12)] {
            let seen = seen.0.lock().unwrap();
            let want = alone(prompt, seed);
            assert_eq!(seen.1[0].tokens, want.tokens);
            assert_eq!(seen.0.iter().map(|t| t.id).collect::<Vec<_>>(), want.tokens);
            for (x, y) in seen.1[0].logprobs.iter().zip(&want.logprobs) {
                assert!((x - y).abs() < 1e-4, "{x} vs {y}");
            }
        }
        for t in &sa.0.lock().unwrap().0 {
            assert_eq!(t.top.len(), 3);
            assert!(t.top.windows(2).all(|w| w[0].1 >= w[1].1));
            if let Some(&(_, lp)) = t.top.iter().find(|(id, _)| *id == t.id) {
                assert!((lp - t.logp).abs() < 1e-5, "{lp} vs {}", t.logp);
            }
        }
    }

    /// A set of random pairs of rank `r` on every projection of `model` (which carries a
    /// rank-1 host adapter with B = 0), keyed as the Tinker server keys its clients', and
    /// on the output head when `head`.
    fn random_set(model: &Model, r: usize, seed: u64, scaling: f64, head: bool) -> AdapterSnapshot {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let dev = model.device();
        let mut pairs = Vec::new();
        for (_, _, lin) in model.projections() {
            let host = lin.lora.as_ref().unwrap();
            let mut rand =
                |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-0.3..0.3)).collect() };
            let (i, o) = (lin.in_features(), lin.out_features());
            let a = candle_core::Tensor::from_vec(rand(r * i), (r, i), dev).unwrap();
            let b = candle_core::Tensor::from_vec(rand(o * r), (o, r), dev).unwrap();
            pairs.push((host.lora_a.as_tensor().id(), a, b));
        }
        let (v, h) = model.lm_head.dims2().unwrap();
        let mut rand =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-0.3..0.3)).collect() };
        let head = head.then(|| {
            (
                candle_core::Tensor::from_vec(rand(r * h), (r, h), dev).unwrap(),
                candle_core::Tensor::from_vec(rand(v * r), (v, r), dev).unwrap(),
            )
        });
        AdapterSnapshot::from_pairs(0, pairs)
            .with_scaling(Some(scaling))
            .with_head(head)
    }

    /// Requests of different adapters (one with an output head adapter, and the base
    /// model) decode in the same forwards and each samples what it samples alone with its
    /// adapter.
    #[test]
    fn requests_of_different_adapters_share_a_batch() {
        let dir = fixtures::model_dir("qwen2");
        let (mut model, tok) = (fixtures::load("qwen2"), Tokenizer::from_dir(&dir).unwrap());
        let host = crate::model::LoraConfig {
            r: 1,
            ..crate::model::LoraConfig::default()
        };
        model.attach_lora(&host, 0).unwrap();
        let sets = [
            None,
            Some(Arc::new(random_set(&model, 2, 1, 2.0, false))),
            Some(Arc::new(random_set(&model, 8, 2, 0.5, true))),
        ];
        let prompts = [vec![1u32, 2, 3, 4], vec![7, 8], vec![5, 6, 7]];
        let alone = |set: &Option<Arc<AdapterSnapshot>>, p: &Vec<u32>, seed| {
            let mode = Mode {
                adapter: set.as_deref(),
                ..Mode::INFERENCE
            };
            let params = request(p.clone(), seed, 0).params;
            generate(&model, &tok, std::slice::from_ref(p), 1, &params, mode)
                .unwrap()
                .remove(0)
                .remove(0)
        };
        let mut sampler = Sampler::new(&model, &tok, Mode::INFERENCE);
        let seen: Vec<Seen> = (0..3).map(|_| Seen::default()).collect();
        for (i, (set, p)) in sets.iter().zip(&prompts).enumerate() {
            let r = Request {
                adapter: set.clone(),
                ..request(p.clone(), 20 + i as u64, 0)
            };
            sampler.admit(
                r,
                Box::new(Probe {
                    seen: seen[i].clone(),
                    listen: true,
                }),
            );
        }
        while !sampler.is_empty() {
            sampler.step().unwrap();
        }
        let mut outs = Vec::new();
        for (i, (set, p)) in sets.iter().zip(&prompts).enumerate() {
            let got = seen[i].0.lock().unwrap().1[0].clone();
            let want = alone(set, p, 20 + i as u64);
            assert_eq!(got.tokens, want.tokens, "request {i}");
            for (x, y) in got.logprobs.iter().zip(&want.logprobs) {
                assert!((x - y).abs() < 1e-4, "request {i}: {x} vs {y}");
            }
            outs.push(got.tokens);
        }
        // The adapters change what is sampled (the comparison is not of three base runs).
        let base_b = alone(&None, &prompts[1], 21);
        assert_ne!(base_b.logprobs, alone(&sets[1], &prompts[1], 21).logprobs);
    }

    /// A choice released mid-way (as a trajectory whose tool fires) and resumed with ids
    /// appended goes on from its cache and its own generator: the same tokens and
    /// log-probs as one sequence decoded by hand through the same insertion; a prefill
    /// request (no new tokens) holds its forks for that, and a held choice resumed from a
    /// prompt that does not extend it is prefilled afresh.
    ///
    /// Also as on a GPU, decode steps pooled, where the sampler queues each next step
    /// behind its draw (`draw_ahead`): a choice released after such a step has had its
    /// last token read already.
    #[test]
    fn a_released_choice_resumes_from_its_cache() {
        released_choice_case();
        crate::sampler::decode::as_on_a_gpu(|| {
            crate::model::kv_cache::with_pooling(true, released_choice_case)
        });
    }

    fn released_choice_case() {
        use crate::sampler::decode::advance;
        let dir = fixtures::model_dir("qwen2");
        let (model, tok) = (fixtures::load("qwen2"), Tokenizer::from_dir(&dir).unwrap());
        let prompt = vec![1u32, 2, 3, 4];
        let insert = [508u32, 17, 18];
        let params = request(prompt.clone(), 3, 0).params;
        // By hand: fork seed as the sampler seeds choice 2 of request index 9.
        let seed = sample_seed(params.seed, 9, 2);
        let mut by_hand = Sequence::new(&model, prompt.clone(), seed);
        for k in 0..8 {
            advance(&model, &mut [&mut by_hand], Mode::INFERENCE).unwrap();
            by_hand.sample_next(&params).unwrap();
            if k == 3 {
                by_hand.append(&insert);
            }
        }
        let mut sampler = Sampler::new(&model, &tok, Mode::INFERENCE);
        let seen = Seen::default();
        let probe = || {
            Box::new(Probe {
                seen: seen.clone(),
                listen: true,
            })
        };
        let prefill = Request {
            index: 9,
            first_choice: 1,
            hold: true,
            params: SamplingParams {
                max_new_tokens: 0,
                ..params.clone()
            },
            ..Request::new(prompt.clone(), 2, params.clone())
        };
        let ticket = Sampling::admit(&mut sampler, prefill, probe());
        assert!(Sampling::step(&mut sampler).unwrap());
        assert!(sampler.is_empty(), "a prefill ends at once");
        assert_eq!(seen.0.lock().unwrap().1.len(), 2);
        assert!(seen.0.lock().unwrap().0.is_empty(), "no token is drawn");
        let held = sampler.release(ticket, 2).unwrap();
        assert!(sampler.release(ticket, 2).is_none(), "released once");
        let part = |ids: Vec<u32>| Request {
            hold: true,
            ..Request::new(ids, 1, params.clone())
        };
        let ticket = sampler.resume(held, part(prompt.clone()), probe());
        for _ in 0..4 {
            Sampling::step(&mut sampler).unwrap();
        }
        let Some(Held::Sequence(seq)) = sampler.release(ticket, 0) else {
            panic!("a live choice is released with its sequence");
        };
        assert!(sampler.is_empty());
        let mut ids = seq.tokens.clone();
        ids.extend(insert);
        let ticket = sampler.resume(Held::Sequence(seq), part(ids), probe());
        for _ in 0..4 {
            Sampling::step(&mut sampler).unwrap();
        }
        let Some(Held::Sequence(seq)) = sampler.release(ticket, 0) else {
            panic!("a live choice is released with its sequence");
        };
        assert_eq!(seq.tokens, by_hand.tokens);
        for (a, b) in seq.logprobs.iter().zip(&by_hand.logprobs) {
            match (a, b) {
                (Some(a), Some(b)) => assert!((a - b).abs() < 1e-5, "{a} vs {b}"),
                (a, b) => assert_eq!(a.is_none(), b.is_none()),
            }
        }
        // The sink saw the sampled tokens only, in order.
        let sampled: Vec<u32> = seen.0.lock().unwrap().0.iter().map(|t| t.id).collect();
        let want: Vec<u32> = (prompt.len()..by_hand.tokens.len())
            .filter(|&k| by_hand.logprobs[k - prompt.len()].is_some())
            .map(|k| by_hand.tokens[k])
            .collect();
        assert_eq!(sampled, want);
        // A held sequence that the prompt does not extend is not used: fresh prefill,
        // seeded as a new choice.
        let other = vec![7u32, 8];
        let alone = generate(
            &model,
            &tok,
            std::slice::from_ref(&other),
            1,
            &params,
            Mode::INFERENCE,
        )
        .unwrap()
        .remove(0)
        .remove(0);
        let fresh = Seen::default();
        sampler.resume(
            Held::Sequence(Box::new(by_hand)),
            Request::new(other, 1, params.clone()),
            Box::new(Probe {
                seen: fresh.clone(),
                listen: true,
            }),
        );
        while !sampler.is_empty() {
            Sampling::step(&mut sampler).unwrap();
        }
        assert_eq!(fresh.0.lock().unwrap().1[0].tokens, alone.tokens);
    }

    /// What cannot be sampled fails through the sink, before any step.
    #[test]
    fn requests_that_cannot_be_sampled_fail_at_once() {
        let dir = fixtures::model_dir("qwen2");
        let (model, tok) = (fixtures::load("qwen2"), Tokenizer::from_dir(&dir).unwrap());
        let mut sampler = Sampler::new(&model, &tok, Mode::INFERENCE);
        let long = vec![1; model.cfg.max_position_embeddings];
        for r in [
            request(vec![], 0, 0),
            request(long, 0, 0),
            Request {
                n: 0,
                ..request(vec![1], 0, 0)
            },
        ] {
            let seen = Seen::default();
            sampler.admit(
                r,
                Box::new(Probe {
                    seen: seen.clone(),
                    listen: true,
                }),
            );
            assert!(seen.0.lock().unwrap().2.is_some());
        }
        assert!(sampler.is_empty());
    }
}
