//! The calculator trigger (see `plugins/calculator`) built against `rlhost:plugin@0.1.0`
//! with wit-bindgen directly, as a Rust plugin of the first contract was: the SDK has moved
//! on to 0.2.0, and this one proves that the host still loads and runs such plugins (the
//! Python, JavaScript and C ones on 0.1.0 are code_trigger, js_trigger and c_reward).
//!
//! Config: `{"precision": 6}`, decimal places shown for a non-integer result.

mod bindings {
    wit_bindgen::generate!({
        path: "../../wit/v0.1.0",
        world: "trigger-plugin",
    });
}

use arith::calc_tool;
use bindings::exports::rlhost::plugin::{about, trigger};
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

struct Plugin;

impl about::Guest for Plugin {
    fn info() -> about::PluginInfo {
        about::PluginInfo {
            name: env!("CARGO_PKG_NAME").into(),
            version: env!("CARGO_PKG_VERSION").into(),
            description: env!("CARGO_PKG_DESCRIPTION").into(),
        }
    }
}

impl trigger::Guest for Plugin {
    type Session = Calculator;
}

struct Calculator {
    precision: u32,
}

impl trigger::GuestSession for Calculator {
    fn open(config: String, _sample: trigger::Sample) -> Result<trigger::Session, String> {
        let config: Config =
            serde_json::from_str(&config).map_err(|e| format!("calculator config: {e}"))?;
        if config.precision > 18 {
            return Err("calculator config: precision must be at most 18".into());
        }
        Ok(trigger::Session::new(Calculator {
            precision: config.precision,
        }))
    }

    fn stop_patterns(&self) -> Vec<String> {
        vec![calc_tool::CLOSE.to_string()]
    }

    fn fire(&self, text: String) -> Result<Option<String>, String> {
        Ok(calc_tool::answer(&text, self.precision))
    }
}

bindings::export!(Plugin with_types_in bindings);
