//! `model.generate` (WIT 0.2.0): a plugin asking the run's model, only as granted.
//!
//! The grant (`[plugins.NAME] generate = {...}`) says how many calls a trajectory may make,
//! how long each answer may be, how hot it may be sampled and which weights may answer.
//! A call the grant does not cover is an `err` the plugin sees, counted as `refused`; a
//! covered one goes down the [`ModelLink`] the rollout engine gave the plugin's session
//! for one trajectory, and the engine samples it in its own decode batch (with the other
//! requests, never one forward pass per call), seeded from the trajectory's seed and the
//! call's index in it, and never part of the trained tokens. Where no engine is (`plugin
//! call`, `plugin test`), a granted call is refused with that reason.
//!
//! The plugin module knows nothing of the engine: a link is a function that takes a call.

use super::fork::digest;
use super::tape::{Cue, Tape};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Which weights answer a call.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Answerer {
    /// The adapter being trained, at the version the trajectory samples with.
    Policy,
    /// The base model, adapters off.
    Base,
}

impl Answerer {
    pub fn name(self) -> &'static str {
        match self {
            Answerer::Policy => "policy",
            Answerer::Base => "base",
        }
    }
}

/// The largest `max_prompt_tokens`, `max_new_tokens` and `max_calls_per_trajectory` a grant
/// may give (the schema's bounds, checked when the config is read).
const MAX_PROMPT_TOKENS: u32 = 131_072;
const MAX_NEW_TOKENS: u32 = 8192;
const MAX_CALLS: u32 = 1024;

use crate::model::tokenizer::BYTES_PER_TOKEN;

/// The bytes of text a message gives the chat template: its role, content and function
/// calls (their arguments counted as JSON, without writing them out).
fn text_bytes(m: &crate::task::Message) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let calls: usize = m
        .tool_calls
        .iter()
        .map(|c| {
            let mut n = Count(0);
            let _ = serde_json::to_writer(&mut n, &c.function.arguments);
            c.id.len() + c.function.name.len() + n.0
        })
        .sum();
    m.role.len() + m.content.len() + m.tool_call_id.as_ref().map_or(0, String::len) + calls
}

/// `[plugins.NAME] generate = {...}`: what a plugin may ask of the run's model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct GenerateGrant {
    /// Calls per trajectory (one session's calls, its restarts after faults included).
    #[schemars(range(min = 1, max = 1024))]
    pub max_calls_per_trajectory: u32,
    /// Tokens per answer; a request for more gets this many.
    #[schemars(range(min = 1, max = 8192))]
    pub max_new_tokens: u32,
    /// Prompt tokens per call (after the chat template); a longer prompt is refused.
    #[schemars(range(min = 1, max = 131072))]
    pub max_prompt_tokens: u32,
    /// The hottest sampling a call may ask for (0: greedy only).
    #[schemars(range(min = 0.0, max = 10.0))]
    pub temperature_max: f32,
    /// Which weights may answer: `"base"` (a judge that must not drift with the policy)
    /// and/or `"policy"`.
    pub weights: Vec<Answerer>,
    /// Milliseconds one plugin call may spend waiting for the model on top of its
    /// `timeout_ms` (which then counts the plugin's own time only): the engine answers
    /// between its decode steps, so a busy batch makes a call wait.
    #[schemars(range(min = 0, max = 3_600_000))]
    pub max_wait_ms: u64,
}

impl Default for GenerateGrant {
    fn default() -> Self {
        GenerateGrant {
            max_calls_per_trajectory: 4,
            max_new_tokens: 256,
            max_prompt_tokens: 2048,
            temperature_max: 1.0,
            weights: vec![Answerer::Base],
            max_wait_ms: 60_000,
        }
    }
}

impl GenerateGrant {
    /// What is wrong with the grant, if anything, naming the field.
    pub fn check(&self) -> Result<(), String> {
        if self.max_calls_per_trajectory == 0 {
            return Err("max_calls_per_trajectory must be at least 1 (leave `generate` out to grant nothing)".into());
        }
        if self.max_new_tokens == 0 || self.max_prompt_tokens == 0 {
            return Err("max_new_tokens and max_prompt_tokens must be at least 1".into());
        }
        // The schema's bounds, which serde does not enforce: a grant is read before the
        // model is, and the engine bounds prompts by the model's context as well.
        for (key, value, max) in [
            ("max_new_tokens", self.max_new_tokens, MAX_NEW_TOKENS),
            (
                "max_prompt_tokens",
                self.max_prompt_tokens,
                MAX_PROMPT_TOKENS,
            ),
            (
                "max_calls_per_trajectory",
                self.max_calls_per_trajectory,
                MAX_CALLS,
            ),
        ] {
            if value > max {
                return Err(format!("{key} is {value}, over its bound of {max}"));
            }
        }
        if !(self.temperature_max >= 0.0 && self.temperature_max.is_finite()) {
            return Err(format!(
                "temperature_max must be 0 or more, not {}",
                self.temperature_max
            ));
        }
        if self.weights.is_empty() {
            return Err("weights must name \"base\", \"policy\" or both".into());
        }
        Ok(())
    }
}

/// What a plugin asks for, in the host's terms.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Rendered with the run's chat template and its generation prompt.
    Messages(Vec<super::types::Message>),
    TokenIds(Vec<u32>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    pub max_new_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub stop: Vec<String>,
    pub weights: Answerer,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    pub text: String,
    pub token_ids: Vec<u32>,
    /// `stop` or `length`.
    pub finish_reason: String,
    /// Prompt tokens the model read (for the counts).
    pub prompt_tokens: usize,
}

/// Where a call's answer arrives.
type Answer = tokio::sync::oneshot::Receiver<Result<Generated, String>>;

/// One granted call on its way to the engine.
pub struct GenerateCall {
    /// `name@version` of the plugin asking.
    pub plugin: String,
    /// The request, already within the grant (`max_new_tokens` capped).
    pub request: GenerateRequest,
    pub max_prompt_tokens: usize,
    /// The trajectory's seed and the call's index in it: the engine seeds the call's
    /// sampling from both.
    pub trajectory_seed: u64,
    pub index: u32,
    pub reply: tokio::sync::oneshot::Sender<Result<Generated, String>>,
}

/// Where a session's calls go: the engine sampling the session's trajectory, and the
/// trajectory's seed. Cloned into every instance the session opens; the call count is
/// shared, so a plugin that faults on purpose does not start its count again.
#[derive(Clone)]
pub struct ModelLink {
    send: Arc<dyn Fn(GenerateCall) -> Result<(), String> + Send + Sync>,
    seed: u64,
    calls: Arc<AtomicU32>,
    /// Where the calls' outcomes are tallied for the batch the trajectory belongs to.
    tally: Option<Arc<CallTally>>,
    /// The answering model's context in tokens: no prompt longer is rendered, whatever
    /// the grant's `max_prompt_tokens`.
    context: u32,
}

/// One batch's calls: their outcomes by plugin name (`name/answered|refused|failed` →
/// count) and how long each plugin's calls waited for their answers, so that a training
/// step's record counts its own batch's calls exactly, whatever the other batches sampled
/// and scored meanwhile.
#[derive(Debug, Default)]
pub struct CallTally(Mutex<(BTreeMap<String, u64>, BTreeMap<String, Duration>)>);

/// `name@version` → `name`, as the run's other per-plugin figures.
fn plugin_name(plugin: &str) -> &str {
    plugin.split('@').next().unwrap_or(plugin)
}

impl CallTally {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, (BTreeMap<String, u64>, BTreeMap<String, Duration>)> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn add(&self, plugin: &str, outcome: &str) {
        let key = format!("{}/{outcome}", plugin_name(plugin));
        *self.lock().0.entry(key).or_default() += 1;
    }

    fn waited(&self, plugin: &str, took: Duration) {
        *self
            .lock()
            .1
            .entry(plugin_name(plugin).to_string())
            .or_default() += took;
    }

    /// The outcomes, `name/outcome` → count.
    pub fn snapshot(&self) -> BTreeMap<String, u64> {
        self.lock().0.clone()
    }

    /// Seconds each plugin's calls waited for their answers, summed.
    pub fn wait_s(&self) -> BTreeMap<String, f64> {
        self.lock()
            .1
            .iter()
            .map(|(k, d)| (k.clone(), d.as_secs_f64()))
            .collect()
    }
}

impl ModelLink {
    /// A link that hands each call to `send` (an error: the engine is gone).
    pub fn new(
        seed: u64,
        send: impl Fn(GenerateCall) -> Result<(), String> + Send + Sync + 'static,
    ) -> ModelLink {
        ModelLink {
            send: Arc::new(send),
            seed,
            calls: Arc::new(AtomicU32::new(0)),
            tally: None,
            context: u32::MAX,
        }
    }

    /// The same link, its prompts bounded by a model context of `context` tokens.
    pub fn within(mut self, context: usize) -> ModelLink {
        self.context = u32::try_from(context).unwrap_or(u32::MAX);
        self
    }

    /// The calls made on this link so far (refused ones too: each takes an index).
    pub fn calls_made(&self) -> u32 {
        self.calls.load(Ordering::Relaxed)
    }

    /// The same link, its next call numbered `made` (a branch's link goes on from its
    /// parent's calls, which count against the same grant).
    pub fn continuing(self, made: u32) -> ModelLink {
        self.calls.store(made, Ordering::Relaxed);
        self
    }

    /// The same link, its calls' outcomes also tallied in `tally`.
    pub fn tallied(mut self, tally: Arc<CallTally>) -> ModelLink {
        self.tally = Some(tally);
        self
    }
}

/// Makes the link of an instance opened with a seed, for a plugin run with no rollout
/// around it (`plugin test`, `plugin call`): see [`crate::plugin::Plugin::serve_model`].
pub type ModelServer = Arc<dyn Fn(u64) -> ModelLink + Send + Sync>;

/// What one plugin's calls came to (its instances together).
#[derive(Debug, Default)]
pub struct GenerateCounts {
    pub answered: AtomicU64,
    pub refused: AtomicU64,
    /// Calls the engine took and could not answer (a prompt too long for the model...).
    pub failed: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    /// Time from a call's arrival to its answer, summed, in microseconds.
    pub busy_us: AtomicU64,
    /// Why calls were refused, by reason (`weights`, `calls`, `prompt`, ...).
    pub reasons: Mutex<BTreeMap<String, u64>>,
}

/// A snapshot of [`GenerateCounts`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerateTotals {
    pub answered: u64,
    pub refused: u64,
    pub failed: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub seconds: f64,
}

impl GenerateTotals {
    pub fn calls(&self) -> u64 {
        self.answered + self.refused + self.failed
    }
}

impl GenerateCounts {
    pub fn totals(&self) -> GenerateTotals {
        GenerateTotals {
            answered: self.answered.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            prompt_tokens: self.prompt_tokens.load(Ordering::Relaxed),
            completion_tokens: self.completion_tokens.load(Ordering::Relaxed),
            seconds: self.busy_us.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }

    fn refuse(&self, reason: &str) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        *self
            .reasons
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(reason.to_string())
            .or_default() += 1;
    }
}

/// The time one guest call has spent waiting for the model: its deadlines (the epoch's
/// for wasm time, the outer one for wall time) are moved on by it, up to the grant's
/// `max_wait_ms`, so that a plugin's own time budget is not spent by a busy engine.
#[derive(Debug, Default)]
pub struct WaitClock {
    waited: Duration,
    since: Option<Instant>,
    /// What the epoch deadline has been moved on by in this call.
    credited: Duration,
}

impl WaitClock {
    /// A guest call begins: nothing waited yet.
    pub fn begin_call(&mut self) {
        *self = WaitClock::default();
    }

    fn start(&mut self) {
        self.since = Some(Instant::now());
    }

    fn stop(&mut self) {
        if let Some(t) = self.since.take() {
            self.waited += t.elapsed();
        }
    }

    /// Waited in this call so far, a wait in progress included.
    pub fn waited(&self) -> Duration {
        self.waited + self.since.map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// The wait (at most `cap` in all) not yet given back to the epoch deadline.
    pub fn credit(&mut self, cap: Duration) -> Duration {
        let w = self.waited().min(cap);
        let extra = w.saturating_sub(self.credited);
        self.credited = self.credited.max(w);
        extra
    }
}

/// The model side of one plugin instance's store: its grant, its session's link, the
/// plugin's counts, and the clock of its waits.
#[derive(Clone, Default)]
pub struct ModelAccess {
    pub grant: Option<GenerateGrant>,
    pub link: Option<ModelLink>,
    pub counts: Arc<GenerateCounts>,
    pub clock: Arc<Mutex<WaitClock>>,
    /// The instance's record of outside answers: each call's answer goes on it, and a
    /// fork's replay is answered from it.
    pub tape: Arc<Tape>,
}

impl ModelAccess {
    /// How long one guest call may wait for the model beyond its own deadline.
    pub fn max_wait(&self) -> Duration {
        self.grant
            .as_ref()
            .map_or(Duration::ZERO, |g| Duration::from_millis(g.max_wait_ms))
    }

    pub fn clock(&self) -> std::sync::MutexGuard<'_, WaitClock> {
        self.clock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Checks `request` against the grant and the link: the call to send, or the error
    /// the plugin gets (and the reason it is counted under).
    fn admit(
        &self,
        plugin: &str,
        mut request: GenerateRequest,
    ) -> Result<(GenerateCall, Answer), (&'static str, String)> {
        let Some(grant) = &self.grant else {
            return Err((
                "not_granted",
                "generate is not granted to this plugin (the run config's `[plugins.NAME] generate = {...}` grants it)".into(),
            ));
        };
        let Some(link) = &self.link else {
            return Err((
                "no_model",
                "no model answers here: generate is answered in rollouts (rlhost train, rollout, eval), and by `plugin call` and `plugin test` given --generate and --model".into(),
            ));
        };
        // Every call counts, whatever comes of it: a plugin cannot make more calls than
        // its grant, not even refused ones.
        let index = link.calls.fetch_add(1, Ordering::Relaxed);
        if index >= grant.max_calls_per_trajectory {
            return Err((
                "calls",
                format!(
                    "call {} of this trajectory is over the grant's {} (generate.max_calls_per_trajectory)",
                    index + 1,
                    grant.max_calls_per_trajectory
                ),
            ));
        }
        if !grant.weights.contains(&request.weights) {
            let granted: Vec<&str> = grant.weights.iter().map(|w| w.name()).collect();
            return Err((
                "weights",
                format!(
                    "the {} weights are not granted (generate.weights = {granted:?})",
                    request.weights.name()
                ),
            ));
        }
        if !(request.temperature >= 0.0 && request.temperature <= grant.temperature_max) {
            return Err((
                "temperature",
                format!(
                    "temperature {} is over the grant's {} (generate.temperature_max)",
                    request.temperature, grant.temperature_max
                ),
            ));
        }
        if !(request.top_p > 0.0 && request.top_p <= 1.0) {
            return Err((
                "bad_request",
                format!("top_p must be in (0, 1], not {}", request.top_p),
            ));
        }
        if request.max_new_tokens == 0 {
            return Err(("bad_request", "max_new_tokens must be at least 1".into()));
        }
        // A prompt far over the grant, or over the model's context, is refused by its
        // length before anything renders or tokenizes it.
        let max_prompt_tokens = grant.max_prompt_tokens.min(link.context) as usize;
        let too_long = match &request.prompt {
            Prompt::TokenIds(ids) => ids.len() > max_prompt_tokens,
            Prompt::Messages(m) => {
                m.iter().map(text_bytes).sum::<usize>() > BYTES_PER_TOKEN * max_prompt_tokens
            }
        };
        if too_long {
            return Err((
                "prompt",
                if max_prompt_tokens < grant.max_prompt_tokens as usize {
                    format!("the prompt is over the model's context of {max_prompt_tokens} tokens")
                } else {
                    format!(
                        "the prompt is over the grant's {max_prompt_tokens} tokens (generate.max_prompt_tokens)"
                    )
                },
            ));
        }
        if request.stop.len() > 16 || request.stop.iter().any(|s| s.is_empty() || s.len() > 256) {
            return Err((
                "bad_request",
                "stop takes at most 16 texts of 1 to 256 bytes".into(),
            ));
        }
        request.max_new_tokens = request.max_new_tokens.min(grant.max_new_tokens);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let call = GenerateCall {
            plugin: plugin.to_string(),
            request,
            max_prompt_tokens,
            trajectory_seed: link.seed,
            index,
            reply: tx,
        };
        Ok((call, rx))
    }

    /// One `model.generate` call of plugin `plugin`: refused, or sent and awaited, and
    /// its answer recorded on the instance's tape; in a fork's replay, the answer the
    /// original got (not counted again: the call was made once).
    pub async fn generate(
        &self,
        plugin: &str,
        request: GenerateRequest,
    ) -> Result<Generated, String> {
        let asked = digest(&request);
        match self.tape.generate(asked) {
            Cue::Replay(answer) => return answer,
            Cue::Diverged(why) => return Err(why),
            Cue::Live(()) => {}
        }
        let answer = self.ask(plugin, request).await;
        self.tape.record_generate(asked, &answer);
        answer
    }

    /// [`Self::generate`] of the model itself.
    async fn ask(&self, plugin: &str, request: GenerateRequest) -> Result<Generated, String> {
        let tally = |outcome: &str| {
            if let Some(t) = self.link.as_ref().and_then(|l| l.tally.as_ref()) {
                t.add(plugin, outcome);
            }
        };
        let (call, rx) = match self.admit(plugin, request) {
            Ok(admitted) => admitted,
            Err((reason, message)) => {
                self.counts.refuse(reason);
                tally("refused");
                return Err(message);
            }
        };
        let t0 = Instant::now();
        let link = self.link.as_ref().expect("admitted calls have a link");
        if let Err(e) = (link.send)(call) {
            self.counts.failed.fetch_add(1, Ordering::Relaxed);
            tally("failed");
            return Err(message_alone(&e));
        }
        self.clock().start();
        let answer = rx
            .await
            .unwrap_or_else(|_| Err("the rollout this call belonged to has ended".into()));
        self.clock().stop();
        let took = t0.elapsed().min(Duration::from_secs(86_400));
        if let Some(t) = self.link.as_ref().and_then(|l| l.tally.as_ref()) {
            t.waited(plugin, took);
        }
        self.counts
            .busy_us
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
        match &answer {
            Ok(c) => {
                self.counts.answered.fetch_add(1, Ordering::Relaxed);
                tally("answered");
                self.counts
                    .prompt_tokens
                    .fetch_add(c.prompt_tokens as u64, Ordering::Relaxed);
                self.counts
                    .completion_tokens
                    .fetch_add(c.token_ids.len() as u64, Ordering::Relaxed);
            }
            Err(_) => {
                self.counts.failed.fetch_add(1, Ordering::Relaxed);
                tally("failed");
            }
        }
        answer.map_err(|e| message_alone(&e))
    }
}

/// What of a host error's text crosses into the sandbox: the message, never a stack
/// backtrace. candle's errors carry one in their text when `RUST_BACKTRACE` is set in the
/// host's environment, and its frames name the host's files and functions.
pub fn message_alone(text: &str) -> String {
    let frame = |line: &str| {
        let t = line.trim_start();
        let indented = t.len() < line.len();
        let numbered = t
            .split_once(": ")
            .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        (indented && (numbered || t.starts_with("at ")))
            || t == "Stack backtrace:"
            || t.starts_with("note: Some details are omitted")
    };
    let kept: Vec<&str> = text.lines().filter(|l| !frame(l)).collect();
    kept.join("\n").trim_end().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(weights: Answerer, temperature: f32, max_new_tokens: u32) -> GenerateRequest {
        GenerateRequest {
            prompt: Prompt::TokenIds(vec![1, 2, 3]),
            max_new_tokens,
            temperature,
            top_p: 1.0,
            stop: Vec::new(),
            weights,
        }
    }

    /// A link whose engine answers every call with its seed and capped length.
    fn echo_link(seed: u64) -> ModelLink {
        ModelLink::new(seed, |call: GenerateCall| {
            let _ = call.reply.send(Ok(Generated {
                text: format!(
                    "{} {} {}",
                    call.trajectory_seed, call.index, call.request.max_new_tokens
                ),
                token_ids: vec![7; call.request.max_new_tokens as usize],
                finish_reason: "length".into(),
                prompt_tokens: 3,
            }));
            Ok(())
        })
    }

    fn access(grant: Option<GenerateGrant>, link: Option<ModelLink>) -> ModelAccess {
        ModelAccess {
            grant,
            link,
            ..ModelAccess::default()
        }
    }

    fn run<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn calls_outside_the_grant_are_refused_and_counted_by_reason() {
        let grant = GenerateGrant {
            max_calls_per_trajectory: 4,
            max_new_tokens: 8,
            temperature_max: 0.5,
            ..GenerateGrant::default()
        };
        let m = access(Some(grant.clone()), Some(echo_link(1)));
        run(async {
            let e = m
                .generate("p@1", request(Answerer::Policy, 0.0, 4))
                .await
                .unwrap_err();
            assert!(e.contains("policy weights are not granted"), "{e}");
            let e = m
                .generate("p@1", request(Answerer::Base, 0.9, 4))
                .await
                .unwrap_err();
            assert!(e.contains("over the grant's 0.5"), "{e}");
            // Within: the length is capped at the grant's.
            let ok = m
                .generate("p@1", request(Answerer::Base, 0.0, 100))
                .await
                .unwrap();
            assert_eq!(ok.token_ids.len(), 8);
            m.generate("p@1", request(Answerer::Base, 0.5, 4))
                .await
                .unwrap();
            let e = m
                .generate("p@1", request(Answerer::Base, 0.0, 4))
                .await
                .unwrap_err();
            // The two refused calls counted towards the four too.
            assert!(
                e.contains("call 5 of this trajectory is over the grant's 4"),
                "{e}"
            );
        });
        let t = m.counts.totals();
        assert_eq!((t.answered, t.refused, t.failed), (2, 3, 0));
        assert_eq!(t.completion_tokens, 12);
        let reasons = m.counts.reasons.lock().unwrap().clone();
        assert_eq!(
            reasons,
            BTreeMap::from([
                ("calls".to_string(), 1),
                ("temperature".to_string(), 1),
                ("weights".to_string(), 1)
            ])
        );
        // No grant, and a grant with no engine.
        run(async {
            let e = access(None, Some(echo_link(1)))
                .generate("p@1", request(Answerer::Base, 0.0, 4))
                .await
                .unwrap_err();
            assert!(e.contains("not granted"), "{e}");
            let e = access(Some(grant), None)
                .generate("p@1", request(Answerer::Base, 0.0, 4))
                .await
                .unwrap_err();
            assert!(e.contains("no model answers here"), "{e}");
        });
    }

    /// Issue 51: a grant of 100,000,000 prompt tokens made the host render and tokenize a
    /// 64 MiB prompt (33–50 s, 9.9 GB) before refusing it. Such a grant is refused when the
    /// config is read, and within any grant a prompt is bounded by the model's context,
    /// refused by its byte length before it is rendered (the link's engine never sees it).
    #[test]
    fn a_prompt_is_bounded_by_the_models_context_before_it_renders() {
        let huge = GenerateGrant {
            max_prompt_tokens: 100_000_000,
            ..GenerateGrant::default()
        };
        let e = huge.check().unwrap_err();
        assert!(
            e.contains("max_prompt_tokens is 100000000, over its bound of 131072"),
            "{e}"
        );
        let grant = GenerateGrant {
            max_prompt_tokens: 131_072,
            ..GenerateGrant::default()
        };
        assert!(grant.check().is_ok());
        let sent = Arc::new(AtomicU32::new(0));
        let seen = sent.clone();
        let link = ModelLink::new(1, move |_call: GenerateCall| {
            seen.fetch_add(1, Ordering::Relaxed);
            Err("not answered in this test".into())
        })
        .within(1024);
        let m = access(Some(grant), Some(link));
        let messages = |bytes: usize| GenerateRequest {
            prompt: Prompt::Messages(vec![crate::task::Message::new("user", "x".repeat(bytes))]),
            ..request(Answerer::Base, 0.0, 4)
        };
        run(async {
            let e = m.generate("p@1", messages(1 << 20)).await.unwrap_err();
            assert!(e.contains("over the model's context of 1024 tokens"), "{e}");
            let e = m
                .generate(
                    "p@1",
                    GenerateRequest {
                        prompt: Prompt::TokenIds(vec![1; 1025]),
                        ..request(Answerer::Base, 0.0, 4)
                    },
                )
                .await
                .unwrap_err();
            assert!(e.contains("over the model's context of 1024 tokens"), "{e}");
            // Within the context it goes to the engine.
            m.generate("p@1", messages(1000)).await.unwrap_err();
        });
        assert_eq!(sent.load(Ordering::Relaxed), 1);
        assert_eq!(m.counts.reasons.lock().unwrap()["prompt"], 2);
    }

    /// Issue 51: with RUST_BACKTRACE=1 in the host's environment, a failed call's error
    /// carried the host's stack backtrace (candle writes it into its errors' text) into
    /// the sandbox. The plugin gets the message alone.
    #[test]
    fn a_host_backtrace_never_reaches_the_plugin() {
        let failed = candle_core::Error::WithBacktrace {
            inner: Box::new(candle_core::Error::Msg(
                "index-select invalid index 9".into(),
            )),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        };
        let text = format!(
            "the model failed: {:#}",
            anyhow::Error::new(failed).context("decoding")
        );
        assert!(text.lines().count() > 1, "a backtrace to strip: {text}");
        let link = ModelLink::new(1, move |call: GenerateCall| {
            let _ = call.reply.send(Err(text.clone()));
            Ok(())
        });
        let m = access(Some(GenerateGrant::default()), Some(link));
        let e = run(m.generate("p@1", request(Answerer::Base, 0.0, 4))).unwrap_err();
        assert_eq!(
            e,
            "the model failed: decoding: index-select invalid index 9"
        );
    }

    #[test]
    fn each_call_is_seeded_from_the_trajectory_and_its_index() {
        let seeds = |traj: u64| {
            let m = access(Some(GenerateGrant::default()), Some(echo_link(traj)));
            run(async {
                let mut out = Vec::new();
                for _ in 0..3 {
                    out.push(
                        m.generate("p@1", request(Answerer::Base, 0.0, 1))
                            .await
                            .unwrap()
                            .text,
                    );
                }
                out
            })
        };
        let a = seeds(5);
        assert_eq!(a, seeds(5), "same trajectory, same seeds");
        assert_ne!(a[0], a[1], "each call its own seed");
        assert_ne!(a, seeds(6), "another trajectory, other seeds");
    }

    #[test]
    fn a_grant_names_what_is_wrong() {
        let bad = |g: GenerateGrant| g.check().unwrap_err();
        assert!(
            bad(GenerateGrant {
                weights: vec![],
                ..Default::default()
            })
            .contains("weights")
        );
        assert!(
            bad(GenerateGrant {
                max_calls_per_trajectory: 0,
                ..Default::default()
            })
            .contains("max_calls_per_trajectory")
        );
        assert!(
            bad(GenerateGrant {
                temperature_max: f32::NAN,
                ..Default::default()
            })
            .contains("temperature_max")
        );
        GenerateGrant::default().check().unwrap();
    }

    #[test]
    fn a_wait_is_credited_once_and_only_up_to_the_cap() {
        let mut c = WaitClock {
            waited: Duration::from_millis(300),
            ..WaitClock::default()
        };
        assert_eq!(c.credit(Duration::from_secs(1)), Duration::from_millis(300));
        assert_eq!(c.credit(Duration::from_secs(1)), Duration::ZERO, "once");
        c.waited = Duration::from_millis(1500);
        assert_eq!(
            c.credit(Duration::from_secs(1)),
            Duration::from_millis(700),
            "the cap"
        );
        assert_eq!(c.credit(Duration::from_secs(1)), Duration::ZERO);
        c.begin_call();
        assert_eq!(c.waited(), Duration::ZERO);
    }
}
