//! {{name}}: a dataset (a source of task samples). This one makes addition problems whose
//! answer is in the sample's metadata. Replace the problems with yours; keep each sample a
//! function of the seed and the index alone, so that runs repeat and resume exactly.
//!
//! Config (JSON): `{"size": 1000}` (optional): how many samples there are.

use rlhost_sdk::{Dataset, Message, Sample};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Config {
    size: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config { size: 1000 }
    }
}

struct Sums {
    config: Config,
    seed: u64,
}

/// SplitMix64: a small, seedable generator.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Dataset for Sums {
    fn open(config: &str, seed: u64) -> Result<Self, String> {
        let config: Config =
            serde_json::from_str(config).map_err(|e| format!("{{name}} config: {e}"))?;
        if config.size == 0 {
            return Err("{{name}} config: `size` must be at least 1".into());
        }
        Ok(Sums { config, seed })
    }

    fn len(&self) -> u64 {
        self.config.size
    }

    fn get(&self, index: u64) -> Result<Sample, String> {
        if index >= self.config.size {
            return Err(format!("index {index} is past the {} samples", self.config.size));
        }
        let r = mix(self.seed ^ mix(index));
        let (a, b) = (r % 1000, (r >> 32) % 1000);
        let prompt = format!("What is {a} + {b}? Answer as <answer>N</answer>.");
        Ok(Sample {
            messages: vec![Message::new("user", prompt)],
            metadata: serde_json::json!({ "answer": a + b }).to_string(),
        })
    }
}

rlhost_sdk::export!(dataset: Sums);
