//! What a running job shows the outside world: the [`StatusHub`] the trainer writes to,
//! and the HTTP server ([`server`]), Prometheus metrics ([`metrics`]), dashboard page and
//! TensorBoard files ([`tensorboard`]) that read from it.
//!
//! The trainer's side is cheap and never waits on a reader: each step it takes a short
//! write lock to store pre-serialized JSON, sets a few gauges and sends one event on a
//! bounded broadcast channel (a reader that falls behind loses events and is told to
//! resynchronise; it never blocks the sender). All formatting for clients happens on the
//! server's own thread.

pub mod client;
pub mod figures;
pub mod metrics;
mod phase;
pub mod server;
pub mod tensorboard;

use crate::rollout::{SpanKind, Trajectory};
use crate::step::StepMetrics;
pub use phase::Phase;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::broadcast;

/// What `/status` answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    pub run_id: String,
    pub phase: Phase,
    /// Steps finished.
    pub step: u64,
    pub total_steps: u64,
    pub epoch: u64,
    pub adapter_version: u64,
    pub elapsed_s: f64,
    /// Remaining steps times the mean time of the last few steps.
    pub eta_s: Option<f64>,
    pub last_checkpoint: Option<String>,
    pub error: Option<String>,
    pub model: String,
    pub config: String,
    pub tokens_per_s: Option<f64>,
    /// Plugin faults since the run started, `plugin/kind` → count.
    pub faults_total: BTreeMap<String, u64>,
    /// The last step's figures.
    pub metrics: Option<StepMetrics>,
    /// The last held-out evaluation (`train.eval_every`).
    pub eval: Option<EvalPoint>,
    /// The held-out evaluation before the first update.
    pub eval_start: Option<EvalPoint>,
}

/// Held-out figures of one evaluation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalPoint {
    pub step: u64,
    pub accuracy: Option<f64>,
    pub reward: f64,
    pub tool_use: Option<f64>,
}

/// A trajectory as the rollout viewer shows it: text in spans, rewards, how it ended.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RolloutView {
    pub sample_id: u64,
    pub index: usize,
    /// The training step whose batch held it.
    pub step: u64,
    /// The adapter version that sampled it.
    pub version: u64,
    pub reward: f64,
    pub rewards: BTreeMap<String, f64>,
    pub stop: String,
    pub truncated: bool,
    pub turns: u32,
    pub tool_calls: u32,
    /// Function calls by how they went (`ok`, `tool_error`, a malformed call's kind, ...).
    #[serde(default)]
    pub call_kinds: BTreeMap<String, u32>,
    /// The prompt's messages, `role: content` per line.
    pub prompt: String,
    pub spans: Vec<ViewSpan>,
    pub faults: Vec<crate::rollout::FaultRecord>,
    /// What each reward plugin said about its score (a code reward's first failed test).
    #[serde(default)]
    pub notes: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ViewSpan {
    /// `model`, `tool` or `env`.
    pub kind: String,
    pub text: String,
}

impl RolloutView {
    pub fn new(t: &Trajectory, step: u64) -> RolloutView {
        let prompt = t
            .messages
            .iter()
            .take_while(|m| m.role != "assistant")
            .map(|m| format!("{}: {}", m.role, m.content))
            .collect::<Vec<_>>()
            .join("\n");
        RolloutView {
            sample_id: t.sample_id,
            index: t.index,
            step,
            version: t.version,
            reward: t.reward,
            rewards: t.rewards.clone(),
            stop: t.stop.as_str().to_string(),
            truncated: t.truncated,
            turns: t.turns,
            tool_calls: t.tool_calls,
            call_kinds: t.call_kinds.clone(),
            prompt,
            spans: t
                .spans
                .iter()
                .map(|s| ViewSpan {
                    kind: match s.kind {
                        SpanKind::Model => "model",
                        SpanKind::Tool => "tool",
                        SpanKind::Env => "env",
                    }
                    .to_string(),
                    text: s.text.clone(),
                })
                .collect(),
            faults: t.faults.clone(),
            notes: t.notes.clone(),
        }
    }
}

/// One server-sent event, serialized once for every subscriber.
#[derive(Debug, Clone)]
pub struct Event {
    /// `step` or `status`.
    pub name: &'static str,
    pub data: Arc<str>,
}

/// Trajectories kept for `/rollouts/latest`.
pub const MAX_ROLLOUTS: usize = 64;
/// Events a subscriber may fall behind before it is told to resynchronise.
const EVENT_BUFFER: usize = 256;

struct State {
    status: Status,
    /// Each step's metrics as JSON, in order (for `/history`).
    history: Vec<Arc<str>>,
    /// Recent step times, for the ETA.
    step_times: Vec<f64>,
    rollouts: Arc<Vec<RolloutView>>,
    rollouts_step: u64,
}

/// The run's live state; the trainer writes, the status server reads.
pub struct StatusHub {
    state: RwLock<State>,
    started: Instant,
    events: broadcast::Sender<Event>,
    pub metrics: metrics::Metrics,
}

impl StatusHub {
    pub fn new(run_id: &str, model: &str, config: &str, total_steps: u64) -> Arc<StatusHub> {
        let (events, _) = broadcast::channel(EVENT_BUFFER);
        let metrics = metrics::Metrics::new(run_id);
        metrics.set_phase(Phase::Loading);
        metrics.total_steps.set(total_steps as f64);
        Arc::new(StatusHub {
            state: RwLock::new(State {
                status: Status {
                    run_id: run_id.to_string(),
                    phase: Phase::Loading,
                    step: 0,
                    total_steps,
                    epoch: 0,
                    adapter_version: 0,
                    elapsed_s: 0.0,
                    eta_s: None,
                    last_checkpoint: None,
                    error: None,
                    model: model.to_string(),
                    config: config.to_string(),
                    tokens_per_s: None,
                    faults_total: BTreeMap::new(),
                    metrics: None,
                    eval: None,
                    eval_start: None,
                },
                history: Vec::new(),
                step_times: Vec::new(),
                rollouts: Arc::new(Vec::new()),
                rollouts_step: 0,
            }),
            started: Instant::now(),
            events,
            metrics,
        })
    }

    /// A run id from the config's name and the start time, e.g. `multiply-20261122-101500`.
    pub fn run_id(config: &std::path::Path) -> String {
        let stem = config
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "run".into());
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        format!("{stem}-{}", utc_stamp(secs))
    }

    /// Where a resumed run starts (so the progress and ETA count from there).
    pub fn resume_at(&self, step: u64) {
        let mut s = self.write();
        s.status.step = step;
        s.status.adapter_version = step;
        self.metrics.step.set(step as f64);
    }

    /// The held-out evaluation of the starting model (shown as the "before" figures).
    pub fn eval_start(&self, point: &EvalPoint) {
        self.write().status.eval_start = Some(point.clone());
    }

    pub fn set_phase(&self, phase: Phase) {
        let json = {
            let mut s = self.write();
            if s.status.phase == phase {
                return;
            }
            s.status.phase = phase;
            s.status.elapsed_s = self.started.elapsed().as_secs_f64();
            serde_json::to_string(&s.status).unwrap_or_default()
        };
        self.metrics.set_phase(phase);
        let _ = self.events.send(Event {
            name: "status",
            data: json.into(),
        });
    }

    /// A finished step: its metrics and the batch's trajectories (the last
    /// [`MAX_ROLLOUTS`] are kept for the viewer).
    pub fn step<'a>(
        &self,
        m: &StepMetrics,
        trajectories: impl IntoIterator<Item = &'a Trajectory>,
    ) {
        let json: Arc<str> = serde_json::to_string(m).unwrap_or_default().into();
        let all: Vec<&Trajectory> = trajectories.into_iter().collect();
        let views: Vec<RolloutView> = all
            .iter()
            .skip(all.len().saturating_sub(MAX_ROLLOUTS))
            .map(|t| RolloutView::new(t, m.step))
            .collect();
        {
            let mut s = self.write();
            let st = &mut s.status;
            st.step = m.step;
            st.epoch = m.epoch;
            st.adapter_version = m.adapter_version;
            st.tokens_per_s = Some(m.sampled_tokens_per_s);
            for (k, v) in &m.faults {
                *st.faults_total.entry(k.clone()).or_default() += v;
            }
            st.metrics = Some(m.clone());
            if let Some(reward) = m.eval_reward {
                st.eval = Some(EvalPoint {
                    step: m.step,
                    accuracy: m.eval_accuracy,
                    reward,
                    tool_use: m.eval_tool_use,
                });
            }
            s.step_times.push(m.step_s);
            // The ETA follows the recent pace (the first steps include warm-up costs).
            let recent = &s.step_times[s.step_times.len().saturating_sub(10)..];
            let pace = recent.iter().sum::<f64>() / recent.len() as f64;
            s.status.eta_s = Some(pace * s.status.total_steps.saturating_sub(m.step) as f64);
            s.history.push(json.clone());
            s.rollouts = Arc::new(views);
            s.rollouts_step = m.step;
        }
        self.metrics.record(m);
        let _ = self.events.send(Event {
            name: "step",
            data: json,
        });
    }

    pub fn checkpoint(&self, path: &str) {
        self.write().status.last_checkpoint = Some(path.to_string());
    }

    /// The run ended with an error.
    pub fn fail(&self, error: &str) {
        self.write().status.error = Some(error.to_string());
        self.set_phase(Phase::Failed);
    }

    pub fn status(&self) -> Status {
        let mut st = self.read().status.clone();
        if !matches!(st.phase, Phase::Done | Phase::Failed) {
            st.elapsed_s = self.started.elapsed().as_secs_f64();
        }
        st
    }

    /// `{"steps":[...]}`, every step so far.
    pub fn history_json(&self) -> String {
        let s = self.read();
        let mut out =
            String::with_capacity(16 + s.history.iter().map(|h| h.len() + 1).sum::<usize>());
        out.push_str("{\"steps\":[");
        for (i, h) in s.history.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(h);
        }
        out.push_str("]}");
        out
    }

    /// The step the rollouts are from and the last `n` of them.
    pub fn rollouts(&self, n: usize) -> (u64, Vec<RolloutView>) {
        let (step, all) = {
            let s = self.read();
            (s.rollouts_step, s.rollouts.clone())
        };
        let skip = all.len().saturating_sub(n);
        (step, all[skip..].to_vec())
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    /// Readers of `/events` now (a dashboard holds one while its page is open).
    pub fn viewers(&self) -> usize {
        self.events.receiver_count()
    }

    // A poisoned lock only means a panic elsewhere while holding it; the state is plain
    // data, still readable.
    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// `YYYYMMDD-HHMMSS` in UTC (civil-from-days, Howard Hinnant's algorithm).
fn utc_stamp(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_stamp_matches_known_dates() {
        // date -u -d @0 / @951782400 (leap day 2000) / @1795305600
        assert_eq!(utc_stamp(0), "19700101-000000");
        assert_eq!(utc_stamp(951_782_400), "20000229-000000");
        assert_eq!(utc_stamp(1_795_305_600 + 3_723), "20261122-010203");
    }

    #[test]
    fn step_updates_status_history_eta_and_faults() {
        let hub = StatusHub::new("r", "m", "c.toml", 10);
        let mut rx = hub.subscribe();
        for step in 1..=2 {
            let m = StepMetrics {
                step,
                step_s: 2.0,
                faults: [("calc/timeout".to_string(), 1)].into(),
                ..Default::default()
            };
            hub.step(&m, []);
        }
        let st = hub.status();
        assert_eq!(st.step, 2);
        assert_eq!(st.eta_s, Some(16.0));
        assert_eq!(st.faults_total["calc/timeout"], 2);
        let h: serde_json::Value = serde_json::from_str(&hub.history_json()).unwrap();
        assert_eq!(h["steps"].as_array().unwrap().len(), 2);
        assert_eq!(h["steps"][1]["step"], 2);
        let e = rx.try_recv().unwrap();
        assert_eq!(e.name, "step");
        hub.set_phase(Phase::Update);
        hub.set_phase(Phase::Update);
        assert_eq!(rx.try_recv().unwrap().name, "step");
        let e = rx.try_recv().unwrap();
        assert_eq!(e.name, "status");
        assert!(e.data.contains("\"phase\":\"update\""));
        // The same phase twice is one event.
        assert!(rx.try_recv().is_err());
    }
}
