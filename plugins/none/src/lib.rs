//! The `none` trigger: declares no stop patterns, so it never fires. Use it for
//! single-turn tasks, where the model answers without tools.

use rlhost_sdk::{Sample, Trigger};

struct NoTool;

impl Trigger for NoTool {
    fn open(config: &str, _sample: Sample) -> Result<Self, String> {
        match config.trim() {
            "" | "{}" => Ok(NoTool),
            other => Err(format!(
                "the none trigger takes no configuration, got {other}"
            )),
        }
    }

    fn stop_patterns(&self) -> Vec<String> {
        Vec::new()
    }

    fn fire(&mut self, _text: &str) -> Result<Option<String>, String> {
        Ok(None)
    }
}

rlhost_sdk::export!(trigger: NoTool);
