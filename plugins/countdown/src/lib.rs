//! The countdown task (as in TinyZero): given a few numbers and a target, write an
//! equation that uses each number exactly once and equals the target.
//!
//! One plugin, three roles:
//! - dataset: a seeded generator of solvable puzzles; each sample's metadata holds the
//!   numbers, the target and a reference solution;
//! - reward: components `format` (the answer is a well-formed expression in
//!   `<answer>…</answer>`) and `correct` (it uses each number exactly once and equals the
//!   target);
//! - trigger: the calculator (`<calc>EXPR</calc>` → `<result>VALUE</result>`).
//!
//! Dataset config (all optional): `{"size": 10000, "min_numbers": 3, "max_numbers": 4,
//! "max_number": 99, "max_target": 100}`.

use arith::{Ratio, calc_tool};
use rlhost_sdk::{Component, Dataset, Message, Reward, Sample, Trajectory, Trigger};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct DataConfig {
    size: u64,
    min_numbers: usize,
    max_numbers: usize,
    max_number: u64,
    max_target: u64,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            size: 10_000,
            min_numbers: 3,
            max_numbers: 4,
            max_number: 99,
            max_target: 100,
        }
    }
}

/// What each sample's metadata holds.
#[derive(Serialize, Deserialize)]
struct Puzzle {
    numbers: Vec<u64>,
    target: u64,
    solution: String,
}

/// SplitMix64: tiny, fast, and good enough to draw puzzles; seeded per sample so that
/// `get(i)` never depends on which other samples were drawn.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

struct Puzzles {
    config: DataConfig,
    seed: u64,
}

impl Puzzles {
    /// Draws numbers and combines them at random with exact, positive, integer steps;
    /// the last value is the target, the steps are the reference solution. Retries until
    /// the target is in range.
    fn puzzle(&self, index: u64) -> Puzzle {
        let c = &self.config;
        let mut rng = SplitMix(self.seed ^ index.wrapping_mul(0xd1b5_4a32_d192_ed03));
        loop {
            let n = rng.range(c.min_numbers as u64, c.max_numbers as u64) as usize;
            let numbers: Vec<u64> = (0..n).map(|_| rng.range(1, c.max_number)).collect();
            let mut pool: Vec<(u64, String)> =
                numbers.iter().map(|&x| (x, x.to_string())).collect();
            while pool.len() > 1 {
                let i = rng.range(0, pool.len() as u64 - 1) as usize;
                let (a, ea) = pool.swap_remove(i);
                let j = rng.range(0, pool.len() as u64 - 1) as usize;
                let (b, eb) = pool.swap_remove(j);
                let combined = match rng.range(0, 3) {
                    0 => (a + b, format!("({ea} + {eb})")),
                    1 if a > b => (a - b, format!("({ea} - {eb})")),
                    1 if b > a => (b - a, format!("({eb} - {ea})")),
                    2 if a * b <= 10 * c.max_target.max(c.max_number) => {
                        (a * b, format!("{ea} * {eb}"))
                    }
                    3 if b != 0 && a % b == 0 => (a / b, format!("{ea} / {eb}")),
                    3 if a != 0 && b % a == 0 => (b / a, format!("{eb} / {ea}")),
                    _ => (a + b, format!("({ea} + {eb})")),
                };
                pool.push(combined);
            }
            let (target, expr) = pool.pop().expect("at least one number");
            let expr = expr
                .strip_prefix('(')
                .and_then(|e| e.strip_suffix(')'))
                .filter(|e| balanced(e))
                .map(str::to_string)
                .unwrap_or(expr);
            // A cheap guard that the rendering says what was computed.
            let exact = arith::eval(&expr).ok().and_then(Ratio::as_integer);
            if (1..=c.max_target).contains(&target) && exact == Some(i128::from(target)) {
                return Puzzle {
                    numbers,
                    target,
                    solution: expr,
                };
            }
        }
    }
}

/// Whether every `(` in `s` is closed in order (so stripping outer parentheses is safe).
fn balanced(s: &str) -> bool {
    let mut depth = 0i32;
    for c in s.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            _ => {}
        }
        if depth < 0 {
            return false;
        }
    }
    depth == 0
}

fn prompt(p: &Puzzle) -> String {
    let numbers: Vec<String> = p.numbers.iter().map(u64::to_string).collect();
    format!(
        "Using the numbers [{}], create an equation that equals {}. You can use + - * / and \
         parentheses, and each number exactly once. You can check arithmetic with the \
         calculator: write <calc>EXPRESSION</calc> and the result appears as \
         <result>VALUE</result>. Give your final equation in <answer></answer> tags, for \
         example <answer>(1 + 2) / 3</answer>.",
        numbers.join(", "),
        p.target
    )
}

impl Dataset for Puzzles {
    fn open(config: &str, seed: u64) -> Result<Self, String> {
        let config: DataConfig =
            serde_json::from_str(config).map_err(|e| format!("countdown config: {e}"))?;
        if config.min_numbers < 2 || config.max_numbers < config.min_numbers {
            return Err("countdown config: need 2 <= min_numbers <= max_numbers".into());
        }
        if config.max_numbers > 6 || config.max_number < 1 || config.max_target < 1 {
            return Err(
                "countdown config: need max_numbers <= 6, max_number >= 1, max_target >= 1".into(),
            );
        }
        Ok(Puzzles { config, seed })
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
        let puzzle = self.puzzle(index);
        Ok(Sample {
            messages: vec![Message::new("user", prompt(&puzzle))],
            metadata: serde_json::to_string(&puzzle).map_err(|e| e.to_string())?,
        })
    }
}

struct Score;

/// The text inside the last `<answer>…</answer>`.
fn last_answer(text: &str) -> Option<&str> {
    let end = text.rfind("</answer>")?;
    let start = text[..end].rfind("<answer>")? + "<answer>".len();
    Some(text[start..end].trim())
}

/// Whether `expr` uses exactly the multiset `numbers` and equals `target`.
fn solves(expr: &arith::Expr, numbers: &[u64], target: u64) -> bool {
    let mut used: Vec<Option<i128>> = expr.numbers().into_iter().map(Ratio::as_integer).collect();
    let mut given: Vec<Option<i128>> = numbers.iter().map(|&n| Some(i128::from(n))).collect();
    used.sort();
    given.sort();
    used == given && expr.eval().ok() == Some(Ratio::integer(i128::from(target)))
}

impl Reward for Score {
    fn open(config: &str) -> Result<Self, String> {
        match config.trim() {
            "" | "{}" => Ok(Score),
            other => Err(format!(
                "the countdown reward takes no configuration, got {other}"
            )),
        }
    }

    fn score(&mut self, trajectory: Trajectory) -> Result<Vec<Component>, String> {
        let puzzle: Puzzle = serde_json::from_str(&trajectory.metadata)
            .map_err(|e| format!("countdown reward: metadata is not a countdown puzzle: {e}"))?;
        let parsed = last_answer(&trajectory.completion).and_then(|a| arith::parse(a).ok());
        let format = parsed.is_some();
        let correct = parsed.is_some_and(|e| solves(&e, &puzzle.numbers, puzzle.target));
        Ok(vec![
            Component::new("format", f64::from(u8::from(format))),
            Component::new("correct", f64::from(u8::from(correct))),
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
            .map_err(|e| format!("countdown calculator config: {e} (it takes none: pass {{}})"))?;
        Ok(Calculator)
    }

    fn stop_patterns(&self) -> Vec<String> {
        vec![calc_tool::CLOSE.to_string()]
    }

    fn fire(&mut self, text: &str) -> Result<Option<String>, String> {
        Ok(calc_tool::answer(text, 6))
    }
}

rlhost_sdk::export!(dataset: Puzzles, reward: Score, trigger: Calculator);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn puzzles_are_solvable_by_their_reference_solution_and_deterministic() {
        let puzzles = Puzzles {
            config: DataConfig::default(),
            seed: 7,
        };
        for i in 0..500 {
            let p = puzzles.puzzle(i);
            let expr = arith::parse(&p.solution).unwrap();
            assert!(solves(&expr, &p.numbers, p.target), "{i}: {}", p.solution);
            assert_eq!(puzzles.puzzle(i).solution, p.solution);
        }
    }

    #[test]
    fn finds_the_last_answer() {
        assert_eq!(
            last_answer("<answer>1</answer> <answer> 2+3 </answer>"),
            Some("2+3")
        );
        assert_eq!(last_answer("no answer"), None);
    }
}
