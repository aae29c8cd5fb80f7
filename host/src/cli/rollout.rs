//! `rlhost rollout` and `rlhost eval`: sample and score trajectories with a run config,
//! without training. `rollout` is for debugging a task's tools and rewards: it writes
//! every trajectory to a JSONL file and prints a readable view of a few, tool spans
//! marked. `eval` reports accuracy, tool-use rate and rewards on the held-out split.

use crate::config::setup::{Setup, display};
use crate::config::{set_path, set_value};
use crate::data::Cursor;
use crate::rollout::eval::evaluate;
use crate::rollout::{BatchStats, Engine, SpanKind, Trajectory};
use crate::sampler::decode::sample_seed;
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use tokio::runtime::Handle;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Split {
    Train,
    Eval,
}

#[derive(Debug, Args)]
pub struct RolloutArgs {
    #[command(flatten)]
    source: super::source::RunSource,
    /// Where to write the trajectories, one JSON object per line.
    #[arg(long)]
    out: PathBuf,
    /// Which samples: the held-out split or the training split.
    #[arg(long, value_enum, default_value = "eval")]
    split: Split,
    /// How many prompts (default: all held-out ones, or one batch of training ones).
    #[arg(long)]
    prompts: Option<usize>,
    /// A PEFT adapter to sample with (overrides model.adapter).
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Overrides run.seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Overrides rollout.group_size.
    #[arg(long)]
    group_size: Option<usize>,
    /// How many trajectories to print.
    #[arg(long, default_value_t = 2)]
    show: usize,
    /// Also write preference pairs made from the trajectories to this file (JSONL, the
    /// rows `rlhost dpo` and `rlhost rm` read): in each group whose rewards differ, a
    /// trajectory with the highest reward chosen over one with the lowest.
    #[arg(long, value_name = "FILE")]
    pairs: Option<PathBuf>,
    /// Pairs a group gives at most with --pairs (each best against each worst, in
    /// sampling order).
    #[arg(long, default_value_t = 1, requires = "pairs")]
    pairs_per_group: usize,
}

pub fn run(args: RolloutArgs, handle: &Handle, quiet: bool) -> Result<()> {
    let mut set = args.source.set.clone();
    if let Some(seed) = args.seed {
        set.push(set_value("run.seed", seed as i64));
    }
    if let Some(g) = args.group_size {
        set.push(set_value("rollout.group_size", g as i64));
    }
    if let Some(adapter) = &args.adapter {
        set.push(set_path("model.adapter", adapter)?);
    }
    let loaded = super::source::load_config(
        args.source.config.as_deref(),
        &args.source.plugins,
        &set,
        handle,
    )?;
    let setup = super::source::open_run(loaded, &args.source.plugins, handle, quiet, &|| {})?;
    let c = &setup.loaded.config;
    let samples = match args.split {
        Split::Eval => {
            let mut all = handle.block_on(setup.dataset.eval_samples())?;
            if all.is_empty() {
                bail!(
                    "{}: the held-out split is empty; set data.eval_size (or eval_fraction, eval_path), or pass --split train",
                    setup.loaded.path.display()
                );
            }
            all.truncate(args.prompts.unwrap_or(all.len()));
            all
        }
        Split::Train => {
            let n = args.prompts.unwrap_or(c.rollout.prompts_per_step);
            handle.block_on(setup.dataset.next_batch(&mut Cursor::default(), n))?
        }
    };
    let engine = Engine::new(&setup.lm, &setup.settings, &setup.rewards, handle.clone())?;
    let tmp = args.out.with_extension("jsonl.tmp");
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(&tmp).with_context(|| format!("cannot write {}", tmp.display()))?,
    );
    let mut all: Vec<Trajectory> = Vec::new();
    let mut total = BatchStats::default();
    let batches: Vec<_> = samples.chunks(c.rollout.prompts_per_step).collect();
    for (b, batch) in batches.iter().enumerate() {
        let seed = sample_seed(c.run.seed, b, usize::MAX);
        let (groups, stats) = engine.run(batch, seed, 0, setup.mode())?;
        for t in groups.into_iter().flat_map(|g| g.trajectories) {
            serde_json::to_writer(&mut out, &t)?;
            out.write_all(b"\n")?;
            all.push(t);
        }
        if !quiet {
            eprintln!(
                "batch {}/{}: {} trajectories, {:.1} s, {:.0} sampled tokens/s",
                b + 1,
                batches.len(),
                stats.trajectories,
                stats.wall_s,
                // With vLLM servers the decode happens there: per wall second.
                stats.sampled_tokens as f64
                    / if stats.requests > 0 {
                        stats.wall_s
                    } else {
                        stats.decode_s
                    }
                    .max(1e-9)
            );
        }
        total.add(&stats);
    }
    out.flush()?;
    drop(out);
    std::fs::rename(&tmp, &args.out)
        .with_context(|| format!("cannot write {}", args.out.display()))?;

    let made_pairs = match &args.pairs {
        Some(path) => {
            let rows = preference_pairs(&all, args.pairs_per_group);
            let text: String = rows.iter().map(|r| r.to_string() + "\n").collect();
            crate::model::peft::write_atomic(path, text.as_bytes())
                .with_context(|| format!("cannot write {}", path.display()))?;
            Some((rows.len(), path))
        }
        None => None,
    };
    let color = std::io::stdout().is_terminal();
    for t in all.iter().take(args.show) {
        print!("{}", view(t, color));
    }
    print!("{}", summary(&all, &total, &setup));
    println!("wrote {} trajectories to {}", all.len(), display(&args.out));
    if let Some((n, path)) = made_pairs {
        let groups: std::collections::BTreeSet<u64> = all.iter().map(|t| t.sample_id).collect();
        println!(
            "wrote {n} preference pairs from {} groups to {}",
            groups.len(),
            display(path)
        );
    }
    Ok(())
}

/// Preference pairs from sampled groups (`--pairs`): in each group (one prompt's
/// trajectories) whose rewards are not all equal, each trajectory with the group's highest
/// reward is chosen over each with its lowest, in sampling order, up to `per_group` pairs.
/// A row is `{prompt, chosen, rejected}` as message lists (the conversation before the
/// first assistant message, and each trajectory's messages from there), with both rewards
/// and the sample id beside them.
fn preference_pairs(trajectories: &[Trajectory], per_group: usize) -> Vec<serde_json::Value> {
    let mut groups: BTreeMap<u64, Vec<&Trajectory>> = BTreeMap::new();
    for t in trajectories {
        groups.entry(t.sample_id).or_default().push(t);
    }
    let split = |t: &Trajectory| {
        let at = t
            .messages
            .iter()
            .position(|m| m.role == "assistant")
            .unwrap_or(t.messages.len());
        (t.messages[..at].to_vec(), t.messages[at..].to_vec())
    };
    let mut rows = Vec::new();
    for (id, mut group) in groups {
        group.sort_by_key(|t| t.index);
        let best = group
            .iter()
            .map(|t| t.reward)
            .fold(f64::NEG_INFINITY, f64::max);
        let worst = group.iter().map(|t| t.reward).fold(f64::INFINITY, f64::min);
        if best.partial_cmp(&worst) != Some(std::cmp::Ordering::Greater) {
            continue;
        }
        let chosen = group.iter().filter(|t| t.reward == best);
        let pairs = chosen
            .flat_map(|c| {
                group
                    .iter()
                    .filter(|t| t.reward == worst)
                    .map(move |r| (c, r))
            })
            .take(per_group);
        for (c, r) in pairs {
            let (prompt, chosen) = split(c);
            let (_, rejected) = split(r);
            rows.push(serde_json::json!({
                "prompt": prompt,
                "chosen": chosen,
                "rejected": rejected,
                "chosen_reward": c.reward,
                "rejected_reward": r.reward,
                "sample_id": id,
            }));
        }
    }
    rows
}

/// One trajectory for a human: its header, then the completion with inserted spans
/// marked (coloured on a terminal, bracketed otherwise).
pub fn view(t: &Trajectory, color: bool) -> String {
    let mut s = String::new();
    let components: Vec<String> = t.rewards.iter().map(|(k, v)| format!("{k}={v}")).collect();
    s.push_str(&format!(
        "── sample {} #{}  reward {:.3} ({})  stop {}  turns {}  tool calls {}{}\n",
        t.sample_id,
        t.index,
        t.reward,
        components.join(" "),
        t.stop.as_str(),
        t.turns,
        t.tool_calls,
        if t.faults.is_empty() {
            String::new()
        } else {
            format!("  faults {}", t.faults.len())
        }
    ));
    if let Some(last_user) = t
        .messages
        .iter()
        .take_while(|m| m.role != "assistant")
        .last()
    {
        s.push_str(&format!("[{}] {}\n", last_user.role, last_user.content));
    }
    for span in &t.spans {
        let text = &span.text;
        match (span.kind, color) {
            (SpanKind::Model, _) => s.push_str(text),
            (SpanKind::Tool, true) => s.push_str(&format!("\x1b[36m{text}\x1b[0m")),
            (SpanKind::Env, true) => s.push_str(&format!("\x1b[33m{text}\x1b[0m")),
            (SpanKind::Tool, false) => s.push_str(&format!("⟦tool⟧{text}⟦/tool⟧")),
            (SpanKind::Env, false) => s.push_str(&format!("⟦env⟧{text}⟦/env⟧")),
        }
    }
    s.push('\n');
    for f in &t.faults {
        s.push_str(&format!(
            "  fault: {} {} {}: {}\n",
            f.plugin, f.call, f.kind, f.message
        ));
    }
    for (plugin, note) in &t.notes {
        s.push_str(&format!("  note: {plugin}: {note}\n"));
    }
    if !t.call_kinds.is_empty() {
        let kinds: Vec<String> = t
            .call_kinds
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        s.push_str(&format!("  function calls: {}\n", kinds.join(", ")));
    }
    s
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (n, sum) = xs.fold((0usize, 0.0), |(n, s), x| (n + 1, s + x));
    if n == 0 { 0.0 } else { sum / n as f64 }
}

fn summary(all: &[Trajectory], stats: &BatchStats, setup: &Setup) -> String {
    let n = all.len().max(1) as f64;
    let rewards: Vec<f64> = all.iter().map(|t| t.reward).collect();
    let m = mean(rewards.iter().copied());
    let sd = mean(rewards.iter().map(|r| (r - m) * (r - m))).sqrt();
    let mut components: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for t in all {
        for (k, v) in &t.rewards {
            components.entry(k).or_default().push(*v);
        }
    }
    let mut stops: BTreeMap<&str, usize> = BTreeMap::new();
    for t in all {
        *stops.entry(t.stop.as_str()).or_default() += 1;
    }
    let mut s = String::from("── summary\n");
    s.push_str(&format!("trajectories   {}\n", all.len()));
    s.push_str(&format!("reward         {m:.4} ± {sd:.4}\n"));
    for (k, v) in &components {
        s.push_str(&format!("  {k:<12} {:.4}\n", mean(v.iter().copied())));
    }
    s.push_str(&format!(
        "turns          {:.2} per trajectory\ntool calls     {:.2} per trajectory\nsampled tokens {:.1} per trajectory\n",
        all.iter().map(|t| t.turns as f64).sum::<f64>() / n,
        all.iter().map(|t| t.tool_calls as f64).sum::<f64>() / n,
        stats.sampled_tokens as f64 / n
    ));
    let stops: Vec<String> = stops.iter().map(|(k, v)| format!("{k} {v}")).collect();
    s.push_str(&format!("stops          {}\n", stops.join(", ")));
    let mut calls: BTreeMap<&str, u32> = BTreeMap::new();
    for (k, v) in all.iter().flat_map(|t| &t.call_kinds) {
        *calls.entry(k).or_default() += v;
    }
    let kinds = all.iter().flat_map(|t| &t.call_kinds);
    if let Some(malformed) = crate::rollout::env::tools::malformed_rate(kinds) {
        let total: u32 = calls.values().sum();
        let kinds: Vec<String> = calls.iter().map(|(k, v)| format!("{k} {v}")).collect();
        s.push_str(&format!(
            "function calls {total} ({}); malformed {:.1}%\n",
            kinds.join(", "),
            100.0 * malformed
        ));
    }
    s.push_str(&format!(
        "time           {:.1} s: prefill {:.1} s, decode {:.1} s, waiting on plugins {:.1} s ({:.1}%); plugin calls {:.2} s in all\n",
        stats.wall_s,
        stats.prefill_s,
        stats.decode_s,
        stats.plugin_wait_s,
        100.0 * stats.plugin_wait_s / stats.wall_s.max(1e-9),
        stats.plugin_busy_s
    ));
    if stats.requests > 0 {
        s.push_str(&format!(
            "vLLM           {} requests ({} sent again after a fault), waiting on the servers {:.1} s ({:.1}%), loading adapters {:.2} s\n",
            stats.requests,
            stats.retries,
            stats.server_wait_s,
            100.0 * stats.server_wait_s / stats.wall_s.max(1e-9),
            stats.adapter_load_s,
        ));
    }
    if stats.asks > 0 {
        s.push_str(&format!(
            "model calls    {} from plugins, {} tokens sampled for them, {:.2} s decoding them alone ({:.1}%)\n",
            stats.asks,
            stats.asked_tokens,
            stats.ask_s,
            100.0 * stats.ask_s / stats.wall_s.max(1e-9),
        ));
    }
    s.push_str(&format!(
        "throughput     {:.2} trajectories/s, {:.1} sampled tokens/s\n",
        stats.trajectories as f64 / stats.wall_s.max(1e-9),
        stats.sampled_tokens as f64 / stats.wall_s.max(1e-9)
    ));
    for (name, p) in &setup.plugins {
        let f = p.faults();
        if f.total() > 0 {
            let kinds: Vec<String> = crate::plugin::FaultKind::ALL
                .iter()
                .filter(|k| f.get(**k) > 0)
                .map(|k| format!("{k} {}", f.get(*k)))
                .collect();
            s.push_str(&format!("faults         {name}: {}\n", kinds.join(", ")));
        }
        let g = p.generate().totals();
        if g.calls() > 0 {
            s.push_str(&format!(
                "generate       {name}: {} answered, {} refused, {} failed; {} prompt and {} completion tokens\n",
                g.answered, g.refused, g.failed, g.prompt_tokens, g.completion_tokens
            ));
        }
    }
    // An OpenEnv server's faults are not a plugin's: counted from the trajectories.
    let mut remote: BTreeMap<&str, BTreeMap<&str, u32>> = BTreeMap::new();
    for f in all
        .iter()
        .flat_map(|t| &t.faults)
        .filter(|f| f.plugin.starts_with("openenv:"))
    {
        *remote
            .entry(f.plugin.as_str())
            .or_default()
            .entry(f.kind.as_str())
            .or_default() += 1;
    }
    for (server, kinds) in remote {
        let kinds: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} {n}")).collect();
        s.push_str(&format!(
            "faults         {server}: {}
",
            kinds.join(", ")
        ));
    }
    s
}

#[derive(Debug, Args)]
pub struct EvalArgs {
    #[command(flatten)]
    source: super::source::RunSource,
    /// A PEFT adapter to evaluate (overrides model.adapter); none: the base model.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Evaluate at most this many held-out prompts.
    #[arg(long)]
    prompts: Option<usize>,
    /// Samples per prompt.
    #[arg(long, default_value_t = 1)]
    samples: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Also write the trajectories here (JSONL).
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn eval(args: EvalArgs, handle: &Handle, quiet: bool) -> Result<()> {
    let mut set = args.source.set.clone();
    set.push(set_value("rollout.group_size", args.samples.max(1) as i64));
    set.push(set_value(
        "sampling.temperature",
        f64::from(args.temperature),
    ));
    if let Some(adapter) = &args.adapter {
        set.push(set_path("model.adapter", adapter)?);
    }
    let loaded = super::source::load_config(
        args.source.config.as_deref(),
        &args.source.plugins,
        &set,
        handle,
    )?;
    let setup = super::source::open_run(loaded, &args.source.plugins, handle, quiet, &|| {})?;
    let mut samples = handle.block_on(setup.dataset.eval_samples())?;
    if samples.is_empty() {
        bail!(
            "{}: the held-out split is empty; set data.eval_size (or eval_fraction, eval_path)",
            setup.loaded.path.display()
        );
    }
    samples.truncate(args.prompts.unwrap_or(samples.len()));
    let engine = Engine::new(&setup.lm, &setup.settings, &setup.rewards, handle.clone())?;
    let (report, all) = evaluate(
        &engine,
        &samples,
        setup.loaded.config.rollout.prompts_per_step,
        setup.loaded.config.run.seed,
        setup.mode(),
        |done, total| {
            if !quiet {
                eprintln!("eval: {done}/{total} prompts");
            }
        },
    )?;
    if let Some(out) = &args.out {
        let mut text = String::new();
        for t in &all {
            text.push_str(&serde_json::to_string(t)?);
            text.push('\n');
        }
        crate::model::peft::write_atomic(out, text.as_bytes())?;
    }
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::Message;

    fn sampled(id: u64, index: usize, reply: &str, reward: f64) -> Trajectory {
        let mut t = Trajectory::sampled(vec![1, 2, 3], 2, vec![Some(-1.0)]);
        t.sample_id = id;
        t.index = index;
        t.reward = reward;
        t.messages = vec![
            Message::new("system", "Use the calculator."),
            Message::new("user", format!("problem {id}")),
            Message::new("assistant", reply),
        ];
        t
    }

    /// A group gives its best over its worst, in sampling order, up to the cap; a group
    /// whose rewards are all equal gives none.
    #[test]
    fn pairs_take_a_groups_best_over_its_worst() {
        let ts = [
            sampled(1, 0, "b", 0.1),
            sampled(1, 1, "a", 1.1),
            sampled(1, 2, "c", 0.1),
            sampled(1, 3, "d", 0.5),
            sampled(2, 0, "x", 1.0),
            sampled(2, 1, "y", 1.0),
        ];
        let rows = preference_pairs(&ts, 1);
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert_eq!(r["prompt"].as_array().unwrap().len(), 2);
        assert_eq!(r["prompt"][1]["content"], "problem 1");
        assert_eq!(r["chosen"][0]["content"], "a");
        assert_eq!(r["rejected"][0]["content"], "b");
        assert_eq!(
            (r["chosen_reward"].as_f64(), r["rejected_reward"].as_f64()),
            (Some(1.1), Some(0.1))
        );
        let rows = preference_pairs(&ts, 5);
        let rejected: Vec<&str> = rows
            .iter()
            .map(|r| r["rejected"][0]["content"].as_str().unwrap())
            .collect();
        assert_eq!(rejected, ["b", "c"]);
    }
}
