//! The gateway's calls on vLLM servers: in a `[gateway]` run with `rollout.engine =
//! "vllm"`, [`pump_remote`] takes the place of [`pump`](super::pump::pump). Each choice of
//! a call is one token-in/token-out completion on the run's [`Pool`] (the least loaded
//! live server, at most `max_in_flight` each), sampled by the adapter version the trainer
//! published, which the pool writes and loads on every server first. The ids and log-probs
//! are the server's (checked by the pool, never re-tokenized); they are replayed through
//! the sampler's own stop rule ([`stop_check`]), so a choice ends where the local sampler
//! would end it, with the same `finish` and text.
//!
//! A server that fails is taken out and the choice goes to another; when none is left the
//! calls fail with the last server's error, and so does the run (as a plugin run on vLLM
//! does). Tokens reach the caller when the server's
//! answer does (a streamed call gets its tokens in one burst), and `top_logprobs` is
//! refused before a call is queued (vLLM names alternatives by text, not by id).

use super::pump::{Event, Job, Pumped};
use crate::model::generate::{Completion, Finish, sample_seed, stop_check};
use crate::model::sample::SamplingParams;
use crate::model::sampler::Token;
use crate::model::tokenizer::{IncrementalDecoder, Tokenizer};
use crate::model::{LanguageModel, Mode};
use crate::rollout::vllm::{self, Pool, RequestError, Sampled};
use anyhow::Result;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::Duration;
use tokio::runtime::Handle;
use tokio::sync::mpsc::UnboundedSender;

/// One choice of a call, waiting for a server or on one.
struct Choice {
    index: usize,
    request: vllm::Request,
    params: SamplingParams,
    tx: UnboundedSender<Event>,
}

/// A server's answer to one choice.
struct Answer {
    choice: Choice,
    server: usize,
    result: Result<Sampled, RequestError>,
}

/// Serves queued calls on `pool`'s servers with `mode`'s adapter (policy `version`) until
/// `stop` says so and nothing is in flight, or the queue's senders are all gone.
pub fn pump_remote(
    pool: &Arc<Pool>,
    lm: &LanguageModel,
    mode: Mode,
    jobs: &Receiver<Job>,
    version: u64,
    stop: &dyn Fn() -> bool,
    handle: &Handle,
) -> Result<Pumped> {
    let model = pool.acquire(lm, mode, version)?;
    let pumped = serve(pool, &model, &lm.tokenizer, jobs, version, stop, handle);
    pool.release(version, mode, lm);
    pumped
}

fn serve(
    pool: &Arc<Pool>,
    model: &str,
    tokenizer: &Tokenizer,
    jobs: &Receiver<Job>,
    version: u64,
    stop: &dyn Fn() -> bool,
    handle: &Handle,
) -> Result<Pumped> {
    let (answers_tx, answers) = channel::<Answer>();
    let mut queue: VecDeque<Choice> = VecDeque::new();
    let mut in_flight = 0usize;
    let mut pumped = Pumped::default();
    let mut open = true;
    loop {
        let stopping = stop();
        while open && !stopping {
            match jobs.try_recv() {
                Ok(job) => admit(job, model, &mut queue, &mut pumped),
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => open = false,
            }
        }
        // With no server left the run ends; what is in flight is answered (or failed) by
        // its thread, or dropped with the run.
        dispatch(pool, &mut queue, &mut in_flight, &answers_tx, handle)?;
        if queue.is_empty() && in_flight == 0 {
            if stopping || !open {
                break;
            }
            // Idle: wait for a call, looking at `stop` now and then.
            match jobs.recv_timeout(Duration::from_millis(50)) {
                Ok(job) => admit(job, model, &mut queue, &mut pumped),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => open = false,
            }
            continue;
        }
        match answers.recv_timeout(Duration::from_millis(20)) {
            Ok(a) => {
                in_flight -= 1;
                answered(pool, a, tokenizer, version, &mut queue);
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => unreachable!("the loop holds a sender"),
        }
    }
    Ok(pumped)
}

/// A call's choices, queued: choice `j` seeded by `sample_seed(seed, index, j)` as the
/// local sampler seeds it (vLLM takes a signed 64-bit seed).
fn admit(job: Job, model: &str, queue: &mut VecDeque<Choice>, pumped: &mut Pumped) {
    if job.tx.is_closed() {
        return;
    }
    let r = &job.request;
    if r.top_logprobs > 0 || r.adapter.is_some() {
        // The handlers refuse these before queueing; a caller that did not is told here.
        let _ = job.tx.send(Event::Failed(
            "the vLLM engine serves neither top_logprobs nor a per-request adapter".into(),
        ));
        return;
    }
    pumped.requests += 1;
    let p = &r.params;
    for j in 0..r.n {
        queue.push_back(Choice {
            index: j,
            request: vllm::Request {
                model: model.to_string(),
                prompt: r.prompt.clone(),
                max_tokens: p.max_new_tokens,
                temperature: p.temperature,
                top_k: p.top_k,
                top_p: p.top_p,
                min_p: p.min_p,
                seed: sample_seed(p.seed, r.index, j) & (i64::MAX as u64),
                stop: p.stop_strings.clone(),
                stop_token_ids: p.stop_token_ids.clone(),
            },
            params: p.clone(),
            tx: job.tx.clone(),
        });
    }
}

/// Sends queued choices to servers with room; with no server left, fails them and says
/// so.
fn dispatch(
    pool: &Arc<Pool>,
    queue: &mut VecDeque<Choice>,
    in_flight: &mut usize,
    answers: &Sender<Answer>,
    handle: &Handle,
) -> Result<()> {
    while let Some(front) = queue.front() {
        if front.tx.is_closed() {
            // Its caller went away.
            queue.pop_front();
            continue;
        }
        let Some(server) = pool.pick() else {
            let why = format!(
                "every vLLM server has stopped answering (rollout.vllm.servers); the last: {}",
                pool.last_fault()
            );
            for c in queue.drain(..) {
                let _ = c.tx.send(Event::Failed(why.clone()));
            }
            anyhow::bail!(why);
        };
        if !pool.has_room(server) {
            return Ok(());
        }
        let choice = queue.pop_front().expect("looked at above");
        *in_flight += 1;
        let (slot, answers) = (pool.servers()[server].reserve(), answers.clone());
        handle.spawn_blocking(move || {
            let result = slot.complete(&choice.request);
            // The server has room again before the loop hears of it.
            drop(slot);
            let _ = answers.send(Answer {
                choice,
                server,
                result,
            });
        });
    }
    Ok(())
}

/// Hands an answer to its caller: the tokens, then the finished choice. A server fault
/// takes the server out and queues the choice again; any other error fails the call.
fn answered(
    pool: &Arc<Pool>,
    a: Answer,
    tokenizer: &Tokenizer,
    version: u64,
    queue: &mut VecDeque<Choice>,
) {
    let Answer {
        choice,
        server,
        result,
    } = a;
    let sampled = match result {
        Ok(s) => s,
        Err(e) if e.server_fault() => {
            pool.mark_dead(server, &e);
            queue.push_front(choice);
            return;
        }
        Err(e) => {
            let _ = choice.tx.send(Event::Failed(format!("vLLM: {e}")));
            return;
        }
    };
    match replay(tokenizer, &choice, sampled) {
        Ok((tokens, completion)) => {
            for t in tokens {
                if choice.tx.send(Event::Token(t)).is_err() {
                    return;
                }
            }
            let _ = choice.tx.send(Event::Done {
                choice: choice.index,
                completion,
                version,
            });
        }
        Err(e) => {
            let url = &pool.servers()[server].url;
            let _ = choice
                .tx
                .send(Event::Failed(format!("vLLM server {url}: {e:#}")));
        }
    }
}

/// The server's ids and log-probs as the local sampler would have given them: each token
/// with the text it completes, up to the first the sampler's stop rule ends the choice at
/// (a server that sampled past it is cut there); no stop found is `length`.
fn replay(
    tokenizer: &Tokenizer,
    choice: &Choice,
    sampled: Sampled,
) -> Result<(Vec<Token>, Completion)> {
    if sampled.token_ids.is_empty() {
        anyhow::bail!("no tokens for a request with room for some");
    }
    let mut dec = IncrementalDecoder::new(tokenizer, false);
    let mut tokens = Vec::with_capacity(sampled.token_ids.len());
    let mut finish = Finish::Length;
    for (k, (&id, &logp)) in sampled.token_ids.iter().zip(&sampled.logprobs).enumerate() {
        let text = dec.push(id)?.unwrap_or_default();
        tokens.push(Token {
            choice: choice.index,
            id,
            logp,
            text,
            top: Vec::new(),
        });
        if let Some(f) = stop_check(k + 1, &dec, id, &choice.params) {
            finish = f;
            break;
        }
    }
    dec.flush()?;
    let completion = Completion::new(
        tokens.iter().map(|t| t.id).collect(),
        tokens.iter().map(|t| t.logp).collect(),
        dec.text().to_string(),
        finish,
    );
    Ok((tokens, completion))
}
