//! A reward for literal patterns in the completion: one component per configured
//! pattern, valued by how often the pattern occurs (non-overlapping), capped. With
//! `cap = 1` it is a format or tool-use check ("did the answer use `<calc>`?").
//!
//! Config: `{"patterns": {"used_tool": "<calc>", "answered": "</answer>"}, "cap": 1}`.
//! `where` chooses the text searched: `"completion"` (default: everything generated,
//! tool output included) or `"assistant"` (the assistant messages only).

use rlhost_sdk::{Component, Reward, Trajectory};
use serde::Deserialize;
use std::collections::BTreeMap;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    patterns: BTreeMap<String, String>,
    #[serde(default = "one")]
    cap: f64,
    #[serde(default, rename = "where")]
    within: Within,
}

fn one() -> f64 {
    1.0
}

#[derive(Deserialize, Default, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum Within {
    #[default]
    Completion,
    Assistant,
}

struct Patterns(Config);

impl Reward for Patterns {
    fn open(config: &str) -> Result<Self, String> {
        let config: Config =
            serde_json::from_str(config).map_err(|e| format!("pattern_reward config: {e}"))?;
        if config.patterns.is_empty() {
            return Err("pattern_reward config: `patterns` must name at least one pattern".into());
        }
        if let Some((name, _)) = config.patterns.iter().find(|(_, p)| p.is_empty()) {
            return Err(format!("pattern_reward config: pattern `{name}` is empty"));
        }
        if !(config.cap > 0.0 && config.cap.is_finite()) {
            return Err("pattern_reward config: `cap` must be a positive number".into());
        }
        Ok(Patterns(config))
    }

    fn score(&mut self, trajectory: Trajectory) -> Result<Vec<Component>, String> {
        let text = match self.0.within {
            Within::Completion => trajectory.completion,
            Within::Assistant => trajectory
                .messages
                .iter()
                .filter(|m| m.role == "assistant")
                .map(|m| m.content.as_str())
                .collect::<Vec<_>>()
                .join("\n"),
        };
        Ok(self
            .0
            .patterns
            .iter()
            .map(|(name, p)| {
                let n = text.matches(p.as_str()).count() as f64;
                Component::new(name.clone(), n.min(self.0.cap))
            })
            .collect())
    }
}

rlhost_sdk::export!(reward: Patterns);
