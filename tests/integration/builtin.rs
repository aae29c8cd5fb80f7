//! The built-in model is built from nothing (tokenizer, weights, warm start) into a normal
//! model directory, and the cache is reused. A small recipe keeps this fast; the real one
//! (`builtin:multiply`) is measured in the README.

use super::{load, tokio_runtime};
use rlhost::builtin::{Inputs, MULTIPLY, Recipe, ensure};
use rlhost::data::{DataConfig, Dataset};
use rlhost::model::{LanguageModel, Placement};
use rlhost::rollout::ToolSpec;

#[test]
fn a_small_builtin_model_is_built_loaded_and_cached() {
    let rt = tokio_runtime();
    let plugin = rt.block_on(load("multiply"));
    let cfg = DataConfig {
        plugin: Some("multiply".into()),
        eval_size: Some(0),
        ..DataConfig::default()
    };
    let dataset = rt
        .block_on(Dataset::open(
            &cfg,
            std::path::Path::new("."),
            Some(&plugin),
            1,
        ))
        .unwrap();
    let trigger = ToolSpec {
        plugin,
        config: "{}".into(),
    };
    let recipe = Recipe {
        hidden: 32,
        layers: 1,
        heads: 2,
        kv_heads: 1,
        intermediate: 64,
        sft_examples: 48,
        sft_epochs: 1,
        sft_batch: 16,
        // One pass and no bar: this small model's outcomes were measured without one.
        bar: None,
        ..MULTIPLY
    };
    // A private cache, so that the test builds for real.
    let cache = rlhost_tests::temp_dir("builtin-cache");
    let inputs = Inputs {
        dataset: &dataset,
        task: "multiply",
        trigger: Some(&trigger),
        tools: None,
        seed: 1,
    };
    let dir = ensure(&recipe, &inputs, rt.handle(), &cache, true).unwrap();
    let lm = LanguageModel::open(&dir, &Placement::CPU).unwrap();
    assert_eq!(lm.model.cfg.hidden_size, 32);
    // Digits are single tokens, so numbers can be copied digit by digit.
    assert_eq!(lm.tokenizer.encode("10063").unwrap().len(), 5);
    let text = lm
        .chat()
        .unwrap()
        .render(
            &[serde_json::json!({"role": "user", "content": "What is 2 * 3?"})],
            None,
            true,
        )
        .unwrap();
    assert_eq!(
        text,
        "<|im_start|>user\nWhat is 2 * 3?<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        lm.eos_token_ids[0],
        lm.tokenizer.token_to_id("<|im_end|>").unwrap()
    );
    let modified = std::fs::metadata(dir.join("model.safetensors"))
        .unwrap()
        .modified()
        .unwrap();
    let again = ensure(&recipe, &inputs, rt.handle(), &cache, true).unwrap();
    assert_eq!(dir, again);
    assert_eq!(
        std::fs::metadata(again.join("model.safetensors"))
            .unwrap()
            .modified()
            .unwrap(),
        modified,
        "the cached model is reused"
    );
}
