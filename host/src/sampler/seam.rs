//! The sampler seam: what every caller samples through — the trajectory engine, the
//! gateway, plugins' `model.generate` and [`generate`](super::generate) — and what answers
//! it: the in-process [`Sampler`](super::Sampler) or vLLM servers
//! ([`Servers`](super::servers::Servers)).
//!
//! A caller admits a [`Request`] with a [`Sink`] that takes its [`Token`]s as they are
//! drawn, calls [`Sampling::step`] to make progress, and may release a choice where it is
//! (a trajectory whose tool fires at a stop pattern) and resume it later with ids
//! appended ([`Held`]).

use super::decode::{Completion, Sequence, sample_seed};
use super::draw::SamplingParams;
use crate::model::lora::AdapterSnapshot;
use anyhow::Result;
use std::sync::Arc;

/// What to sample.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    /// Choices, sharing the prompt's prefill.
    pub n: usize,
    pub params: SamplingParams,
    /// The request's place in its caller's numbering: choice `j` is seeded by
    /// `sample_seed(params.seed, index, j)`.
    pub index: usize,
    /// With each token, the log-probs of the `top_logprobs` likeliest (0: none).
    pub top_logprobs: usize,
    /// The adapter this request samples with, in place of the sampler's mode's (`None`:
    /// the mode's). Requests of different adapters decode in the same forwards.
    pub adapter: Option<Arc<AdapterSnapshot>>,
    /// The number of the request's first choice: its choices are `first_choice..
    /// first_choice + n`, in seeds and in what the sink is told (a group whose
    /// trajectories are admitted in parts keeps each trajectory's seed).
    pub first_choice: usize,
    /// Sampled by the base model (adapters off), in a forward of its own.
    pub base: bool,
    /// A finished choice is held for [`Sampling::release`] (a caller that may continue
    /// it) instead of being dropped.
    pub hold: bool,
}

impl Request {
    /// `n` choices of `prompt` with `params`, numbered from 0, by the sampler's weights.
    pub fn new(prompt: Vec<u32>, n: usize, params: SamplingParams) -> Request {
        Request {
            prompt,
            n,
            params,
            index: 0,
            top_logprobs: 0,
            adapter: None,
            first_choice: 0,
            base: false,
            hold: false,
        }
    }

    /// The seed of choice `choice` (numbered from `first_choice`).
    pub fn seed(&self, choice: usize) -> u64 {
        sample_seed(self.params.seed, self.index, choice)
    }
}

/// A request's handle, for [`Sampling::release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket(pub u64);

/// What continues a released choice: in process, its sequence with its KV cache; on
/// servers, the server that holds its prefix in its cache (if one answered it).
pub enum Held {
    Sequence(Box<Sequence>),
    Server(Option<usize>),
}

/// The sampler seam: where tokens come from, in process ([`Sampler`]) or on vLLM servers
/// ([`Servers`](super::servers::Servers)). Requests join whenever they come; [`step`](Self::step)
/// makes progress and hands tokens to the requests' sinks, in order per choice.
pub trait Sampling<'t> {
    /// Takes a request; its tokens go to `sink`. A request that cannot be sampled fails
    /// through its sink at once.
    fn admit(&mut self, request: Request, sink: Box<dyn Sink + 't>) -> Ticket;

    /// Continues a choice [`release`](Self::release) gave back: `request.prompt` is its
    /// ids so far and what was appended since (`n` is 1); `params` bound this part.
    fn resume(&mut self, held: Held, request: Request, sink: Box<dyn Sink + 't>) -> Ticket;

    /// Stops choice `choice` of `ticket` where it is, after the last token its sink took
    /// (or takes back a held finished one), and gives back what continues it; `None` when
    /// it is not known (failed, dropped, or released already).
    fn release(&mut self, ticket: Ticket, choice: usize) -> Option<Held>;

    /// Makes progress: in process one forward and one token for every live choice; on
    /// servers, answers handed over and waiting choices sent. `false` when nothing could
    /// be done (every request is on a server, or waits for room on one). An error means
    /// the sampler cannot go on (no server left); a model failure instead fails the
    /// requests it touched, through their sinks.
    fn step(&mut self) -> Result<bool>;

    /// Requests not yet finished.
    fn pending(&self) -> usize;

    /// Forwards run so far (in process; 0 on servers).
    fn forwards(&self) -> u64;

    /// Seconds spent in the base model's forwards (for requests with `base`).
    fn base_s(&self) -> f64;
}

/// One drawn token of one choice.
#[derive(Debug, Clone, PartialEq)]
pub struct Token {
    pub choice: usize,
    pub id: u32,
    /// Its log-prob under the sampling temperature (see [`super::draw`]).
    pub logp: f32,
    /// The text it completes (empty while a character is still incomplete).
    pub text: String,
    /// The likeliest tokens and their log-probs, most likely first, when asked for.
    pub top: Vec<(u32, f32)>,
}

/// Where a request's tokens go, on the sampler's thread.
pub trait Sink: Send {
    /// A token was drawn. `false`: the caller stopped listening; the choice is dropped.
    fn token(&mut self, token: Token) -> bool;
    /// A choice ended (its text cut after a stop string, as `generate` cuts it).
    fn done(&mut self, choice: usize, completion: Completion);
    /// The model failed on this request (the message names why); nothing more comes.
    fn failed(&mut self, message: &str);
}
