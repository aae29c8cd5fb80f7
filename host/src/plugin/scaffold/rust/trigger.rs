//! {{name}}: a trigger (a tool the model calls in the middle of generation). This one
//! upper-cases what the model writes between `<shout>` and `</shout>` and returns it as
//! `<result>…</result>`. Replace the tool with yours.
//!
//! Config (JSON): `{"suffix": "!"}` (optional) is appended to each result.

use rlhost_sdk::{Sample, Trigger};
use serde::Deserialize;

const OPEN: &str = "<shout>";
const CLOSE: &str = "</shout>";

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct Config {
    suffix: String,
}

/// One trajectory's session: it may keep state between the calls of that trajectory.
struct Shout {
    config: Config,
}

impl Trigger for Shout {
    fn open(config: &str, _sample: Sample) -> Result<Self, String> {
        let config = serde_json::from_str(config).map_err(|e| format!("{{name}} config: {e}"))?;
        Ok(Shout { config })
    }

    fn stop_patterns(&self) -> Vec<String> {
        vec![CLOSE.to_string()]
    }

    fn fire(&mut self, text: &str) -> Result<Option<String>, String> {
        // The host fires when the text ends with a stop pattern; check anyway.
        let Some(body) = text.strip_suffix(CLOSE) else {
            return Ok(None);
        };
        let Some(start) = body.rfind(OPEN) else {
            return Ok(None);
        };
        let shouted = body[start + OPEN.len()..].to_uppercase();
        Ok(Some(format!("<result>{shouted}{}</result>", self.config.suffix)))
    }
}

rlhost_sdk::export!(trigger: Shout);
