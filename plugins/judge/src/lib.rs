//! `judge`: a reward that asks the run's base model to grade the answer against a rubric
//! (LiteChainRL's model-judged rewards, verl's "judge in the loop"), through
//! `model.generate`, which the run must grant.
//!
//! Config: `{"rubric": "...", "scale": 10, "max_new_tokens": 16, "temperature": 0}`
//! (greedy unless told; a temperature must be within the grant's). The judge reads the
//! rubric, the question (the prompt's last user message) and the answer (the trajectory's
//! last assistant message, or its completion), and is asked for `Score: N` with N from 0
//! to `scale`. Components:
//! - `judge`: N / scale, the first whole number after `Score:` (else the first whole
//!   number at all), capped at 1; 0 when there is none;
//! - `judge_parsed`: 1 when the answer held a number, 0 when the judge said none (a
//!   judge too weak for its rubric shows up here; weigh it 0 to watch it).
//!
//! Below full marks, the judge's reply is logged at `warn`: the host keeps it as the
//! trajectory's note (`notes.judge` in the rollout's records), so one can read why.
//!
//! The run grants it: `[plugins.judge] generate = { weights = ["base"] }` (the base model,
//! adapters off, greedy: a judge that does not drift with the policy it grades). A judge
//! the run does not grant, or one past its grant, is the plugin's error: the reward's
//! `fallback` counts, and the fault is counted and recorded.

use rlhost_sdk::model::{GenerateRequest, Prompt, Weights};
use rlhost_sdk::{Component, Message, Reward, Trajectory};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    rubric: String,
    #[serde(default = "ten")]
    scale: u32,
    #[serde(default = "sixteen")]
    max_new_tokens: u32,
    #[serde(default)]
    temperature: f32,
}

fn ten() -> u32 {
    10
}

fn sixteen() -> u32 {
    16
}

struct Judge(Config);

/// The grade in the judge's text: the first whole number after `Score:` (any case), else
/// the first whole number in it.
fn grade(text: &str) -> Option<u32> {
    let lower = text.to_lowercase();
    let after = lower.find("score:").map_or(&lower[..], |i| &lower[i + 6..]);
    let digits: String = after
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(|c| c.is_ascii_digit())
        .take(9)
        .collect();
    digits.parse().ok()
}

/// The messages the judge reads.
fn prompt(config: &Config, trajectory: &Trajectory) -> Vec<Message> {
    let question = trajectory
        .messages
        .iter()
        .rev()
        .find(|m| m.role == "user")
        .map_or("", |m| m.content.as_str());
    let answer = trajectory
        .messages
        .iter()
        .rev()
        .find(|m| m.role == "assistant")
        .map_or(trajectory.completion.as_str(), |m| m.content.as_str());
    vec![
        Message::new(
            "system",
            format!(
                "You grade answers. Rubric: {}\nReply with `Score: N`, N a whole number from 0 to {}.",
                config.rubric, config.scale
            ),
        ),
        Message::new(
            "user",
            format!("Question: {question}\nAnswer: {answer}\nGrade the answer."),
        ),
    ]
}

impl Reward for Judge {
    fn open(config: &str) -> Result<Self, String> {
        let config: Config =
            serde_json::from_str(config).map_err(|e| format!("judge config: {e}"))?;
        if config.rubric.trim().is_empty() || config.scale == 0 {
            return Err(
                "judge config: `rubric` must say what a good answer is, `scale` be at least 1"
                    .into(),
            );
        }
        Ok(Judge(config))
    }

    fn score(&mut self, trajectory: Trajectory) -> Result<Vec<Component>, String> {
        let mut request = GenerateRequest::new(
            Prompt::Messages(prompt(&self.0, &trajectory)),
            self.0.max_new_tokens,
        );
        request.weights = Weights::Base;
        request.temperature = self.0.temperature;
        let answer = rlhost_sdk::model::generate(&request).map_err(|e| format!("judge: {e}"))?;
        let n = grade(&answer.text);
        let value = n.map_or(0.0, |n| (f64::from(n) / f64::from(self.0.scale)).min(1.0));
        if value < 1.0 {
            rlhost_sdk::log(
                rlhost_sdk::Level::Warn,
                &format!("judge said: {}", answer.text.trim()),
            );
        }
        Ok(vec![
            Component::new("judge", value),
            Component::new("judge_parsed", if n.is_some() { 1.0 } else { 0.0 }),
        ])
    }
}

rlhost_sdk::export!(reward: Judge);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grade_is_the_number_after_score() {
        assert_eq!(grade("Score: 7"), Some(7));
        assert_eq!(grade("I'd say 3 steps, SCORE: 9/10"), Some(9));
        assert_eq!(grade("eight out of 10"), Some(10));
        assert_eq!(grade("no number"), None);
        assert_eq!(grade("Score: none, 4"), Some(4));
    }

    #[test]
    fn the_judge_reads_the_rubric_the_question_and_the_last_answer() {
        let config = Config {
            rubric: "correct product".into(),
            scale: 5,
            max_new_tokens: 8,
            temperature: 0.0,
        };
        let t = Trajectory {
            messages: vec![
                Message::new("user", "3*4?"),
                Message::new("assistant", "12"),
            ],
            completion: "12<|im_end|>".into(),
            metadata: "{}".into(),
            turns: 1,
            truncated: false,
        };
        let m = prompt(&config, &t);
        assert!(m[0].content.contains("correct product") && m[0].content.contains("0 to 5"));
        assert_eq!(
            m[1].content,
            "Question: 3*4?\nAnswer: 12\nGrade the answer."
        );
    }
}
