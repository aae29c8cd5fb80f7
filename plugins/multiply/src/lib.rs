//! Multiplication: "What is 347 * 29?", answered in `<answer>N</answer>`. A small model
//! cannot multiply in its head, but it can call the calculator and copy the result, so
//! the tool is what makes answers right: the task of rlhost's built-in demo.
//!
//! One plugin, three roles:
//! - dataset: seeded problems; each sample's metadata holds `a`, `b`, `answer` and a
//!   `reference` solution (a tool call by tool style, and the answer text);
//! - reward: `format` (the completion ends its answer as `<answer>INTEGER</answer>`) and
//!   `correct` (that integer is the product);
//! - trigger: the calculator (`<calc>EXPR</calc>` → `<result>VALUE</result>`).
//!
//! Dataset config (all optional): `{"size": 10000, "min_a": 100, "max_a": 999,
//! "min_b": 10, "max_b": 99}`.

use arith::calc_tool;
use rlhost_sdk::{Component, Dataset, Message, Reward, Sample, Trajectory, Trigger};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct DataConfig {
    size: u64,
    min_a: u64,
    max_a: u64,
    min_b: u64,
    max_b: u64,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            size: 10_000,
            min_a: 100,
            max_a: 999,
            min_b: 10,
            max_b: 99,
        }
    }
}

/// What each sample's metadata holds.
#[derive(Serialize, Deserialize)]
struct Problem {
    a: u64,
    b: u64,
    answer: u64,
}

/// A sample's metadata: the problem, and a `reference` that solves it with a tool call in
/// each style a tool may take (the calculator's `<calc>`, a fenced python block) and the
/// final answer text. rlhost's built-in warm start writes the call of the run's tool.
fn metadata(p: &Problem) -> Result<String, String> {
    let mut value = serde_json::to_value(p).map_err(|e| e.to_string())?;
    value["reference"] = serde_json::json!({
        "tool_calls": {
            "calc": format!("<calc>{}*{}</calc>", p.a, p.b),
            "python": format!("```python\nprint({} * {})\n```", p.a, p.b),
        },
        "answer": format!("<answer>{}</answer>", p.answer),
    });
    Ok(value.to_string())
}

/// SplitMix64, seeded per sample so that `get(i)` is independent of other draws.
fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

struct Problems {
    config: DataConfig,
    seed: u64,
}

impl Problems {
    fn problem(&self, index: u64) -> Problem {
        let c = &self.config;
        let r1 = splitmix(self.seed ^ index.wrapping_mul(0xd1b5_4a32_d192_ed03));
        let r2 = splitmix(r1);
        let a = c.min_a + r1 % (c.max_a - c.min_a + 1);
        let b = c.min_b + r2 % (c.max_b - c.min_b + 1);
        Problem {
            a,
            b,
            answer: a * b,
        }
    }
}

/// The user prompt for a problem.
pub fn prompt(a: u64, b: u64) -> String {
    format!("What is {a} * {b}?")
}

impl Dataset for Problems {
    fn open(config: &str, seed: u64) -> Result<Self, String> {
        let config: DataConfig =
            serde_json::from_str(config).map_err(|e| format!("multiply config: {e}"))?;
        if config.min_a > config.max_a
            || config.min_b > config.max_b
            || config.max_a > 1_000_000_000
            || config.max_b > 1_000_000_000
        {
            return Err("multiply config: need min <= max for a and b, each at most 1e9".into());
        }
        Ok(Problems { config, seed })
    }

    fn len(&self) -> u64 {
        self.config.size
    }

    fn get(&self, index: u64) -> Result<Sample, String> {
        if index >= self.config.size {
            return Err(format!(
                "index {index} out of range (size {})",
                self.config.size
            ));
        }
        let p = self.problem(index);
        Ok(Sample {
            messages: vec![Message::new("user", prompt(p.a, p.b))],
            metadata: metadata(&p)?,
        })
    }
}

/// The integer inside the last `<answer>…</answer>`, if it is one.
fn answer(text: &str) -> Option<u64> {
    let end = text.rfind("</answer>")?;
    let start = text[..end].rfind("<answer>")? + "<answer>".len();
    text[start..end].trim().parse().ok()
}

struct Score;

impl Reward for Score {
    fn open(config: &str) -> Result<Self, String> {
        match config.trim() {
            "" | "{}" => Ok(Score),
            other => Err(format!(
                "the multiply reward takes no configuration, got {other}"
            )),
        }
    }

    fn score(&mut self, trajectory: Trajectory) -> Result<Vec<Component>, String> {
        let problem: Problem = serde_json::from_str(&trajectory.metadata)
            .map_err(|e| format!("multiply reward: metadata is not a multiply problem: {e}"))?;
        let given = answer(&trajectory.completion);
        Ok(vec![
            Component::new("format", f64::from(u8::from(given.is_some()))),
            Component::new(
                "correct",
                f64::from(u8::from(given == Some(problem.answer))),
            ),
        ])
    }
}

struct Calculator;

/// The calculator takes no configuration: a config that is not JSON, or names a field,
/// is a mistake to report rather than to ignore.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoConfig {}

impl Trigger for Calculator {
    fn open(config: &str, _sample: Sample) -> Result<Self, String> {
        serde_json::from_str::<NoConfig>(config)
            .map_err(|e| format!("multiply calculator config: {e} (it takes none: pass {{}})"))?;
        Ok(Calculator)
    }

    fn stop_patterns(&self) -> Vec<String> {
        vec![calc_tool::CLOSE.to_string()]
    }

    fn fire(&mut self, text: &str) -> Result<Option<String>, String> {
        Ok(calc_tool::answer(text, 6))
    }
}

rlhost_sdk::export!(dataset: Problems, reward: Score, trigger: Calculator);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_parsed_from_the_last_tag() {
        assert_eq!(
            answer("<answer>12</answer> then <answer> 56 </answer>"),
            Some(56)
        );
        assert_eq!(answer("<answer>5.5</answer>"), None);
        assert_eq!(answer("no tag"), None);
    }

    #[test]
    fn problems_are_seeded_and_in_range() {
        let p = Problems::open("{}", 7).unwrap();
        let (x, y) = (p.problem(3), p.problem(3));
        assert_eq!((x.a, x.b), (y.a, y.b));
        assert_eq!(x.answer, x.a * x.b);
        for i in 0..100 {
            let q = p.problem(i);
            assert!((100..=999).contains(&q.a) && (10..=99).contains(&q.b));
        }
        let z = Problems::open("{}", 8).unwrap().problem(3);
        assert!((z.a, z.b) != (x.a, x.b), "another seed, another problem");
    }
}
