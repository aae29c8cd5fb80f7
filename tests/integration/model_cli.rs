//! The `rlhost` binary on model directories: `generate` (raw, chat, log-probs, seeds,
//! adapters) and `export --merge`, and one clear line for each bad model directory.

use rlhost_tests::{TestCommand, temp_dir};
use std::path::PathBuf;

fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/models")
        .join(name)
        .display()
        .to_string()
}

fn lines(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn generate_is_seeded_and_reports_logprobs() {
    let run = |seed: &str| {
        TestCommand::new(&["generate", "--model", &fixture("qwen2"), "--chat"])
            .args([
                "--prompt",
                "What is 2 + 3?",
                "-n",
                "3",
                "--max-new-tokens",
                "6",
            ])
            .args(["--seed", seed, "--json", "--logprobs", "--temperature", "1"])
            .ok()
    };
    let a = lines(&run("1").stdout);
    assert_eq!(a.len(), 3);
    for s in &a {
        let toks = s["tokens"].as_array().unwrap();
        assert_eq!(toks.len(), 6, "{s}");
        assert!(toks.iter().all(|t| t["logprob"].as_f64().unwrap() < 0.0));
        assert_eq!(s["finish"], "length");
        // The chat template wrapped the prompt: 39 tokens for this one (fixture case
        // single_user_default_system).
        assert_eq!(s["prompt_tokens"], 39);
    }
    assert_eq!(a, lines(&run("1").stdout));
    assert_ne!(a, lines(&run("2").stdout));
}

#[test]
fn adapter_changes_greedy_output_and_merge_reproduces_it() {
    let greedy = |model: &str, adapter: Option<&str>| {
        let mut cmd = TestCommand::new(&["generate", "--model", model, "--prompt", "<calc>3 + 4"])
            .args(["--greedy", "--max-new-tokens", "12", "--json"]);
        if let Some(a) = adapter {
            cmd = cmd.args(["--adapter", a]);
        }
        lines(&cmd.ok().stdout)[0]["token_ids"].clone()
    };
    let base = fixture("llama");
    let adapter = format!("{base}/adapter");
    let plain = greedy(&base, None);
    let tuned = greedy(&base, Some(&adapter));
    assert_ne!(plain, tuned);
    let out = temp_dir("merged-llama");
    TestCommand::new(&["export", "--model", &base, "--adapter", &adapter, "--merge"])
        .args(["--out", out.to_str().unwrap()])
        .ok();
    assert_eq!(greedy(out.to_str().unwrap(), None), tuned);
}

#[test]
fn bad_model_directories_get_one_clear_line() {
    let err = TestCommand::new(&["generate", "--model", "/no/such/model", "--prompt", "x"]).fails();
    assert!(
        err.contains("model directory /no/such/model does not exist"),
        "{err}"
    );

    // A copy of qwen2 with one file broken at a time.
    let src = PathBuf::from(fixture("qwen2"));
    let dir = temp_dir("broken-model");
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let model = dir.to_str().unwrap().to_string();
    let gen_fails = || TestCommand::new(&["generate", "--model", &model, "--prompt", "x"]).fails();

    std::fs::write(dir.join("config.json"), "{\"model_type\": \"qwen2\",").unwrap();
    let err = gen_fails();
    assert!(err.contains("config.json is not valid JSON"), "{err}");
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();

    std::fs::write(dir.join("model.safetensors"), b"not safetensors").unwrap();
    let err = gen_fails();
    assert!(
        err.contains("model.safetensors is not a readable safetensors file"),
        "{err}"
    );
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let err = gen_fails();
    assert!(err.contains("no weights in"), "{err}");
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();

    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let err = gen_fails();
    assert!(err.contains("tokenizer.json"), "{err}");
    std::fs::copy(src.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();

    std::fs::write(
        dir.join("generation_config.json"),
        "{\"eos_token_id\": \"x\"}",
    )
    .unwrap();
    let err = gen_fails();
    assert!(
        err.contains("generation_config.json") && err.contains("eos_token_id"),
        "{err}"
    );
    std::fs::copy(
        src.join("generation_config.json"),
        dir.join("generation_config.json"),
    )
    .unwrap();

    // Every error is one line, and the repaired directory works again.
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    TestCommand::new(&[
        "generate",
        "--model",
        &model,
        "--prompt",
        "x",
        "--max-new-tokens",
        "2",
    ])
    .ok();
}
