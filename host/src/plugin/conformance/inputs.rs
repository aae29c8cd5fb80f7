//! The conformance checks' inputs, drawn from a fixed seed so that a report repeats
//! exactly: random text (and text that ends with one of a trigger's patterns), values
//! that fit a function's JSON Schema, and trajectories for rewards to score.

use crate::plugin::{Sample, Transcript};
use crate::rng::SplitMix64;

/// A trajectory of `sample` answered by `completion`, now and then cut off.
pub(super) fn trajectory(sample: &Sample, completion: String, rng: &mut SplitMix) -> Transcript {
    Transcript {
        truncated: rng.below(8) == 0,
        ..Transcript::single_turn(sample, completion)
    }
}

pub(super) fn clip(text: &str) -> String {
    match text.char_indices().nth(60) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_string(),
    }
}

/// A random value that fits `schema` (the keywords [`crate::plugin::schema`] knows); `depth`
/// bounds nesting.
pub(super) fn random_value(
    schema: &serde_json::Value,
    rng: &mut SplitMix,
    depth: u32,
) -> serde_json::Value {
    use serde_json::{Value, json};
    if let Some(options) = schema
        .get("enum")
        .and_then(Value::as_array)
        .filter(|o| !o.is_empty())
    {
        return options[rng.below(options.len() as u64) as usize].clone();
    }
    if let Some(c) = schema.get("const") {
        return c.clone();
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(any) = schema
            .get(key)
            .and_then(Value::as_array)
            .filter(|a| !a.is_empty())
        {
            return random_value(&any[rng.below(any.len() as u64) as usize], rng, depth);
        }
    }
    let kind = match schema.get("type") {
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(ts)) if !ts.is_empty() => ts[rng.below(ts.len() as u64) as usize]
            .as_str()
            .unwrap_or("null")
            .to_string(),
        _ => "string".into(),
    };
    let num = |k: &str| schema.get(k).and_then(Value::as_f64);
    match kind.as_str() {
        "object" => {
            let mut out = serde_json::Map::new();
            let required: Vec<&str> = schema
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            for (name, sub) in schema
                .get("properties")
                .and_then(Value::as_object)
                .into_iter()
                .flatten()
            {
                if required.contains(&name.as_str()) || (depth < 3 && rng.below(2) == 0) {
                    out.insert(name.clone(), random_value(sub, rng, depth + 1));
                }
            }
            Value::Object(out)
        }
        "array" => {
            let lo = schema.get("minItems").and_then(Value::as_u64).unwrap_or(0);
            let hi = schema
                .get("maxItems")
                .and_then(Value::as_u64)
                .unwrap_or(lo + 4)
                .max(lo);
            let n = if depth >= 3 {
                lo
            } else {
                lo + rng.below(hi - lo + 1)
            };
            let item = schema.get("items").cloned().unwrap_or(json!({}));
            Value::Array(
                (0..n)
                    .map(|_| random_value(&item, rng, depth + 1))
                    .collect(),
            )
        }
        "integer" => {
            let lo = num("minimum")
                .or(num("exclusiveMinimum").map(|x| x.floor() + 1.0))
                .unwrap_or(-1000.0);
            let hi = num("maximum")
                .or(num("exclusiveMaximum").map(|x| x.ceil() - 1.0))
                .unwrap_or(1000.0)
                .max(lo);
            json!(lo as i64 + rng.below((hi - lo) as u64 + 1) as i64)
        }
        "number" => {
            let lo = num("minimum")
                .or(num("exclusiveMinimum"))
                .unwrap_or(-1000.0);
            let hi = num("maximum")
                .or(num("exclusiveMaximum"))
                .unwrap_or(1000.0)
                .max(lo);
            let x = lo + (hi - lo) * (rng.below(1 << 20) as f64 / (1 << 20) as f64);
            json!(x)
        }
        "boolean" => json!(rng.below(2) == 1),
        "null" => Value::Null,
        _ => {
            let lo = schema.get("minLength").and_then(Value::as_u64).unwrap_or(0) as usize;
            let hi = schema
                .get("maxLength")
                .and_then(Value::as_u64)
                .map_or(lo.max(24), |m| m as usize)
                .max(lo);
            let mut text: String = rng.text(&[]).chars().take(hi).collect();
            while text.chars().count() < lo {
                text.push('x');
            }
            json!(text)
        }
    }
}

/// The conformance inputs' draws ([`SplitMix64`], with modulo draws below `n`).
pub(super) struct SplitMix(pub(super) SplitMix64);

/// What random text is made of: words a model writes, digits and operators, markup,
/// whitespace, and characters outside ASCII.
const PIECES: [&str; 24] = [
    "the",
    "answer",
    " ",
    " ",
    "\n",
    "42",
    "7",
    "-3.5",
    "+",
    "*",
    "/",
    "(",
    ")",
    "=",
    "<answer>",
    "</answer>",
    "print(",
    "é",
    "中文",
    "🙂",
    "\t",
    "```",
    "'",
    "\"",
];

impl SplitMix {
    pub(super) fn next(&mut self) -> u64 {
        self.0.next_u64()
    }

    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// Up to ~60 random pieces, now and then one of `patterns` among them.
    pub(super) fn text(&mut self, patterns: &[String]) -> String {
        let n = self.below(60);
        let mut text = String::new();
        for _ in 0..n {
            if !patterns.is_empty() && self.below(20) == 0 {
                text.push_str(&patterns[self.below(patterns.len() as u64) as usize]);
            } else if self.below(6) == 0 {
                // A random scalar value from the first planes.
                let c = char::from_u32(self.below(0x3_0000) as u32).unwrap_or('?');
                text.push(c);
            } else {
                text.push_str(PIECES[self.below(PIECES.len() as u64) as usize]);
            }
        }
        text
    }

    /// Random text ending with one of `patterns`, often with another pattern before it
    /// and a language tag after that (so that open/close pairs such as code fences get a
    /// random body to run).
    pub(super) fn call_text(&mut self, patterns: &[String]) -> String {
        const TAGS: [&str; 5] = ["", "python\n", "js\n", "c\n", " "];
        let pick = |r: &mut SplitMix| patterns[r.below(patterns.len() as u64) as usize].clone();
        // Free of the patterns: a stray one would close the call early or unbalance it.
        let plain = |r: &mut SplitMix| {
            let mut text = r.text(&[]);
            for p in patterns {
                text = text.replace(p.as_str(), "");
            }
            text
        };
        let mut text = plain(self);
        if self.below(2) == 0 {
            text.push_str(&pick(self));
            text.push_str(TAGS[self.below(TAGS.len() as u64) as usize]);
            text.push_str(&plain(self));
            text.push('\n');
        }
        text.push_str(&pick(self));
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_text_repeats_for_a_seed_and_call_text_ends_with_a_pattern() {
        let patterns = vec!["</calc>".to_string(), "```".to_string()];
        let (mut a, mut b) = (
            SplitMix(SplitMix64::from_state(3)),
            SplitMix(SplitMix64::from_state(3)),
        );
        for _ in 0..50 {
            assert_eq!(a.text(&patterns), b.text(&patterns));
            let call = a.call_text(&patterns);
            assert_eq!(call, b.call_text(&patterns));
            assert!(
                patterns.iter().any(|p| call.ends_with(p.as_str())),
                "{call:?}"
            );
        }
    }
}
