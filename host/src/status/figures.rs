//! The step figures rlhost exports, in one table: each with its Prometheus name (under
//! the `rlhost_` prefix; base units, `_ratio` for fractions) and its TensorBoard tag, so
//! `/metrics` and the event files can never disagree on what a figure is.

use crate::step::StepMetrics;

/// One exported figure of a step's metrics.
pub struct Figure<T> {
    /// Prometheus name, if `/metrics` exposes it.
    pub name: Option<&'static str>,
    /// TensorBoard tag, if the event files carry it.
    pub tag: Option<&'static str>,
    pub help: &'static str,
    pub get: fn(&StepMetrics) -> T,
}

const fn fig(
    name: Option<&'static str>,
    tag: Option<&'static str>,
    help: &'static str,
    get: fn(&StepMetrics) -> f64,
) -> Figure<f64> {
    Figure {
        name,
        tag,
        help,
        get,
    }
}

/// Figures every step has.
pub const EVERY_STEP: &[Figure<f64>] = &[
    fig(Some("epoch"), None, "Epoch over the training split", |m| {
        m.epoch as f64
    }),
    fig(
        Some("adapter_version"),
        None,
        "Adapter version after the step",
        |m| m.adapter_version as f64,
    ),
    fig(
        Some("reward_mean"),
        Some("reward/mean"),
        "Mean reward of the step's trajectories",
        |m| m.reward_mean,
    ),
    fig(
        Some("reward_std"),
        Some("reward/std"),
        "Standard deviation of the step's rewards",
        |m| m.reward_std,
    ),
    fig(Some("loss"), Some("loss/total"), "Training loss", |m| {
        m.loss
    }),
    fig(
        Some("policy_loss"),
        Some("loss/policy"),
        "Policy (clipped surrogate) loss",
        |m| m.policy_loss,
    ),
    fig(
        Some("kl"),
        Some("policy/kl"),
        "Mean per-token KL to the reference policy",
        |m| m.kl,
    ),
    fig(
        Some("entropy"),
        Some("policy/entropy"),
        "Mean per-token entropy of the policy",
        |m| m.entropy,
    ),
    fig(
        Some("clip_fraction"),
        Some("policy/clip_fraction"),
        "Fraction of tokens whose ratio was clipped",
        |m| m.clip_fraction,
    ),
    fig(
        Some("approx_kl"),
        Some("policy/approx_kl"),
        "Mean per-token KL of the sampled policy to the policy at each step",
        |m| m.approx_kl,
    ),
    fig(
        Some("grad_norm"),
        Some("optim/grad_norm"),
        "Gradient norm before clipping",
        |m| m.grad_norm,
    ),
    fig(
        Some("learning_rate"),
        Some("optim/lr"),
        "Learning rate of the step",
        |m| m.lr,
    ),
    fig(
        Some("response_tokens"),
        Some("rollout/response_tokens"),
        "Mean sampled tokens per trajectory",
        |m| m.response_tokens,
    ),
    fig(
        Some("turns"),
        Some("rollout/turns"),
        "Mean assistant turns per trajectory",
        |m| m.turns,
    ),
    fig(
        Some("tool_calls"),
        Some("rollout/tool_calls"),
        "Mean tool calls per trajectory",
        |m| m.tool_calls,
    ),
    fig(
        Some("truncated_ratio"),
        Some("rollout/truncated"),
        "Fraction of trajectories a limit cut off",
        |m| m.truncated,
    ),
    fig(
        Some("trajectories"),
        None,
        "Trajectories in the step's batch",
        |m| m.trajectories as f64,
    ),
    fig(
        Some("groups_dropped"),
        Some("rollout/groups_dropped"),
        "Groups dynamic sampling dropped",
        |m| m.groups_dropped as f64,
    ),
    fig(
        Some("groups_flat"),
        Some("rollout/groups_flat"),
        "Groups trained on whose rewards were all equal",
        |m| m.groups_flat as f64,
    ),
    fig(
        Some("sampled_tokens_per_second"),
        Some("throughput/sampled_tokens_per_s"),
        "Rollout throughput",
        |m| m.sampled_tokens_per_s,
    ),
    fig(
        Some("tool_wait_seconds"),
        Some("time/tool_wait_s"),
        "Time the decoder sat idle waiting on tool and environment calls while sampling the step's batch",
        |m| m.tool_wait_s,
    ),
    fig(
        Some("tool_wait_ratio"),
        Some("time/tool_wait_share"),
        "Share of the batch's sampling time the decoder waited on tools",
        |m| m.tool_wait_share,
    ),
    fig(
        Some("generate_answered"),
        Some("generate/answered"),
        "Plugins' model.generate calls the step's batch answered",
        |m| m.generate_answered as f64,
    ),
    fig(
        Some("generate_tokens"),
        Some("generate/tokens"),
        "Tokens sampled for plugins' model.generate calls in the step's batch (never trained on)",
        |m| m.generate_tokens as f64,
    ),
    fig(
        Some("generate_seconds"),
        Some("generate/seconds"),
        "Decoding time spent on plugins' model.generate calls alone in the step's batch",
        |m| m.generate_s,
    ),
    fig(
        Some("rollout_seconds"),
        Some("time/rollout_s"),
        "Time the step waited for rollouts",
        |m| m.rollout_s,
    ),
    fig(
        Some("update_seconds"),
        Some("time/update_s"),
        "Time the step's update took",
        |m| m.update_s,
    ),
    fig(
        Some("step_seconds"),
        Some("time/step_s"),
        "Wall time of the step",
        |m| m.step_s,
    ),
];

/// Figures only some steps have: PPO's critic on its steps, the held-out set on the steps
/// `train.eval_every` evaluates. `/metrics` keeps the last value (NaN before one).
pub const SOME_STEPS: &[Figure<Option<f64>>] = &[
    Figure {
        name: Some("value_loss"),
        tag: Some("loss/value"),
        help: "PPO: the critic's clipped value loss (NaN without a critic)",
        get: |m| m.value_loss,
    },
    Figure {
        name: Some("teacher_kl"),
        tag: Some("distill/reverse_kl"),
        help: "On-policy distillation: mean per-token log pi_student - log pi_teacher over the sampled tokens",
        get: |m| m.teacher_kl,
    },
    Figure {
        name: Some("rollout_kl"),
        tag: Some("mismatch/rollout_kl"),
        help: "k3 KL between the sampler's and the trainer's log-probs of the sampled tokens",
        get: |m| m.rollout_kl,
    },
    Figure {
        name: Some("rollout_logp_diff"),
        tag: Some("mismatch/logp_diff"),
        help: "Mean absolute difference of the sampler's and the trainer's log-probs",
        get: |m| m.rollout_logp_diff,
    },
    Figure {
        name: Some("rollout_max_ratio"),
        tag: Some("mismatch/max_ratio"),
        help: "Largest token ratio trainer/sampler probability in the step's batch",
        get: |m| m.rollout_max_ratio,
    },
    Figure {
        name: Some("malformed_call_rate"),
        tag: Some("rollout/malformed_call_rate"),
        help: "Share of the step's function calls that were malformed (bad JSON, unknown function, arguments failing the schema, ...)",
        get: |m| m.malformed_call_rate,
    },
    Figure {
        name: Some("adapter_load_seconds"),
        tag: Some("time/adapter_load"),
        help: "vLLM: seconds the step's batch spent writing its adapter version and loading it on the servers",
        get: |m| m.adapter_load_s,
    },
    Figure {
        name: Some("vllm_retries"),
        tag: Some("rollout/vllm_retries"),
        help: "vLLM: requests of the step's batch sent again after a 5xx, a reset connection or a malformed answer",
        get: |m| m.vllm_retries.map(|n| n as f64),
    },
    Figure {
        name: Some("eval_accuracy"),
        tag: Some("eval/accuracy"),
        help: "Held-out accuracy, greedy, at the last evaluation (NaN before one)",
        get: |m| m.eval_accuracy,
    },
    Figure {
        name: Some("eval_reward"),
        tag: Some("eval/reward"),
        help: "Held-out mean reward at the last evaluation",
        get: |m| m.eval_reward,
    },
    Figure {
        name: Some("eval_tool_use_ratio"),
        tag: Some("eval/tool_use"),
        help: "Held-out share of answers that called a tool, at the last evaluation",
        get: |m| m.eval_tool_use,
    },
    Figure {
        name: Some("eval_malformed_call_rate"),
        tag: Some("eval/malformed_call_rate"),
        help: "Held-out share of function calls that were malformed, at the last evaluation",
        get: |m| m.eval_malformed_call_rate,
    },
    Figure {
        name: None,
        tag: Some("time/eval_s"),
        help: "Time the evaluation took",
        get: |m| m.eval_s,
    },
];

/// A step's figures as TensorBoard tags (`reward/mean`, `reward/correct`, `loss/policy`,
/// `faults/calculator/timeout`, ...).
pub fn scalars(m: &StepMetrics) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = EVERY_STEP
        .iter()
        .filter_map(|f| Some((f.tag?.to_string(), (f.get)(m))))
        .collect();
    if let Some(a) = m.accuracy {
        out.push(("accuracy".into(), a));
    }
    out.extend(
        SOME_STEPS
            .iter()
            .filter_map(|f| Some((f.tag?.to_string(), (f.get)(m)?))),
    );
    for (k, v) in &m.rewards {
        out.push((format!("reward/{k}"), *v));
    }
    for (k, v) in &m.faults {
        out.push((format!("faults/{k}"), *v as f64));
    }
    for (k, v) in &m.function_calls {
        out.push((format!("function_calls/{k}"), *v as f64));
    }
    for (k, v) in &m.http_requests {
        out.push((format!("http/{k}"), *v as f64));
    }
    for (k, v) in &m.generate_calls {
        out.push((format!("generate/{k}"), *v as f64));
    }
    for (k, v) in &m.generate_wait_s {
        out.push((format!("generate/{k}/wait_s"), *v));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A figure some steps lack is exported on the steps that have it, and only there.
    #[test]
    fn optional_figures_appear_on_the_steps_that_have_them() {
        let tags =
            |m: &StepMetrics| -> Vec<String> { scalars(m).into_iter().map(|(t, _)| t).collect() };
        let grpo = StepMetrics::default();
        assert!(
            !tags(&grpo)
                .iter()
                .any(|t| t == "loss/value" || t == "eval/accuracy")
        );
        let ppo = StepMetrics {
            value_loss: Some(0.25),
            eval_accuracy: Some(0.5),
            ..Default::default()
        };
        let s = scalars(&ppo);
        assert!(s.contains(&("loss/value".to_string(), 0.25)));
        assert!(s.contains(&("eval/accuracy".to_string(), 0.5)));
        // Names and tags are unique across the tables.
        let mut names: Vec<&str> = EVERY_STEP.iter().filter_map(|f| f.name).collect();
        names.extend(SOME_STEPS.iter().filter_map(|f| f.name));
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n);
    }
}
