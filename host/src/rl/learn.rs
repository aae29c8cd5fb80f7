//! One step's learning from a rollout batch: reward shaping (DAPO's overlong penalty, KL
//! in the reward) → advantages per group → the clipped-surrogate update of the adapter;
//! and the step's figures.

use super::algorithms::{self, Overlong};
use super::distill::Teacher;
use super::optim::AdamW;
use super::plan::{Advantages, TrainPlan};
use super::producer::Batch;
use super::tree_rows::{self, TreeRow};
use super::update::{Row, StepInputs, UpdateConfig, UpdateStats, sequence_kl, update};
use super::value_head::ValueHead;
use crate::model::Model;
use crate::model::lora::seeded;
use crate::rollout::{Group, Trajectory};
use crate::sampler::decode::sample_seed;
use crate::step::{StepMetrics, TreeFigures};
use anyhow::{Result, bail};
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Instant;

/// The policy being trained, its optimizer, and how each step updates it.
pub struct Learner<'a> {
    model: &'a Model,
    /// PPO's value head.
    critic: Option<&'a ValueHead>,
    /// On-policy distillation's teacher (`plan.distill`).
    teacher: Option<&'a Teacher>,
    pub opt: AdamW,
    plan: &'a TrainPlan,
    /// The plan's update settings, with the terminal's progress bar.
    cfg: UpdateConfig,
    /// Steps in a row whose group advantages were all zero (nothing to learn from).
    flat_steps: u64,
}

/// Steps in a row with every advantage zero before a run says so.
const FLAT_STEPS_WARNING: u64 = 3;

impl<'a> Learner<'a> {
    pub fn new(
        model: &'a Model,
        critic: Option<&'a ValueHead>,
        teacher: Option<&'a Teacher>,
        opt: AdamW,
        plan: &'a TrainPlan,
        progress: Option<indicatif::ProgressBar>,
    ) -> Learner<'a> {
        Learner {
            model,
            critic,
            teacher,
            opt,
            plan,
            cfg: UpdateConfig {
                progress,
                ..plan.update.clone()
            },
            flat_steps: 0,
        }
    }

    /// Rewards → advantages → update for `batch` at `step` (0-based); the step's figures
    /// and the groups as scored (with any overlong or KL components added).
    pub fn learn(&mut self, batch: &Batch, step: u64) -> Result<(StepMetrics, Vec<Group>)> {
        let t0 = Instant::now();
        let plan = self.plan;
        let shaping = &plan.shaping;
        let lr = plan.schedule.at(step, plan.steps);
        let mut groups = batch.groups.clone();
        if shaping.overlong == Overlong::Penalty {
            overlong_penalty(
                &mut groups,
                shaping.max_total_tokens,
                shaping.overlong_cache,
            );
        }
        let kl_in_reward = match shaping.kl_penalty {
            Some(beta) => Some(self.kl_into_rewards(&mut groups, beta)?),
            None => None,
        };
        let rewards: Vec<Vec<f64>> = groups
            .iter()
            .map(|g| g.trajectories.iter().map(|t| t.reward).collect())
            .collect();
        // Distillation alone learns from the teacher: the task's rewards are reported only.
        let task_reward = plan.distill.is_none_or(|d| d.task_reward);
        // PPO's advantages are per token, from the critic (the update computes them).
        let advantages = match plan.advantages {
            Advantages::Group {
                estimator,
                scale,
                eps,
            } if task_reward => algorithms::advantages(&rewards, estimator, scale, eps),
            _ => vec![0.0; rewards.iter().map(Vec::len).sum()],
        };
        if matches!(plan.advantages, Advantages::Group { .. }) && plan.distill.is_none() {
            self.note_flat(&rewards, &advantages, batch.dropped, step);
        }
        let trajectories: Vec<&Trajectory> = groups.iter().flat_map(|g| &g.trajectories).collect();
        // A tree group's trajectories take their terms from its tree; a flat one's, the
        // group estimator's.
        let mut tree_terms: Vec<TreeRow> = Vec::with_capacity(trajectories.len());
        let mut at = 0;
        for g in &groups {
            let flat = &advantages[at..at + g.trajectories.len()];
            at += g.trajectories.len();
            match &plan.tree {
                Some(how) if task_reward && tree_rows::is_tree(g) => {
                    tree_terms.extend(tree_rows::tree_rows(g, how).map_err(|e| {
                        anyhow::anyhow!("training on sample {}'s tree: {e}", g.sample_id)
                    })?);
                }
                _ => tree_terms.extend(flat.iter().map(|&a| TreeRow::flat(a))),
            }
        }
        let mut rows: Vec<Row> = trajectories
            .iter()
            .zip(&tree_terms)
            .filter(|(tr, _)| !(shaping.overlong == Overlong::Filter && tr.truncated))
            .filter(|(tr, _)| tr.sampled_tokens() > 0)
            .map(|(tr, terms)| Row {
                trajectory: tr,
                advantage: terms.advantage,
                token_advantages: &terms.token_advantages,
                stale: tr.version < step,
                trained_from: terms.trained_from,
            })
            .collect();
        let distilled = match (plan.distill, self.teacher) {
            (Some(d), Some(teacher)) if !rows.is_empty() => {
                Some(teacher.distill(self.model, &rows, &self.cfg, d.coef)?)
            }
            (Some(_), None) => bail!("[distill] is set but no teacher was loaded"),
            _ => None,
        };
        if let Some(d) = &distilled {
            for (row, terms) in rows.iter_mut().zip(&d.per_row) {
                row.token_advantages = terms;
            }
        }
        let stats = if rows.is_empty() {
            UpdateStats::default()
        } else {
            let dropout = self
                .model
                .lora
                .as_ref()
                .is_some_and(|l| l.dropout > 0.0)
                .then(|| Mutex::new(seeded(sample_seed(plan.seed ^ 0xd0, step as usize, 0))));
            let inputs = StepInputs {
                lr,
                seed: sample_seed(plan.seed ^ 0x5b, step as usize, 0),
                dropout: dropout.as_ref(),
            };
            update(
                self.model,
                self.critic,
                &mut self.opt,
                &rows,
                &self.cfg,
                &inputs,
            )?
        };
        let mut m = step_metrics(&trajectories, &stats, kl_in_reward);
        m.teacher_kl = distilled.map(|d| d.reverse_kl);
        m.step = step + 1;
        m.adapter_version = step + 1;
        m.lr = lr;
        m.epoch = batch.cursor.epoch;
        m.groups = groups.len();
        m.groups_dropped = batch.dropped;
        m.groups_flat = rewards
            .iter()
            .filter(|r| !algorithms::informative(r))
            .count();
        m.sampled_tokens_per_s = batch.stats.sampled_tokens as f64 / batch.stats.wall_s.max(1e-9);
        m.sampled_tokens = batch.stats.sampled_tokens as u64;
        m.tree = groups.iter().any(tree_rows::is_tree).then(|| {
            let s = &batch.stats;
            TreeFigures {
                leaves: trajectories.len() as f64 / groups.len().max(1) as f64,
                depth: trajectories
                    .iter()
                    .map(|t| t.tree.as_ref().map_or(0, |p| p.depth()) as f64)
                    .sum::<f64>()
                    / trajectories.len().max(1) as f64,
                branch_points: s.branch_points as u64,
                probes: s.branch_probes as u64,
                forks: s.forks as u64,
                fork_failures: s.fork_failures as u64,
                fork_s: s.fork_s,
                replays: s.replays as u64,
                replay_s: s.replay_s,
            }
        });
        m.tool_wait_s = batch.stats.plugin_wait_s;
        m.tool_busy_s = batch.stats.tool_busy_s;
        m.generate_answered = batch
            .stats
            .generate_calls
            .iter()
            .filter(|(k, _)| k.ends_with("/answered"))
            .map(|(_, n)| n)
            .sum();
        m.generate_tokens = batch.stats.asked_tokens as u64;
        m.generate_s = batch.stats.ask_s;
        m.generate_calls = batch.stats.generate_calls.clone();
        m.generate_wait_s = batch.stats.generate_wait_s.clone();
        m.tool_wait_share = batch.stats.plugin_wait_s / batch.stats.wall_s.max(1e-9);
        m.adapter_load_s = (batch.stats.requests > 0).then_some(batch.stats.adapter_load_s);
        m.vllm_retries = (batch.stats.requests > 0).then_some(batch.stats.retries as u64);
        m.update_s = t0.elapsed().as_secs_f64();
        Ok((m, groups))
    }

    /// Counts steps whose group advantages are all zero, and says once a streak reaches
    /// [`FLAT_STEPS_WARNING`] (and every 10 steps after) that nothing is being learned,
    /// with the likely cause read off the rewards.
    fn note_flat(&mut self, rewards: &[Vec<f64>], advantages: &[f64], dropped: usize, step: u64) {
        if !advantages.iter().all(|a| a.abs() < 1e-12) {
            self.flat_steps = 0;
            return;
        }
        self.flat_steps += 1;
        let n = self.flat_steps;
        if n < FLAT_STEPS_WARNING || !(n - FLAT_STEPS_WARNING).is_multiple_of(10) {
            return;
        }
        tracing::warn!(
            "steps {}..{}: every advantage was 0, so nothing was learned; {}",
            step + 2 - n,
            step + 1,
            flat_cause(rewards, dropped)
        );
    }

    /// r ← r − β·Σ_t KL_t (component `kl_penalty`); returns the mean KL per token.
    fn kl_into_rewards(&self, groups: &mut [Group], beta: f64) -> Result<f64> {
        let all: Vec<&Trajectory> = groups
            .iter()
            .flat_map(|g| &g.trajectories)
            .filter(|t| t.tokens.len() >= 2)
            .collect();
        let rows: Vec<Row> = all
            .iter()
            .map(|t| Row {
                trajectory: t,
                advantage: 0.0,
                token_advantages: &[],
                stale: false,
                trained_from: 0,
            })
            .collect();
        let kls = sequence_kl(self.model, &rows, &self.cfg)?;
        let tokens: usize = all.iter().map(|t| t.sampled_tokens()).sum();
        let mean = kls.iter().sum::<f64>() / tokens.max(1) as f64;
        let by_key: HashMap<(u64, usize), f64> = all
            .iter()
            .zip(&kls)
            .map(|(t, k)| ((t.sample_id, t.index), *k))
            .collect();
        for t in groups.iter_mut().flat_map(|g| g.trajectories.iter_mut()) {
            let k = by_key.get(&(t.sample_id, t.index)).copied().unwrap_or(0.0);
            t.rewards.insert("kl_penalty".into(), -beta * k);
            t.reward -= beta * k;
        }
        Ok(mean)
    }
}

/// DAPO's soft overlong punishment (component `overlong`): the length after the prompt
/// against the room `max_total_tokens` left it.
fn overlong_penalty(groups: &mut [Group], max_total_tokens: usize, cache: usize) {
    for t in groups.iter_mut().flat_map(|g| g.trajectories.iter_mut()) {
        let len = t.completion_tokens().len();
        let room = max_total_tokens.saturating_sub(t.prompt_len);
        let p = algorithms::overlong_penalty(len, room, cache);
        t.rewards.insert("overlong".into(), p);
        t.reward += p;
    }
}

/// The batch's figures: means over its trajectories, the update's statistics, faults
/// by `plugin/kind`. The KL is the reward's when it went there, else the loss's.
fn step_metrics(
    trajectories: &[&Trajectory],
    stats: &UpdateStats,
    kl_in_reward: Option<f64>,
) -> StepMetrics {
    let n = trajectories.len().max(1) as f64;
    let mean = |f: &dyn Fn(&Trajectory) -> f64| trajectories.iter().map(|t| f(t)).sum::<f64>() / n;
    let reward_mean = mean(&|t| t.reward);
    let reward_std = mean(&|t| (t.reward - reward_mean).powi(2)).sqrt();
    let components = crate::rollout::trajectory::component_means(trajectories.iter().copied());
    let mut faults: BTreeMap<String, u64> = BTreeMap::new();
    for f in trajectories.iter().flat_map(|t| &t.faults) {
        *faults
            .entry(format!("{}/{}", f.plugin, f.kind))
            .or_default() += 1;
    }
    let mut function_calls: BTreeMap<String, u64> = BTreeMap::new();
    for (kind, n) in trajectories.iter().flat_map(|t| &t.call_kinds) {
        *function_calls.entry(kind.clone()).or_default() += u64::from(*n);
    }
    let malformed_call_rate =
        crate::rollout::env::tools::malformed_rate(trajectories.iter().flat_map(|t| &t.call_kinds));
    StepMetrics {
        reward_mean,
        reward_std,
        accuracy: components.get("correct").copied(),
        rewards: components,
        loss: stats.loss,
        policy_loss: stats.policy_loss,
        kl: kl_in_reward.unwrap_or(stats.kl),
        entropy: stats.entropy,
        clip_fraction: stats.clip_fraction,
        approx_kl: stats.approx_kl,
        value_loss: stats.value_loss,
        rollout_kl: stats.rollout_kl,
        rollout_logp_diff: stats.rollout_logp_diff,
        rollout_max_ratio: stats.rollout_max_ratio,
        grad_norm: stats.grad_norm,
        optimizer_steps: stats.optimizer_steps,
        response_tokens: mean(&|t| t.sampled_tokens() as f64),
        turns: mean(&|t| t.turns as f64),
        tool_calls: mean(&|t| t.tool_calls as f64),
        truncated: mean(&|t| f64::from(u8::from(t.truncated))),
        trajectories: trajectories.len(),
        faults,
        malformed_call_rate,
        function_calls,
        ..Default::default()
    }
}

/// Why a batch's group advantages are all zero, and what to change, read off its
/// `rewards` (one list per group kept) and the groups dynamic sampling `dropped`.
fn flat_cause(rewards: &[Vec<f64>], dropped: usize) -> String {
    let all: Vec<f64> = rewards.iter().flatten().copied().collect();
    if rewards.is_empty() {
        format!(
            "dynamic sampling dropped every group ({dropped} this step): each prompt's samples scored alike; the task may be too easy or too hard for the model, or the reward too coarse"
        )
    } else if rewards.iter().all(|g| g.len() < 2) {
        "each group has one trajectory (rollout.group_size = 1), so it is its own baseline; raise group_size or use estimator = \"reinforce\"".to_string()
    } else if all.iter().all(|r| (r - all[0]).abs() < 1e-12) {
        format!(
            "every trajectory got the same reward ({}): check that the reward plugin scores what it should, and that the model can ever succeed (or ever fail) at the task",
            all[0]
        )
    } else {
        "within each group the rewards are equal (prompts are all solved or all failed): raise sampling.temperature or rollout.group_size for more varied samples, or use easier or harder prompts".to_string()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A scored trajectory of `sampled` model tokens after a 2-token prompt.
    pub(crate) fn trajectory(reward: f64, sampled: usize, faults: &[(&str, &str)]) -> Trajectory {
        serde_json::from_value(serde_json::json!({
            "sample_id": 0, "index": 0, "version": 0,
            "tokens": vec![1u32; 2 + sampled], "prompt_len": 2,
            "logps": vec![Some(-1.0f32); sampled], "spans": [], "messages": [],
            "completion": "", "metadata": {}, "turns": 1, "tool_calls": sampled % 2,
            "tool_truncations": 0, "stop": "end_of_turn", "truncated": false,
            "faults": faults.iter().map(|(p, k)| serde_json::json!({
                "plugin": p, "call": "fire", "kind": k, "message": "x"})).collect::<Vec<_>>(),
            "rewards": {"correct": reward}, "reward": reward,
        }))
        .unwrap()
    }

    /// A batch with nothing to learn from is told apart by what its rewards look like.
    #[test]
    fn a_flat_batch_names_its_likely_cause() {
        assert!(flat_cause(&[], 4).contains("dynamic sampling dropped every group (4"));
        assert!(flat_cause(&[vec![1.0], vec![0.0]], 0).contains("group_size = 1"));
        assert!(flat_cause(&[vec![0.0, 0.0], vec![0.0, 0.0]], 0).contains("same reward (0)"));
        assert!(flat_cause(&[vec![1.0, 1.0], vec![0.0, 0.0]], 0).contains("within each group"));
    }

    #[test]
    fn step_figures_are_means_over_the_batch() {
        let ts = [
            trajectory(1.0, 4, &[]),
            trajectory(0.0, 2, &[("calc", "timeout")]),
            trajectory(0.5, 3, &[("calc", "timeout"), ("judge", "trap")]),
        ];
        let refs: Vec<&Trajectory> = ts.iter().collect();
        let stats = UpdateStats {
            loss: 0.25,
            kl: 0.125,
            ..Default::default()
        };
        let m = step_metrics(&refs, &stats, None);
        assert_eq!(m.reward_mean, 0.5);
        assert!((m.reward_std - (1.0f64 / 6.0).sqrt()).abs() < 1e-12);
        assert_eq!(m.accuracy, Some(0.5));
        assert_eq!(
            (m.response_tokens, m.tool_calls, m.turns),
            (3.0, 1.0 / 3.0, 1.0)
        );
        assert_eq!((m.loss, m.kl, m.trajectories), (0.25, 0.125, 3));
        assert_eq!(m.faults["calc/timeout"], 2);
        assert_eq!(m.faults["judge/trap"], 1);
        // KL that went into the reward is the one reported.
        assert_eq!(step_metrics(&refs, &stats, Some(0.5)).kl, 0.5);
    }

    #[test]
    fn overlong_penalty_is_a_component_added_to_the_reward() {
        let mut groups = vec![Group {
            sample_id: 0,
            trajectories: vec![trajectory(1.0, 10, &[]), trajectory(1.0, 2, &[])],
        }];
        // 12 tokens of room, the last 4 a ramp: 10 tokens is 2 into it, 2 is clear.
        overlong_penalty(&mut groups, 14, 4);
        let t = &groups[0].trajectories;
        let p = algorithms::overlong_penalty(10, 12, 4);
        assert!(p < 0.0);
        assert_eq!((t[0].rewards["overlong"], t[0].reward), (p, 1.0 + p));
        assert_eq!((t[1].rewards["overlong"], t[1].reward), (0.0, 1.0));
    }
}
