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

mod inputs;
mod roles;

use crate::plugin::{Fault, FaultKind, Plugin, Role, Sample};
use crate::rng::SplitMix64;
use inputs::SplitMix;
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
pub enum Verdict {
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
    pub outcome: Verdict,
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
    pub fn count(&self, outcome: Verdict) -> usize {
        self.checks.iter().filter(|c| c.outcome == outcome).count()
    }

    /// No check failed and every check ran.
    pub fn passed(&self) -> bool {
        self.count(Verdict::Fail) == 0 && self.count(Verdict::Skip) == 0
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
    fn check(&mut self, role: Option<Role>, name: &str, outcome: Verdict, detail: String) {
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
            self.check(role, "the remaining checks", Verdict::Skip, detail);
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
            (Verdict::Pass, format!("{} {}", info.name, info.version))
        } else {
            (Verdict::Fail, problems.join("; "))
        };
        self.check(None, "about is well formed", outcome, detail);
        // Loading refuses any other version, so a loaded plugin's is supported.
        self.check(
            None,
            "WIT version is supported",
            Verdict::Pass,
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

    /// Opens `role` with a `config` it should refuse: a guest error passes, another fault
    /// fails, and opening is `if_opened`.
    async fn refuses(
        &mut self,
        role: Role,
        config: &str,
        sample: &Sample,
        if_opened: (Verdict, String),
    ) -> (Verdict, String) {
        match self.open(role, config, sample).await {
            Err(f) if f.kind == FaultKind::GuestError => {
                (Verdict::Pass, format!("guest error: {}", f.message))
            }
            Err(f) => (Verdict::Fail, f.to_string()),
            Ok(()) => if_opened,
        }
    }

    /// Opens `role` with `{}`, with a malformed config and with an unknown field, then
    /// with the configuration under test; true when the last one opened.
    async fn opens(&mut self, role: Role, samples: &[Sample]) -> bool {
        let sample = &samples[0];
        let r = Some(role);
        let opened = match self.open(role, "{}", sample).await {
            Ok(()) => {
                self.check(r, "open with {}", Verdict::Pass, "opened".into());
                true
            }
            Err(f) if f.kind == FaultKind::GuestError => {
                let detail = format!("guest error: {}", f.message);
                self.check(r, "open with {}", Verdict::Pass, detail);
                false
            }
            Err(f) => {
                self.check(r, "open with {}", Verdict::Fail, f.to_string());
                false
            }
        };
        if self.out_of_time(r) {
            return false;
        }
        let opened_anyway = (
            Verdict::Fail,
            format!("opened with {MALFORMED:?}: a config that is not JSON must be an error"),
        );
        let (outcome, detail) = self.refuses(role, MALFORMED, sample, opened_anyway).await;
        self.check(r, "open with a malformed config", outcome, detail);
        if opened && !self.out_of_time(r) {
            let opened_anyway = (
                Verdict::Warn,
                format!("opened with {UNKNOWN_FIELD}: a misspelt field goes unnoticed"),
            );
            let (outcome, detail) = self
                .refuses(role, UNKNOWN_FIELD, sample, opened_anyway)
                .await;
            self.check(r, "open with an unknown field", outcome, detail);
        }
        if self.options.config.trim() == "{}" {
            if !opened {
                let detail = "it does not open with {} and the samples tested: pass --config with a config it accepts, or --sample with samples it can open";
                self.check(r, "the remaining checks", Verdict::Skip, detail.into());
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
                    Verdict::Pass,
                    String::new(),
                );
                true
            }
            Err(f) => {
                self.check(
                    r,
                    "open with the given config",
                    Verdict::Fail,
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
            None => (Verdict::Pass, format!("{n} calls{extra}")),
            Some(first) => (
                Verdict::Fail,
                format!(
                    "{} of {n} calls faulted; the first: {first}{extra}",
                    faults.len()
                ),
            ),
        };
        self.check(Some(role), name, outcome, detail);
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

#[cfg(test)]
mod tests {
    use super::*;

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
