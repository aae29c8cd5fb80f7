//! A math answer checked against the sample's, the way `math-verify` (TRL's
//! `accuracy_reward`) checks it: the final answer taken from the completion ([`extract`]),
//! both answers put in one spelling ([`normal`]), then compared as text, as values within
//! a relative tolerance, or item by item for tuples and intervals ([`value`]).
//!
//! Config (all optional):
//! `{"answer_key": "answer", "order": ["boxed", "hash", "answer_is", "last_number"],
//! "tolerance": 1e-9}` (relative: float noise, not a rounded approximation). The gold answer is the sample's `metadata[answer_key]`, a string
//! or a number; a gold text with a `\boxed{}` or a `#### N` line (MATH's and GSM8K's
//! solutions) is reduced to that answer first.
//!
//! Components: `correct` (1 or 0) and `format` (1 when the answer was found by any source
//! but the last number, e.g. in a `\boxed{}`).

pub mod extract;
pub mod normal;
pub mod value;

use extract::Source;
use rlhost_sdk::{Component, Reward, Trajectory};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {
    answer_key: String,
    order: Vec<Source>,
    tolerance: f64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            answer_key: "answer".into(),
            order: vec![
                Source::Boxed,
                Source::Hash,
                Source::AnswerIs,
                Source::LastNumber,
            ],
            tolerance: 1e-9,
        }
    }
}

struct MathAnswer(Config);

/// The score of `completion` against `gold`: (correct, format).
pub fn score(completion: &str, gold: &str, order: &[Source], tolerance: f64) -> (bool, bool) {
    let gold = extract::find(gold, &[Source::Boxed, Source::Hash])
        .map_or_else(|| gold.to_string(), |(_, a)| a);
    let Some((source, given)) = extract::find(completion, order) else {
        return (false, false);
    };
    let (given, given_percent) = normal::normalize(&given);
    let (gold, gold_percent) = normal::normalize(&gold);
    let correct = value::same(&given, &gold, given_percent || gold_percent, tolerance);
    (correct, source != Source::LastNumber)
}

impl Reward for MathAnswer {
    fn open(config: &str) -> Result<Self, String> {
        let config: Config =
            serde_json::from_str(config).map_err(|e| format!("math_answer config: {e}"))?;
        if config.order.is_empty() {
            return Err("math_answer config: `order` must name at least one source".into());
        }
        if !(config.tolerance >= 0.0 && config.tolerance.is_finite()) {
            return Err("math_answer config: `tolerance` must be a number ≥ 0".into());
        }
        Ok(MathAnswer(config))
    }

    fn score(&mut self, trajectory: Trajectory) -> Result<Vec<Component>, String> {
        let metadata: serde_json::Value = serde_json::from_str(&trajectory.metadata)
            .map_err(|e| format!("math_answer: the sample's metadata is not JSON: {e}"))?;
        let key = &self.0.answer_key;
        let gold = match metadata.get(key) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Number(n)) => n.to_string(),
            _ => {
                return Err(format!(
                    "math_answer: the sample's metadata has no `{key}` (a string or a number): set answer_key to the column that holds the answer"
                ));
            }
        };
        let (correct, format) = score(
            &trajectory.completion,
            &gold,
            &self.0.order,
            self.0.tolerance,
        );
        Ok(vec![
            Component::new("correct", f64::from(u8::from(correct))),
            Component::new("format", f64::from(u8::from(format))),
        ])
    }
}

rlhost_sdk::export!(reward: MathAnswer);

#[cfg(test)]
mod tests {
    use super::*;

    fn check(completion: &str, gold: &str) -> bool {
        score(completion, gold, &Config::default().order, 1e-9).0
    }

    #[test]
    fn gsm8k_and_math_shaped_pairs() {
        assert!(check(
            "She pays 3 * 8 = 24.\n#### 24",
            "Natalia sold ... \n#### 24"
        ));
        assert!(check("The answer is $1,200.", "1200"));
        assert!(check("so $\\boxed{\\dfrac{3}{4}}$", "\\frac34"));
        assert!(check("\\boxed{0.75}", "\\frac{3}{4}"));
        assert!(check(
            "\\boxed{\\left(2, -\\frac{1}{2}\\right)}",
            "(2,-0.5)"
        ));
        assert!(check("\\boxed{90^\\circ}", "90"));
        assert!(check("\\boxed{5\\text{ cm}}", "5"));
        assert!(check("\\boxed{25\\%}", "0.25"));
        assert!(check("\\boxed{2\\sqrt{3}}", "\\sqrt{12}"));
        assert!(!check("\\boxed{[1, 2)}", "[1,2]"));
        assert!(!check("\\boxed{13}", "12"));
        assert!(!check("I do not know", "12"));
    }

    #[test]
    fn format_says_where_the_answer_came_from() {
        let order = Config::default().order;
        assert_eq!(score("\\boxed{7}", "7", &order, 1e-9), (true, true));
        assert_eq!(score("it is 7", "7", &order, 1e-9), (true, false));
        assert_eq!(score("nothing", "7", &order, 1e-9), (false, false));
    }
}
