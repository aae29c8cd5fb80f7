//! The calculator trigger: the model writes `<calc>EXPR</calc>`, the tool appends
//! `<result>VALUE</result>`. Exact arithmetic (see the `arith` crate); an expression it
//! cannot evaluate gets `<result>error: WHY</result>` so that the model sees why.
//!
//! Config: `{"precision": 6}`, decimal places shown for a non-integer result.

use arith::calc_tool;
use rlhost_sdk::{Sample, Trigger};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {
    precision: u32,
}

impl Default for Config {
    fn default() -> Self {
        Config { precision: 6 }
    }
}

struct Calculator {
    precision: u32,
}

impl Trigger for Calculator {
    fn open(config: &str, _sample: Sample) -> Result<Self, String> {
        let config: Config =
            serde_json::from_str(config).map_err(|e| format!("calculator config: {e}"))?;
        if config.precision > 18 {
            return Err("calculator config: precision must be at most 18".into());
        }
        Ok(Calculator {
            precision: config.precision,
        })
    }

    fn stop_patterns(&self) -> Vec<String> {
        vec![calc_tool::CLOSE.to_string()]
    }

    fn fire(&mut self, text: &str) -> Result<Option<String>, String> {
        Ok(calc_tool::answer(text, self.precision))
    }
}

rlhost_sdk::export!(trigger: Calculator);
