//! {{name}}: tools (functions the model calls in its own tool-call format). This one has
//! two: `add`, the sum of two integers (stateless), and `tally`, which adds an amount to
//! the trajectory's running total and returns the total (it keeps state). Replace them
//! with yours.
//!
//! In a run the host checks each call against the function's JSON Schema before it gets
//! here; the checks below still refuse what does not fit (`rlhost plugin test` sends such
//! calls), and an `Err` is the function's own refusal, which the model reads.
//!
//! Config (JSON): `{"start": 0}` (optional): the running total when a trajectory starts.

use rlhost_sdk::{FunctionSpec, Sample, Tools};
use serde::Deserialize;
use serde_json::json;

/// The largest magnitude of an argument and of the total.
const LIMIT: i64 = 1_000_000_000;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
struct Config {
    start: i64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddArgs {
    a: i64,
    b: i64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TallyArgs {
    amount: i64,
}

/// One trajectory's session: its state lives as long as the trajectory.
struct Counter {
    total: i64,
}

impl Tools for Counter {
    fn open(config: &str, _sample: Sample) -> Result<Self, String> {
        let config: Config =
            serde_json::from_str(config).map_err(|e| format!("{{name}} config: {e}"))?;
        in_range("start", config.start).map_err(|e| format!("{{name}} config: {e}"))?;
        Ok(Counter {
            total: config.start,
        })
    }

    fn functions(&self) -> Vec<FunctionSpec> {
        let integer = json!({"type": "integer", "minimum": -LIMIT, "maximum": LIMIT});
        vec![
            FunctionSpec {
                name: "add".into(),
                description: "The sum of two integers.".into(),
                parameters: json!({
                    "type": "object",
                    "properties": {"a": integer, "b": integer},
                    "required": ["a", "b"],
                    "additionalProperties": false,
                })
                .to_string(),
                // Reads no state: its calls may run at once, each in a fresh instance.
                stateless: true,
            },
            FunctionSpec {
                name: "tally".into(),
                description: "Adds an amount to the running total and returns the total.".into(),
                parameters: json!({
                    "type": "object",
                    "properties": {"amount": integer},
                    "required": ["amount"],
                    "additionalProperties": false,
                })
                .to_string(),
                stateless: false,
            },
        ]
    }

    fn call(&mut self, name: &str, arguments: &str) -> Result<String, String> {
        match name {
            "add" => {
                let AddArgs { a, b } = parse(arguments)?;
                in_range("a", a)?;
                in_range("b", b)?;
                Ok((a + b).to_string())
            }
            "tally" => {
                let TallyArgs { amount } = parse(arguments)?;
                in_range("amount", amount)?;
                let total = self.total + amount;
                if !(-LIMIT..=LIMIT).contains(&total) {
                    return Err(format!(
                        "the total would leave -{LIMIT}..{LIMIT}; it stays {}",
                        self.total
                    ));
                }
                self.total = total;
                Ok(total.to_string())
            }
            _ => Err(format!("there is no function `{name}`")),
        }
    }
}

fn parse<'a, T: Deserialize<'a>>(arguments: &'a str) -> Result<T, String> {
    serde_json::from_str(arguments).map_err(|e| format!("bad arguments: {e}"))
}

fn in_range(what: &str, x: i64) -> Result<(), String> {
    if !(-LIMIT..=LIMIT).contains(&x) {
        return Err(format!("`{what}` must be from -{LIMIT} to {LIMIT}"));
    }
    Ok(())
}

rlhost_sdk::export!(tools: Counter);
