//! Rollout throughput: trajectories/s, sampled tokens/s and the share of wall time spent
//! waiting on plugins, with no tool, the calculator and the Python code tool; and what
//! shared group prefill saves over prefilling every sample on its own.
//!
//! ```sh
//! cargo run --release --example rollout_bench -- --model tests/fixtures/models/qwen2 --teach
//! cargo run --release --example rollout_bench -- --model DIR --prompts 4 --group 4 --max-new-tokens 32
//! ```
//!
//! A random model never calls a tool, so `--teach` first fits the tiny model's adapter
//! (SFT, a few hundred steps) to answer "What is A*B?" prompts by calling the tool the
//! prompt names; the benchmark then measures real tool calls. "Separate prefill" runs
//! each of a group's G samples as its own prompt (group size 1), which is what sampling
//! without a shared cache costs. Prints one JSON object per case, then a table.

use anyhow::{Context, Result};
use rlhost::model::Placement;
use rlhost::model::{LanguageModel, LoraConfig, Mode};
use rlhost::plugin::{Limits, PluginRuntime, PluginSpec, RuntimeOptions, Sample};
use rlhost::rl::sft::{self, SftOptions, SftRow};
use rlhost::rollout::{
    Answerers, BatchStats, Engine, Rewards, RolloutLimits, RolloutSettings, ToolSpec,
};
use serde_json::json;
use std::path::PathBuf;

struct Args {
    model: PathBuf,
    plugins: PathBuf,
    prompts: usize,
    group: usize,
    max_new_tokens: usize,
    teach: bool,
}

fn args() -> Result<Args> {
    let mut a = Args {
        model: "tests/fixtures/models/qwen2".into(),
        plugins: "plugins/dist".into(),
        prompts: 16,
        group: 8,
        max_new_tokens: 64,
        teach: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => a.model = value()?.into(),
            "--plugins" => a.plugins = value()?.into(),
            "--prompts" => a.prompts = value()?.parse()?,
            "--group" => a.group = value()?.parse()?,
            "--max-new-tokens" => a.max_new_tokens = value()?.parse()?,
            "--teach" => a.teach = true,
            other => anyhow::bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

fn prompt(i: usize, tool: &str) -> (usize, usize, String) {
    let (x, y) = (3 + (i * 7) % 17, 2 + (i * 5) % 13);
    (x, y, format!("What is {x}*{y}? Use the {tool}."))
}

fn answer(x: usize, y: usize, tool: &str) -> String {
    let p = x * y;
    if tool == "calculator" {
        format!("<calc>{x}*{y}</calc><result>{p}</result><answer>{p}</answer>")
    } else {
        format!("```python\nprint({x}*{y})\n```\n<output>\n{p}\n</output>\n<answer>{p}</answer>")
    }
}

/// Fits the adapter so that the model calls the named tool.
fn teach(lm: &mut LanguageModel) -> Result<()> {
    let chat = lm.chat()?;
    let mut rows = Vec::new();
    for tool in ["calculator", "python"] {
        for i in 0..12 {
            let (x, y, p) = prompt(i, tool);
            let user = [json!({"role": "user", "content": p})];
            let head = chat.render(&user, None, true)?;
            let full = chat.render(
                &[
                    user[0].clone(),
                    json!({"role": "assistant", "content": answer(x, y, tool)}),
                ],
                None,
                false,
            )?;
            let full = full.trim_end_matches('\n');
            let head_ids = lm.tokenizer.encode(&head)?;
            let mut tokens = head_ids.clone();
            tokens.extend(lm.tokenizer.encode(&full[head.len()..])?);
            let loss_mask = (0..tokens.len())
                .map(|i| u8::from(i >= head_ids.len()))
                .collect();
            rows.push(SftRow { tokens, loss_mask });
        }
    }
    lm.model.attach_lora(&LoraConfig::default(), 0)?;
    let t0 = std::time::Instant::now();
    let losses = sft::fit(
        &lm.model,
        &rows,
        &SftOptions {
            steps: 300,
            lr: 1e-2,
            target_loss: 0.02,
            pack_sequences: false,
        },
    )?;
    eprintln!(
        "taught in {:.1} s: {} steps, loss {:.3} -> {:.4}",
        t0.elapsed().as_secs_f64(),
        losses.len(),
        losses[0],
        losses.last().unwrap()
    );
    Ok(())
}

fn main() -> Result<()> {
    rlhost::model::compute::set_up_process();
    let a = args()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut lm = LanguageModel::open(&a.model, &Placement::CPU)?;
    if a.teach {
        teach(&mut lm)?;
    }
    let runtime = PluginRuntime::new(&RuntimeOptions {
        cache_dir: rlhost::plugin::cache::default_dir(),
        ..RuntimeOptions::default()
    })?;
    let load = |name: &str| -> Result<ToolSpec> {
        let plugin = rt.block_on(runtime.load(PluginSpec {
            path: a.plugins.join(format!("{name}.wasm")),
            limits: Limits::default(),
            grants: Default::default(),
        }))?;
        Ok(ToolSpec {
            plugin,
            config: "{}".into(),
        })
    };
    let rewards = Rewards::none();
    let mut rows = Vec::new();
    for (case, tool_name, trigger) in [
        ("no tool", "calculator", None),
        ("calculator", "calculator", Some(load("calculator")?)),
        ("python", "python", Some(load("code_trigger")?)),
    ] {
        let mut sampling = rlhost::sampler::draw::defaults(&lm)?;
        sampling.temperature = 1.0;
        sampling.top_k = 0;
        sampling.top_p = 1.0;
        sampling.max_new_tokens = a.max_new_tokens;
        let samples: Vec<(u64, Sample)> = (0..a.prompts)
            .map(|i| {
                let (_, _, p) = prompt(100 + i, tool_name);
                (i as u64, Sample::from_prompt(&p))
            })
            .collect();
        for shared in [true, false] {
            let settings = RolloutSettings {
                group_size: if shared { a.group } else { 1 },
                sampling: sampling.clone(),
                limits: RolloutLimits::default(),
                template_kwargs: Default::default(),
                env: Answerers {
                    trigger: trigger.clone(),
                    ..Default::default()
                },
                remote: None,
                tree: None,
            };
            let batch: Vec<(u64, Sample)> = if shared {
                samples.clone()
            } else {
                // Each sample G times, as G one-sample prompts.
                samples
                    .iter()
                    .flat_map(|(id, s)| {
                        (0..a.group).map(move |j| (id * a.group as u64 + j as u64, s.clone()))
                    })
                    .collect()
            };
            let engine = Engine::new(&lm, &settings, &rewards, rt.handle().clone())?;
            // Warm-up: plugin instances, allocator, caches.
            engine.run(&batch[..1], 99, 0, Mode::INFERENCE)?;
            let (groups, s) = engine.run(&batch, 1, 0, Mode::INFERENCE)?;
            let trajectories: Vec<_> = groups.iter().flat_map(|g| &g.trajectories).collect();
            let calls: u32 = trajectories.iter().map(|t| t.tool_calls).sum();
            let row = json!({
                "case": case,
                "prefill": if shared { "shared" } else { "separate" },
                "trajectories": s.trajectories,
                "wall_s": s.wall_s,
                "prefill_s": s.prefill_s,
                "decode_s": s.decode_s,
                "plugin_wait_s": s.plugin_wait_s,
                "plugin_busy_s": s.plugin_busy_s,
                "trajectories_per_s": s.trajectories as f64 / s.wall_s,
                "sampled_tokens_per_s": s.sampled_tokens as f64 / s.wall_s,
                "tool_calls_per_trajectory": calls as f64 / s.trajectories as f64,
                "prompt_tokens": s.prompt_tokens,
                "sampled_tokens": s.sampled_tokens,
                "inserted_tokens": s.inserted_tokens,
            });
            println!("{row}");
            rows.push((case, shared, calls as f64 / s.trajectories as f64, s));
        }
    }
    println!(
        "\n{:<11} {:>8} {:>8} {:>8} {:>10} {:>9} {:>9} {:>12}",
        "case", "prefill", "traj/s", "tok/s", "prefill s", "wall s", "plugin%", "calls/traj"
    );
    for (case, shared, calls, s) in &rows {
        print_row(case, *shared, *calls, s);
    }
    Ok(())
}

fn print_row(case: &str, shared: bool, calls: f64, s: &BatchStats) {
    println!(
        "{:<11} {:>8} {:>8.2} {:>8.1} {:>10.2} {:>9.2} {:>8.1}% {:>12}",
        case,
        if shared { "shared" } else { "separate" },
        s.trajectories as f64 / s.wall_s,
        s.sampled_tokens as f64 / s.wall_s,
        s.prefill_s,
        s.wall_s,
        100.0 * s.plugin_wait_s / s.wall_s,
        format!("{calls:.2}"),
    );
}
