//! {{name}}: a reward (it scores finished trajectories into named components). This one
//! gives `format` (the completion answers in `<answer>…</answer>`) and `correct` (that
//! answer is the sample's `answer` from its metadata; 0 when the sample has none). Replace
//! the scoring with yours; the run config weighs the components.
//!
//! Config (JSON): `{"tag": "answer"}` (optional): the tag the answer is written in.

use rlhost_sdk::{Component, Reward, Trajectory};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {
    tag: String,
}

impl Default for Config {
    fn default() -> Self {
        Config { tag: "answer".into() }
    }
}

struct Score {
    open: String,
    close: String,
}

impl Reward for Score {
    fn open(config: &str) -> Result<Self, String> {
        let config: Config =
            serde_json::from_str(config).map_err(|e| format!("{{name}} config: {e}"))?;
        if config.tag.is_empty() || config.tag.contains(['<', '>', '/']) {
            return Err("{{name}} config: `tag` must be a tag name such as \"answer\"".into());
        }
        Ok(Score {
            open: format!("<{}>", config.tag),
            close: format!("</{}>", config.tag),
        })
    }

    fn score(&mut self, trajectory: Trajectory) -> Result<Vec<Component>, String> {
        let text = &trajectory.completion;
        let given = text.rfind(&self.close).and_then(|end| {
            let start = text[..end].rfind(&self.open)? + self.open.len();
            Some(text[start..end].trim().to_string())
        });
        let metadata: serde_json::Value = serde_json::from_str(&trajectory.metadata)
            .map_err(|e| format!("{{name}}: the sample's metadata is not JSON: {e}"))?;
        let expected = match &metadata["answer"] {
            serde_json::Value::String(s) => Some(s.trim().to_string()),
            serde_json::Value::Null => None,
            other => Some(other.to_string()),
        };
        let correct = given.is_some() && given == expected;
        Ok(vec![
            Component::new("format", if given.is_some() { 1.0 } else { 0.0 }),
            Component::new("correct", if correct { 1.0 } else { 0.0 }),
        ])
    }
}

rlhost_sdk::export!(reward: Score);
