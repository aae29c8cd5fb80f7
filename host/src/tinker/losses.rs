//! The Tinker API's built-in losses, as its documentation defines them: each one a sum
//! over a datum's tokens (no mean: a caller who wants a mean scales `weights` or
//! `advantages`), from the target tokens' log-probs under the adapter being trained,
//! `logp = log p_θ(target_t | input_≤t)`, and the datum's `loss_fn_inputs`.
//!
//! - `cross_entropy`: L = −Σ_t w_t · logp_t
//! - `importance_sampling`: r_t = exp(logp_t − q_t); L = −Σ_t r_t · A_t
//! - `ppo`: L = −Σ_t min(r_t · A_t, clip(r_t, lo, hi) · A_t), lo = 0.8, hi = 1.2 unless set
//! - `cispo`: L = −Σ_t sg(clip(r_t, lo, hi)) · logp_t · A_t
//! - `dro`: L = −Σ_t (logp_t · A_t − ½ β (logp_t − q_t)²)
//!
//! where `q_t` is the sampler's log-prob (`logprobs`), `A_t` the advantage (`advantages`)
//! and `w_t` the weight (`weights`); `sg` stops the gradient. `clip_low_threshold`,
//! `clip_high_threshold` and `beta` come from `loss_fn_config`. The tests check each
//! against the same formula written out in plain floats, with finite differences for the
//! gradient.

use crate::rl::algorithms::clipped_surrogate;
use candle_core::{Result, Tensor};
use std::collections::HashMap;
use std::fmt;

/// A loss and its settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Loss {
    CrossEntropy,
    ImportanceSampling,
    Ppo { low: f64, high: f64 },
    Cispo { low: f64, high: f64 },
    Dro { beta: f64 },
}

/// Why a loss could not be set up: the API answers with this text.
#[derive(Debug, Clone, PartialEq)]
pub struct LossError(pub String);

impl fmt::Display for LossError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LossError {}

/// The losses the API names that rlhost runs.
pub const SUPPORTED: [&str; 5] = [
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
];

impl Loss {
    /// The loss `name` with `config` (numbers by key), refusing unknown keys and losses
    /// by name.
    pub fn parse(
        name: &str,
        config: &HashMap<String, f64>,
    ) -> std::result::Result<Loss, LossError> {
        let allowed: &[&str] = match name {
            "cross_entropy" | "importance_sampling" => &[],
            "ppo" | "cispo" => &["clip_low_threshold", "clip_high_threshold"],
            "dro" => &["beta"],
            other => {
                return Err(LossError(format!(
                    "loss_fn {other:?} is not one rlhost runs; it runs {}",
                    SUPPORTED.join(", ")
                )));
            }
        };
        let mut keys: Vec<&String> = config.keys().collect();
        keys.sort();
        if let Some(bad) = keys.iter().find(|k| !allowed.contains(&k.as_str())) {
            return Err(LossError(format!(
                "loss_fn_config key {bad:?} does not apply to {name} (it takes {})",
                if allowed.is_empty() {
                    "none".to_string()
                } else {
                    allowed.join(", ")
                }
            )));
        }
        let get = |k: &str, default: f64| config.get(k).copied().unwrap_or(default);
        let clip = || {
            let (low, high) = (
                get("clip_low_threshold", 0.8),
                get("clip_high_threshold", 1.2),
            );
            if !(low.is_finite() && high.is_finite() && 0.0 <= low && low <= high) {
                return Err(LossError(format!(
                    "loss_fn_config: clip_low_threshold {low} and clip_high_threshold {high} \
                     must be finite with 0 ≤ low ≤ high (they are ratios: 0.8 and 1.2 by default)"
                )));
            }
            Ok((low, high))
        };
        Ok(match name {
            "cross_entropy" => Loss::CrossEntropy,
            "importance_sampling" => Loss::ImportanceSampling,
            "ppo" => {
                let (low, high) = clip()?;
                Loss::Ppo { low, high }
            }
            "cispo" => {
                let (low, high) = clip()?;
                Loss::Cispo { low, high }
            }
            _ => {
                let Some(beta) = config.get("beta").copied() else {
                    return Err(LossError(
                        "loss_fn dro needs loss_fn_config {\"beta\": …} (the weight of its \
                         quadratic penalty)"
                            .into(),
                    ));
                };
                if !beta.is_finite() || beta < 0.0 {
                    return Err(LossError(format!(
                        "loss_fn_config beta must be a finite number ≥ 0, got {beta}"
                    )));
                }
                Loss::Dro { beta }
            }
        })
    }

    /// The `loss_fn_inputs` this loss reads besides `target_tokens`.
    pub fn inputs(&self) -> &'static [&'static str] {
        match self {
            Loss::CrossEntropy => &["weights"],
            Loss::ImportanceSampling | Loss::Ppo { .. } | Loss::Cispo { .. } | Loss::Dro { .. } => {
                &["logprobs", "advantages"]
            }
        }
    }

    /// Per-token losses `[N]` of one datum (their sum is its loss), from `logp: [N]` (with
    /// its graph) and the datum's inputs by name, each `[N]` f32 on `logp`'s device.
    pub fn elementwise(&self, logp: &Tensor, inputs: &HashMap<&str, Tensor>) -> Result<Tensor> {
        let input = |k: &str| {
            inputs
                .get(k)
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg(format!("loss input {k:?} is missing")))
        };
        match *self {
            Loss::CrossEntropy => (logp * input("weights")?)?.neg(),
            Loss::ImportanceSampling => {
                let ratio = (logp - input("logprobs")?)?.exp()?;
                (ratio * input("advantages")?)?.neg()
            }
            // The trainer's clipped surrogate, its range given as thresholds here.
            Loss::Ppo { low, high } => Ok(clipped_surrogate(
                logp,
                &input("logprobs")?,
                &input("advantages")?,
                1.0 - low,
                high - 1.0,
            )?
            .0),
            Loss::Cispo { low, high } => {
                let adv = input("advantages")?;
                let ratio = (logp - input("logprobs")?)?.exp()?;
                let coef = ratio.clamp(low, high)?.detach();
                ((coef * logp)? * adv)?.neg()
            }
            Loss::Dro { beta } => {
                let adv = input("advantages")?;
                let gap = (logp - input("logprobs")?)?;
                let objective = ((logp * adv)? - (gap.sqr()? * (0.5 * beta))?)?;
                objective.neg()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The same formulas in plain floats, per token.
    fn reference(loss: Loss, logp: f64, q: f64, adv: f64, w: f64) -> f64 {
        let r = (logp - q).exp();
        match loss {
            Loss::CrossEntropy => -w * logp,
            Loss::ImportanceSampling => -r * adv,
            Loss::Ppo { low, high } => -(r * adv).min(r.clamp(low, high) * adv),
            Loss::Cispo { low, high } => -r.clamp(low, high) * logp * adv,
            Loss::Dro { beta } => -(logp * adv - 0.5 * beta * (logp - q).powi(2)),
        }
    }

    /// d/dlogp of the reference, with the clip coefficient held fixed for CISPO (its
    /// stop-gradient).
    fn reference_grad(loss: Loss, logp: f64, q: f64, adv: f64, w: f64) -> f64 {
        match loss {
            Loss::Cispo { low, high } => -(logp - q).exp().clamp(low, high) * adv,
            _ => {
                let h = 1e-6;
                (reference(loss, logp + h, q, adv, w) - reference(loss, logp - h, q, adv, w))
                    / (2.0 * h)
            }
        }
    }

    #[test]
    fn each_loss_and_its_gradient_match_the_documented_formula() {
        let dev = Device::Cpu;
        // Ratios inside and outside the clip range, both signs of advantage.
        let logp = [-1.0f32, -0.2, -2.5, -0.7, -3.0, -0.05];
        let q = [-1.1f32, -0.9, -1.0, -0.7, -2.0, -0.6];
        let adv = [0.5f32, -1.0, 1.5, 0.0, -0.3, 2.0];
        let w = [1.0f32, 0.0, 1.0, 0.5, 1.0, 1.0];
        let losses = [
            Loss::CrossEntropy,
            Loss::ImportanceSampling,
            Loss::Ppo {
                low: 0.8,
                high: 1.2,
            },
            Loss::Cispo {
                low: 0.7,
                high: 1.3,
            },
            Loss::Dro { beta: 0.4 },
        ];
        for loss in losses {
            let var = Var::new(&logp[..], &dev).unwrap();
            let mut inputs = HashMap::new();
            inputs.insert("logprobs", Tensor::new(&q[..], &dev).unwrap());
            inputs.insert("advantages", Tensor::new(&adv[..], &dev).unwrap());
            inputs.insert("weights", Tensor::new(&w[..], &dev).unwrap());
            let per = loss.elementwise(var.as_tensor(), &inputs).unwrap();
            let got = per.to_vec1::<f32>().unwrap();
            let grads = per.sum_all().unwrap().backward().unwrap();
            let g = grads
                .get(var.as_tensor())
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            for i in 0..logp.len() {
                let (l, qq, a, ww) = (logp[i] as f64, q[i] as f64, adv[i] as f64, w[i] as f64);
                let want = reference(loss, l, qq, a, ww);
                assert!(
                    (got[i] as f64 - want).abs() < 1e-5,
                    "{loss:?} token {i}: {} vs {want}",
                    got[i]
                );
                let want_g = reference_grad(loss, l, qq, a, ww);
                assert!(
                    (g[i] as f64 - want_g).abs() < 1e-3,
                    "{loss:?} gradient at token {i}: {} vs {want_g}",
                    g[i]
                );
            }
        }
    }

    #[test]
    fn settings_are_checked_by_name() {
        let none = HashMap::new();
        assert_eq!(
            Loss::parse("ppo", &none).unwrap(),
            Loss::Ppo {
                low: 0.8,
                high: 1.2
            }
        );
        let e = Loss::parse("gspo", &none).unwrap_err().to_string();
        assert!(e.contains("\"gspo\"") && e.contains("cross_entropy"), "{e}");
        let e = Loss::parse("dro", &none).unwrap_err().to_string();
        assert!(e.contains("beta"), "{e}");
        let stray: HashMap<String, f64> = [("beta".to_string(), 1.0)].into();
        let e = Loss::parse("cross_entropy", &stray)
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"beta\"") && e.contains("cross_entropy"), "{e}");
        let upside: HashMap<String, f64> = [
            ("clip_low_threshold".to_string(), 1.5),
            ("clip_high_threshold".to_string(), 1.2),
        ]
        .into();
        assert!(Loss::parse("cispo", &upside).is_err());
    }
}
