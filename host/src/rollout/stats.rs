//! Where a batch's time and tokens went ([`BatchStats`]): what `train` logs a step and
//! the status endpoint shows.

/// Where a batch's time went.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct BatchStats {
    pub wall_s: f64,
    pub prefill_s: f64,
    /// Time in packed forwards after the prefill.
    pub decode_s: f64,
    /// Time the decoder sat idle because every live trajectory waited on a plugin.
    pub plugin_wait_s: f64,
    /// Sum of the durations of all plugin calls (they overlap decoding and each other).
    pub plugin_busy_s: f64,
    /// The part of it spent in tool and environment calls (trigger firings, function
    /// calls, environment steps: not scoring), an OpenEnv server's included.
    pub tool_busy_s: f64,
    pub prompt_tokens: usize,
    pub sampled_tokens: usize,
    pub inserted_tokens: usize,
    pub forwards: usize,
    pub trajectories: usize,
    /// With vLLM servers: completion requests, and the time the loop sat idle waiting
    /// for their answers (plugin calls overlapping them are not counted there).
    pub requests: usize,
    pub server_wait_s: f64,
    /// With vLLM servers: requests sent again after a fault the server may get over (a
    /// 5xx, a reset connection, a malformed answer).
    pub retries: usize,
    /// With vLLM servers: writing the batch's adapter version and loading it on every
    /// server (0 when it was loaded already).
    pub adapter_load_s: f64,
    /// Plugins' `model.generate` calls this batch took (within their grants; some may
    /// still fail, e.g. a prompt longer than the model's context), and the tokens sampled
    /// for them (never part of a trajectory).
    pub asks: usize,
    pub asked_tokens: usize,
    /// Decoding time spent on them alone (local engine): the base model's forwards, and
    /// every step in which only asks decoded. Policy asks that share a forward with the
    /// trajectories add to it only a few rows, not counted here.
    pub ask_s: f64,
    /// Plugins' `model.generate` calls of this batch's trajectories (their sessions and
    /// their scoring) by outcome, `plugin/answered|refused|failed`.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub generate_calls: std::collections::BTreeMap<String, u64>,
    /// Seconds each plugin's calls waited for their answers, summed (they overlap).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub generate_wait_s: std::collections::BTreeMap<String, f64>,
    /// Tree rollouts: branch points taken, sessions forked for the branches (and those
    /// whose fork failed), and the seconds the forks took (on the worker pool, while the
    /// rest of the batch decodes; the trajectory that branches waits for them: a plugin
    /// session's fork is deferred, so this is mostly a server episode's replay).
    pub branch_points: usize,
    /// With the entropy rule: branch points measured (whether or not they branched).
    pub branch_probes: usize,
    pub forks: usize,
    pub fork_failures: usize,
    pub fork_s: f64,
    /// Deferred forks' replays, made at a branch's first call to a forked session (a
    /// branch that never calls it again makes none), and their seconds, inside those
    /// calls (so inside `tool_busy_s` too).
    pub replays: usize,
    pub replay_s: f64,
}

impl BatchStats {
    /// Adds another batch's figures (for totals over several batches).
    pub fn add(&mut self, s: &BatchStats) {
        self.wall_s += s.wall_s;
        self.prefill_s += s.prefill_s;
        self.decode_s += s.decode_s;
        self.plugin_wait_s += s.plugin_wait_s;
        self.plugin_busy_s += s.plugin_busy_s;
        self.tool_busy_s += s.tool_busy_s;
        self.prompt_tokens += s.prompt_tokens;
        self.sampled_tokens += s.sampled_tokens;
        self.inserted_tokens += s.inserted_tokens;
        self.forwards += s.forwards;
        self.trajectories += s.trajectories;
        self.requests += s.requests;
        self.retries += s.retries;
        self.server_wait_s += s.server_wait_s;
        self.adapter_load_s += s.adapter_load_s;
        self.asks += s.asks;
        self.asked_tokens += s.asked_tokens;
        self.ask_s += s.ask_s;
        self.branch_points += s.branch_points;
        self.branch_probes += s.branch_probes;
        self.forks += s.forks;
        self.fork_failures += s.fork_failures;
        self.fork_s += s.fork_s;
        self.replays += s.replays;
        self.replay_s += s.replay_s;
        for (k, n) in &s.generate_calls {
            *self.generate_calls.entry(k.clone()).or_default() += n;
        }
        for (k, w) in &s.generate_wait_s {
            *self.generate_wait_s.entry(k.clone()).or_default() += w;
        }
    }
}
