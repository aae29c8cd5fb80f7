//! Rewards: reward plugins score a finished trajectory into named components; the run
//! config weighs and sums them, and an environment's step rewards add in as `env`.
//!
//! A reward plugin's fault never stops a run: the plugin's share of the total becomes its
//! configured `fallback`, the fault is counted by the plugin and recorded on the
//! trajectory, and training goes on.

use super::trajectory::{FaultRecord, Trajectory};
use crate::plugin::{Component, Fault, Plugin, RewardScorer};
use anyhow::{Context, Result};
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
}

/// An opened reward function: a few scorer instances so that trajectories finishing
/// together are scored in parallel.
pub struct RewardFn {
    spec: RewardSpec,
    scorers: Vec<Mutex<RewardScorer>>,
    next: std::sync::atomic::AtomicUsize,
}

impl RewardFn {
    pub fn name(&self) -> &str {
        self.spec.plugin.name()
    }

    /// Scores one trajectory on one of the instances.
    pub async fn score(
        &self,
        trajectory: &crate::plugin::Trajectory,
    ) -> Result<Vec<Component>, Fault> {
        let i = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % self.scorers.len();
        self.scorers[i].lock().await.score(trajectory).await
    }
}

/// All reward functions of a run, and the environment reward's weight.
pub struct Rewards {
    pub fns: Vec<Arc<RewardFn>>,
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
            fns.push(Arc::new(RewardFn {
                spec,
                scorers,
                next: Default::default(),
            }));
        }
        Ok(Rewards { fns, env_weight })
    }

    /// No reward functions and no environment: every trajectory scores 0.
    pub fn none() -> Rewards {
        Rewards {
            fns: Vec::new(),
            env_weight: 1.0,
        }
    }

    /// Writes the components and the weighted total into `trajectory`. `results` holds one
    /// entry per reward function, in order; `env` is the sum of the environment's step
    /// rewards, if it gave any.
    pub fn combine(
        &self,
        trajectory: &mut Trajectory,
        results: Vec<Result<Vec<Component>, Fault>>,
        env: Option<f64>,
    ) {
        let mut total = 0.0;
        for (f, result) in self.fns.iter().zip(results) {
            match result {
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
}
