//! The trainer's [`TrainPlan`], built from the config: `[train]` resolved against the
//! run, rollout, sampling, LoRA and distillation sections it depends on. The one place a
//! config becomes the trainer's settings.

use super::sections::RunConfig;
use super::train::CorrectionKind;
use crate::rl::algorithms::{Algorithm, RolloutCorrection};
use crate::rl::optim::AdamWConfig;
use crate::rl::plan::{
    Advantages, Batches, Distill, EvalPlan, Saves, Schedule, Shaping, TrainPlan,
};
use crate::rl::tree_rows::TreeTraining;
use crate::rl::update::{PpoConfig, UpdateConfig};
use std::path::Path;

impl RunConfig {
    /// The trainer's settings: `[train]` resolved against the run, rollout, sampling and
    /// LoRA sections (`source` names the config in the trainer's messages).
    pub fn train_plan(&self, source: &Path) -> TrainPlan {
        let t = &self.train;
        let r = &self.rollout;
        TrainPlan {
            steps: t.steps,
            seed: self.run.seed,
            lora: self.lora.to_config(),
            schedule: Schedule {
                lr: t.lr,
                warmup_steps: t.warmup_steps,
                min_lr_ratio: t.min_lr_ratio,
            },
            optimizer: AdamWConfig {
                weight_decay: t.weight_decay,
                ..AdamWConfig::default()
            },
            batches: Batches {
                prompts: r.prompts_per_step,
                queue_capacity: r.queue_capacity,
                max_staleness: r.max_staleness,
                dynamic_sampling: t.dynamic_sampling,
                max_resample: t.max_resample,
            },
            shaping: Shaping {
                overlong: t.overlong,
                overlong_cache: t.overlong_cache,
                max_total_tokens: r.max_total_tokens,
                // PPO puts the KL into its token rewards itself (the update's GAE reads it
                // there).
                kl_penalty: (t.kl_in_reward && t.kl_coef > 0.0 && t.algorithm == Algorithm::Grpo)
                    .then_some(t.kl_coef),
            },
            distill: self.distill.as_ref().map(|d| Distill {
                coef: d.coef,
                task_reward: d.task_reward,
            }),
            tree: r.tree.as_ref().map(|tree| TreeTraining {
                advantage: tree.advantage,
                shared_prefix: tree.shared_prefix,
                eps: t.adv_eps,
            }),
            advantages: match t.algorithm {
                Algorithm::Grpo => Advantages::Group {
                    estimator: t.estimator,
                    scale: t.scale(),
                    eps: t.adv_eps,
                },
                Algorithm::Ppo => Advantages::Critic(t.critic),
            },
            update: self.update_config(),
            eval: EvalPlan {
                every: t.eval_every,
                prompts: t.eval_prompts,
                prompts_per_call: r.prompts_per_step,
            },
            saves: Saves {
                every: t.save_every.max(1),
                keep_last: t.keep_last,
            },
            source: source.display().to_string(),
        }
    }

    /// `[train]`'s update settings.
    fn update_config(&self) -> UpdateConfig {
        let t = &self.train;
        UpdateConfig {
            clip_low: t.clip_low,
            clip_high: t.clip_high,
            aggregation: t.aggregation,
            norm_constant: if t.norm_constant > 0.0 {
                t.norm_constant
            } else {
                self.rollout.max_total_tokens as f64
            },
            // In the reward or in the loss, never both.
            kl_coef: if t.kl_in_reward { 0.0 } else { t.kl_coef },
            kl_estimator: t.kl_estimator,
            reward_kl_estimator: t.kl_reward_estimator,
            // The sampler records log-probs at its temperature, and at 1 when greedy.
            temperature: match self.sampling.temperature {
                t if t > 0.0 => f64::from(t),
                _ => 1.0,
            },
            tis_cap: t.tis_cap,
            rollout_correction: match t.rollout_correction {
                CorrectionKind::None => RolloutCorrection::None,
                CorrectionKind::TokenTis => RolloutCorrection::TokenTis {
                    cap: t.rollout_correction_cap,
                },
                CorrectionKind::SeqMis => RolloutCorrection::SeqMis {
                    min: t.rollout_correction_min,
                    cap: t.rollout_correction_cap,
                },
            },
            max_grad_norm: t.max_grad_norm,
            micro_batch_tokens: t.micro_batch_tokens,
            pack_sequences: t.pack_sequences,
            mini_batches: t.mini_batches,
            epochs: t.epochs_per_batch,
            old_logps: t.old_logps,
            ppo: (t.algorithm == Algorithm::Ppo).then_some(PpoConfig {
                gamma: t.gamma,
                lam: t.lam,
                vf_coef: t.vf_coef,
                value_clip: t.value_clip,
                whiten: t.whiten_advantages,
                kl_reward_coef: if t.kl_in_reward { t.kl_coef } else { 0.0 },
            }),
            progress: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rl::algorithms::{Critic, Estimator, Scale};

    fn plan(sets: &[&str]) -> TrainPlan {
        let text = "[model]\npath = \"m\"\n[data]\npath = \"d.jsonl\"\n[rollout]\nmax_total_tokens = 300\n";
        super::super::parse(
            text,
            &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
        .unwrap()
        .train_plan(Path::new("run.toml"))
    }

    #[test]
    fn the_kl_goes_into_the_reward_or_the_loss_never_both() {
        let p = plan(&["train.kl_coef=0.05"]);
        assert_eq!((p.shaping.kl_penalty, p.update.kl_coef), (None, 0.05));
        let p = plan(&["train.kl_coef=0.05", "train.kl_in_reward=true"]);
        assert_eq!((p.shaping.kl_penalty, p.update.kl_coef), (Some(0.05), 0.0));
        // PPO puts it in its token rewards, through the update.
        let p = plan(&[
            "train.kl_coef=0.05",
            "train.kl_in_reward=true",
            "train.algorithm=\"ppo\"",
        ]);
        assert_eq!((p.shaping.kl_penalty, p.update.kl_coef), (None, 0.0));
        assert_eq!(p.update.ppo.map(|c| c.kl_reward_coef), Some(0.05));
    }

    #[test]
    fn advantages_follow_the_algorithm_and_the_estimators_own_scale() {
        let p = plan(&["train.estimator=\"rloo\""]);
        assert_eq!(
            p.advantages,
            Advantages::Group {
                estimator: Estimator::Rloo,
                scale: Scale::None,
                eps: 1e-4
            }
        );
        assert!(p.update.ppo.is_none());
        let p = plan(&["train.algorithm=\"ppo\"", "train.critic=\"separate\""]);
        assert_eq!(p.advantages, Advantages::Critic(Critic::Separate));
    }

    #[test]
    fn defaults_are_resolved_against_the_other_sections() {
        let p = plan(&["sampling.temperature=0", "run.seed=9"]);
        // Dr. GRPO's constant defaults to the rollout's room; a greedy sampler records
        // log-probs at temperature 1.
        assert_eq!(p.update.norm_constant, 300.0);
        assert_eq!(p.update.temperature, 1.0);
        assert_eq!((p.seed, p.source.as_str()), (9, "run.toml"));
        let p = plan(&["sampling.temperature=0.7", "train.norm_constant=64"]);
        assert!((p.update.temperature - 0.7).abs() < 1e-6);
        assert_eq!(p.update.norm_constant, 64.0);
    }

    /// A limit past the model's context is clamped when the model opens: the overlong
    /// penalty and a constant left to the limit follow; a constant the config set stays.
    #[test]
    fn the_clamped_room_reaches_the_shaping_and_the_constant() {
        let mut p = plan(&[]);
        p.within_room(256, true);
        assert_eq!(
            (p.shaping.max_total_tokens, p.update.norm_constant),
            (256, 256.0)
        );
        let mut p = plan(&["train.norm_constant=64"]);
        p.within_room(256, false);
        assert_eq!(
            (p.shaping.max_total_tokens, p.update.norm_constant),
            (256, 64.0)
        );
        let mut p = plan(&[]);
        p.within_room(1000, true);
        assert_eq!(
            (p.shaping.max_total_tokens, p.update.norm_constant),
            (300, 300.0)
        );
    }
}
