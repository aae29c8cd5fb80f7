//! Rewards: reward plugins score a finished trajectory into named components; the run
//! config weighs and sums them, and an environment's step rewards add in as `env`.
//!
//! A reward plugin's fault never stops a run: the plugin's share of the total becomes its
//! configured `fallback`, the fault is counted by the plugin and recorded on the
//! trajectory, and training goes on.
//!
//! A reward with `cases` (a metadata key, e.g. a code reward's `tests`) is scored case by
//! case: each case of the sample's list goes to a fresh instance on its own, under the
//! plugin's time and memory limits, so one case that loops or exhausts memory fails alone
//! (a fault, counted; the case scores 0) and the others still count. The components are
//! then each case's mean, and `all_…` components their minimum (see [`aggregate`]).

use super::trajectory::{FaultRecord, Trajectory};
use crate::model::Model;
use crate::plugin::model::ModelLink;
use crate::plugin::{Component, Fault, Plugin, RewardScorer};
use anyhow::{Context, Result};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::Mutex;

/// One reward function as configured.
#[derive(Clone)]
pub struct RewardSpec {
    pub plugin: Plugin,
    /// The plugin's configuration as JSON.
    pub config: String,
    /// Weight per component name; components not listed get `default_weight`.
    pub weights: BTreeMap<String, f64>,
    pub default_weight: f64,
    /// The plugin's weighted contribution when it faults.
    pub fallback: f64,
    /// The metadata key of the cases scored one by one, if any.
    pub cases: Option<String>,
}

/// What one reward function made of one trajectory.
#[derive(Debug)]
pub struct Scored {
    /// The components, or the fault that stands for all of them.
    pub result: Result<Vec<Component>, Fault>,
    /// Faults of single cases that the other cases outweighed (scored case by case).
    pub case_faults: Vec<Fault>,
    /// Why the plugin scored as it did, when it said: the first line it logged at `warn`
    /// or above (a code reward's first failed test), or a faulted case's fault.
    pub note: Option<String>,
}

/// An opened reward function: a few scorer instances so that trajectories finishing
/// together are scored in parallel.
pub struct RewardFn {
    spec: RewardSpec,
    scorers: Vec<Mutex<RewardScorer>>,
    next: std::sync::atomic::AtomicUsize,
    /// Cases scored at once across all trajectories, as many as there are scorers: the
    /// fresh instances of case-by-case scoring stay as few as the whole-trajectory ones.
    case_slots: Arc<tokio::sync::Semaphore>,
}

impl RewardFn {
    /// The reward's plugin.
    pub fn plugin(&self) -> &Plugin {
        &self.spec.plugin
    }

    pub fn name(&self) -> &str {
        self.spec.plugin.name()
    }

    /// Scores one trajectory: case by case when the spec names the cases and the sample
    /// has them, else on one of the instances. `model`: where the plugin's
    /// `model.generate` calls go while it scores this trajectory (the trajectory's own
    /// engine; none outside a rollout).
    pub async fn score(
        &self,
        trajectory: &crate::plugin::Transcript,
        model: Option<ModelLink>,
    ) -> Scored {
        // No cases (an empty list) is the plugin's to refuse, scored whole.
        if let Some(key) = &self.spec.cases
            && let Some(cases) = trajectory.metadata.get(key).map(split_cases)
            && !cases.is_empty()
        {
            return self.score_cases(trajectory, key, cases, model).await;
        }
        let i = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % self.scorers.len();
        let mut scorer = self.scorers[i].lock().await;
        scorer.set_model(model);
        let result = scorer.score(trajectory).await;
        scorer.set_model(None);
        Scored {
            result,
            case_faults: Vec::new(),
            note: scorer.take_note(),
        }
    }

    /// Scores each case in a fresh instance that sees only that case under `key` (a
    /// one-element list) and where it stands under `rlhost_case` (`{"index", "count"}`).
    /// As many cases run at once, over all trajectories, as the run keeps scorer instances
    /// (`rollout.reward_instances`).
    async fn score_cases(
        &self,
        trajectory: &crate::plugin::Transcript,
        key: &str,
        cases: Vec<Value>,
        model: Option<ModelLink>,
    ) -> Scored {
        let count = cases.len();
        // A task per case: the cases of one trajectory run on the runtime's threads at
        // once (futures polled within this task would all run on its one thread).
        let tasks: Vec<_> = cases
            .into_iter()
            .enumerate()
            .map(|(index, case)| {
                let mut one = trajectory.clone();
                if let Some(m) = one.metadata.as_object_mut() {
                    m.insert(key.to_string(), Value::Array(vec![case]));
                    m.insert(
                        "rlhost_case".into(),
                        json!({"index": index, "count": count}),
                    );
                }
                let plugin = self.spec.plugin.clone();
                let config = self.spec.config.clone();
                let slots = self.case_slots.clone();
                let model = model.clone();
                tokio::spawn(async move {
                    let _slot = slots.acquire_owned().await.expect("never closed");
                    let mut scorer = match plugin.open_reward(&config).await {
                        Ok(scorer) => scorer,
                        Err(e) => return (Err(plugin.open_fault("reward.open", e)), None),
                    };
                    scorer.set_model(model);
                    let result = scorer.score(&one).await;
                    (result, scorer.take_note())
                })
            })
            .collect();
        let mut results = Vec::with_capacity(count);
        for task in tasks {
            match task.await {
                Ok(result) => results.push(result),
                // A panic here is the host's bug, not the plugin's fault: pass it on.
                Err(e) => std::panic::resume_unwind(e.into_panic()),
            }
        }
        aggregate(results)
    }
}

/// The cases in a metadata value: a list's items; an object of parallel lists (APPS'
/// `{"inputs": [...], "outputs": [...], "fn_name": ...}`) as one object per position with
/// the other fields copied; JSON text holding either, parsed first; anything else (one
/// test script, lists of unequal length) is a single case, for the plugin to read or
/// refuse.
pub fn split_cases(value: &Value) -> Vec<Value> {
    let parsed;
    let value = match value {
        Value::String(text) if text.trim_start().starts_with(['[', '{']) => {
            match serde_json::from_str::<Value>(text) {
                Ok(v) => {
                    parsed = v;
                    &parsed
                }
                Err(_) => value,
            }
        }
        _ => value,
    };
    match value {
        Value::Array(items) => items.clone(),
        Value::Object(fields) => {
            let mut lengths = fields.values().filter_map(Value::as_array).map(Vec::len);
            let Some(n) = lengths.next() else {
                return vec![value.clone()];
            };
            if lengths.any(|m| m != n) {
                return vec![value.clone()];
            }
            (0..n)
                .map(|i| {
                    let one = fields.iter().map(|(k, v)| {
                        let v = match v {
                            Value::Array(items) => items[i].clone(),
                            other => other.clone(),
                        };
                        (k.clone(), v)
                    });
                    Value::Object(one.collect())
                })
                .collect()
        }
        other => vec![other.clone()],
    }
}

/// One case's components (or its fault) and the note its instance logged.
pub type CaseResult = (Result<Vec<Component>, Fault>, Option<String>);

/// Per-case results (in case order) as one score. Each component is its mean over the
/// cases, except a component named `all_…`, which is its minimum: it holds only if it held
/// for every case (`all_passed`). A case that faulted scores 0 on every component; its
/// fault is kept. When every case faulted, the first fault stands for the whole score (and
/// the reward's `fallback` applies). The note is the first case's that has one.
pub fn aggregate(results: Vec<CaseResult>) -> Scored {
    let count = results.len();
    let mut names: Vec<String> = Vec::new();
    let mut note = None;
    let mut faults = Vec::new();
    let mut scored = Vec::new();
    for (index, (result, case_note)) in results.into_iter().enumerate() {
        match result {
            Ok(components) => {
                for c in &components {
                    if !names.contains(&c.name) {
                        names.push(c.name.clone());
                    }
                }
                scored.push(components);
                if note.is_none() {
                    note = case_note;
                }
            }
            Err(fault) => {
                if note.is_none() {
                    note = Some(format!("case {index}: {} ({})", fault.message, fault.kind));
                }
                faults.push(fault);
            }
        }
    }
    if scored.is_empty() {
        let mut faults = faults.into_iter();
        return Scored {
            result: Err(faults.next().expect("at least one case")),
            case_faults: faults.collect(),
            note,
        };
    }
    let value = |components: &Vec<Component>, name: &str| {
        components
            .iter()
            .find(|c| c.name == name)
            .map_or(0.0, |c| c.value)
    };
    let components = names
        .into_iter()
        .map(|name| {
            // Faulted cases score 0: in a mean they count as 0, and they make a minimum 0.
            let values = scored.iter().map(|c| value(c, &name));
            let value = if name.starts_with("all_") {
                let min = values.fold(f64::INFINITY, f64::min);
                if faults.is_empty() { min } else { min.min(0.0) }
            } else {
                values.sum::<f64>() / count as f64
            };
            Component { name, value }
        })
        .collect();
    Scored {
        result: Ok(components),
        case_faults: faults,
        note,
    }
}

/// A reward a model computes on the run's device from a trajectory's tokens: a reward
/// model `rlhost rm` trained (`crate::rl::reward_model::Scorer`, which the config side
/// opens). Unlike a plugin it reads no text and calls nothing: it is scored once a batch's
/// rollouts have all finished, every trajectory of the batch in a few forwards.
pub trait ModelReward: Send + Sync {
    /// What messages call it (its folder).
    fn name(&self) -> &str;
    /// One score per sequence (a trajectory's prompt and completion tokens as sampled).
    fn score(&self, model: &Model, sequences: &[&[u32]]) -> Result<Vec<f64>>;
}

/// A reward model and the weight of its component in the total.
pub struct WeightedModel {
    pub scorer: Arc<dyn ModelReward>,
    pub weight: f64,
}

/// The component a reward model's score is recorded under.
pub const MODEL_COMPONENT: &str = "rm";

/// All reward functions of a run, its reward models, and the environment reward's weight.
pub struct Rewards {
    pub fns: Vec<Arc<RewardFn>>,
    pub models: Vec<WeightedModel>,
    pub env_weight: f64,
}

impl Rewards {
    /// Opens `instances` scorers per reward function.
    pub async fn open(
        specs: Vec<RewardSpec>,
        env_weight: f64,
        instances: usize,
    ) -> Result<Rewards> {
        let mut fns = Vec::new();
        for spec in specs {
            let mut scorers = Vec::new();
            for _ in 0..instances.max(1) {
                let scorer = spec
                    .plugin
                    .open_reward(&spec.config)
                    .await
                    .with_context(|| format!("opening reward plugin `{}`", spec.plugin.name()))?;
                scorers.push(Mutex::new(scorer));
            }
            let case_slots = Arc::new(tokio::sync::Semaphore::new(scorers.len()));
            fns.push(Arc::new(RewardFn {
                spec,
                scorers,
                next: Default::default(),
                case_slots,
            }));
        }
        Ok(Rewards {
            fns,
            models: Vec::new(),
            env_weight,
        })
    }

    /// No reward functions and no environment: every trajectory scores 0.
    pub fn none() -> Rewards {
        Rewards {
            fns: Vec::new(),
            models: Vec::new(),
            env_weight: 1.0,
        }
    }

    /// Writes the components, the weighted total, the faults and the notes into
    /// `trajectory`. `results` holds one entry per reward function, in order; `env` is
    /// the sum of the environment's step rewards, if it gave any.
    pub fn combine(&self, trajectory: &mut Trajectory, results: Vec<Scored>, env: Option<f64>) {
        let mut total = 0.0;
        for (f, scored) in self.fns.iter().zip(results) {
            for fault in &scored.case_faults {
                trajectory.faults.push(FaultRecord::from(fault));
            }
            if let Some(note) = scored.note {
                trajectory.notes.insert(f.name().to_string(), note);
            }
            match scored.result {
                Ok(components) => {
                    for c in components {
                        let w = f
                            .spec
                            .weights
                            .get(&c.name)
                            .copied()
                            .unwrap_or(f.spec.default_weight);
                        total += w * c.value;
                        // Two plugins naming a component alike keep both, the later one
                        // under `plugin/name`.
                        let key = if trajectory.rewards.contains_key(&c.name) {
                            format!("{}/{}", f.name(), c.name)
                        } else {
                            c.name
                        };
                        trajectory.rewards.insert(key, c.value);
                    }
                }
                Err(fault) => {
                    total += f.spec.fallback;
                    trajectory.faults.push(FaultRecord::from(&fault));
                }
            }
        }
        if let Some(env) = env {
            total += self.env_weight * env;
            trajectory.rewards.insert("env".into(), env);
        }
        trajectory.reward = total;
    }

    /// Adds each reward model's score of `trajectories` (already scored by [`combine`]:
    /// this adds to their totals) as the component `rm` (a second model's as
    /// `NAME/rm`), its weight times the score to the total. A model that fails fails the
    /// batch: it runs on the run's own device, as sampling does, and a score that is not a
    /// number would poison the step.
    ///
    /// [`combine`]: Rewards::combine
    pub fn score_models<'t>(
        &self,
        model: &Model,
        trajectories: impl IntoIterator<Item = &'t mut Trajectory>,
    ) -> Result<()> {
        if self.models.is_empty() {
            return Ok(());
        }
        let mut all: Vec<&mut Trajectory> = trajectories.into_iter().collect();
        if all.is_empty() {
            return Ok(());
        }
        for m in &self.models {
            let sequences: Vec<&[u32]> = all.iter().map(|t| t.tokens.as_slice()).collect();
            let scores = m
                .scorer
                .score(model, &sequences)
                .with_context(|| format!("scoring with the reward model {}", m.scorer.name()))?;
            if let Some(bad) = scores.iter().find(|s| !s.is_finite()) {
                anyhow::bail!(
                    "the reward model {} scored a trajectory {bad}",
                    m.scorer.name()
                );
            }
            for (t, score) in all.iter_mut().zip(scores) {
                let key = if t.rewards.contains_key(MODEL_COMPONENT) {
                    format!("{}/{MODEL_COMPONENT}", m.scorer.name())
                } else {
                    MODEL_COMPONENT.to_string()
                };
                t.rewards.insert(key, score);
                t.reward += m.weight * score;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::FaultKind;

    fn c(name: &str, value: f64) -> Component {
        Component {
            name: name.into(),
            value,
        }
    }

    fn fault(message: &str) -> Fault {
        Fault {
            plugin: "code_tests@0.1.0".into(),
            call: "reward.score",
            kind: FaultKind::Timeout,
            message: message.into(),
        }
    }

    #[test]
    fn cases_come_from_lists_parallel_lists_and_json_text() {
        assert_eq!(split_cases(&json!(["a", "b"])), [json!("a"), json!("b")]);
        // APPS: parallel lists, scalar fields copied into each case.
        let apps = json!({"inputs": [[1, 2], [3]], "outputs": [[3], [3]], "fn_name": "f"});
        assert_eq!(
            split_cases(&apps),
            [
                json!({"inputs": [1, 2], "outputs": [3], "fn_name": "f"}),
                json!({"inputs": [3], "outputs": [3], "fn_name": "f"})
            ]
        );
        assert_eq!(split_cases(&json!(apps.to_string())).len(), 2);
        // One script, an object without lists, unequal lists: one case, as given.
        let script = json!("def check(candidate):\n    assert candidate(1)");
        assert_eq!(split_cases(&script), std::slice::from_ref(&script));
        let one = json!({"input": "1", "output": "2"});
        assert_eq!(split_cases(&one), std::slice::from_ref(&one));
        let unequal = json!({"input": ["1"], "output": []});
        assert_eq!(split_cases(&unequal), std::slice::from_ref(&unequal));
        assert_eq!(split_cases(&json!("[not json")), [json!("[not json")]);
        assert!(split_cases(&json!([])).is_empty());
    }

    #[test]
    fn cases_average_all_components_take_the_minimum_and_faults_count_zero() {
        let s = aggregate(vec![
            (Ok(vec![c("passed", 1.0), c("all_passed", 1.0)]), None),
            (Err(fault("still running")), None),
            (
                Ok(vec![c("passed", 0.0), c("all_passed", 0.0)]),
                Some("case 2: wrong output".into()),
            ),
            (Ok(vec![c("passed", 1.0), c("all_passed", 1.0)]), None),
        ]);
        let got = s.result.unwrap();
        assert_eq!(got, [c("passed", 0.5), c("all_passed", 0.0)]);
        assert_eq!(s.case_faults.len(), 1);
        assert_eq!(s.note.as_deref(), Some("case 1: still running (timeout)"));

        // A fault alone makes an `all_` component 0 even where every scored case had 1.
        let s = aggregate(vec![
            (Ok(vec![c("all_passed", 1.0)]), None),
            (Err(fault("x")), None),
        ]);
        assert_eq!(s.result.unwrap(), [c("all_passed", 0.0)]);
        let s = aggregate(vec![
            (Ok(vec![c("all_passed", 1.0), c("passed", 1.0)]), None);
            3
        ]);
        assert_eq!(s.result.unwrap(), [c("all_passed", 1.0), c("passed", 1.0)]);
    }

    #[test]
    fn when_every_case_faults_the_first_fault_stands_for_the_score() {
        let s = aggregate(vec![(Err(fault("a")), None), (Err(fault("b")), None)]);
        assert_eq!(s.result.unwrap_err().message, "a");
        assert_eq!(s.case_faults.len(), 1);
        assert_eq!(s.case_faults[0].message, "b");
    }
}
