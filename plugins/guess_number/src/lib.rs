//! A turn-level environment (RL2 / rl4llm style): the model guesses a secret number; after
//! each assistant turn the environment answers `higher`, `lower` or ends the episode.
//!
//! The secret is the sample's `metadata.secret`. Config (optional):
//! `{"max_guesses": 8}`. Reward: 1.0 on the step that guesses right, and -0.1 for a turn
//! with no number in it, so that a policy learns to guess and to guess well.

use rlhost_sdk::{Environment, Message, Sample, StepResult};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {
    max_guesses: u32,
}

impl Default for Config {
    fn default() -> Self {
        Config { max_guesses: 8 }
    }
}

#[derive(Deserialize)]
struct Metadata {
    secret: i64,
}

struct Game {
    secret: i64,
    guesses: u32,
    max_guesses: u32,
}

/// The last integer in the text, e.g. `I guess 42.` → 42.
fn last_number(text: &str) -> Option<i64> {
    text.split(|c: char| !(c.is_ascii_digit() || c == '-'))
        .filter_map(|word| word.parse().ok())
        .next_back()
}

fn reply(content: String, done: bool, reward: Option<f64>) -> StepResult {
    StepResult {
        messages: if done {
            vec![]
        } else {
            vec![Message::new("user", content)]
        },
        done,
        reward,
    }
}

impl Environment for Game {
    fn open(config: &str, sample: Sample) -> Result<Self, String> {
        let config: Config =
            serde_json::from_str(config).map_err(|e| format!("guess_number config: {e}"))?;
        let metadata: Metadata = serde_json::from_str(&sample.metadata)
            .map_err(|e| format!("guess_number: sample metadata needs a `secret` number: {e}"))?;
        Ok(Game {
            secret: metadata.secret,
            guesses: 0,
            max_guesses: config.max_guesses,
        })
    }

    fn step(&mut self, assistant: &str) -> Result<StepResult, String> {
        self.guesses += 1;
        let out_of_guesses = self.guesses >= self.max_guesses;
        Ok(match last_number(assistant) {
            Some(guess) if guess == self.secret => reply(String::new(), true, Some(1.0)),
            _ if out_of_guesses => reply(String::new(), true, Some(0.0)),
            Some(guess) if guess < self.secret => {
                reply(format!("{guess} is too low. Higher."), false, None)
            }
            Some(guess) => reply(format!("{guess} is too high. Lower."), false, None),
            None => reply("Say a number.".into(), false, Some(-0.1)),
        })
    }
}

rlhost_sdk::export!(environment: Game);
