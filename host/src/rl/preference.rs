//! Preference losses as small pure functions over per-pair values, each with its equation:
//! DPO and its variants for `rlhost dpo`, the Bradley–Terry loss for `rlhost rm`.
//!
//! Names follow TRL's `DPOTrainer`: a pair's `chosen` and `rejected` completions, their
//! summed log-probs under the policy (`logps`, with gradients) and under the reference
//! (`ref_logps`: the same model with its adapter off), and the implicit rewards
//! `β·(logps − ref_logps)`. Every tensor here is `[B]`, one entry a pair, f32.
//!
//! Checked against TRL 1.16 (`DPOTrainer._compute_loss` for `sigmoid`, `robust` and
//! `ipo`, `experimental.cpo.CPOTrainer.cpo_loss` for `simpo`, `RewardTrainer.compute_loss`)
//! on a fixed batch made by `scripts/preference_reference.py`.

use candle_core::{Result, Tensor};
use serde::{Deserialize, Serialize};

/// `dpo.loss`: how a pair's log-ratios become its loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum PairLoss {
    /// DPO (Rafailov et al. 2023); with `label_smoothing` ε, conservative DPO (cDPO):
    /// ℓ = −(1−ε)·log σ(β·Δ) − ε·log σ(−β·Δ), Δ = (logπ_c − logπref_c) − (logπ_r − logπref_r).
    Sigmoid,
    /// Robust DPO (rDPO, Chowdhury et al. 2024), unbiased under labels flipped with
    /// probability ε: ℓ = [−(1−ε)·log σ(β·Δ) + ε·log σ(−β·Δ)] / (1 − 2ε).
    Robust,
    /// IPO (Azar et al. 2023) on log-ratios averaged over each completion's tokens, as TRL
    /// does (the IPO authors' normalisation): ℓ = (Δ_c/|c| − Δ_r/|r| − 1/(2β))².
    Ipo,
    /// SimPO (Meng et al. 2024): reference-free, on the length-normalised log-probs, with a
    /// target margin γ: ℓ = −(1−ε)·log σ(β·h) − ε·log σ(−β·h),
    /// h = logπ_c/|c| − logπ_r/|r| − γ/β.
    Simpo,
}

impl PairLoss {
    /// Whether the loss reads the reference model's log-probs (SimPO does not: no
    /// reference forward is run for it).
    pub fn uses_reference(self) -> bool {
        self != PairLoss::Simpo
    }
}

/// A pair loss's settings (`[dpo]`).
#[derive(Debug, Clone, Copy)]
pub struct PairLossSettings {
    pub loss: PairLoss,
    /// β: the strength of the implicit KL to the reference (DPO, rDPO), IPO's τ, SimPO's
    /// reward scale.
    pub beta: f64,
    /// ε, the share of labels taken to be flipped (cDPO, rDPO, SimPO); IPO ignores it.
    pub label_smoothing: f64,
    /// SimPO's target reward margin γ.
    pub simpo_gamma: f64,
}

/// One `[B]` quantity of a batch of pairs for each side: the chosen completions' and the
/// rejected ones' (summed log-probs, or token counts).
pub struct Sides<'a> {
    pub chosen: &'a Tensor,
    pub rejected: &'a Tensor,
}

/// What a pair loss gives: the loss of each pair (`[B]`, with gradients) and the implicit
/// rewards TRL logs as `rewards/chosen` and `rewards/rejected` (detached).
pub struct PairLossOut {
    pub loss: Tensor,
    pub chosen_rewards: Tensor,
    pub rejected_rewards: Tensor,
}

/// log σ(x) = min(x, 0) − log(1 + e^{−|x|}), stable for any x.
pub fn log_sigmoid(x: &Tensor) -> Result<Tensor> {
    let tail = ((x.abs()?.neg()?.exp()? + 1.0)?).log()?;
    x.minimum(0.0)? - tail
}

/// −(1−ε)·log σ(z) − ε·log σ(−z): the cross-entropy of σ(z) against a label smoothed to
/// 1−ε.
fn smoothed(z: &Tensor, eps: f64) -> Result<Tensor> {
    let pos = log_sigmoid(z)?;
    if eps == 0.0 {
        return pos.neg();
    }
    (pos * -(1.0 - eps))? - (log_sigmoid(&z.neg()?)? * eps)?
}

/// The loss of each pair under `s`. `logps` are the policy's summed log-probs of each
/// completion, `ref_logps` the reference's (unused by SimPO), `tokens` each completion's
/// token count (read by IPO and SimPO).
pub fn pair_loss(
    logps: &Sides,
    ref_logps: Option<&Sides>,
    tokens: &Sides,
    s: &PairLossSettings,
) -> Result<PairLossOut> {
    let beta = s.beta;
    let ratios = || -> Result<(Tensor, Tensor)> {
        let r = ref_logps.ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "the {:?} loss needs the reference log-probs",
                s.loss
            ))
        })?;
        Ok(((logps.chosen - r.chosen)?, (logps.rejected - r.rejected)?))
    };
    let (loss, chosen_rewards, rejected_rewards) = match s.loss {
        PairLoss::Sigmoid | PairLoss::Robust => {
            let (c, r) = ratios()?;
            let z = ((&c - &r)? * beta)?;
            let loss = match s.loss {
                PairLoss::Sigmoid => smoothed(&z, s.label_smoothing)?,
                _ => {
                    let eps = s.label_smoothing;
                    let clean = (log_sigmoid(&z)? * -(1.0 - eps))?;
                    let flipped = (log_sigmoid(&z.neg()?)? * eps)?;
                    ((clean + flipped)? / (1.0 - 2.0 * eps))?
                }
            };
            (loss, (c * beta)?, (r * beta)?)
        }
        PairLoss::Ipo => {
            let (c, r) = ratios()?;
            let c_avg = (&c / tokens.chosen.clamp(1.0, f64::INFINITY)?)?;
            let r_avg = (&r / tokens.rejected.clamp(1.0, f64::INFINITY)?)?;
            let loss = ((c_avg - r_avg)? - 1.0 / (2.0 * beta))?.sqr()?;
            (loss, (c * beta)?, (r * beta)?)
        }
        PairLoss::Simpo => {
            let c_avg = (logps.chosen / tokens.chosen.clamp(1.0, f64::INFINITY)?)?;
            let r_avg = (logps.rejected / tokens.rejected.clamp(1.0, f64::INFINITY)?)?;
            let h = ((&c_avg - &r_avg)? - s.simpo_gamma / beta)?;
            let loss = smoothed(&(h * beta)?, s.label_smoothing)?;
            (loss, (c_avg * beta)?, (r_avg * beta)?)
        }
    };
    Ok(PairLossOut {
        loss,
        chosen_rewards: chosen_rewards.detach(),
        rejected_rewards: rejected_rewards.detach(),
    })
}

/// The Bradley–Terry loss of a reward model's scores, with TRL's optional per-pair margin
/// and centring term:
/// ℓ = mean(−log σ(r_c − r_r − m)) + c·mean((r_c + r_r)²).
pub fn bradley_terry(
    chosen: &Tensor,
    rejected: &Tensor,
    margin: Option<&Tensor>,
    center_coefficient: Option<f64>,
) -> Result<Tensor> {
    let mut diff = (chosen - rejected)?;
    if let Some(m) = margin {
        diff = (diff - m)?;
    }
    let mut loss = log_sigmoid(&diff)?.mean_all()?.neg()?;
    if let Some(c) = center_coefficient {
        loss = (loss + ((chosen + rejected)?.sqr()?.mean_all()? * c)?)?;
    }
    Ok(loss)
}

/// TRL's metrics of a batch's implicit rewards: `rewards/chosen`, `rewards/rejected`,
/// `rewards/margins` (means) and `rewards/accuracies` (the share with chosen > rejected,
/// strictly, as TRL counts it).
pub fn reward_metrics(chosen: &[f32], rejected: &[f32]) -> [(&'static str, f64); 4] {
    let n = chosen.len().max(1) as f64;
    let mean = |v: &[f32]| v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let right = chosen.iter().zip(rejected).filter(|(c, r)| c > r).count();
    [
        ("rewards/chosen", mean(chosen)),
        ("rewards/rejected", mean(rejected)),
        ("rewards/margins", mean(chosen) - mean(rejected)),
        ("rewards/accuracies", right as f64 / n),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn t(v: &[f32]) -> Tensor {
        Tensor::new(v, &Device::Cpu).unwrap()
    }

    fn vals(x: &Tensor) -> Vec<f32> {
        x.to_vec1().unwrap()
    }

    /// Written out per pair in f64, the losses the functions must equal.
    fn ls(x: f64) -> f64 {
        // log σ(x), directly (fine for the small values used here).
        -(1.0 + (-x).exp()).ln()
    }

    #[test]
    fn log_sigmoid_is_stable_at_the_extremes() {
        let v = vals(&log_sigmoid(&t(&[-100.0, -1.0, 0.0, 2.0, 100.0])).unwrap());
        assert!((v[0] + 100.0).abs() < 1e-4 && v[4].abs() < 1e-6);
        for (x, got) in [(-1.0, v[1]), (0.0, v[2]), (2.0, v[3])] {
            assert!((ls(x) - got as f64).abs() < 1e-6, "{x}: {got}");
        }
    }

    #[test]
    fn each_pair_loss_matches_its_equation() {
        let (pc, pr, rc, rr) = (
            [-3.0f32, -7.5],
            [-4.0f32, -6.0],
            [-3.5f32, -7.0],
            [-3.8f32, -6.2],
        );
        let (nc, nr) = ([3.0f32, 5.0], [4.0f32, 2.0]);
        let logps = (t(&pc), t(&pr));
        let refs = (t(&rc), t(&rr));
        let toks = (t(&nc), t(&nr));
        fn side(p: &(Tensor, Tensor)) -> Sides<'_> {
            Sides {
                chosen: &p.0,
                rejected: &p.1,
            }
        }
        let (beta, eps, gamma) = (0.2, 0.1, 0.5);
        for loss in [
            PairLoss::Sigmoid,
            PairLoss::Robust,
            PairLoss::Ipo,
            PairLoss::Simpo,
        ] {
            let s = PairLossSettings {
                loss,
                beta,
                label_smoothing: eps,
                simpo_gamma: gamma,
            };
            let out = pair_loss(&side(&logps), Some(&side(&refs)), &side(&toks), &s).unwrap();
            for (i, got) in vals(&out.loss).into_iter().enumerate() {
                let (c, r) = ((pc[i] - rc[i]) as f64, (pr[i] - rr[i]) as f64);
                let d = c - r;
                let want = match loss {
                    PairLoss::Sigmoid => -(1.0 - eps) * ls(beta * d) - eps * ls(-beta * d),
                    PairLoss::Robust => {
                        (-(1.0 - eps) * ls(beta * d) + eps * ls(-beta * d)) / (1.0 - 2.0 * eps)
                    }
                    PairLoss::Ipo => {
                        (c / nc[i] as f64 - r / nr[i] as f64 - 1.0 / (2.0 * beta)).powi(2)
                    }
                    PairLoss::Simpo => {
                        let h = pc[i] as f64 / nc[i] as f64
                            - pr[i] as f64 / nr[i] as f64
                            - gamma / beta;
                        -(1.0 - eps) * ls(beta * h) - eps * ls(-beta * h)
                    }
                };
                assert!(
                    (want - got as f64).abs() < 1e-5,
                    "{loss:?} pair {i}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn simpo_needs_no_reference_and_the_others_do() {
        let (a, b) = (t(&[-1.0]), t(&[-2.0]));
        let side = Sides {
            chosen: &a,
            rejected: &b,
        };
        let mut s = PairLossSettings {
            loss: PairLoss::Simpo,
            beta: 2.0,
            label_smoothing: 0.0,
            simpo_gamma: 0.5,
        };
        assert!(pair_loss(&side, None, &side, &s).is_ok());
        s.loss = PairLoss::Sigmoid;
        assert!(pair_loss(&side, None, &side, &s).is_err());
    }

    #[test]
    fn bradley_terry_with_margin_and_centring() {
        let (c, r, m) = (
            t(&[1.0, -0.5, 2.0]),
            t(&[0.0, 0.5, 1.0]),
            t(&[0.5, 0.0, 2.0]),
        );
        let got = bradley_terry(&c, &r, Some(&m), Some(0.01))
            .unwrap()
            .to_scalar::<f32>()
            .unwrap() as f64;
        let d = [0.5f64, -1.0, -1.0];
        let s = [1.0f64, 0.0, 3.0];
        let want = -d.iter().map(|&x| ls(x)).sum::<f64>() / 3.0
            + 0.01 * s.iter().map(|x| x * x).sum::<f64>() / 3.0;
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }

    #[test]
    fn reward_metrics_count_strict_wins() {
        let m = reward_metrics(&[1.0, 0.5, 2.0, 0.0], &[0.0, 0.5, 1.0, 1.0]);
        assert_eq!(m[3], ("rewards/accuracies", 0.5));
        assert!((m[2].1 - 0.25).abs() < 1e-9);
    }
}
