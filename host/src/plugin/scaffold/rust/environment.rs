//! {{name}}: an environment (it answers each assistant turn). This one keeps the model
//! talking for a number of turns and rewards a last turn that says `done`. Replace the
//! game with yours.
//!
//! Config (JSON): `{"turns": 3}` (optional): how many assistant turns an episode has.

use rlhost_sdk::{Environment, Message, Sample, StepResult};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {
    turns: u32,
}

impl Default for Config {
    fn default() -> Self {
        Config { turns: 3 }
    }
}

/// One trajectory's episode.
struct Talk {
    config: Config,
    turn: u32,
}

impl Environment for Talk {
    fn open(config: &str, _sample: Sample) -> Result<Self, String> {
        let config: Config =
            serde_json::from_str(config).map_err(|e| format!("{{name}} config: {e}"))?;
        if config.turns == 0 {
            return Err("{{name}} config: `turns` must be at least 1".into());
        }
        Ok(Talk { config, turn: 0 })
    }

    fn step(&mut self, assistant: &str) -> Result<StepResult, String> {
        self.turn += 1;
        if self.turn >= self.config.turns {
            let said_done = assistant.to_lowercase().contains("done");
            return Ok(StepResult {
                messages: Vec::new(),
                done: true,
                reward: Some(if said_done { 1.0 } else { 0.0 }),
            });
        }
        let left = self.config.turns - self.turn;
        Ok(StepResult {
            messages: vec![Message::new(
                "user",
                format!("You wrote {} characters. {left} turns to go; say done in the last.", assistant.chars().count()),
            )],
            done: false,
            reward: None,
        })
    }
}

rlhost_sdk::export!(environment: Talk);
