//! `sim_user`: an environment whose user is played by the model itself (a simulated user,
//! as in tau-bench-style multi-turn tasks), asked through `model.generate`, which the run
//! must grant.
//!
//! Config: `{"persona": "...", "turns": 3, "max_new_tokens": 48, "temperature": 0.7}`.
//! After each assistant turn the user model reads its persona (a system message) and the
//! conversation so far with the roles swapped (the assistant's turns are what it was told,
//! its own earlier turns what it said), and writes the user's next message. The episode
//! ends after `turns` assistant turns, or when the user's message holds `[done]`. No step
//! reward: a reward plugin scores the whole conversation.
//!
//! The run grants it: `[plugins.sim_user] generate = { weights = ["base"], temperature_max
//! = 1.0 }`. Each call is seeded from the trajectory, so a run repeats. A call the grant
//! refuses ends the episode with the refusal as the plugin's error (a fault, counted).

use rlhost_sdk::model::{GenerateRequest, Prompt, Weights};
use rlhost_sdk::{Environment, Message, Sample, StepResult};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {
    persona: String,
    turns: u32,
    max_new_tokens: u32,
    temperature: f32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            persona: "You are a curious user. Ask short follow-up questions. \
                      Say [done] when you are satisfied."
                .into(),
            turns: 3,
            max_new_tokens: 48,
            temperature: 0.7,
        }
    }
}

struct SimUser {
    config: Config,
    /// The conversation as the assistant sees it.
    history: Vec<Message>,
    turns: u32,
}

/// The conversation as the user model reads it: its persona, then the roles swapped.
fn user_view(persona: &str, history: &[Message]) -> Vec<Message> {
    let mut view = vec![Message::new("system", persona)];
    for m in history {
        let role = match m.role.as_str() {
            "assistant" => "user",
            "user" => "assistant",
            _ => continue,
        };
        view.push(Message::new(role, m.content.clone()));
    }
    view
}

impl Environment for SimUser {
    fn open(config: &str, sample: Sample) -> Result<Self, String> {
        let config: Config =
            serde_json::from_str(config).map_err(|e| format!("sim_user config: {e}"))?;
        if config.turns == 0 || config.max_new_tokens == 0 {
            return Err("sim_user config: `turns` and `max_new_tokens` must be at least 1".into());
        }
        Ok(SimUser {
            config,
            history: sample.messages,
            turns: 0,
        })
    }

    fn step(&mut self, assistant: &str) -> Result<StepResult, String> {
        self.history.push(Message::new("assistant", assistant));
        self.turns += 1;
        if self.turns >= self.config.turns {
            return Ok(StepResult {
                messages: Vec::new(),
                done: true,
                reward: None,
            });
        }
        let mut request = GenerateRequest::new(
            Prompt::Messages(user_view(&self.config.persona, &self.history)),
            self.config.max_new_tokens,
        );
        request.weights = Weights::Base;
        request.temperature = self.config.temperature;
        let said = rlhost_sdk::model::generate(&request)
            .map_err(|e| format!("sim_user: {e}"))?
            .text;
        let done = said.contains("[done]");
        let said = said.replace("[done]", "").trim().to_string();
        self.history.push(Message::new("user", said.clone()));
        Ok(StepResult {
            messages: vec![Message::new("user", said)],
            done,
            reward: None,
        })
    }
}

rlhost_sdk::export!(environment: SimUser);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_user_model_reads_the_conversation_with_roles_swapped() {
        let history = vec![
            Message::new("system", "be brief"),
            Message::new("user", "hi"),
            Message::new("assistant", "hello, how can I help?"),
        ];
        let view = user_view("persona", &history);
        let roles: Vec<&str> = view.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "assistant", "user"]);
        assert_eq!(view[0].content, "persona");
        assert_eq!(view[2].content, "hello, how can I help?");
    }
}
