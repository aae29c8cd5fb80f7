//! The code task: problems that a small model cannot do in its head but a few lines of
//! code answer exactly, answered in `<answer>N</answer>`. The task of
//! `rlhost train --plugin code_trigger.wasm` (Python) and `--plugin js_trigger.wasm`
//! (JavaScript): the code tool is what makes answers right.
//!
//! Two roles:
//! - dataset: seeded problems from several families (below); each sample's metadata holds
//!   the family, the integer answer and a `reference`: a tool call that solves it, by
//!   tool style (`python` and `js`: a fenced block in that language), and the final
//!   answer text. rlhost's built-in warm start writes such calls for the tool a run uses,
//!   and the real tool answers them;
//! - reward: `format` (the completion ends its answer as `<answer>INTEGER</answer>`),
//!   `correct` (that integer is the answer) and `tool_use` (a tool's output is in the
//!   completion: one of the `tool_outputs` markers, by default the code tool's `<output>`
//!   and the calculator's `<result>`).
//!
//! Families: `sum_multiples` (the sum of the multiples of K in a range), `count_divisible`
//! (how many integers up to N are divisible by P or Q), `modpow` (A^B mod M), `digit_sum`
//! (the digit sum of A^B, a number of up to ~400 digits), `divisors` (the divisor count of
//! N), `lcm` (of three numbers) and `count_char` (a letter's count in a string). Loops stay
//! under ~10k iterations, so that a call costs the sandboxed interpreter milliseconds.
//!
//! Dataset config (all optional): `{"size": 10000, "families": ["modpow", …]}` (default:
//! every family, drawn uniformly). Reward config: `{"tool_outputs": ["<output>"]}`.

use rlhost_sdk::{Component, Dataset, Message, Reward, Sample, Trajectory};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// Every family, in the order a sample's draw picks among the configured ones.
const FAMILIES: [&str; 7] = [
    "sum_multiples",
    "count_divisible",
    "modpow",
    "digit_sum",
    "divisors",
    "lcm",
    "count_char",
];

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct DataConfig {
    size: u64,
    families: Vec<String>,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            size: 10_000,
            families: FAMILIES.iter().map(|f| f.to_string()).collect(),
        }
    }
}

/// SplitMix64, seeded per sample so that `get(i)` is independent of other draws.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi` (the modulo bias is negligible at these ranges).
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// One problem: the prompt, the Python that answers it, and the answer.
#[derive(Debug, Clone, PartialEq)]
struct Problem {
    family: &'static str,
    prompt: String,
    /// The Python that prints the answer.
    code: String,
    /// The JavaScript that prints it.
    js: String,
    answer: u64,
}

fn problem(family: &'static str, r: &mut SplitMix) -> Problem {
    let (prompt, code, js, answer) = match family {
        "sum_multiples" => {
            let k = r.range(3, 19);
            let a = r.range(10, 999);
            let b = a + r.range(200, 1999);
            (
                format!("What is the sum of the multiples of {k} from {a} to {b}?"),
                format!("print(sum(i for i in range({a}, {b} + 1) if i % {k} == 0))"),
                format!("let s = 0\nfor (let i = {a}; i <= {b}; i++) if (i % {k} == 0) s += i\ns"),
                (a..=b).filter(|i| i.is_multiple_of(k)).sum(),
            )
        }
        "count_divisible" => {
            let n = r.range(1000, 9999);
            let p = r.range(2, 13);
            let q = loop {
                let q = r.range(2, 13);
                if q != p {
                    break q;
                }
            };
            (
                format!("How many integers from 1 to {n} are divisible by {p} or {q}?"),
                format!("print(sum(1 for i in range(1, {n} + 1) if i % {p} == 0 or i % {q} == 0))"),
                format!(
                    "let c = 0\nfor (let i = 1; i <= {n}; i++) if (i % {p} == 0 || i % {q} == 0) c++\nc"
                ),
                (1..=n)
                    .filter(|i| i.is_multiple_of(p) || i.is_multiple_of(q))
                    .count() as u64,
            )
        }
        "modpow" => {
            let a = r.range(2, 999);
            let b = r.range(100, 9999);
            let m = r.range(1000, 9999);
            (
                format!("What is {a} to the power {b} modulo {m}?"),
                format!("print(pow({a}, {b}, {m}))"),
                format!("let r = 1\nfor (let i = 0; i < {b}; i++) r = r * {a} % {m}\nr"),
                modpow(a, b, m),
            )
        }
        "digit_sum" => {
            let a = r.range(2, 99);
            let b = r.range(20, 199);
            (
                format!("What is the digit sum of {a} to the power {b}?"),
                format!("print(sum(int(d) for d in str({a} ** {b})))"),
                format!("[...String({a}n ** {b}n)].reduce((s, d) => s + +d, 0)"),
                power_digit_sum(a, b),
            )
        }
        "divisors" => {
            let n = r.range(1000, 9999);
            (
                format!("How many divisors does {n} have?"),
                format!("print(sum(1 for d in range(1, {n} + 1) if {n} % d == 0))"),
                format!("let c = 0\nfor (let d = 1; d <= {n}; d++) if ({n} % d == 0) c++\nc"),
                (1..=n).filter(|d| n.is_multiple_of(*d)).count() as u64,
            )
        }
        "lcm" => {
            let (a, b, c) = (r.range(10, 99), r.range(10, 99), r.range(10, 99));
            (
                format!("What is the least common multiple of {a}, {b} and {c}?"),
                format!("import math\nprint(math.lcm({a}, {b}, {c}))"),
                format!(
                    "const gcd = (x, y) => (y ? gcd(y, x % y) : x);\n[{a}, {b}, {c}].reduce((x, y) => (x / gcd(x, y)) * y)"
                ),
                lcm(lcm(a, b), c),
            )
        }
        "count_char" => {
            let letters = b"abcd";
            let len = r.range(20, 32);
            let text: String = (0..len)
                .map(|_| letters[(r.next() % 4) as usize] as char)
                .collect();
            let letter = letters[(r.next() % 4) as usize] as char;
            (
                format!("How many times does {letter} occur in \"{text}\"?"),
                format!("print(\"{text}\".count(\"{letter}\"))"),
                format!("\"{text}\".split(\"{letter}\").length - 1"),
                text.chars().filter(|&c| c == letter).count() as u64,
            )
        }
        other => unreachable!("family `{other}` is checked when the dataset opens"),
    };
    Problem {
        family,
        prompt,
        code,
        js,
        answer,
    }
}

/// `a^b mod m` by square and multiply.
fn modpow(a: u64, mut b: u64, m: u64) -> u64 {
    let (mut base, mut acc) = (u128::from(a % m), 1u128 % u128::from(m));
    while b > 0 {
        if b & 1 == 1 {
            acc = acc * base % u128::from(m);
        }
        base = base * base % u128::from(m);
        b >>= 1;
    }
    acc as u64
}

/// The sum of the decimal digits of `a^b`, in base-10^9 limbs (Python's `str(a ** b)`).
fn power_digit_sum(a: u64, b: u64) -> u64 {
    const BASE: u64 = 1_000_000_000;
    let mut limbs = vec![1u64];
    for _ in 0..b {
        let mut carry = 0;
        for limb in &mut limbs {
            let v = *limb * a + carry;
            *limb = v % BASE;
            carry = v / BASE;
        }
        while carry > 0 {
            limbs.push(carry % BASE);
            carry /= BASE;
        }
    }
    let mut sum = 0;
    for mut limb in limbs {
        while limb > 0 {
            sum += limb % 10;
            limb /= 10;
        }
    }
    sum
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: u64, b: u64) -> u64 {
    a / gcd(a, b) * b
}

/// What each sample's metadata holds.
#[derive(Serialize, Deserialize)]
struct Metadata {
    family: String,
    answer: u64,
    /// `{"tool_calls": {"python": "```python\n…\n```", "js": "```js\n…\n```"},
    /// "answer": "<answer>N</answer>"}`.
    reference: serde_json::Value,
}

struct Problems {
    config: DataConfig,
    families: Vec<&'static str>,
    seed: u64,
}

impl Problems {
    fn problem(&self, index: u64) -> Problem {
        let mut r = SplitMix(self.seed ^ index.wrapping_mul(0xd1b5_4a32_d192_ed03));
        let family = self.families[(r.next() % self.families.len() as u64) as usize];
        problem(family, &mut r)
    }
}

impl Dataset for Problems {
    fn open(config: &str, seed: u64) -> Result<Self, String> {
        let config: DataConfig =
            serde_json::from_str(config).map_err(|e| format!("code_task config: {e}"))?;
        if config.families.is_empty() {
            return Err(format!(
                "code_task config: `families` is empty; choose from {FAMILIES:?}"
            ));
        }
        let families = config
            .families
            .iter()
            .map(|f| {
                FAMILIES.iter().copied().find(|k| k == f).ok_or_else(|| {
                    format!("code_task config: unknown family `{f}`, expected one of {FAMILIES:?}")
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Problems {
            config,
            families,
            seed,
        })
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
        let metadata = Metadata {
            family: p.family.to_string(),
            answer: p.answer,
            reference: json!({
                "tool_calls": {
                    "python": format!("```python\n{}\n```", p.code),
                    "js": format!("```js\n{}\n```", p.js),
                },
                "answer": format!("<answer>{}</answer>", p.answer),
            }),
        };
        Ok(Sample {
            messages: vec![Message::new("user", p.prompt)],
            metadata: serde_json::to_string(&metadata).map_err(|e| e.to_string())?,
        })
    }
}

/// The integer inside the last `<answer>…</answer>`, if it is one.
fn answer(text: &str) -> Option<u64> {
    let end = text.rfind("</answer>")?;
    let start = text[..end].rfind("<answer>")? + "<answer>".len();
    text[start..end].trim().parse().ok()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RewardConfig {
    tool_outputs: Vec<String>,
}

impl Default for RewardConfig {
    fn default() -> Self {
        RewardConfig {
            tool_outputs: vec!["<output>".into(), "<result>".into()],
        }
    }
}

struct Score(RewardConfig);

impl Reward for Score {
    fn open(config: &str) -> Result<Self, String> {
        let config = if config.trim().is_empty() {
            RewardConfig::default()
        } else {
            serde_json::from_str(config).map_err(|e| format!("code_task reward config: {e}"))?
        };
        Ok(Score(config))
    }

    fn score(&mut self, trajectory: Trajectory) -> Result<Vec<Component>, String> {
        let meta: Metadata = serde_json::from_str(&trajectory.metadata)
            .map_err(|e| format!("code_task reward: metadata is not a code_task problem: {e}"))?;
        let given = answer(&trajectory.completion);
        let used = self
            .0
            .tool_outputs
            .iter()
            .any(|m| trajectory.completion.contains(m.as_str()));
        Ok(vec![
            Component::new("format", f64::from(u8::from(given.is_some()))),
            Component::new("correct", f64::from(u8::from(given == Some(meta.answer)))),
            Component::new("tool_use", f64::from(u8::from(used))),
        ])
    }
}

rlhost_sdk::export!(dataset: Problems, reward: Score);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_match_what_python_prints() {
        // Each value printed by python3 for the code shown.
        assert_eq!(modpow(417, 2381, 9973), 8583); // pow(417, 2381, 9973)
        assert_eq!(power_digit_sum(2, 100), 115); // sum(int(d) for d in str(2 ** 100))
        assert_eq!(power_digit_sum(99, 199), 1863); // sum(int(d) for d in str(99 ** 199))
        assert_eq!(lcm(lcm(84, 90), 22), 13860); // math.lcm(84, 90, 22)
        assert_eq!(modpow(5, 0, 7), 1);
    }

    #[test]
    fn every_family_draws_problems_whose_reference_solves_them() {
        let p = Problems::open("{}", 7).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for i in 0..200 {
            let q = p.problem(i);
            assert_eq!(p.problem(i), q, "seeded per index");
            seen.insert(q.family);
            let sample = p.get(i).unwrap();
            let meta: Metadata = serde_json::from_str(&sample.metadata).unwrap();
            assert_eq!(meta.answer, q.answer);
            let call = meta.reference["tool_calls"]["python"].as_str().unwrap();
            assert!(call.starts_with("```python\n") && call.ends_with("\n```"));
            let js = meta.reference["tool_calls"]["js"].as_str().unwrap();
            assert!(js.starts_with("```js\n") && js.ends_with("\n```"));
            assert_eq!(
                meta.reference["answer"],
                format!("<answer>{}</answer>", q.answer)
            );
        }
        assert_eq!(
            seen.len(),
            FAMILIES.len(),
            "every family is drawn: {seen:?}"
        );
        let other = Problems::open("{}", 8).unwrap();
        assert_ne!(
            other.problem(3),
            p.problem(3),
            "another seed, another problem"
        );
    }

    #[test]
    fn configs_are_checked() {
        let only = Problems::open(r#"{"families": ["modpow"]}"#, 1).unwrap();
        assert!((0..20).all(|i| only.problem(i).family == "modpow"));
        assert!(
            Problems::open(r#"{"families": ["fibonacci"]}"#, 1)
                .err()
                .unwrap()
                .contains("unknown family `fibonacci`")
        );
        assert!(Problems::open(r#"{"families": []}"#, 1).is_err());
        assert!(Problems::open(r#"{"sise": 3}"#, 1).is_err());
    }

    #[test]
    fn the_reward_scores_format_correctness_and_tool_use() {
        let p = Problems::open("{}", 3).unwrap();
        let sample = p.get(0).unwrap();
        let right = p.problem(0).answer;
        let mut score = Score::open("").unwrap();
        let mut run = |completion: String| {
            let c = score
                .score(Trajectory {
                    messages: vec![],
                    completion,
                    metadata: sample.metadata.clone(),
                    turns: 1,
                    truncated: false,
                })
                .unwrap();
            c.iter().map(|c| c.value).collect::<Vec<_>>()
        };
        let tool = format!("```python\nprint(1)\n```\n<output>\n{right}\n</output>\n");
        assert_eq!(
            run(format!("{tool}<answer>{right}</answer>")),
            [1.0, 1.0, 1.0]
        );
        assert_eq!(
            run(format!("<answer>{}</answer>", right + 1)),
            [1.0, 0.0, 0.0]
        );
        assert_eq!(run("no answer".into()), [0.0, 0.0, 0.0]);
        assert!(Score::open(r#"{"markers": []}"#).is_err());
    }
}
