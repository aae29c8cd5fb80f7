//! The `units` tools' task: problems a small model cannot do in its head but the three
//! functions of `plugins/units` answer exactly, each answered in `<answer>…</answer>`:
//!
//! - "Convert 37 mi to km." → `convert(value, from, to)` → `59.5457 km`;
//! - "What date is 45 days after 2024-03-10?" → `add_days(date, days)` → `2024-04-24`;
//! - "What is 3/4 + 5/6?" → `exact(a, op, b)` → `19/12`.
//!
//! One plugin, two roles (the functions are the `units` plugin's):
//! - dataset: seeded problems of the three kinds in turn; each sample's metadata holds the
//!   `kind`, the `answer` (as the function writes it) and a `reference` solution: the call
//!   in the Hermes format (`<tool_call>{"name": …, "arguments": …}</tool_call>`, what
//!   Qwen2.5/Qwen3 and the built-in model write) and the answer text;
//! - reward: `format` (the last assistant turn holds `<answer>…</answer>`), `correct` (that
//!   answer is the function's: a number within 1e-6 of it for a conversion, the same text
//!   otherwise) and `tool_use` (some turn called a function; logged, not to be rewarded).
//!
//! Dataset config (all optional): `{"size": 10000, "kinds": ["convert", "add_days",
//! "exact"]}`.

use rlhost_sdk::{Component, Dataset, Message, Reward, Sample, Trajectory};
use serde::{Deserialize, Serialize};
use serde_json::json;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct DataConfig {
    size: u64,
    kinds: Vec<Kind>,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            size: 10_000,
            kinds: vec![Kind::Convert, Kind::AddDays, Kind::Exact],
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Kind {
    Convert,
    AddDays,
    Exact,
}

/// What each sample's metadata holds besides its reference.
#[derive(Serialize, Deserialize)]
struct Problem {
    kind: Kind,
    /// The function's answer, as it writes it.
    answer: String,
}

/// Conversions asked, with each unit's factor to its dimension's base unit as a fraction
/// (the units plugin's table); temperatures go by formula.
const PAIRS: [(&str, &str); 10] = [
    ("mi", "km"),
    ("km", "mi"),
    ("lb", "kg"),
    ("kg", "lb"),
    ("ft", "m"),
    ("in", "cm"),
    ("oz", "g"),
    ("yd", "m"),
    ("F", "C"),
    ("C", "F"),
];

fn factor(unit: &str) -> (i128, i128) {
    match unit {
        "m" => (1, 1),
        "km" => (1000, 1),
        "cm" => (1, 100),
        "mi" => (1_609_344, 1000),
        "ft" => (3048, 10_000),
        "in" => (254, 10_000),
        "yd" => (9144, 10_000),
        "kg" => (1, 1),
        "g" => (1, 1000),
        "lb" => (45_359_237, 100_000_000),
        "oz" => (45_359_237, 1_600_000_000),
        other => unreachable!("no factor for {other}"),
    }
}

fn gcd(a: i128, b: i128) -> i128 {
    if b == 0 { a.abs() } else { gcd(b, a % b) }
}

/// `value` in `from` as `to`, exactly, as a fraction (numerator, denominator > 0).
fn converted(value: i64, from: &str, to: &str) -> (i128, i128) {
    let v = i128::from(value);
    let (n, d) = match (from, to) {
        // (v - 32) * 5/9
        ("F", "C") => ((v - 32) * 5, 9),
        // v * 9/5 + 32
        ("C", "F") => (v * 9 + 160, 5),
        _ => {
            let (fa, fb) = factor(from);
            let (ta, tb) = factor(to);
            (v * fa * tb, fb * ta)
        }
    };
    let g = gcd(n, d);
    (n / g, d / g)
}

/// Python's `f"{x:.6g}"`: six significant digits, trailing zeros dropped, exponent form
/// below 1e-4 and from 1e6 on.
fn g6(x: f64) -> String {
    if x == 0.0 {
        return "0".into();
    }
    let e = format!("{x:.5e}");
    let (mantissa, exp) = e.split_once('e').expect("an exponent");
    let exp: i32 = exp.parse().expect("an integer exponent");
    let trim = |s: String| -> String {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    };
    if (-4..6).contains(&exp) {
        trim(format!("{x:.*}", (5 - exp) as usize))
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{}e{sign}{:02}", trim(mantissa.to_string()), exp.abs())
    }
}

/// Days since 1970-01-01 of a civil date, and back (Howard Hinnant's algorithms).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

fn date(days: i64) -> String {
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}")
}

/// A fraction as Python's `str(Fraction)`: `n/d`, or `n` when `d` is 1.
fn fraction(n: i128, d: i128) -> String {
    let g = gcd(n, d);
    let (n, d) = (n / g * d.signum(), (d / g).abs());
    if d == 1 {
        n.to_string()
    } else {
        format!("{n}/{d}")
    }
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

/// A problem: the prompt, the call that answers it (function, arguments) and the answer.
fn problem(kind: Kind, r: &mut impl FnMut() -> u64) -> (String, &'static str, Arguments, String) {
    let mut pick = |lo: i64, hi: i64| lo + (r() % (hi - lo + 1) as u64) as i64;
    match kind {
        Kind::Convert => {
            let (from, to) = PAIRS[pick(0, PAIRS.len() as i64 - 1) as usize];
            let value = pick(1, 999);
            let (n, d) = converted(value, from, to);
            (
                format!("Convert {value} {from} to {to}."),
                "convert",
                vec![
                    ("value", json!(value)),
                    ("from", json!(from)),
                    ("to", json!(to)),
                ],
                format!("{} {to}", g6(n as f64 / d as f64)),
            )
        }
        Kind::AddDays => {
            let start = pick(days_from_civil(2000, 1, 1), days_from_civil(2030, 12, 31));
            let days = pick(1, 999);
            (
                format!("What date is {days} days after {}?", date(start)),
                "add_days",
                vec![("date", json!(date(start))), ("days", json!(days))],
                date(start + days),
            )
        }
        Kind::Exact => {
            let (a, b, c, d) = (pick(1, 19), pick(2, 19), pick(1, 19), pick(2, 19));
            let ops = ['+', '-', '*', '/'];
            let op = ops[pick(0, 3) as usize];
            let (a, b, c, d) = (i128::from(a), i128::from(b), i128::from(c), i128::from(d));
            let (n, m) = match op {
                '+' => (a * d + c * b, b * d),
                '-' => (a * d - c * b, b * d),
                '*' => (a * c, b * d),
                _ => (a * d, b * c),
            };
            (
                format!("What is {a}/{b} {op} {c}/{d}?"),
                "exact",
                vec![
                    ("a", json!(format!("{a}/{b}"))),
                    ("op", json!(op.to_string())),
                    ("b", json!(format!("{c}/{d}"))),
                ],
                fraction(n, m),
            )
        }
    }
}

impl Dataset for Problems {
    fn open(config: &str, seed: u64) -> Result<Self, String> {
        let config: DataConfig =
            serde_json::from_str(config).map_err(|e| format!("units_task config: {e}"))?;
        if config.kinds.is_empty() {
            return Err("units_task config: `kinds` is empty; name at least one of convert, add_days, exact".into());
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
        let kinds = &self.config.kinds;
        let kind = kinds[(index % kinds.len() as u64) as usize];
        let mut state = splitmix(self.seed ^ index.wrapping_mul(0xd1b5_4a32_d192_ed03));
        let mut r = || {
            state = splitmix(state);
            state
        };
        let (prompt, name, arguments, answer) = problem(kind, &mut r);
        let mut metadata = serde_json::to_value(Problem {
            kind,
            answer: answer.clone(),
        })
        .map_err(|e| e.to_string())?;
        metadata["reference"] = json!({
            "tool_calls": {"hermes": hermes_call(name, &arguments)},
            "answer": format!("<answer>{answer}</answer>"),
        });
        Ok(Sample {
            messages: vec![Message::new("user", prompt)],
            metadata: metadata.to_string(),
        })
    }
}

/// A call's arguments in the order the function's schema lists them (a JSON object here
/// would sort its keys).
type Arguments = Vec<(&'static str, serde_json::Value)>;

/// The call in the Hermes format, its JSON as Python's `json.dumps` writes it (`", "` and
/// `": "` separators): what the chat templates' `tojson` renders and what models trained
/// on them write.
fn hermes_call(name: &str, arguments: &Arguments) -> String {
    let args: Vec<String> = arguments
        .iter()
        .map(|(k, v)| format!("\"{k}\": {v}"))
        .collect();
    format!(
        "<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {{{}}}}}\n</tool_call>",
        args.join(", ")
    )
}

/// The text inside the last `<answer>…</answer>`, trimmed.
fn answer(text: &str) -> Option<&str> {
    let end = text.rfind("</answer>")?;
    let start = text[..end].rfind("<answer>")? + "<answer>".len();
    Some(text[start..end].trim())
}

/// The leading number of a conversion's answer (`59.5457 km` → 59.5457).
fn number(text: &str) -> Option<f64> {
    text.split_whitespace().next()?.parse().ok()
}

fn right(kind: Kind, given: &str, want: &str) -> bool {
    match kind {
        Kind::Convert => match (number(given), number(want)) {
            (Some(g), Some(w)) => (g - w).abs() <= 1e-6 * w.abs().max(1.0),
            _ => false,
        },
        _ => given == want,
    }
}

struct Score;

impl Reward for Score {
    fn open(config: &str) -> Result<Self, String> {
        match config.trim() {
            "" | "{}" => Ok(Score),
            other => Err(format!(
                "the units_task reward takes no configuration, got {other}"
            )),
        }
    }

    fn score(&mut self, trajectory: Trajectory) -> Result<Vec<Component>, String> {
        let problem: Problem = serde_json::from_str(&trajectory.metadata)
            .map_err(|e| format!("units_task reward: metadata is not a units problem: {e}"))?;
        let last = trajectory
            .messages
            .iter()
            .rev()
            .find(|m| m.role == "assistant")
            .map_or("", |m| m.content.as_str());
        let given = answer(last);
        let called = trajectory
            .messages
            .iter()
            .any(|m| m.role == "assistant" && !m.tool_calls.is_empty());
        Ok(vec![
            Component::new("format", f64::from(u8::from(given.is_some()))),
            Component::new(
                "correct",
                f64::from(u8::from(
                    given.is_some_and(|g| right(problem.kind, g, &problem.answer)),
                )),
            ),
            Component::new("tool_use", f64::from(u8::from(called))),
        ])
    }
}

rlhost_sdk::export!(dataset: Problems, reward: Score);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_as_python_writes_them() {
        for (x, want) in [
            (59.545728, "59.5457"),
            (1607.744, "1607.74"),
            (0.5, "0.5"),
            (100.0, "100"),
            (1234567.0, "1.23457e+06"),
            (0.0000123, "1.23e-05"),
            (-17.7777777, "-17.7778"),
        ] {
            assert_eq!(g6(x), want, "{x}");
        }
    }

    #[test]
    fn conversions_dates_and_fractions_are_exact() {
        let (n, d) = converted(37, "mi", "km");
        assert_eq!(g6(n as f64 / d as f64), "59.5457");
        let (n, d) = converted(212, "F", "C");
        assert_eq!((n, d), (100, 1));
        assert_eq!(date(days_from_civil(2024, 3, 10) + 45), "2024-04-24");
        assert_eq!(date(days_from_civil(2024, 1, 31) + 30), "2024-03-01");
        assert_eq!(date(days_from_civil(2000, 2, 28) + 1), "2000-02-29");
        assert_eq!(fraction(19, 12), "19/12");
        assert_eq!(fraction(-4, 2), "-2");
        assert_eq!(fraction(3, -6), "-1/2");
    }

    #[test]
    fn answers_are_judged_by_kind() {
        assert!(right(Kind::Convert, "59.5457 km", "59.5457 km"));
        assert!(right(Kind::Convert, "59.5457", "59.5457 km"));
        assert!(!right(Kind::Convert, "59.55 km", "59.5457 km"));
        assert!(right(Kind::Exact, "19/12", "19/12"));
        assert!(!right(Kind::Exact, "38/24", "19/12"));
        assert_eq!(answer("x <answer> 3 </answer>"), Some("3"));
    }

    #[test]
    fn samples_are_seeded_and_carry_a_hermes_reference() {
        let p = Problems::open("{}", 7).unwrap();
        let a = p.get(4).unwrap();
        assert_eq!(a.messages, p.get(4).unwrap().messages);
        let meta: serde_json::Value = serde_json::from_str(&a.metadata).unwrap();
        let call = meta["reference"]["tool_calls"]["hermes"].as_str().unwrap();
        assert!(
            call.starts_with("<tool_call>\n{\"name\": \"add_days\", \"arguments\": {\"date\": \""),
            "{call}"
        );
        assert!(call.ends_with("}}\n</tool_call>"), "{call}");
        assert!(Problems::open(r#"{"kinds": []}"#, 7).is_err());
    }
}
