//! `rlhost status URL`: a running job's `/status`, fetched and printed for a terminal.

use super::Status;
use anyhow::{Context, Result};
use std::time::Duration;

/// Fetches `/status` from `url` (the dashboard's address, with or without `/status`).
pub fn fetch(url: &str) -> Result<Status> {
    let base = url.trim_end_matches('/').trim_end_matches("/status");
    let base = if base.contains("://") {
        base.to_string()
    } else {
        format!("http://{base}")
    };
    let endpoint = format!("{base}/status");
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into();
    let body = agent
        .get(&endpoint)
        .call()
        .and_then(|mut r| r.body_mut().read_to_string())
        .with_context(|| {
            format!("cannot read {endpoint} (is the run started with --status-addr, and is it still running?)")
        })?;
    serde_json::from_str(&body)
        .with_context(|| format!("{endpoint} did not answer with an rlhost status"))
}

/// `2m 05s`, `1h 02m`.
pub fn duration(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return "-".into();
    }
    let s = secs.round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {:02}s", s / 60, s % 60),
        _ => format!("{}h {:02}m", s / 3600, s % 3600 / 60),
    }
}

/// The status as a few aligned lines.
pub fn render(st: &Status) -> String {
    let mut out = String::new();
    let pct = 100.0 * st.step as f64 / st.total_steps.max(1) as f64;
    out.push_str(&format!(
        "run {}  phase {}  step {}/{} ({pct:.0}%)  epoch {}  adapter v{}\n",
        st.run_id,
        st.phase.as_str(),
        st.step,
        st.total_steps,
        st.epoch,
        st.adapter_version
    ));
    out.push_str(&format!(
        "elapsed {}  eta {}  sampled tokens/s {}\n",
        duration(st.elapsed_s),
        st.eta_s.map_or("-".into(), duration),
        st.tokens_per_s.map_or("-".into(), |t| format!("{t:.0}"))
    ));
    out.push_str(&format!("model {}  config {}\n", st.model, st.config));
    if let Some(m) = &st.metrics {
        let comps: Vec<String> = m
            .rewards
            .iter()
            .map(|(k, v)| format!("{k} {v:.3}"))
            .collect();
        out.push_str(&format!(
            "reward {:.3} ± {:.3}{}{}\n",
            m.reward_mean,
            m.reward_std,
            if comps.is_empty() {
                String::new()
            } else {
                format!("  ({})", comps.join(", "))
            },
            m.accuracy
                .map(|a| format!("  accuracy {a:.3}"))
                .unwrap_or_default()
        ));
        out.push_str(&format!(
            "loss {:.4}  kl {:.4}  entropy {:.3}  clip fraction {:.3}  grad norm {:.3}  lr {:.2e}\n",
            m.loss, m.kl, m.entropy, m.clip_fraction, m.grad_norm, m.lr
        ));
        out.push_str(&format!(
            "response {:.1} tokens  turns {:.2}  tool calls {:.2}  truncated {:.1}%  step {:.1}s (rollout {:.1}s, update {:.1}s)\n",
            m.response_tokens,
            m.turns,
            m.tool_calls,
            100.0 * m.truncated,
            m.step_s,
            m.rollout_s,
            m.update_s
        ));
    }
    if let Some(e) = &st.eval {
        out.push_str(&format!(
            "held-out (step {}): reward {:.3}{}{}\n",
            e.step,
            e.reward,
            e.accuracy
                .map(|a| format!("  accuracy {a:.3}"))
                .unwrap_or_default(),
            e.tool_use
                .map(|t| format!("  tool use {:.1}%", 100.0 * t))
                .unwrap_or_default()
        ));
    }
    if st.faults_total.is_empty() {
        out.push_str("plugin faults: none\n");
    } else {
        let f: Vec<String> = st
            .faults_total
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        out.push_str(&format!("plugin faults: {}\n", f.join(", ")));
    }
    if let Some(c) = &st.last_checkpoint {
        out.push_str(&format!("last checkpoint: {c}\n"));
    }
    if let Some(e) = &st.error {
        out.push_str(&format!("error: {e}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_like_a_clock() {
        assert_eq!(duration(5.4), "5s");
        assert_eq!(duration(125.0), "2m 05s");
        assert_eq!(duration(3720.0), "1h 02m");
        assert_eq!(duration(f64::NAN), "-");
    }
}
