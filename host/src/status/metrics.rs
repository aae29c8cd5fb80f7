//! `/metrics`: the run's figures as Prometheus text exposition, through the official
//! Rust client (`prometheus-client`). Gauges hold the last step's values (a scrape every
//! few seconds sees every step of a slow run, and the latest of a fast one); plugin
//! faults are a counter per plugin and kind, so `rate()` works on them.

use super::Phase;
use crate::rl::trainer::StepMetrics;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

type F64 = Gauge<f64, AtomicU64>;
type Labels = Vec<(String, String)>;
/// Reads an optional figure (the held-out ones) from a step's metrics.
type OptField = fn(&StepMetrics) -> Option<f64>;

/// Every figure `/metrics` exposes; the hub sets them, the server encodes them.
pub struct Metrics {
    registry: Registry,
    pub step: F64,
    pub total_steps: F64,
    phase: Family<Labels, F64>,
    gauges: Vec<(&'static str, F64)>,
    reward_component: Family<Labels, F64>,
    accuracy: F64,
    /// Held-out figures: set on the steps that evaluate, kept in between.
    eval: [(F64, OptField); 3],
    faults: Family<Labels, Counter>,
}

/// (name, help, the value in a step's metrics). Names follow Prometheus conventions:
/// base units (seconds), `_ratio` for fractions.
type Field = (&'static str, &'static str, fn(&StepMetrics) -> f64);
const FIELDS: &[Field] = &[
    ("epoch", "Epoch over the training split", |m| m.epoch as f64),
    ("adapter_version", "Adapter version after the step", |m| {
        m.adapter_version as f64
    }),
    (
        "reward_mean",
        "Mean reward of the step's trajectories",
        |m| m.reward_mean,
    ),
    (
        "reward_std",
        "Standard deviation of the step's rewards",
        |m| m.reward_std,
    ),
    ("loss", "Training loss", |m| m.loss),
    ("policy_loss", "Policy (clipped surrogate) loss", |m| {
        m.policy_loss
    }),
    ("kl", "Mean per-token KL to the reference policy", |m| m.kl),
    ("entropy", "Mean per-token entropy of the policy", |m| {
        m.entropy
    }),
    (
        "clip_fraction",
        "Fraction of tokens whose ratio was clipped",
        |m| m.clip_fraction,
    ),
    ("grad_norm", "Gradient norm before clipping", |m| {
        m.grad_norm
    }),
    ("learning_rate", "Learning rate of the step", |m| m.lr),
    (
        "response_tokens",
        "Mean sampled tokens per trajectory",
        |m| m.response_tokens,
    ),
    ("turns", "Mean assistant turns per trajectory", |m| m.turns),
    ("tool_calls", "Mean tool calls per trajectory", |m| {
        m.tool_calls
    }),
    (
        "truncated_ratio",
        "Fraction of trajectories a limit cut off",
        |m| m.truncated,
    ),
    ("trajectories", "Trajectories in the step's batch", |m| {
        m.trajectories as f64
    }),
    ("groups_dropped", "Groups dynamic sampling dropped", |m| {
        m.groups_dropped as f64
    }),
    ("sampled_tokens_per_second", "Rollout throughput", |m| {
        m.sampled_tokens_per_s
    }),
    (
        "rollout_seconds",
        "Time the step waited for rollouts",
        |m| m.rollout_s,
    ),
    ("update_seconds", "Time the step's update took", |m| {
        m.update_s
    }),
    ("step_seconds", "Wall time of the step", |m| m.step_s),
];

impl Metrics {
    pub fn new(run_id: &str) -> Metrics {
        let mut registry = Registry::with_prefix("rlhost");
        registry.register(
            "run",
            "The run this process trains",
            Info::new(vec![("run_id".to_string(), run_id.to_string())]),
        );
        let step = F64::default();
        registry.register("step", "Training steps finished", step.clone());
        let total_steps = F64::default();
        registry.register("total_steps", "Training steps planned", total_steps.clone());
        let phase = Family::<Labels, F64>::default();
        registry.register("phase", "1 for the run's current phase", phase.clone());
        let gauges: Vec<(&'static str, F64)> = FIELDS
            .iter()
            .map(|(name, help, _)| {
                let g = F64::default();
                registry.register(*name, *help, g.clone());
                (*name, g)
            })
            .collect();
        let accuracy = F64::default();
        registry.register(
            "accuracy",
            "Mean of the `correct` reward component (NaN when no reward gives one)",
            accuracy.clone(),
        );
        accuracy.set(f64::NAN);
        let eval_fields: [(&str, &str, OptField); 3] = [
            (
                "eval_accuracy",
                "Held-out accuracy, greedy, at the last evaluation (NaN before one)",
                |m| m.eval_accuracy,
            ),
            (
                "eval_reward",
                "Held-out mean reward at the last evaluation",
                |m| m.eval_reward,
            ),
            (
                "eval_tool_use_ratio",
                "Held-out share of answers that called a tool, at the last evaluation",
                |m| m.eval_tool_use,
            ),
        ];
        let eval = eval_fields.map(|(name, help, get)| {
            let g = F64::default();
            g.set(f64::NAN);
            registry.register(name, help, g.clone());
            (g, get)
        });
        let reward_component = Family::<Labels, F64>::default();
        registry.register(
            "reward_component",
            "Mean of each reward component",
            reward_component.clone(),
        );
        let faults = Family::<Labels, Counter>::default();
        registry.register(
            "plugin_faults",
            "Plugin faults (trap, timeout, out of memory, bad output) by plugin and kind",
            faults.clone(),
        );
        Metrics {
            registry,
            step,
            total_steps,
            phase,
            gauges,
            reward_component,
            accuracy,
            eval,
            faults,
        }
    }

    pub fn set_phase(&self, current: Phase) {
        for p in Phase::ALL {
            self.phase
                .get_or_create(&vec![("phase".to_string(), p.as_str().to_string())])
                .set(f64::from(u8::from(p == current)));
        }
    }

    pub fn record(&self, m: &StepMetrics) {
        self.step.set(m.step as f64);
        for ((_, _, get), (_, gauge)) in FIELDS.iter().zip(&self.gauges) {
            gauge.set(get(m));
        }
        self.accuracy.set(m.accuracy.unwrap_or(f64::NAN));
        for (gauge, get) in &self.eval {
            if let Some(v) = get(m) {
                gauge.set(v);
            }
        }
        for (k, v) in &m.rewards {
            self.reward_component
                .get_or_create(&vec![("component".to_string(), k.clone())])
                .set(*v);
        }
        for (key, n) in &m.faults {
            let (plugin, kind) = key.split_once('/').unwrap_or((key.as_str(), "unknown"));
            self.faults
                .get_or_create(&vec![
                    ("plugin".to_string(), plugin.to_string()),
                    ("kind".to_string(), kind.to_string()),
                ])
                .inc_by(*n);
        }
    }

    /// The text exposition format (version 0.0.4 compatible, OpenMetrics `# EOF` end).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
