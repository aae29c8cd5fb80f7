//! `rlhost plugin test`: does a component keep the contract, role by role?
//!
//! The checks a plugin author needs before a training run meets the plugin: `about` is well
//! formed; opening with `{}` works or is a guest error and a malformed config is a guest
//! error (never a trap or a silent default); datasets give the same samples for a seed, and
//! their samples are well formed; rewards return finite, named, distinct components, the
//! same ones for the same trajectory; triggers stay silent on text that does not end with
//! one of their stop patterns and return bounded output on text that does; environments
//! answer with `tool` or `user` messages; and no call faults over a few hundred seeded
//! random inputs. Each call is timed.
//!
//! The inputs are drawn from a fixed seed, so a report repeats exactly for the same file.
//!
//! A plugin that hangs must not hang its test: a check stops after [`STREAK`] faults of one
//! kind in a row, or [`TIMEOUT_STREAK`] timeouts (its row says so), the samples are taken
//! from the plugin's dataset only until its first timeout, and after [`MAX_TIMEOUTS`]
//! timed-out calls in all the checks still to run are skipped: at the default 5 s
//! deadline a plugin that hangs in every call is done in about 40 s. A check left with nothing to compare (every call faulted) is
//! `skip` with the reason, never `pass`.

use crate::plugin::{Fault, FaultKind, Plugin, Role, Sample, Trajectory};
use crate::rng::SplitMix64;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// What to test with.
#[derive(Debug, Clone)]
pub struct Options {
    /// The plugin's configuration for the checks that need an opened role (JSON).
    pub config: String,
    /// Samples to open triggers and environments with and to build reward trajectories
    /// from. Empty: the plugin's own dataset's samples if it exports one, else a prompt.
    pub samples: Vec<Sample>,
    /// How many random inputs each role gets.
    pub inputs: usize,
    /// Seed of the random inputs and of the plugin's randomness.
    pub seed: u64,
    /// Print each check to stderr as it completes.
    pub progress: bool,
}

/// Faults of one kind in a row after which a check stops calling.
pub const STREAK: usize = 3;
/// Timeouts in a row after which a check stops calling (each one waited the deadline).
pub const TIMEOUT_STREAK: usize = 2;
/// Timed-out calls after which the remaining checks are skipped.
pub const MAX_TIMEOUTS: usize = 8;

impl Default for Options {
    fn default() -> Self {
        Options {
            config: "{}".into(),
            samples: Vec::new(),
            inputs: 200,
            seed: 0,
            progress: false,
        }
    }
}

/// How one check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Pass,
    /// Not against the contract, but likely a mistake (e.g. an unknown config field
    /// accepted in silence).
    Warn,
    Fail,
    /// Could not run, or had nothing to compare: an earlier check it depends on failed,
    /// the runner stopped calling a plugin that kept timing out, or every call faulted.
    Skip,
}

/// One row of the report.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// The role checked, or `None` for the plugin as a whole.
    pub role: Option<Role>,
    pub name: String,
    pub outcome: Outcome,
    pub detail: String,
}

/// The time calls of one kind took.
#[derive(Debug, Clone, Serialize)]
pub struct Timing {
    /// The call, e.g. `trigger.fire`.
    pub call: String,
    pub calls: usize,
    pub median_ms: f64,
    pub max_ms: f64,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub plugin: String,
    pub checks: Vec<Check>,
    pub timings: Vec<Timing>,
}

impl Report {
    pub fn count(&self, outcome: Outcome) -> usize {
        self.checks.iter().filter(|c| c.outcome == outcome).count()
    }

    /// No check failed and every check ran.
    pub fn passed(&self) -> bool {
        self.count(Outcome::Fail) == 0 && self.count(Outcome::Skip) == 0
    }
}

/// Runs every check that applies to `plugin`'s roles.
pub async fn run(plugin: &Plugin, options: &Options) -> Report {
    let mut t = Tester {
        plugin,
        options,
        rng: SplitMix(SplitMix64::from_state(options.seed ^ 0x5eed_c0de)),
        checks: Vec::new(),
        times: BTreeMap::new(),
        timeouts: 0,
    };
    t.about();
    let samples = t.samples().await;
    for role in plugin.roles().to_vec() {
        if t.out_of_time(Some(role)) || !t.opens(role, &samples).await {
            continue;
        }
        if t.out_of_time(Some(role)) {
            continue;
        }
        match role {
            Role::Dataset => t.dataset().await,
            Role::Reward => t.reward(&samples).await,
            Role::Trigger => t.trigger(&samples).await,
            Role::Environment => t.environment(&samples).await,
            Role::Tools => t.tools(&samples).await,
        }
    }
    let timings = t
        .times
        .into_iter()
        .map(|(call, mut times)| {
            times.sort();
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            Timing {
                call: call.to_string(),
                calls: times.len(),
                median_ms: ms(times[times.len() / 2]),
                max_ms: ms(*times.last().expect("timed at least once")),
            }
        })
        .collect();
    Report {
        plugin: plugin.id().to_string(),
        checks: t.checks,
        timings,
    }
}

struct Tester<'a> {
    plugin: &'a Plugin,
    options: &'a Options,
    rng: SplitMix,
    checks: Vec<Check>,
    times: BTreeMap<&'static str, Vec<Duration>>,
    /// Calls that timed out so far, in every check.
    timeouts: usize,
}

/// Faults of one kind in a row, within one check.
#[derive(Default)]
struct Streak {
    kind: Option<FaultKind>,
    count: usize,
}

impl Streak {
    /// Records a call's outcome (`None`: it did not fault); true once [`STREAK`] faults
    /// of one kind (other than guest errors) came in a row.
    fn push(&mut self, fault: Option<&Fault>) -> bool {
        match fault {
            // A guest error is the plugin answering: it neither hangs nor dies.
            None => *self = Streak::default(),
            Some(f) if f.kind == FaultKind::GuestError => *self = Streak::default(),
            Some(f) if self.kind == Some(f.kind) => self.count += 1,
            Some(f) => {
                self.kind = Some(f.kind);
                self.count = 1;
            }
        }
        self.count >= self.limit()
    }

    /// How many of this streak's kind in a row stop a check.
    fn limit(&self) -> usize {
        match self.kind {
            Some(FaultKind::Timeout) => TIMEOUT_STREAK,
            _ => STREAK,
        }
    }

    /// Whether the streak has stopped its check.
    fn stopped_now(&self) -> bool {
        self.kind.is_some() && self.count >= self.limit()
    }

    /// What a check's row says when the streak stopped it after `made` of `planned` calls.
    fn stopped(&self, made: usize, planned: usize) -> String {
        match self.kind {
            Some(kind) if self.stopped_now() => format!(
                "; stopped after {} {kind} faults in a row ({made} of {planned} calls made)",
                self.count
            ),
            _ => String::new(),
        }
    }
}

/// A JSON text that does not parse.
const MALFORMED: &str = r#"{"config": "#;
/// A config no plugin knows.
const UNKNOWN_FIELD: &str = r#"{"surely_not_a_field": 1}"#;

impl Tester<'_> {
    fn check(&mut self, role: Option<Role>, name: &str, outcome: Outcome, detail: String) {
        if self.options.progress {
            let outcome = format!("{outcome:?}").to_lowercase();
            let role = role.map_or("-".to_string(), |r| r.to_string());
            eprintln!("  {role:<11} {name}: {outcome}  {detail}");
        }
        self.checks.push(Check {
            role,
            name: name.to_string(),
            outcome,
            detail,
        });
    }

    /// Runs `call`, timing it under `name`.
    async fn timed<T>(&mut self, name: &'static str, call: impl AsyncFnOnce() -> T) -> T {
        let started = Instant::now();
        let out = call().await;
        self.times.entry(name).or_default().push(started.elapsed());
        out
    }

    /// Counts a call's fault towards [`MAX_TIMEOUTS`]; passes it on.
    fn saw<'f>(&mut self, fault: Option<&'f Fault>) -> Option<&'f Fault> {
        if fault.is_some_and(|f| f.kind == FaultKind::Timeout) {
            self.timeouts += 1;
        }
        fault
    }

    /// True once [`MAX_TIMEOUTS`] calls timed out; the first time, the checks of `role`
    /// (or of the plugin) left to run are reported skipped, with why.
    fn out_of_time(&mut self, role: Option<Role>) -> bool {
        if self.timeouts < MAX_TIMEOUTS {
            return false;
        }
        let said = self
            .checks
            .iter()
            .any(|c| c.role == role && c.name == "the remaining checks");
        if !said {
            let detail = format!(
                "not run: {} calls timed out (the limit is {MAX_TIMEOUTS}, each call waits for the plugin's deadline); fix what hangs, then test again",
                self.timeouts
            );
            self.check(role, "the remaining checks", Outcome::Skip, detail);
        }
        true
    }

    fn about(&mut self) {
        let info = self.plugin.info().clone();
        let name_ok = !info.name.is_empty()
            && info.name.len() <= 64
            && info
                .name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-');
        let version_ok = info.version.split('.').count() >= 2
            && info
                .version
                .split(['.', '-', '+'])
                .next()
                .is_some_and(|major| major.parse::<u64>().is_ok());
        let one_line = !info.description.contains('\n') && info.description.len() <= 200;
        let problems: Vec<String> = [
            (!name_ok).then(|| {
                format!(
                    "name {:?} is not 1-64 lowercase letters, digits, `_` or `-`",
                    info.name
                )
            }),
            (!version_ok).then(|| format!("version {:?} is not MAJOR.MINOR[.PATCH]", info.version)),
            (!one_line).then(|| "description is not one line of at most 200 bytes".to_string()),
        ]
        .into_iter()
        .flatten()
        .collect();
        let (outcome, detail) = if problems.is_empty() {
            (Outcome::Pass, format!("{} {}", info.name, info.version))
        } else {
            (Outcome::Fail, problems.join("; "))
        };
        self.check(None, "about is well formed", outcome, detail);
        // Loading refuses any other version, so a loaded plugin's is supported.
        self.check(
            None,
            "WIT version is supported",
            Outcome::Pass,
            format!("rlhost:plugin@{}", self.plugin.wit_version()),
        );
    }

    /// The samples to test the roles with: given ones, else the plugin's own dataset's
    /// first ones (opened with the config), else one plain prompt.
    async fn samples(&mut self) -> Vec<Sample> {
        if !self.options.samples.is_empty() {
            return self.options.samples.clone();
        }
        if self.plugin.roles().contains(&Role::Dataset)
            && let Ok(mut source) = self
                .plugin
                .open_dataset(&self.options.config, self.options.seed)
                .await
        {
            let mut samples = Vec::new();
            let mut streak = Streak::default();
            for i in 0..source.len().min(8) {
                match source.get(i).await {
                    Ok(sample) => {
                        streak.push(None);
                        samples.push(sample);
                    }
                    // A timeout costs the whole deadline: the checks see it anyway.
                    Err(f) => {
                        if streak.push(self.saw(Some(&f))) || f.kind == FaultKind::Timeout {
                            break;
                        }
                    }
                }
            }
            if !samples.is_empty() {
                return samples;
            }
        }
        vec![Sample::from_prompt("What is 6 times 7?")]
    }

    /// Opens `role` with `{}`, with a malformed config and with an unknown field, then
    /// with the configuration under test; true when the last one opened.
    async fn opens(&mut self, role: Role, samples: &[Sample]) -> bool {
        let sample = &samples[0];
        let r = Some(role);
        let opened = match self.open(role, "{}", sample).await {
            Ok(()) => {
                self.check(r, "open with {}", Outcome::Pass, "opened".into());
                true
            }
            Err(f) if f.kind == FaultKind::GuestError => {
                let detail = format!("guest error: {}", f.message);
                self.check(r, "open with {}", Outcome::Pass, detail);
                false
            }
            Err(f) => {
                self.check(r, "open with {}", Outcome::Fail, f.to_string());
                false
            }
        };
        if self.out_of_time(r) {
            return false;
        }
        let (outcome, detail) = match self.open(role, MALFORMED, sample).await {
            Err(f) if f.kind == FaultKind::GuestError => {
                (Outcome::Pass, format!("guest error: {}", f.message))
            }
            Err(f) => (Outcome::Fail, f.to_string()),
            Ok(()) => (
                Outcome::Fail,
                format!("opened with {MALFORMED:?}: a config that is not JSON must be an error"),
            ),
        };
        self.check(r, "open with a malformed config", outcome, detail);
        if opened && !self.out_of_time(r) {
            let (outcome, detail) = match self.open(role, UNKNOWN_FIELD, sample).await {
                Err(f) if f.kind == FaultKind::GuestError => {
                    (Outcome::Pass, format!("guest error: {}", f.message))
                }
                Err(f) => (Outcome::Fail, f.to_string()),
                Ok(()) => (
                    Outcome::Warn,
                    format!("opened with {UNKNOWN_FIELD}: a misspelt field goes unnoticed"),
                ),
            };
            self.check(r, "open with an unknown field", outcome, detail);
        }
        if self.options.config.trim() == "{}" {
            if !opened {
                let detail = "it does not open with {} and the samples tested: pass --config with a config it accepts, or --sample with samples it can open";
                self.check(r, "the remaining checks", Outcome::Skip, detail.into());
            }
            return opened;
        }
        if self.out_of_time(r) {
            return false;
        }
        let config = self.options.config.clone();
        match self.open(role, &config, sample).await {
            Ok(()) => {
                self.check(
                    r,
                    "open with the given config",
                    Outcome::Pass,
                    String::new(),
                );
                true
            }
            Err(f) => {
                self.check(
                    r,
                    "open with the given config",
                    Outcome::Fail,
                    f.to_string(),
                );
                false
            }
        }
    }

    async fn open(&mut self, role: Role, config: &str, sample: &Sample) -> Result<(), Fault> {
        let plugin = self.plugin;
        let seed = self.options.seed;
        let result = match role {
            Role::Trigger => {
                self.timed("trigger.open", async || {
                    plugin.open_trigger(config, sample, seed).await.map(drop)
                })
                .await
            }
            Role::Environment => {
                self.timed("environment.open", async || {
                    plugin
                        .open_environment(config, sample, seed)
                        .await
                        .map(drop)
                })
                .await
            }
            Role::Dataset => {
                self.timed("dataset.open", async || {
                    plugin.open_dataset(config, seed).await.map(drop)
                })
                .await
            }
            Role::Reward => {
                self.timed("reward.open", async || {
                    plugin.open_reward(config).await.map(drop)
                })
                .await
            }
            Role::Tools => {
                self.timed("tools.open", async || {
                    plugin.open_tools(config, sample, seed).await.map(drop)
                })
                .await
            }
        };
        let result = result.map_err(as_fault);
        self.saw(result.as_ref().err());
        result
    }

    /// Tallies `n` calls' results into one check: pass when none faulted; `extra` ends
    /// the row either way.
    fn faults_check(&mut self, role: Role, name: &str, n: usize, faults: &[Fault], extra: &str) {
        let (outcome, detail) = match faults.first() {
            None => (Outcome::Pass, format!("{n} calls{extra}")),
            Some(first) => (
                Outcome::Fail,
                format!(
                    "{} of {n} calls faulted; the first: {first}{extra}",
                    faults.len()
                ),
            ),
        };
        self.check(Some(role), name, outcome, detail);
    }

    async fn dataset(&mut self) {
        let role = Some(Role::Dataset);
        let (config, seed) = (self.options.config.clone(), self.options.seed);
        let (mut a, mut b) = match (
            self.plugin.open_dataset(&config, seed).await,
            self.plugin.open_dataset(&config, seed).await,
        ) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => {
                let detail = format!("{e:#}");
                return self.check(role, "opens", Outcome::Fail, detail);
            }
        };
        let len = a.len();
        if len == 0 || b.len() != len {
            let detail = format!("len {len} then {}: must be the same and above 0", b.len());
            return self.check(role, "len", Outcome::Fail, detail);
        }
        self.check(role, "len", Outcome::Pass, format!("{len} samples"));
        let mut indices = vec![0, len - 1];
        for _ in 0..self.options.inputs.saturating_sub(2) {
            indices.push(self.rng.below(len));
        }
        let (mut faults, mut differ, mut malformed) = (Vec::new(), Vec::new(), Vec::new());
        let (mut compared, mut made, mut streak) = (0, 0, Streak::default());
        for &i in &indices {
            made += 1;
            let first = self.timed("dataset.get", async || a.get(i).await).await;
            let fault = first.as_ref().err().cloned();
            let stop = streak.push(self.saw(fault.as_ref()));
            if let Some(f) = fault {
                faults.push(f);
                if stop || self.timeouts >= MAX_TIMEOUTS {
                    break;
                }
                continue;
            }
            let again = b.get(i).await;
            self.saw(again.as_ref().err());
            match (first, again) {
                (Ok(x), Ok(y)) => {
                    compared += 1;
                    if x != y {
                        differ.push(i);
                    }
                    if let Some(problem) = sample_problem(&x) {
                        malformed.push(format!("sample {i}: {problem}"));
                    }
                }
                (Err(f), _) | (_, Err(f)) => faults.push(f),
            }
        }
        let n = indices.len();
        let stopped = streak.stopped(made, n);
        self.faults_check(Role::Dataset, "get: no fault", made, &faults, &stopped);
        let (outcome, detail) = if compared == 0 {
            (
                Outcome::Skip,
                "nothing to compare: no index gave a sample twice".to_string(),
            )
        } else if differ.is_empty() {
            (
                Outcome::Pass,
                format!("{compared} indices, opened twice with seed {seed}"),
            )
        } else {
            (
                Outcome::Fail,
                format!(
                    "{} of {compared} indices gave another sample the second time (first: {})",
                    differ.len(),
                    differ[0]
                ),
            )
        };
        self.check(role, "deterministic for a seed", outcome, detail);
        let (outcome, detail) = match malformed.first() {
            None if compared == 0 => (
                Outcome::Skip,
                "nothing to check: no sample came back".to_string(),
            ),
            None => (Outcome::Pass, format!("{compared} samples")),
            Some(first) => (
                Outcome::Fail,
                format!("{} malformed; {first}", malformed.len()),
            ),
        };
        self.check(role, "samples are well formed", outcome, detail);
    }

    /// A tools plugin: its functions are well formed (checked when a session opens: names,
    /// JSON Schema objects this host can check), calls with random arguments that fit
    /// each function's schema never fault, and arguments that do not fit get the
    /// function's own error (`err`), not a fault.
    async fn tools(&mut self, samples: &[Sample]) {
        let role = Some(Role::Tools);
        let config = self.options.config.clone();
        let seed = self.options.seed;
        let mut session = match self.plugin.open_tools(&config, &samples[0], seed).await {
            Ok(s) => s,
            Err(e) => {
                return self.check(
                    role,
                    "functions are well formed",
                    Outcome::Fail,
                    format!("{e:#}"),
                );
            }
        };
        let specs = session.functions().to_vec();
        if specs.is_empty() {
            return self.check(
                role,
                "functions are well formed",
                Outcome::Fail,
                "it lists no function".into(),
            );
        }
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        self.check(
            role,
            "functions are well formed",
            Outcome::Pass,
            names.join(", "),
        );
        let (mut faults, mut answered, mut refused, mut made, mut streak) =
            (Vec::new(), 0, 0, 0, Streak::default());
        for i in 0..self.options.inputs {
            let spec = &specs[i % specs.len()];
            let arguments = random_value(&spec.parameters, &mut self.rng, 0);
            made += 1;
            let text = arguments.to_string();
            let result = self
                .timed("tools.call", async || {
                    session.invoke(&spec.name, &text).await
                })
                .await;
            let stop = streak.push(self.saw(result.as_ref().err()));
            match result {
                Ok(Ok(_)) => answered += 1,
                Ok(Err(_)) => refused += 1,
                Err(f) => faults.push(f),
            }
            if stop || self.timeouts >= MAX_TIMEOUTS {
                break;
            }
        }
        let extra = format!(
            ", {answered} answered, {refused} refused{}",
            streak.stopped(made, self.options.inputs)
        );
        self.faults_check(
            Role::Tools,
            "calls with fitting arguments: no fault",
            made,
            &faults,
            &extra,
        );
        // Arguments that fail the schema: the host never sends them in a run, but a
        // function must refuse them (`err`), never trap.
        let spec = &specs[0];
        let (mut bad_faults, mut bad_answered) = (Vec::new(), 0);
        for bad in ["[]", "{\"surely_not_a_parameter\": []}", "\"text\""] {
            match session.invoke(&spec.name, bad).await {
                Ok(Ok(_)) => bad_answered += 1,
                Ok(Err(_)) => {}
                Err(f) => bad_faults.push(f),
            }
        }
        let (outcome, detail) = match (bad_faults.first(), bad_answered) {
            (Some(f), _) => (
                Outcome::Fail,
                format!("`{}` faulted on arguments that do not fit: {f}", spec.name),
            ),
            (None, 0) => (Outcome::Pass, format!("`{}` refused all 3", spec.name)),
            (None, n) => (
                Outcome::Warn,
                format!(
                    "`{}` answered {n} of 3 calls whose arguments do not fit its schema",
                    spec.name
                ),
            ),
        };
        self.check(role, "arguments that do not fit: refused", outcome, detail);
    }

    async fn reward(&mut self, samples: &[Sample]) {
        let role = Some(Role::Reward);
        let config = self.options.config.clone();
        let mut scorer = match self.plugin.open_reward(&config).await {
            Ok(s) => s,
            Err(e) => return self.check(role, "opens", Outcome::Fail, format!("{e:#}")),
        };
        let (mut faults, mut guest_errors, mut problems, mut unstable) =
            (Vec::new(), Vec::new(), Vec::new(), 0);
        let (mut scored, mut made, mut streak) = (0, 0, Streak::default());
        for i in 0..self.options.inputs {
            let sample = &samples[i % samples.len()];
            let completion = self.rng.text(&[]);
            let trajectory = trajectory(sample, completion, &mut self.rng);
            made += 1;
            let result = self
                .timed("reward.score", async || scorer.score(&trajectory).await)
                .await;
            let stop = streak.push(self.saw(result.as_ref().err()));
            match result {
                Ok(components) => {
                    scored += 1;
                    if let Some(problem) = components_problem(&components) {
                        problems.push(problem);
                    }
                    if i % 8 == 0 && scorer.score(&trajectory).await.ok() != Some(components) {
                        unstable += 1;
                    }
                }
                Err(f) if f.kind == FaultKind::GuestError => guest_errors.push(f),
                Err(f) => faults.push(f),
            }
            if stop || self.timeouts >= MAX_TIMEOUTS {
                break;
            }
        }
        let extra = format!(
            ", {} guest errors{}",
            guest_errors.len(),
            streak.stopped(made, self.options.inputs)
        );
        let n = made;
        self.faults_check(Role::Reward, "score: no fault", n, &faults, &extra);
        let (outcome, detail) = if scored == 0 {
            let first = guest_errors
                .first()
                .map_or(String::new(), |f| format!(": {}", f.message));
            (
                Outcome::Fail,
                format!(
                    "no trajectory was scored{first}; pass --sample with samples this reward can score"
                ),
            )
        } else if let Some(first) = problems.first() {
            (
                Outcome::Fail,
                format!("{} of {scored}: {first}", problems.len()),
            )
        } else {
            (Outcome::Pass, format!("{scored} scored"))
        };
        self.check(role, "finite, named, distinct components", outcome, detail);
        let (outcome, detail) = if scored == 0 {
            (Outcome::Skip, "nothing was scored".to_string())
        } else if unstable == 0 {
            (Outcome::Pass, "scored twice, the same".to_string())
        } else {
            (
                Outcome::Warn,
                format!("{unstable} trajectories got other components the second time"),
            )
        };
        self.check(role, "deterministic", outcome, detail);
    }

    async fn trigger(&mut self, samples: &[Sample]) {
        let role = Some(Role::Trigger);
        let (config, seed) = (self.options.config.clone(), self.options.seed);
        let mut session = match self.plugin.open_trigger(&config, &samples[0], seed).await {
            Ok(s) => s,
            Err(e) => return self.check(role, "opens", Outcome::Fail, format!("{e:#}")),
        };
        let patterns = session.stop_patterns().to_vec();
        self.check(
            role,
            "stop patterns",
            Outcome::Pass,
            format!("{patterns:?}"),
        );
        if patterns.is_empty() {
            let detail = "none: a trigger the host never fires (single-turn)".to_string();
            return self.check(role, "fire", Outcome::Pass, detail);
        }
        let limit = self.plugin.spec().limits.max_output_bytes;
        let n = self.options.inputs;
        // Text that does not end with a pattern: the host never fires on it, and the
        // plugin must not answer it either (it checks what it was given).
        let (mut answered, mut faults) = (Vec::new(), Vec::new());
        let (mut silent, mut made, mut streak) = (0, 0, Streak::default());
        for _ in 0..n / 2 {
            let mut text = self.rng.text(&patterns);
            while patterns.iter().any(|p| text.ends_with(p.as_str())) {
                text.push('.');
            }
            made += 1;
            let result = self
                .timed("trigger.fire", async || session.fire(&text).await)
                .await;
            let stop = streak.push(self.saw(result.as_ref().err()));
            match result {
                Ok(Some(_)) => answered.push(text),
                Ok(None) => silent += 1,
                Err(f) => faults.push(f),
            }
            if stop || self.timeouts >= MAX_TIMEOUTS {
                break;
            }
        }
        let first_half = streak.stopped(made, n / 2);
        let (outcome, detail) = match answered.first() {
            None if silent == 0 => (
                Outcome::Skip,
                format!("nothing to check: every call faulted{first_half}"),
            ),
            None => (Outcome::Pass, format!("{silent} texts{first_half}")),
            Some(first) => (
                Outcome::Fail,
                format!(
                    "answered {} of {} texts that end with no stop pattern, e.g. {:?}",
                    answered.len(),
                    n / 2,
                    clip(first)
                ),
            ),
        };
        self.check(role, "silent without a stop pattern", outcome, detail);
        // Text that ends with a pattern: any answer, bounded (the host refuses more than
        // its limit as bad output), and no fault; a fresh session now and then.
        let mut largest = 0;
        let mut fired = 0;
        // The same streak: a trigger that hung on the texts above hangs on these too.
        let mut made2 = 0;
        for i in 0..n - n / 2 {
            if self.timeouts >= MAX_TIMEOUTS || streak.stopped_now() {
                break;
            }
            made2 += 1;
            if i % 16 == 15 {
                let plugin = self.plugin;
                match self
                    .timed("trigger.open", async || {
                        plugin
                            .open_trigger(&config, &samples[i % samples.len()], seed)
                            .await
                    })
                    .await
                {
                    Ok(s) => session = s,
                    Err(e) => {
                        let f = as_fault(e);
                        streak.push(self.saw(Some(&f)));
                        faults.push(f);
                        continue;
                    }
                }
            }
            let text = self.rng.call_text(&patterns);
            let result = self
                .timed("trigger.fire", async || session.fire(&text).await)
                .await;
            streak.push(self.saw(result.as_ref().err()));
            match result {
                Ok(Some(out)) => {
                    fired += 1;
                    largest = largest.max(out.len());
                }
                Ok(None) => {}
                Err(f) => faults.push(f),
            }
        }
        let extra = format!(
            "; {fired} answered, the largest {largest} bytes (limit {limit}){}",
            streak.stopped(made + made2, n)
        );
        self.faults_check(
            Role::Trigger,
            "fire: no fault, bounded output",
            made + made2,
            &faults,
            &extra,
        );
    }

    async fn environment(&mut self, samples: &[Sample]) {
        let (config, seed) = (self.options.config.clone(), self.options.seed);
        let (mut faults, mut problems) = (Vec::new(), Vec::new());
        let (mut steps, mut episodes, mut answered) = (0, 0, 0);
        let mut streak = Streak::default();
        while steps < self.options.inputs && !streak.stopped_now() && self.timeouts < MAX_TIMEOUTS {
            let sample = &samples[episodes % samples.len()];
            episodes += 1;
            let plugin = self.plugin;
            let mut episode = match self
                .timed("environment.open", async || {
                    plugin.open_environment(&config, sample, seed).await
                })
                .await
            {
                Ok(e) => e,
                Err(e) => {
                    let f = as_fault(e);
                    streak.push(self.saw(Some(&f)));
                    faults.push(f);
                    steps += 1;
                    continue;
                }
            };
            for _ in 0..8 {
                steps += 1;
                let turn = self.rng.text(&[]);
                let result = self
                    .timed("environment.step", async || episode.step(&turn).await)
                    .await;
                if streak.push(self.saw(result.as_ref().err())) || self.timeouts >= MAX_TIMEOUTS {
                    if let Err(f) = result {
                        faults.push(f);
                    }
                    break;
                }
                match result {
                    Ok(step) => {
                        answered += 1;
                        if let Some(m) = step
                            .messages
                            .iter()
                            .find(|m| m.role != "tool" && m.role != "user")
                        {
                            problems.push(format!("a message with role {:?}", m.role));
                        }
                        if step.reward.is_some_and(|r| !r.is_finite()) {
                            problems.push(format!("step reward {:?}", step.reward));
                        }
                        if step.done {
                            break;
                        }
                    }
                    Err(f) if f.kind == FaultKind::GuestError => break,
                    Err(f) => {
                        faults.push(f);
                        break;
                    }
                }
            }
        }
        let extra = format!(
            " in {episodes} episodes{}",
            streak.stopped(steps, self.options.inputs)
        );
        self.faults_check(Role::Environment, "step: no fault", steps, &faults, &extra);
        let (outcome, detail) = match problems.first() {
            None if answered == 0 => (
                Outcome::Skip,
                "nothing to check: no step answered".to_string(),
            ),
            None => (
                Outcome::Pass,
                "tool or user messages, finite rewards".into(),
            ),
            Some(first) => (
                Outcome::Fail,
                format!("{} steps gave {first}", problems.len()),
            ),
        };
        self.check(
            Some(Role::Environment),
            "steps are well formed",
            outcome,
            detail,
        );
    }
}

/// An `anyhow` error from opening a role, as the fault it carries (opening fails only
/// with one once the role is known to be exported).
fn as_fault(e: anyhow::Error) -> Fault {
    match e.downcast::<Fault>() {
        Ok(f) => f,
        Err(e) => Fault {
            plugin: String::new(),
            call: "open",
            kind: FaultKind::Incompatible,
            message: format!("{e:#}"),
        },
    }
}

fn sample_problem(sample: &Sample) -> Option<String> {
    const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];
    if sample.messages.is_empty() {
        return Some("no messages".into());
    }
    if let Some(m) = sample
        .messages
        .iter()
        .find(|m| !ROLES.contains(&m.role.as_str()))
    {
        return Some(format!("a message with role {:?}", m.role));
    }
    if !sample.messages.iter().any(|m| m.role == "user") {
        return Some("no user message".into());
    }
    None
}

fn components_problem(components: &[crate::plugin::Component]) -> Option<String> {
    if components.is_empty() {
        return Some("no components".into());
    }
    let mut names: Vec<&str> = components.iter().map(|c| c.name.as_str()).collect();
    names.sort_unstable();
    names
        .windows(2)
        .find(|w| w[0] == w[1])
        .map(|w| format!("component `{}` twice", w[0]))
}

/// A trajectory of `sample` answered by `completion`, now and then cut off.
fn trajectory(sample: &Sample, completion: String, rng: &mut SplitMix) -> Trajectory {
    Trajectory {
        truncated: rng.below(8) == 0,
        ..Trajectory::single_turn(sample, completion)
    }
}

fn clip(text: &str) -> String {
    match text.char_indices().nth(60) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_string(),
    }
}

/// SplitMix64: the inputs depend on the seed alone.
/// A random value that fits `schema` (the keywords [`super::schema`] knows); `depth`
/// bounds nesting.
fn random_value(schema: &serde_json::Value, rng: &mut SplitMix, depth: u32) -> serde_json::Value {
    use serde_json::{Value, json};
    if let Some(options) = schema
        .get("enum")
        .and_then(Value::as_array)
        .filter(|o| !o.is_empty())
    {
        return options[rng.below(options.len() as u64) as usize].clone();
    }
    if let Some(c) = schema.get("const") {
        return c.clone();
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(any) = schema
            .get(key)
            .and_then(Value::as_array)
            .filter(|a| !a.is_empty())
        {
            return random_value(&any[rng.below(any.len() as u64) as usize], rng, depth);
        }
    }
    let kind = match schema.get("type") {
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(ts)) if !ts.is_empty() => ts[rng.below(ts.len() as u64) as usize]
            .as_str()
            .unwrap_or("null")
            .to_string(),
        _ => "string".into(),
    };
    let num = |k: &str| schema.get(k).and_then(Value::as_f64);
    match kind.as_str() {
        "object" => {
            let mut out = serde_json::Map::new();
            let required: Vec<&str> = schema
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            for (name, sub) in schema
                .get("properties")
                .and_then(Value::as_object)
                .into_iter()
                .flatten()
            {
                if required.contains(&name.as_str()) || (depth < 3 && rng.below(2) == 0) {
                    out.insert(name.clone(), random_value(sub, rng, depth + 1));
                }
            }
            Value::Object(out)
        }
        "array" => {
            let lo = schema.get("minItems").and_then(Value::as_u64).unwrap_or(0);
            let hi = schema
                .get("maxItems")
                .and_then(Value::as_u64)
                .unwrap_or(lo + 4)
                .max(lo);
            let n = if depth >= 3 {
                lo
            } else {
                lo + rng.below(hi - lo + 1)
            };
            let item = schema.get("items").cloned().unwrap_or(json!({}));
            Value::Array(
                (0..n)
                    .map(|_| random_value(&item, rng, depth + 1))
                    .collect(),
            )
        }
        "integer" => {
            let lo = num("minimum")
                .or(num("exclusiveMinimum").map(|x| x.floor() + 1.0))
                .unwrap_or(-1000.0);
            let hi = num("maximum")
                .or(num("exclusiveMaximum").map(|x| x.ceil() - 1.0))
                .unwrap_or(1000.0)
                .max(lo);
            json!(lo as i64 + rng.below((hi - lo) as u64 + 1) as i64)
        }
        "number" => {
            let lo = num("minimum")
                .or(num("exclusiveMinimum"))
                .unwrap_or(-1000.0);
            let hi = num("maximum")
                .or(num("exclusiveMaximum"))
                .unwrap_or(1000.0)
                .max(lo);
            let x = lo + (hi - lo) * (rng.below(1 << 20) as f64 / (1 << 20) as f64);
            json!(x)
        }
        "boolean" => json!(rng.below(2) == 1),
        "null" => Value::Null,
        _ => {
            let lo = schema.get("minLength").and_then(Value::as_u64).unwrap_or(0) as usize;
            let hi = schema
                .get("maxLength")
                .and_then(Value::as_u64)
                .map_or(lo.max(24), |m| m as usize)
                .max(lo);
            let mut text: String = rng.text(&[]).chars().take(hi).collect();
            while text.chars().count() < lo {
                text.push('x');
            }
            json!(text)
        }
    }
}

/// The conformance inputs' draws ([`SplitMix64`], with modulo draws below `n`).
struct SplitMix(SplitMix64);

/// What random text is made of: words a model writes, digits and operators, markup,
/// whitespace, and characters outside ASCII.
const PIECES: [&str; 24] = [
    "the",
    "answer",
    " ",
    " ",
    "\n",
    "42",
    "7",
    "-3.5",
    "+",
    "*",
    "/",
    "(",
    ")",
    "=",
    "<answer>",
    "</answer>",
    "print(",
    "é",
    "中文",
    "🙂",
    "\t",
    "```",
    "'",
    "\"",
];

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// Up to ~60 random pieces, now and then one of `patterns` among them.
    fn text(&mut self, patterns: &[String]) -> String {
        let n = self.below(60);
        let mut text = String::new();
        for _ in 0..n {
            if !patterns.is_empty() && self.below(20) == 0 {
                text.push_str(&patterns[self.below(patterns.len() as u64) as usize]);
            } else if self.below(6) == 0 {
                // A random scalar value from the first planes.
                let c = char::from_u32(self.below(0x3_0000) as u32).unwrap_or('?');
                text.push(c);
            } else {
                text.push_str(PIECES[self.below(PIECES.len() as u64) as usize]);
            }
        }
        text
    }

    /// Random text ending with one of `patterns`, often with another pattern before it
    /// and a language tag after that (so that open/close pairs such as code fences get a
    /// random body to run).
    fn call_text(&mut self, patterns: &[String]) -> String {
        const TAGS: [&str; 5] = ["", "python\n", "js\n", "c\n", " "];
        let pick = |r: &mut SplitMix| patterns[r.below(patterns.len() as u64) as usize].clone();
        // Free of the patterns: a stray one would close the call early or unbalance it.
        let plain = |r: &mut SplitMix| {
            let mut text = r.text(&[]);
            for p in patterns {
                text = text.replace(p.as_str(), "");
            }
            text
        };
        let mut text = plain(self);
        if self.below(2) == 0 {
            text.push_str(&pick(self));
            text.push_str(TAGS[self.below(TAGS.len() as u64) as usize]);
            text.push_str(&plain(self));
            text.push('\n');
        }
        text.push_str(&pick(self));
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_text_repeats_for_a_seed_and_call_text_ends_with_a_pattern() {
        let patterns = vec!["</calc>".to_string(), "```".to_string()];
        let (mut a, mut b) = (
            SplitMix(SplitMix64::from_state(3)),
            SplitMix(SplitMix64::from_state(3)),
        );
        for _ in 0..50 {
            assert_eq!(a.text(&patterns), b.text(&patterns));
            let call = a.call_text(&patterns);
            assert_eq!(call, b.call_text(&patterns));
            assert!(
                patterns.iter().any(|p| call.ends_with(p.as_str())),
                "{call:?}"
            );
        }
    }

    #[test]
    fn component_and_sample_problems_are_named() {
        let c = |name: &str| crate::plugin::Component {
            name: name.into(),
            value: 1.0,
        };
        assert_eq!(components_problem(&[c("a"), c("b")]), None);
        assert_eq!(
            components_problem(&[c("a"), c("b"), c("a")]).as_deref(),
            Some("component `a` twice")
        );
        assert_eq!(components_problem(&[]).as_deref(), Some("no components"));
        let mut sample = Sample::from_prompt("hi");
        assert_eq!(sample_problem(&sample), None);
        sample.messages[0].role = "robot".into();
        assert_eq!(
            sample_problem(&sample).as_deref(),
            Some("a message with role \"robot\"")
        );
    }
}
