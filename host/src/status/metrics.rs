//! `/metrics`: the run's figures as Prometheus text exposition, through the official
//! Rust client (`prometheus-client`). Gauges hold the last step's values (a scrape every
//! few seconds sees every step of a slow run, and the latest of a fast one); plugin
//! faults are a counter per plugin and kind, so `rate()` works on them.

use super::figures::{EVERY_STEP, Figure, SOME_STEPS};
use super::phase::Phase;
use crate::step::StepMetrics;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

type F64 = Gauge<f64, AtomicU64>;
type Labels = Vec<(String, String)>;

/// Every figure `/metrics` exposes; the hub sets them, the server encodes them.
pub struct Metrics {
    registry: Registry,
    pub step: F64,
    pub total_steps: F64,
    phase: Family<Labels, F64>,
    /// One per named figure of [`EVERY_STEP`], in its order.
    gauges: Vec<(&'static Figure<f64>, F64)>,
    reward_component: Family<Labels, F64>,
    accuracy: F64,
    /// Figures only some steps have (PPO's, the held-out set's): set on those steps, kept
    /// in between.
    some_steps: Vec<(&'static Figure<Option<f64>>, F64)>,
    faults: Family<Labels, Counter>,
    http: Family<Labels, Counter>,
    generate: Family<Labels, Counter>,
    generate_wait: Family<Labels, Counter<f64, AtomicU64>>,
}

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
        let gauges = EVERY_STEP
            .iter()
            .filter_map(|f| {
                let g = F64::default();
                registry.register(f.name?, f.help, g.clone());
                Some((f, g))
            })
            .collect();
        let accuracy = F64::default();
        registry.register(
            "accuracy",
            "Mean of the `correct` reward component (NaN when no reward gives one)",
            accuracy.clone(),
        );
        accuracy.set(f64::NAN);
        let some_steps = SOME_STEPS
            .iter()
            .filter_map(|f| {
                let g = F64::default();
                g.set(f64::NAN);
                registry.register(f.name?, f.help, g.clone());
                Some((f, g))
            })
            .collect();
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
        let http = Family::<Labels, Counter>::default();
        registry.register(
            "plugin_http_requests",
            "Outbound HTTP requests of plugins granted allow_http, by plugin and outcome \
             (answered, denied, failed)",
            http.clone(),
        );
        let generate = Family::<Labels, Counter>::default();
        registry.register(
            "plugin_generate_calls",
            "model.generate calls of plugins, by plugin and outcome (answered, refused, failed)",
            generate.clone(),
        );
        let generate_wait = Family::<Labels, Counter<f64, AtomicU64>>::default();
        registry.register(
            "plugin_generate_wait_seconds",
            "Seconds plugins' model.generate calls waited for their answers, summed, by plugin",
            generate_wait.clone(),
        );
        Metrics {
            http,
            generate,
            generate_wait,
            registry,
            step,
            total_steps,
            phase,
            gauges,
            reward_component,
            accuracy,
            some_steps,
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
        for (f, gauge) in &self.gauges {
            gauge.set((f.get)(m));
        }
        self.accuracy.set(m.accuracy.unwrap_or(f64::NAN));
        for (f, gauge) in &self.some_steps {
            if let Some(v) = (f.get)(m) {
                gauge.set(v);
            }
        }
        for (k, v) in &m.rewards {
            self.reward_component
                .get_or_create(&vec![("component".to_string(), k.clone())])
                .set(*v);
        }
        for (key, n) in &m.faults {
            // `plugin/kind`; a plugin name may hold `/` itself (`openenv:http://…`).
            let (plugin, kind) = key.rsplit_once('/').unwrap_or((key.as_str(), "unknown"));
            self.faults
                .get_or_create(&vec![
                    ("plugin".to_string(), plugin.to_string()),
                    ("kind".to_string(), kind.to_string()),
                ])
                .inc_by(*n);
        }
        for (plugin, s) in &m.generate_wait_s {
            self.generate_wait
                .get_or_create(&vec![("plugin".to_string(), plugin.clone())])
                .inc_by(*s);
        }
        for (family, counts) in [
            (&self.http, &m.http_requests),
            (&self.generate, &m.generate_calls),
        ] {
            for (key, n) in counts {
                let (plugin, outcome) = key.split_once('/').unwrap_or((key.as_str(), "unknown"));
                family
                    .get_or_create(&vec![
                        ("plugin".to_string(), plugin.to_string()),
                        ("outcome".to_string(), outcome.to_string()),
                    ])
                    .inc_by(*n);
            }
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
