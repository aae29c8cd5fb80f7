//! The model's side of the Tinker API: one thread owns the base model and every training
//! client's adapter, and runs the accepted operations in the order they reach it
//! (each training client's in its `seq_id` order, see [`super::gate`]), settling each
//! one's future. Sampling requests for the same weights are decoded together by one
//! continuous-batching [`Sampler`]; requests that arrive for those weights while it runs
//! join it, anything else waits until it is done.

use super::adapter::Adapter;
use super::futures::{Futures, Settled};
use super::losses::Loss;
use super::proto;
use super::snapshots::{KEEP_UNNAMED, Snapshots};
use super::wire::UserError;
use crate::model::LanguageModel;
use crate::model::lora::{AdapterSnapshot, LoraConfig, Mode};
use crate::rl::optim::AdamWConfig;
use crate::rl::packing::{self, Layout};
use crate::sampler::decode::{Completion, Finish};
use crate::sampler::draw::SamplingParams;
use crate::sampler::kv_budget::KvBudget;
use crate::sampler::{Request, Sampler, Sink, Token};
use anyhow::{Context, Result, bail};
use candle_core::{DType, Device, Tensor};
use prost::Message;
use serde_json::json;
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

/// One datum of a forward/backward, checked: `tokens` and `targets` of equal length, and
/// each loss input with one value per token.
#[derive(Debug, Clone)]
pub struct CheckedDatum {
    pub tokens: Vec<u32>,
    pub targets: Vec<u32>,
    pub inputs: HashMap<String, Vec<f32>>,
}

/// Which weights a sampler reads.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SamplerWeights {
    /// The base model, no adapter.
    Base,
    /// Sampler weights by key: a `tinker://` path (read from `dir` when not in memory), or
    /// a snapshot made for a sampling session (`save_weights_and_get_sampling_client`).
    Saved { key: String, dir: Option<PathBuf> },
}

/// A sampling request, checked.
#[derive(Debug, Clone)]
pub struct SampleJob {
    pub request: String,
    pub weights: SamplerWeights,
    pub prompt: Vec<u32>,
    pub n: usize,
    pub params: SamplingParams,
    /// What it asks about its own prompt.
    pub ask: super::prompt::Ask,
    pub topk_sample: usize,
}

/// What the worker is asked to do; `request` is the future it settles.
#[derive(Debug)]
pub enum Work {
    Create {
        request: String,
        model_id: String,
        lora: LoraConfig,
        /// Train an adapter on the output head too (`train_unembed`).
        head: bool,
        seed: u64,
    },
    /// A checkpoint into a training client: a new one (`create`) or one that exists.
    Load {
        request: String,
        model_id: String,
        dir: PathBuf,
        optimizer: bool,
        create: bool,
    },
    ForwardBackward {
        request: String,
        model_id: String,
        rows: Vec<CheckedDatum>,
        loss: Loss,
        forward_only: bool,
    },
    Optim {
        request: String,
        model_id: String,
        lr: f64,
        adam: AdamWConfig,
        clip: f64,
    },
    /// Writes a checkpoint (with the optimizer: `save_weights`; without: sampler weights)
    /// to `dir` and answers with `path`; sampler weights are also kept in memory under
    /// `key`. With no `dir`, only the in-memory snapshot (a sampling session's).
    Save {
        request: String,
        model_id: String,
        dir: Option<PathBuf>,
        optimizer: bool,
        key: Option<String>,
        answer: serde_json::Value,
    },
    Sample(SampleJob),
    /// Settles `request` as failed, in its turn (a request refused while others of its
    /// training client wait behind it).
    Fail {
        request: String,
        message: String,
    },
    /// Drops a finished session's training clients.
    Unload {
        model_ids: Vec<String>,
    },
}

impl Work {
    fn request(&self) -> Option<&str> {
        match self {
            Work::Create { request, .. }
            | Work::Load { request, .. }
            | Work::ForwardBackward { request, .. }
            | Work::Optim { request, .. }
            | Work::Save { request, .. }
            | Work::Fail { request, .. } => Some(request),
            Work::Sample(job) => Some(&job.request),
            Work::Unload { .. } => None,
        }
    }
}

/// Tokens (lanes × longest lane) a forward/backward runs at once: its datums are split
/// into micro-batches of about this many (the loss is a sum, so the split changes
/// nothing but memory and speed).
pub const TOKENS_PER_FORWARD: usize = 8192;

pub struct Worker {
    pub lm: LanguageModel,
    pub base_name: String,
    pub futures: Arc<Futures>,
    models: HashMap<String, Adapter>,
    saved: Snapshots,
    version: u64,
    /// What sampling requests may hold of keys and values at once: one that fits waits
    /// for room, one that never fits is refused.
    kv: KvBudget,
    /// The most bytes of that budget the requests in a batch held at once.
    pub kv_peak: u64,
}

impl Worker {
    pub fn new(
        lm: LanguageModel,
        base_name: String,
        futures: Arc<Futures>,
        kv: KvBudget,
    ) -> Worker {
        Worker {
            lm,
            base_name,
            futures,
            models: HashMap::new(),
            saved: Snapshots::default(),
            version: 0,
            kv,
            kv_peak: 0,
        }
    }

    /// Runs work until every sender is gone.
    pub fn run(&mut self, rx: &Receiver<Work>) {
        let mut backlog: VecDeque<Work> = VecDeque::new();
        loop {
            let work = match backlog.pop_front() {
                Some(w) => w,
                None => match rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(w) => w,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return,
                },
            };
            // A panic in one operation fails that operation (and, in a sampling round, the
            // requests it held), not the server: the thread goes on with the next.
            let mut held = Vec::new();
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match work {
                Work::Sample(job) => self.sampling_round(job, rx, &mut backlog, &mut held),
                other => {
                    held.extend(other.request().map(str::to_string));
                    self.execute(other)
                }
            }));
            if let Err(panic) = ran {
                let why = panic_message(&panic);
                tracing::error!("tinker: an operation panicked: {why}");
                for id in held.iter().filter(|id| self.futures.pending(id)) {
                    self.futures.finish(
                        id,
                        Settled::server_error(format!(
                            "the server hit a bug running this request ({why}); it goes on \
                             serving other requests"
                        )),
                    );
                }
            }
        }
    }

    /// Runs one operation and settles its future.
    pub fn execute(&mut self, work: Work) {
        let Some(request) = work.request().map(str::to_string) else {
            if let Work::Unload { model_ids } = work {
                for id in model_ids {
                    self.models.remove(&id);
                    self.saved.forget(&id);
                }
            }
            return;
        };
        let outcome = match self.operate(work) {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!("tinker: {request} failed: {e:#}");
                failure(&e)
            }
        };
        self.futures.finish(&request, outcome);
    }

    fn adapter(&mut self, model_id: &str) -> Result<&mut Adapter> {
        self.models
            .get_mut(model_id)
            .ok_or_else(|| unknown(model_id))
    }

    fn operate(&mut self, work: Work) -> Result<Settled> {
        match work {
            Work::Create {
                model_id,
                lora,
                head,
                seed,
                ..
            } => {
                let adapter = Adapter::fresh(&self.lm.model, lora, head, seed)?;
                self.models.insert(model_id.clone(), adapter);
                Ok(Settled::Json(
                    json!({"model_id": model_id, "type": "create_model"}),
                ))
            }
            Work::Load {
                model_id,
                dir,
                optimizer,
                create,
                ..
            } => {
                if !create {
                    self.adapter(&model_id)?;
                }
                let adapter = Adapter::load(&self.lm.model, &dir, optimizer)
                    .map_err(|e| UserError(format!("loading {}: {e:#}", dir.display())))?;
                self.models.insert(model_id.clone(), adapter);
                Ok(Settled::Json(
                    json!({"model_id": model_id, "type": "load_weights"}),
                ))
            }
            Work::ForwardBackward {
                model_id,
                rows,
                loss,
                forward_only,
                ..
            } => {
                let lm = &self.lm;
                let adapter = self
                    .models
                    .get_mut(&model_id)
                    .ok_or_else(|| unknown(&model_id))?;
                let out = forward_backward(lm, adapter, &rows, loss, forward_only)?;
                Ok(Settled::Proto(out.encode_to_vec()))
            }
            Work::Optim {
                model_id,
                lr,
                adam,
                clip,
                ..
            } => {
                let adapter = self.adapter(&model_id)?;
                let norm = adapter.step(lr, adam, clip)?;
                let mut metrics = serde_json::Map::new();
                metrics.insert("step:max".into(), json!(adapter.steps as f64));
                metrics.insert("learning_rate:mean".into(), json!(lr));
                if let Some(n) = norm {
                    metrics.insert("grad_norm:mean".into(), json!(n));
                }
                Ok(Settled::Json(json!({ "metrics": metrics })))
            }
            Work::Save {
                model_id,
                dir,
                optimizer,
                key,
                answer,
                ..
            } => {
                let base = self.base_name.clone();
                self.version += 1;
                let version = self.version;
                let model = &self.lm.model;
                let adapter = self
                    .models
                    .get(&model_id)
                    .ok_or_else(|| unknown(&model_id))?;
                if let Some(dir) = &dir {
                    adapter
                        .save(dir, &base, optimizer)
                        .with_context(|| format!("writing {}", dir.display()))?;
                }
                if let Some(key) = key {
                    let snapshot = Arc::new(adapter.snapshot(model, version)?);
                    match dir {
                        Some(_) => self.saved.insert_named(key, snapshot),
                        None => self.saved.insert_unnamed(&model_id, key, snapshot),
                    }
                }
                Ok(Settled::Json(answer))
            }
            Work::Fail { message, .. } => Err(UserError(message).into()),
            Work::Sample(_) | Work::Unload { .. } => unreachable!("handled by run"),
        }
    }

    /// Samples `first` and every sampling request that arrives while it decodes, whatever
    /// weights each reads, in one continuous batch (sequences of different adapters share
    /// each forward). Other work waits in `backlog`; once some waits, no new sampling
    /// joins, so the batch drains and training is not starved.
    fn sampling_round(
        &mut self,
        first: SampleJob,
        rx: &Receiver<Work>,
        backlog: &mut VecDeque<Work>,
        held: &mut Vec<String>,
    ) {
        let Worker {
            lm,
            futures,
            saved,
            kv,
            kv_peak,
            ..
        } = self;
        let mut sampler = Sampler::new(&lm.model, &lm.tokenizer, Mode::INFERENCE);
        let mut incoming = VecDeque::from([first]);
        // Samples that queued behind training join this batch too.
        while let Some(Work::Sample(_)) = backlog.front() {
            if let Some(Work::Sample(job)) = backlog.pop_front() {
                incoming.push_back(job);
            }
        }
        // The requests in the batch and the bytes of keys and values each may hold.
        let mut holding: Vec<(String, u64)> = Vec::new();
        loop {
            holding.retain(|(id, _)| futures.pending(id));
            if sampler.is_empty() {
                holding.clear();
            }
            let mut used: u64 = holding.iter().map(|h| h.1).sum();
            while let Some(job) = incoming.front() {
                let need = kv.need(job.prompt.len(), job.n, job.params.max_new_tokens);
                let what = format!(
                    "num_samples {} × max_tokens {} after a prompt of {} tokens",
                    job.n,
                    job.params.max_new_tokens,
                    job.prompt.len()
                );
                if let Some(why) = kv.refusal(need, &what, "serve --tinker --kv-budget-mib") {
                    let job = incoming.pop_front().expect("a front");
                    futures.finish(&job.request, Settled::user_error(why));
                    continue;
                }
                // Past the budget it waits, in order, for requests in the batch to end.
                if used + need > kv.bytes && !sampler.is_empty() {
                    break;
                }
                let job = incoming.pop_front().expect("a front");
                used += need;
                *kv_peak = (*kv_peak).max(used);
                holding.push((job.request.clone(), need));
                held.push(job.request.clone());
                match weights(saved, lm, &job.weights) {
                    Ok(w) => admit(&mut sampler, lm, futures, job, w),
                    Err(e) => futures.finish(&job.request, failure(&e)),
                }
            }
            if sampler.is_empty() {
                if incoming.is_empty() {
                    break;
                }
                continue;
            }
            if let Err(e) = sampler.step() {
                tracing::error!("tinker: a decode step failed: {e:#}");
            }
            while let Ok(w) = rx.try_recv() {
                match w {
                    Work::Sample(job) if backlog.is_empty() => incoming.push_back(job),
                    other => backlog.push_back(other),
                }
            }
        }
    }
}

/// What a caught panic carried, as text.
pub fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic without a message".into())
}

/// A training client the worker does not hold.
fn unknown(model_id: &str) -> anyhow::Error {
    UserError(format!(
        "unknown model_id {model_id:?}: no training client by that id (it was never created, \
         failed to load, or its session ended)"
    ))
    .into()
}

/// The outcome of an operation that failed with `e`: the user's fault where it found a
/// problem in what was sent, the server's otherwise.
fn failure(e: &anyhow::Error) -> Settled {
    if e.downcast_ref::<UserError>().is_some() {
        Settled::user_error(format!("{e:#}"))
    } else {
        Settled::server_error(format!("{e:#}"))
    }
}

/// The snapshot sampler weights `w` name (`None`: the base model), from memory or read
/// from the checkpoint directory they were saved to (by a server since restarted).
fn weights(
    saved: &mut Snapshots,
    lm: &LanguageModel,
    w: &SamplerWeights,
) -> Result<Option<Arc<AdapterSnapshot>>> {
    let SamplerWeights::Saved { key, dir } = w else {
        return Ok(None);
    };
    if let Some(s) = saved.get(key) {
        return Ok(Some(s.clone()));
    }
    let Some(dir) = dir.as_ref().filter(|d| d.is_dir()) else {
        bail!(UserError(format!(
            "no sampler weights at {key:?}: save_weights_for_sampler writes them to disk; a \
             save_weights_and_get_sampling_client snapshot lives in memory and only the newest \
             {KEEP_UNNAMED} of each training client are kept"
        )));
    };
    let adapter = Adapter::load(&lm.model, dir, false)
        .map_err(|e| UserError(format!("loading {}: {e:#}", dir.display())))?;
    let snapshot = Arc::new(adapter.snapshot(&lm.model, 0)?);
    saved.insert_named(key.clone(), snapshot.clone());
    Ok(Some(snapshot))
}

/// Admits a sampling request (its prompt's log-probs computed first when asked for).
fn admit(
    sampler: &mut Sampler<'_>,
    lm: &LanguageModel,
    futures: &Arc<Futures>,
    job: SampleJob,
    weights: Option<Arc<AdapterSnapshot>>,
) {
    let mode = Mode {
        adapter: weights.as_deref(),
        ..Mode::INFERENCE
    };
    let prompt = if job.ask.any() {
        let scored = super::prompt::score(
            lm,
            mode,
            &job.prompt,
            &job.ask,
            job.params.temperature,
            job.params.seed,
        );
        match scored {
            Ok(mut p) => {
                if let Some(n) = job.ask.last_n {
                    p.keep_last(n);
                }
                Some(p)
            }
            Err(e) => {
                futures.finish(&job.request, Settled::server_error(format!("{e:#}")));
                return;
            }
        }
    } else {
        None
    };
    let sink = Collect {
        request: job.request.clone(),
        futures: futures.clone(),
        choices: vec![Choice::default(); job.n],
        left: job.n,
        topk: job.topk_sample,
        prompt,
        ask: job.ask.clone(),
    };
    sampler.admit(
        Request {
            prompt: job.prompt,
            n: job.n,
            params: job.params,
            index: 0,
            top_logprobs: job.topk_sample,
            adapter: weights,
            first_choice: 0,
            base: false,
            hold: false,
        },
        Box::new(sink),
    );
}

#[derive(Debug, Clone, Default)]
struct Choice {
    top: Vec<Vec<(u32, f32)>>,
    done: Option<Completion>,
}

/// Gathers one request's choices and settles its future when the last one ends.
struct Collect {
    request: String,
    futures: Arc<Futures>,
    choices: Vec<Choice>,
    left: usize,
    topk: usize,
    /// The prompt's figures, when asked for.
    prompt: Option<super::prompt::Scores>,
    ask: super::prompt::Ask,
}

impl Sink for Collect {
    fn token(&mut self, token: Token) -> bool {
        if self.topk > 0
            && let Some(c) = self.choices.get_mut(token.choice)
        {
            c.top.push(token.top);
        }
        true
    }

    fn done(&mut self, choice: usize, completion: Completion) {
        if let Some(c) = self.choices.get_mut(choice)
            && c.done.is_none()
        {
            c.done = Some(completion);
            self.left -= 1;
        }
        if self.left == 0 {
            let response = self.response();
            self.futures
                .finish(&self.request, Settled::Proto(response.encode_to_vec()));
        }
    }

    fn failed(&mut self, message: &str) {
        self.futures
            .finish(&self.request, Settled::user_error(message.to_string()));
    }
}

impl Collect {
    fn response(&self) -> proto::SampleResponse {
        let sequences = self
            .choices
            .iter()
            .map(|c| {
                let done = c.done.as_ref().expect("every choice ended");
                let stop_reason = match done.finish {
                    Finish::Length => proto::StopReason::Length,
                    Finish::StopToken(_) | Finish::StopString(_) => proto::StopReason::Stop,
                };
                let topk = (self.topk > 0).then(|| {
                    let rows: Vec<Option<Vec<(u32, f32)>>> =
                        c.top.iter().map(|r| Some(r.clone())).collect();
                    proto::TopkLogprobs::from_rows(&rows, self.topk)
                });
                proto::SampledSequence {
                    stop_reason: stop_reason as i32,
                    tokens: proto::i32_bytes(&done.tokens),
                    logprobs: Some(proto::f32_bytes(&done.logprobs)),
                    topk_sampled_logprobs: topk,
                }
            })
            .collect();
        let mut response = proto::SampleResponse {
            sequences,
            ..proto::SampleResponse::default()
        };
        if let Some(p) = &self.prompt {
            p.write(&self.ask, &mut response);
        }
        response
    }
}

/// Runs `rows` through the model with `adapter` and the loss, adding the gradients to the
/// adapter's (unless `forward_only`); answers with each datum's log-probs and per-token
/// losses and the summed loss.
pub fn forward_backward(
    lm: &LanguageModel,
    adapter: &mut Adapter,
    rows: &[CheckedDatum],
    loss: Loss,
    forward_only: bool,
) -> Result<proto::ForwardBackwardOutput> {
    let model = &lm.model;
    let device = model.device().clone();
    // Each datum's, in the request's order (packing places them in its own).
    let mut logprobs: Vec<Vec<f32>> = vec![Vec::new(); rows.len()];
    let mut losses: Vec<Vec<f32>> = vec![Vec::new(); rows.len()];
    let mut total = 0f64;
    // With an output head adapter the logits are whole (`vocab` floats a token): fewer
    // tokens a forward.
    let budget = if adapter.trains_head() {
        (HEAD_LOGITS / model.cfg.vocab_size.max(1)).clamp(1, TOKENS_PER_FORWARD)
    } else {
        TOKENS_PER_FORWARD
    };
    let sized: Vec<(usize, usize)> = rows.iter().map(|r| r.tokens.len()).enumerate().collect();
    // One datum a lane, as `train.pack_sequences` defaults (packing gives the same sums
    // to rounding); to follow that default when it turns on.
    for layout in packing::micro_batches(&sized, false, budget) {
        let mode = Mode {
            adapters: true,
            grad: !forward_only,
            dropout_rng: None,
            adapter: Some(adapter.live()),
            segments: None,
        };
        let (ids, mask, pos, targets) = packed(rows, &layout, &device)?;
        let hidden = model.forward_batch(&ids, &mask, &pos, mode)?;
        let lp = super::adapter::target_logprobs(model, &hidden, &targets, Some(adapter.live()))?;
        let mut sum: Option<Tensor> = None;
        for slot in &layout.slots {
            let row = &rows[slot.row];
            let lp_i = lp
                .get(slot.lane)?
                .narrow(0, slot.start, slot.len)?
                .to_dtype(DType::F32)?;
            let mut inputs = HashMap::new();
            for key in loss.inputs() {
                let values = &row.inputs[*key];
                inputs.insert(*key, Tensor::new(values.as_slice(), &device)?);
            }
            let per = loss.elementwise(&lp_i, &inputs)?;
            logprobs[slot.row] = lp_i.to_vec1::<f32>()?;
            losses[slot.row] = per.to_vec1::<f32>()?;
            let s = per.sum_all()?;
            sum = Some(match sum {
                Some(acc) => (acc + s)?,
                None => s,
            });
        }
        if let Some(sum) = sum {
            total += sum.to_scalar::<f32>()? as f64;
            if !forward_only {
                let grads = sum.backward()?;
                adapter.accumulate(&grads)?;
            }
        }
    }
    let record = proto::ArrayRecord {
        type_tag: "ArrayRecord".into(),
        fields: [
            (
                "logprobs".to_string(),
                proto::BatchedTensor::f32_rows(&logprobs),
            ),
            (
                "elementwise_loss".to_string(),
                proto::BatchedTensor::f32_rows(&losses),
            ),
        ]
        .into(),
        num_datums: rows.len() as i64,
    };
    let tokens: usize = rows.iter().map(|r| r.tokens.len()).sum();
    Ok(proto::ForwardBackwardOutput {
        loss_fn_output_type: "ArrayRecord".into(),
        loss_fn_outputs: vec![record],
        metrics: [
            ("loss:sum".to_string(), total),
            ("tokens:sum".to_string(), tokens as f64),
        ]
        .into(),
    })
}

/// Logits a forward/backward micro-batch holds at most with an output head adapter.
pub const HEAD_LOGITS: usize = 1 << 25;

/// `[L, T]` ids, sequence ids (the attention mask), positions and targets of `rows` as
/// `layout` packs them ([`packing`]).
fn packed(
    rows: &[CheckedDatum],
    layout: &Layout,
    device: &Device,
) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let shape = (layout.lanes, layout.width);
    let at = |v: Vec<u32>| Tensor::from_vec(v, shape, device);
    Ok((
        at(layout.place(|s, k| rows[s.row].tokens[k]))?,
        at(layout.sequence_ids())?,
        at(layout.positions())?,
        at(layout.place(|s, k| rows[s.row].targets[k]))?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(n: usize, first: u32) -> CheckedDatum {
        CheckedDatum {
            tokens: (first..first + n as u32).collect(),
            targets: (first + 1..first + 1 + n as u32).collect(),
            inputs: HashMap::new(),
        }
    }

    /// Sampling requests past the keys-and-values budget wait for room: with room for
    /// one request at a time, three each finish and no two were held at once, and one
    /// that could never fit is refused, naming the flag; with room for three, those share
    /// a batch and the fourth waits for room.
    #[test]
    fn samples_past_the_kv_budget_wait_their_turn() {
        use crate::model::{fixtures, placement::Placement};
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        for alone in [true, false] {
            let lm = LanguageModel::open(&fixtures::model_dir("qwen2"), &Placement::CPU).unwrap();
            let futures = Arc::new(Futures::default());
            let mut kv = KvBudget::new(&lm.model, 1);
            let one = kv.need(3, 2, 8);
            kv.bytes = if alone { one } else { 3 * one };
            let mut w = Worker::new(lm, "base".into(), futures.clone(), kv);
            let job = |n: usize| SampleJob {
                request: futures.open(),
                weights: SamplerWeights::Base,
                prompt: vec![5, 6, 7],
                n,
                params: SamplingParams {
                    max_new_tokens: 8,
                    temperature: 1.0,
                    seed: 3,
                    ..SamplingParams::default()
                },
                ask: Default::default(),
                topk_sample: 0,
            };
            let jobs = [job(2), job(2), job(2), job(4)];
            let ids: Vec<String> = jobs.iter().map(|j| j.request.clone()).collect();
            let mut jobs = jobs.into_iter();
            let first = jobs.next().unwrap();
            let mut backlog: VecDeque<Work> = jobs.map(Work::Sample).collect();
            let (_tx, rx) = std::sync::mpsc::channel();
            w.sampling_round(first, &rx, &mut backlog, &mut Vec::new());
            let outcome = |id: &str| {
                rt.block_on(futures.wait(id, Duration::from_secs(1)))
                    .unwrap()
            };
            for id in &ids[..3] {
                assert!(
                    matches!(*outcome(id), Settled::Proto(_)),
                    "{alone}: {:?}",
                    outcome(id)
                );
            }
            // Four samples: past a budget of one request of two, within one of three
            // (where they wait for the first three to end).
            match &*outcome(&ids[3]) {
                Settled::Failed { message, category } if alone => {
                    assert_eq!(*category, "user");
                    assert!(
                        message.contains("serve --tinker --kv-budget-mib"),
                        "{message}"
                    );
                }
                Settled::Proto(_) if !alone => {}
                other => panic!("{alone}: {other:?}"),
            }
            assert_eq!(w.kv_peak, if alone { one } else { 3 * one }, "{alone}");
        }
    }

    /// Datums pack into lanes within the budget, each token where its datum sits, the
    /// datums' sequence ids keeping them apart.
    #[test]
    fn datums_pack_into_lanes() {
        let rows: Vec<CheckedDatum> = [(3, 10), (3, 20), (10, 30), (2, 40)]
            .iter()
            .map(|&(n, first)| row(n, first))
            .collect();
        let sized: Vec<(usize, usize)> = rows.iter().map(|r| r.tokens.len()).enumerate().collect();
        let layouts = packing::micro_batches(&sized, true, 20);
        assert_eq!(layouts.len(), 1);
        let (ids, mask, pos, targets) = packed(&rows, &layouts[0], &Device::Cpu).unwrap();
        let v = |t: Tensor| t.to_vec2::<u32>().unwrap();
        assert_eq!(
            v(ids),
            [
                vec![30, 31, 32, 33, 34, 35, 36, 37, 38, 39],
                vec![10, 11, 12, 20, 21, 22, 40, 41, 0, 0]
            ]
        );
        assert_eq!(v(mask)[1], [1, 1, 1, 2, 2, 2, 3, 3, 0, 0]);
        assert_eq!(v(pos)[1], [0, 1, 2, 0, 1, 2, 0, 1, 0, 0]);
        assert_eq!(v(targets)[1][..8], [11, 12, 13, 21, 22, 23, 41, 42]);
    }
}
