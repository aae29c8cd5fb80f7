//! The range of every number in the config, checked when it is loaded, with the key named.
//!
//! serde checks types (a negative `group_size` does not parse as an unsigned integer), not
//! meaning: `train.lr = -1` would train by gradient ascent and `lr = nan` would fail steps
//! later as a "NaN gradient norm". Each rule here says what the number is for, so the error
//! can say what would go wrong.

use super::sections::RunConfig;

/// What a number may be.
#[derive(Debug, Clone, Copy)]
enum Rule {
    /// Finite and > 0.
    Positive,
    /// Finite and >= 0.
    NonNegative,
    /// Finite.
    Finite,
    /// In [0, 1].
    Fraction,
    /// In [0, 1).
    FractionBelowOne,
    /// In (0, 1].
    FractionAboveZero,
    /// An integer >= this.
    AtLeast(u64),
    /// 0, or finite and >= this.
    ZeroOrAtLeast(f64),
}

impl Rule {
    fn holds(self, v: f64) -> bool {
        v.is_finite()
            && match self {
                Rule::Positive => v > 0.0,
                Rule::NonNegative => v >= 0.0,
                Rule::Finite => true,
                Rule::Fraction => (0.0..=1.0).contains(&v),
                Rule::FractionBelowOne => (0.0..1.0).contains(&v),
                Rule::FractionAboveZero => v > 0.0 && v <= 1.0,
                Rule::AtLeast(n) => v >= n as f64,
                Rule::ZeroOrAtLeast(x) => v == 0.0 || v >= x,
            }
    }

    fn expected(self) -> String {
        match self {
            Rule::Positive => "a finite number > 0".into(),
            Rule::NonNegative => "a finite number >= 0".into(),
            Rule::Finite => "a finite number".into(),
            Rule::Fraction => "a number in [0, 1]".into(),
            Rule::FractionBelowOne => "a number in [0, 1)".into(),
            Rule::FractionAboveZero => "a number in (0, 1]".into(),
            Rule::AtLeast(n) => format!("at least {n}"),
            // Shown as the f32 it was (the sampler's bounds are f32).
            Rule::ZeroOrAtLeast(x) => format!("0, or a finite number >= {}", x as f32),
        }
    }
}

/// One number to check: its key, its value, the rule and what it is for.
struct Check {
    key: String,
    value: f64,
    rule: Rule,
    why: &'static str,
}

fn check(key: impl Into<String>, value: impl Into<f64>, rule: Rule, why: &'static str) -> Check {
    Check {
        key: key.into(),
        value: value.into(),
        rule,
        why,
    }
}

/// The first number out of its range (integers are compared as f64: exact far beyond
/// any sane limit here), as `key = value is out of range: ...`.
pub fn check_ranges(c: &RunConfig) -> Result<(), String> {
    match checks(c).into_iter().find(|c| !c.rule.holds(c.value)) {
        Some(c) => Err(format!(
            "{} = {} is out of range: expected {} ({})",
            c.key,
            c.value,
            c.rule.expected(),
            c.why
        )),
        None => Ok(()),
    }
}

/// What each number may be, by key, for the configuration reference: `plugins.NAME.…`
/// and `rewards[].…` for the keys of every plugin and reward entry.
pub fn allowed() -> std::collections::BTreeMap<String, String> {
    let every = toml::from_str::<RunConfig>(
        "[model]\npath = \"m\"\n[data]\npath = \"d.jsonl\"\n\
         [plugins.NAME]\npath = \"p.wasm\"\nmemory_mib = 1\ntimeout_ms = 1\nfuel = 1\nmax_output_bytes = 1\n\
         max_http_bytes = 1\nmax_http_in_flight = 1\n\
         [[rewards]]\nplugin = \"NAME\"\nweights = { COMPONENT = 1.0 }\n",
    )
    .expect("a config with every checked key");
    let mut out: std::collections::BTreeMap<String, String> = checks(&every)
        .into_iter()
        .map(|c| {
            let key = c.key.replace("rewards[0]", "rewards[]");
            (key, format!("{} ({})", c.rule.expected(), c.why))
        })
        .collect();
    // Checked with the rest of their section (`DataConfig::validate`,
    // `LoraConfig::validate`).
    out.insert("data.eval_fraction".into(), "a number in [0, 1)".into());
    out.insert("lora.r".into(), "at least 1".into());
    out.insert("lora.dropout".into(), "a number in [0, 1)".into());
    out
}

/// Every number's check against its rule, for the values in `c`.
fn checks(c: &RunConfig) -> Vec<Check> {
    use Rule::*;
    let t = &c.train;
    let s = &c.sampling;
    let r = &c.rollout;
    // A table: one rule a line reads better than rustfmt's five.
    #[rustfmt::skip]
    let mut checks = vec![
        check("train.steps", t.steps as f64, AtLeast(1), "optimizer steps to take"),
        check("train.lr", t.lr, Positive, "the learning rate; a negative one trains by gradient ascent"),
        check("train.min_lr_ratio", t.min_lr_ratio, Fraction, "where the cosine schedule ends, as a share of lr"),
        check("train.weight_decay", t.weight_decay, NonNegative, "AdamW's decoupled weight decay"),
        check("train.max_grad_norm", t.max_grad_norm, NonNegative, "gradient clipping (0: none)"),
        check("train.epochs_per_batch", t.epochs_per_batch as f64, AtLeast(1), "passes over each rollout batch"),
        check("train.mini_batches", t.mini_batches as f64, AtLeast(1), "optimizer steps per pass over a rollout batch"),
        check("train.micro_batch_tokens", t.micro_batch_tokens as f64, AtLeast(1), "tokens per forward/backward pass"),
        check("train.adv_eps", t.adv_eps, Positive, "added to the reward std; 0 gives NaN advantages when a group's rewards are equal"),
        check("train.clip_low", t.clip_low, FractionBelowOne, "the ratio's lower clip is 1 - clip_low"),
        check("train.clip_high", t.clip_high, NonNegative, "the ratio's upper clip is 1 + clip_high"),
        check("train.norm_constant", t.norm_constant, NonNegative, "Dr. GRPO's constant (0: rollout.max_total_tokens)"),
        check("train.kl_coef", t.kl_coef, NonNegative, "the KL penalty's weight"),
        check("train.tis_cap", t.tis_cap, Positive, "the truncated importance weight's cap"),
        check("train.gamma", t.gamma, Fraction, "GAE's discount"),
        check("train.lam", t.lam, Fraction, "GAE's lambda"),
        check("train.vf_coef", t.vf_coef, NonNegative, "the value loss's weight"),
        check("train.value_clip", t.value_clip, Positive, "the value's clip range around the old value"),
        check("train.save_every", t.save_every as f64, AtLeast(1), "steps between checkpoints (the last step always saves)"),
        check("train.keep_last", t.keep_last as f64, AtLeast(1), "checkpoints kept"),
        check("sampling.temperature", s.temperature, ZeroOrAtLeast(crate::sampler::draw::MIN_TEMPERATURE as f64), "0 samples greedily"),
        check("sampling.top_p", s.top_p, FractionAboveZero, "nucleus sampling's mass (1: off)"),
        check("sampling.min_p", s.min_p, Fraction, "min-p sampling's threshold (0: off)"),
        check("sampling.max_new_tokens", s.max_new_tokens as f64, AtLeast(1), "tokens per assistant turn"),
        check("rollout.group_size", r.group_size as f64, AtLeast(1), "trajectories per prompt"),
        check("rollout.prompts_per_step", r.prompts_per_step as f64, AtLeast(1), "prompts per rollout batch"),
        check("rollout.max_turns", r.max_turns, AtLeast(1), "assistant turns per trajectory"),
        check("rollout.max_tool_output_tokens", r.max_tool_output_tokens as f64, AtLeast(1), "tokens one tool answer may add"),
        check("rollout.max_total_tokens", r.max_total_tokens as f64, AtLeast(2), "prompt and completion tokens together"),
        check("rollout.env_reward_weight", r.env_reward_weight, Finite, "the environment's reward weight"),
        check("rollout.queue_capacity", r.queue_capacity as f64, AtLeast(1), "finished batches that may wait"),
        check("rollout.reward_instances", r.reward_instances as f64, AtLeast(1), "scorer instances per reward plugin"),
        check("lora.alpha", c.lora.alpha, Positive, "the adapter's scaling numerator"),
    ];
    // data.eval_fraction, lora.r and lora.dropout are checked with the rest of their
    // section (`DataConfig::validate`, `LoraConfig::validate`).
    for (name, p) in &c.plugins {
        let key = |k: &str| format!("plugins.{name}.{k}");
        let limits = [
            (p.memory_mib, "memory_mib", "the plugin's memory cap"),
            (p.timeout_ms, "timeout_ms", "the plugin's time per call"),
            (p.fuel, "fuel", "the plugin's fuel per call"),
            (
                p.max_output_bytes.map(|v| v as u64),
                "max_output_bytes",
                "what one call may return",
            ),
            (p.max_http_bytes, "max_http_bytes", "an HTTP body's cap"),
            (
                p.max_http_in_flight.map(|v| v as u64),
                "max_http_in_flight",
                "HTTP requests at once",
            ),
        ];
        for (v, k, why) in limits {
            if let Some(v) = v {
                checks.push(check(key(k), v as f64, AtLeast(1), why));
            }
        }
    }
    for (i, w) in c.rewards.iter().enumerate() {
        checks.push(check(
            format!("rewards[{i}].default_weight"),
            w.default_weight,
            Finite,
            "the weight of unlisted components",
        ));
        checks.push(check(
            format!("rewards[{i}].fallback"),
            w.fallback,
            Finite,
            "the reward when the plugin faults",
        ));
        for (k, v) in &w.weights {
            checks.push(check(
                format!("rewards[{i}].weights.{k}"),
                *v,
                Finite,
                "a component's weight",
            ));
        }
    }
    checks
}
