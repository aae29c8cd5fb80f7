//! The sampler seam on vLLM servers: [`Servers`] takes the same requests as the in-process
//! [`Sampler`](crate::sampler::Sampler) and hands the same tokens to the same sinks,
//! so the trajectory engine, the gateway and plugins' `model.generate` sample on servers
//! without a loop of their own.
//!
//! Each choice is one token-in/token-out completion on the run's [`Pool`] (a released
//! choice's continuation goes back to the server that holds its prefix, a new one to the
//! least loaded live server; at most `max_in_flight` each). The ids and log-probs are the
//! server's (checked by the pool, never re-tokenized); they are replayed through the local
//! sampler's own stop rule ([`stop_check`]), so a choice ends where the local sampler would
//! end it, with the same `finish` and text. Its seed is `sample_seed(params.seed, index,
//! choice)`, as the local sampler seeds its generators (vLLM takes a signed 64-bit seed).
//!
//! A server that fails is taken out and its choices go to another; when none is left,
//! [`step`](Sampling::step) fails with the last server's error (and every request in
//! flight fails with it). Tokens reach a sink when
//! the server's answer does (in one burst), and `top_logprobs` and per-request adapters
//! are refused (vLLM names alternatives by text; a version is one adapter name).

use super::vllm::{self, Pool, RequestError, Sampled};
use crate::model::tokenizer::{IncrementalDecoder, Tokenizer};
use crate::sampler::decode::{Completion, Finish, stop_check};
use crate::sampler::{Held, Request, Sampling, Sink, Ticket, Token};
use anyhow::{Result, bail};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use tokio::runtime::Handle;

/// Called when a server's answer arrives, from the thread that waited for it: a caller
/// that blocks on something else (the engine, on its plugins' answers) wakes to step.
pub type Notify = Arc<dyn Fn() + Send + Sync>;

/// One choice waiting for a server.
struct Waiting {
    ticket: Ticket,
    choice: usize,
    request: vllm::TokensRequest,
    /// The server that holds its prefix (a resumed choice), if it is still up.
    server: Option<usize>,
}

/// A server's answer to one choice.
struct Answer {
    waiting: Waiting,
    server: usize,
    result: Result<Sampled, RequestError>,
}

/// A request with choices on their way.
struct Live<'t> {
    ticket: Ticket,
    request: Request,
    sink: Box<dyn Sink + 't>,
    /// Choices not yet finished, released or dropped.
    open: Vec<usize>,
}

/// The seam's side on vLLM servers, for one adapter version.
pub struct Servers<'t> {
    pool: Arc<Pool>,
    /// The model name of the policy's requests (the version's adapter, or the base model)
    /// and of requests with `base`.
    policy: String,
    base: String,
    tokenizer: &'t Tokenizer,
    handle: Handle,
    notify: Option<Notify>,
    answers_tx: Sender<Answer>,
    answers: Receiver<Answer>,
    queue: VecDeque<Waiting>,
    in_flight: usize,
    live: Vec<Live<'t>>,
    /// Finished choices of requests with `hold`, until released: the server that
    /// answered them.
    held: Vec<(Ticket, usize, Option<usize>)>,
    next_ticket: u64,
}

impl<'t> Servers<'t> {
    /// Samples on `pool`'s servers with the model name `policy` (what
    /// [`Pool::acquire`] gave for the version: the caller holds that lease).
    pub fn new(pool: Arc<Pool>, policy: String, tokenizer: &'t Tokenizer, handle: Handle) -> Self {
        let (answers_tx, answers) = channel();
        Servers {
            base: pool.settings.model.clone(),
            pool,
            policy,
            tokenizer,
            handle,
            notify: None,
            answers_tx,
            answers,
            queue: VecDeque::new(),
            in_flight: 0,
            live: Vec::new(),
            held: Vec::new(),
            next_ticket: 0,
        }
    }

    /// Calls `notify` whenever an answer arrives.
    pub fn with_notify(mut self, notify: Notify) -> Self {
        self.notify = Some(notify);
        self
    }

    /// Requests sent to servers and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn ticket(&mut self) -> Ticket {
        self.next_ticket += 1;
        Ticket(self.next_ticket)
    }

    /// Queues choices `first_choice..first_choice + n` of a request, the first pinned to
    /// `server` (a resumed choice).
    fn enqueue(
        &mut self,
        request: Request,
        mut sink: Box<dyn Sink + 't>,
        server: Option<usize>,
    ) -> Ticket {
        let ticket = self.ticket();
        let refused = if request.prompt.is_empty() {
            Some("the prompt is empty".to_string())
        } else if request.n == 0 {
            Some("n must be at least 1".to_string())
        } else if request.top_logprobs > 0 || request.adapter.is_some() {
            Some("vLLM servers serve neither top_logprobs nor a per-request adapter".into())
        } else {
            request.params.validate().err().map(|e| e.to_string())
        };
        if let Some(why) = refused {
            sink.failed(&why);
            return ticket;
        }
        let choices = request.first_choice..request.first_choice + request.n;
        if request.params.max_new_tokens == 0 {
            // Nothing to sample: in process this would prefill the prompt; here the
            // server prefills with the first request that samples.
            for j in choices {
                let empty = Completion::new(Vec::new(), Vec::new(), String::new(), Finish::Length);
                sink.done(j, empty);
                if request.hold {
                    self.held.push((ticket, j, server));
                }
            }
            return ticket;
        }
        let p = &request.params;
        let model = if request.base {
            &self.base
        } else {
            &self.policy
        };
        for j in choices.clone() {
            self.queue.push_back(Waiting {
                ticket,
                choice: j,
                request: vllm::TokensRequest {
                    model: model.clone(),
                    prompt: request.prompt.clone(),
                    max_tokens: p.max_new_tokens,
                    temperature: p.temperature,
                    top_k: p.top_k,
                    top_p: p.top_p,
                    min_p: p.min_p,
                    seed: request.seed(j) & (i64::MAX as u64),
                    stop: p.stop_strings.clone(),
                    stop_token_ids: p.stop_token_ids.clone(),
                },
                server,
            });
        }
        self.live.push(Live {
            ticket,
            request,
            sink,
            open: choices.collect(),
        });
        ticket
    }

    fn live_mut(&mut self, ticket: Ticket) -> Option<&mut Live<'t>> {
        self.live.iter_mut().find(|l| l.ticket == ticket)
    }

    /// Whether a queued or answered choice is still wanted.
    fn wanted(&self, ticket: Ticket, choice: usize) -> bool {
        self.live
            .iter()
            .any(|l| l.ticket == ticket && l.open.contains(&choice))
    }

    /// Sends queued choices to servers with room (a resumed one to its own server while it
    /// is up). With no server left, fails every request and says so.
    fn dispatch(&mut self) -> Result<bool> {
        let mut sent = false;
        let mut k = 0;
        while k < self.queue.len() {
            let w = &self.queue[k];
            if !self.wanted(w.ticket, w.choice) {
                self.queue.remove(k);
                continue;
            }
            let pool = &self.pool;
            let server = match w.server.filter(|&i| pool.servers()[i].alive()) {
                Some(i) => i,
                None => match pool.pick() {
                    Some(i) => i,
                    None => {
                        let why = format!(
                            "every vLLM server has stopped answering (rollout.vllm.servers): nothing more can be sampled; the last, {}",
                            pool.last_fault()
                        );
                        self.queue.clear();
                        for mut l in self.live.drain(..) {
                            l.sink.failed(&why);
                        }
                        bail!(why);
                    }
                },
            };
            if !pool.has_room(server) {
                k += 1;
                continue;
            }
            let waiting = self.queue.remove(k).expect("k is in the queue");
            self.in_flight += 1;
            sent = true;
            let slot = pool.servers()[server].reserve();
            let (answers, notify) = (self.answers_tx.clone(), self.notify.clone());
            self.handle.spawn_blocking(move || {
                let result = slot.complete(&waiting.request);
                // The server has room again before the caller hears of it.
                drop(slot);
                let _ = answers.send(Answer {
                    waiting,
                    server,
                    result,
                });
                if let Some(notify) = notify {
                    notify();
                }
            });
        }
        Ok(sent)
    }

    /// Hands an answer to its sink: the tokens, then the finished choice. A server fault
    /// takes the server out and queues the choice again; any other error fails the
    /// request.
    fn answered(&mut self, a: Answer) {
        let Answer {
            mut waiting,
            server,
            result,
        } = a;
        let (ticket, choice) = (waiting.ticket, waiting.choice);
        if !self.wanted(ticket, choice) {
            return;
        }
        let sampled = match result {
            Ok(s) => s,
            Err(e) if e.server_fault() => {
                self.pool.mark_dead(server, &e);
                waiting.server = None;
                self.queue.push_front(waiting);
                return;
            }
            Err(e) => {
                self.fail(ticket, &format!("vLLM: {e}"));
                return;
            }
        };
        let tokenizer = self.tokenizer;
        let url = self.pool.servers()[server].url.clone();
        let l = self.live_mut(ticket).expect("wanted above");
        match replay(tokenizer, &l.request, choice, sampled) {
            Ok((tokens, completion)) => {
                l.open.retain(|&c| c != choice);
                for t in tokens {
                    if !l.sink.token(t) {
                        // Its caller stopped listening: dropped.
                        return;
                    }
                }
                l.sink.done(choice, completion);
                if l.request.hold {
                    self.held.push((ticket, choice, Some(server)));
                }
            }
            Err(e) => self.fail(ticket, &format!("vLLM server {url}: {e:#}")),
        }
    }

    fn fail(&mut self, ticket: Ticket, why: &str) {
        if let Some(at) = self.live.iter().position(|l| l.ticket == ticket) {
            let mut l = self.live.remove(at);
            l.sink.failed(why);
        }
    }
}

impl<'t> Sampling<'t> for Servers<'t> {
    fn admit(&mut self, request: Request, sink: Box<dyn Sink + 't>) -> Ticket {
        self.enqueue(request, sink, None)
    }

    fn resume(&mut self, held: Held, request: Request, sink: Box<dyn Sink + 't>) -> Ticket {
        let server = match held {
            Held::Server(i) => i,
            Held::Sequence(_) => None,
        };
        self.enqueue(request, sink, server)
    }

    fn release(&mut self, ticket: Ticket, choice: usize) -> Option<Held> {
        if let Some(at) = self
            .held
            .iter()
            .position(|&(t, c, _)| t == ticket && c == choice)
        {
            return Some(Held::Server(self.held.swap_remove(at).2));
        }
        let l = self.live_mut(ticket)?;
        let at = l.open.iter().position(|&c| c == choice)?;
        l.open.remove(at);
        // What its request in flight brings back is not wanted any more; a continuation
        // starts from where the caller stopped, on a server chosen afresh.
        Some(Held::Server(None))
    }

    fn step(&mut self) -> Result<bool> {
        let mut progressed = false;
        while let Ok(a) = self.answers.try_recv() {
            self.in_flight -= 1;
            progressed = true;
            self.answered(a);
        }
        progressed |= self.dispatch()?;
        self.live.retain(|l| !l.open.is_empty());
        Ok(progressed)
    }

    fn pending(&self) -> usize {
        self.live.len()
    }

    fn forwards(&self) -> u64 {
        0
    }

    fn base_s(&self) -> f64 {
        0.0
    }
}

/// The server's ids and log-probs as the local sampler would have given them: each token
/// with the text it completes, up to the first the sampler's stop rule ends the choice at
/// (a server that sampled past it is cut there); no stop found is `length`.
fn replay(
    tokenizer: &Tokenizer,
    request: &Request,
    choice: usize,
    sampled: Sampled,
) -> Result<(Vec<Token>, Completion)> {
    if sampled.token_ids.is_empty() {
        bail!("no tokens for a request with room for some");
    }
    let mut dec = IncrementalDecoder::new(tokenizer, false);
    let mut tokens = Vec::with_capacity(sampled.token_ids.len());
    let mut finish = Finish::Length;
    for (k, (&id, &logp)) in sampled.token_ids.iter().zip(&sampled.logprobs).enumerate() {
        let text = dec.push(id)?.unwrap_or_default();
        tokens.push(Token {
            choice,
            id,
            logp,
            text,
            top: Vec::new(),
        });
        if let Some(f) = stop_check(k + 1, &dec, id, &request.params) {
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
