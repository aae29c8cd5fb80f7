//! The RL math as small pure functions, each with its equation (RL2's
//! `utils/algorithms.py` style). Advantages work on plain numbers per group; losses and
//! KL work on `[B, T]` tensors so that gradients flow through `logps`.
//!
//! Names follow RL2: `logps` (current policy, with gradients), `old_logps` (the policy
//! before this batch's updates, recomputed), `ref_logps` (adapters off), `behavior_logps`
//! (what the sampler recorded), `advantages`, `loss_mask`.

use candle_core::{DType, Result, Tensor};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
/// `train.algorithm`: where advantages come from.
pub enum Algorithm {
    /// The group-baseline family ([`Estimator`] says which).
    Grpo,
    /// A value head and GAE over token rewards.
    Ppo,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
/// PPO's critic: trained through the policy's adapter, or through one of its own (a
/// second forward pass per micro-batch).
pub enum Critic {
    Shared,
    Separate,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
/// What to do with trajectories a length limit cut off.
pub enum Overlong {
    None,
    /// Not trained on.
    Filter,
    /// DAPO's soft overlong punishment ([`overlong_penalty`]).
    Penalty,
}

/// How advantages are estimated from a group's rewards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Estimator {
    /// GRPO: (r_i − mean(r)) / (std(r) + ε), std unbiased as `torch.std` (the group's, or
    /// the batch's with `scale_rewards = "batch"`).
    Grpo,
    /// Dr. GRPO: r_i − mean(r) (no std: it biases towards easy and hard prompts).
    DrGrpo,
    /// RLOO: r_i − mean_{j≠i}(r_j).
    Rloo,
    /// REINFORCE with the batch mean as baseline: r_i − mean over all trajectories.
    Reinforce,
}

/// What the baseline-centred rewards are divided by (TRL's `scale_rewards`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Scale {
    /// The group's reward std (GRPO).
    Group,
    /// The std of every reward in the batch (TRL `scale_rewards = "batch"`; with the
    /// `reinforce` baseline it is RL2's `global_norm` with `norm_var`).
    Batch,
    /// No division (Dr. GRPO, RLOO, REINFORCE as published).
    None,
}

impl Estimator {
    /// The scale each estimator is published with.
    pub fn default_scale(self) -> Scale {
        match self {
            Estimator::Grpo => Scale::Group,
            Estimator::DrGrpo | Estimator::Rloo | Estimator::Reinforce => Scale::None,
        }
    }
}

/// Advantages for `groups` (each a group's rewards, in order), flattened in the same
/// order: the estimator's baseline is subtracted, then the result is divided by
/// `std + eps` where `scale` says whose std. `eps` guards the division when the rewards
/// are all equal.
///
/// TRL (`GRPOTrainer._generate_and_score_completions`):
/// ```python
/// mean = rewards.view(-1, G).mean(dim=1).repeat_interleave(G)
/// advantages = rewards - mean
/// if scale_rewards == "group": std = rewards.view(-1, G).std(dim=1).repeat_interleave(G)
/// elif scale_rewards == "batch": std = rewards.std().expand_as(rewards)
/// if scale_rewards != "none": advantages = advantages / (std + 1e-4)
/// ```
pub fn advantages(groups: &[Vec<f64>], estimator: Estimator, scale: Scale, eps: f64) -> Vec<f64> {
    let all: Vec<f64> = groups.iter().flatten().copied().collect();
    let batch_mean = mean(&all);
    let batch_std = std_unbiased(&all);
    let mut out = Vec::with_capacity(all.len());
    for g in groups {
        let m = mean(g);
        let n = g.len() as f64;
        let divisor = match scale {
            Scale::Group => std_unbiased(g) + eps,
            Scale::Batch => batch_std + eps,
            Scale::None => 1.0,
        };
        for &r in g {
            let centred = match estimator {
                Estimator::Grpo | Estimator::DrGrpo => r - m,
                // mean of the others = (n·m − r) / (n − 1); a group of one has no baseline.
                Estimator::Rloo if g.len() > 1 => r - (n * m - r) / (n - 1.0),
                Estimator::Rloo => 0.0,
                Estimator::Reinforce => r - batch_mean,
            };
            out.push(centred / divisor);
        }
    }
    out
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// Bessel-corrected standard deviation (0 for fewer than two values).
fn std_unbiased(xs: &[f64]) -> f64 {
    if xs.len() < 2 {
        return 0.0;
    }
    let m = mean(xs);
    (xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (xs.len() - 1) as f64).sqrt()
}

/// DAPO's dynamic sampling keeps a group only if its rewards differ: with equal rewards
/// every advantage is 0 and the group adds nothing but cost.
pub fn informative(rewards: &[f64]) -> bool {
    rewards.windows(2).any(|w| (w[0] - w[1]).abs() > 1e-12)
}

/// DAPO's soft overlong punishment for a response of `len` tokens, limit `max_len`,
/// ramp `cache`:
/// 0 if len ≤ max − cache; (max − cache − len) / cache if max − cache < len ≤ max; −1 above.
pub fn overlong_penalty(len: usize, max_len: usize, cache: usize) -> f64 {
    let start = max_len.saturating_sub(cache);
    if len <= start {
        0.0
    } else if len <= max_len && cache > 0 {
        (start as f64 - len as f64) / cache as f64
    } else {
        -1.0
    }
}

/// Per-token KL estimators of KL(π ‖ π_ref) from d = logps − ref_logps (Schulman's k1,
/// k2, k3). k3 = exp(−d) − 1 + d is TRL's `exp(ref − logp) − (ref − logp) − 1`: unbiased,
/// never negative. The sign matters: k1 is log π − log π_ref, not the reverse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum KlEstimator {
    K1,
    K2,
    K3,
}

pub fn kl(logps: &Tensor, ref_logps: &Tensor, estimator: KlEstimator) -> Result<Tensor> {
    let d = (logps - ref_logps)?;
    match estimator {
        KlEstimator::K1 => Ok(d),
        KlEstimator::K2 => d.sqr()? * 0.5,
        KlEstimator::K3 => (d.neg()?.exp()? - 1.0)? + &d,
    }
}

/// How per-token losses become one number.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Aggregation {
    /// DAPO: Σ loss·mask / Σ mask over the whole batch (long answers weigh more).
    TokenMean,
    /// GRPO: mean over sequences of each sequence's token mean.
    SeqMeanTokenMean,
    /// verl's `seq-mean-token-sum`: mean over sequences of each sequence's token sum
    /// (a sequence-level objective: every sampled token counts fully).
    SeqMeanTokenSum,
    /// Dr. GRPO: Σ loss·mask / (B · C) with a constant C (e.g. the max response length),
    /// so that length does not rescale the gradient.
    SeqMeanTokenSumNorm,
}

/// Aggregates `[B, T]` per-token values under `mask` (f32 0/1). `norm` is Dr. GRPO's C.
pub fn aggregate(values: &Tensor, mask: &Tensor, how: Aggregation, norm: f64) -> Result<Tensor> {
    let masked = (values * mask)?;
    match how {
        Aggregation::TokenMean => {
            let n = mask.sum_all()?.to_scalar::<f32>()?.max(1.0) as f64;
            masked.sum_all()? / n
        }
        Aggregation::SeqMeanTokenMean => {
            let per_seq = masked.sum(1)?;
            let lens = mask.sum(1)?.clamp(1f32, f32::MAX)?;
            (per_seq / lens)?.mean_all()
        }
        Aggregation::SeqMeanTokenSum => masked.sum(1)?.mean_all(),
        Aggregation::SeqMeanTokenSumNorm => {
            let b = values.dim(0)? as f64;
            masked.sum_all()? / (b * norm)
        }
    }
}

/// The clipped surrogate per token, PPO with DAPO's decoupled clip range:
/// ratio = exp(logps − old_logps);
/// loss = −min(ratio·A, clip(ratio, 1 − clip_low, 1 + clip_high)·A).
/// Returns the per-token loss and a 0/1 tensor marking tokens where the clip was active.
pub fn clipped_surrogate(
    logps: &Tensor,
    old_logps: &Tensor,
    advantages: &Tensor,
    clip_low: f64,
    clip_high: f64,
) -> Result<(Tensor, Tensor)> {
    let ratio = (logps - old_logps)?.exp()?;
    let adv = advantages.broadcast_as(ratio.shape())?;
    let surr1 = (&ratio * &adv)?;
    let surr2 = (ratio.clamp(1.0 - clip_low, 1.0 + clip_high)? * &adv)?;
    let loss = surr1.minimum(&surr2)?.neg()?;
    let clipped = surr2.lt(&surr1)?.to_dtype(candle_core::DType::F32)?;
    Ok((loss, clipped))
}

/// Truncated importance sampling for trajectories sampled by an older adapter version:
/// w = min(exp(old_logps − behavior_logps), cap), no gradient. Multiplies the per-token
/// loss so that the update is an unbiased-but-bounded estimate under the current policy.
pub fn truncated_is(old_logps: &Tensor, behavior_logps: &Tensor, cap: f64) -> Result<Tensor> {
    let w = (old_logps - behavior_logps)?
        .exp()?
        .clamp(0f32, cap as f32)?;
    Ok(w.detach())
}

/// How the update corrects for the sampler's log-probs differing from the trainer's
/// (`train.rollout_correction`): another engine (vLLM) and other kernels give the same
/// tokens slightly different probabilities, so the sampled data is slightly off-policy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RolloutCorrection {
    None,
    /// Truncated importance sampling per token (TRL `token_truncate`, verl `rollout_is`
    /// at the token level).
    TokenTis {
        cap: f64,
    },
    /// Masked importance sampling per sequence (TRL `sequence_mask`, with verl's lower
    /// bound from `rollout_rs`).
    SeqMis {
        min: f64,
        cap: f64,
    },
}

/// The weights [`RolloutCorrection`] puts on each token's loss, no gradient. With
/// d_t = (old_logps_t − rollout_logps_t)·mask_t (TRL's
/// `vllm_importance_sampling_correction`):
/// - token_tis: w_t = min(e^{d_t}, cap);
/// - seq_mis: ρ = e^{Σ_t d_t} per sequence, w_t = ρ if min ≤ ρ ≤ cap, else 0 (the
///   sequence's tokens teach nothing);
/// - none: w_t = 1.
///
/// `ids` (`[B, T]`) is each token's sequence id within its row, 0 for padding: rows that
/// pack several sequences sum each on its own ([`sequence_sums`]); padding weighs 0.
pub fn rollout_weights(
    old_logps: &Tensor,
    rollout_logps: &Tensor,
    mask: &Tensor,
    ids: &Tensor,
    correction: RolloutCorrection,
) -> Result<Tensor> {
    let d = ((old_logps - rollout_logps)? * mask)?;
    let w = match correction {
        RolloutCorrection::None => d.ones_like()?,
        RolloutCorrection::TokenTis { cap } => d.exp()?.clamp(0f32, cap as f32)?,
        RolloutCorrection::SeqMis { min, cap } => {
            let rho = sequence_sums(&d, ids)?.exp()?;
            let keep = (rho.ge(min as f32)?.to_dtype(d.dtype())?
                * rho.le(cap as f32)?.to_dtype(d.dtype())?)?
                * ids.to_dtype(DType::U32)?.ne(0u32)?.to_dtype(d.dtype())?;
            (rho * keep?)?
        }
    };
    Ok(w.detach())
}

/// Σ of `x` over each token's sequence, at every token of it: `[B, T]` in and out, with
/// `ids` (`[B, T]`, u32) each token's sequence id within its row and 0 for padding (whose
/// sums are 0). With one sequence a row (ids all 1) it is the row sum at every token.
///   out[b, i] = Σ_j [ids[b, j] = ids[b, i] ≠ 0] · x[b, j]
pub fn sequence_sums(x: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let ids = ids.to_dtype(DType::U32)?;
    let same = ids.unsqueeze(2)?.broadcast_eq(&ids.unsqueeze(1)?)?;
    let member = same
        .broadcast_mul(&ids.ne(0u32)?.unsqueeze(2)?)?
        .to_dtype(x.dtype())?;
    member.matmul(&x.unsqueeze(2)?.contiguous()?)?.squeeze(2)
}

/// How far the sampler's log-probs are from the trainer's, over the masked tokens: the
/// sum of k3 = r − 1 − log r with r = e^{old_logps − rollout_logps} (a KL estimate with
/// samples from the sampler), the sum of |old − rollout|, the largest r, and the count.
pub fn rollout_mismatch(
    old_logps: &Tensor,
    rollout_logps: &Tensor,
    mask: &Tensor,
) -> Result<(f64, f64, f64, f64)> {
    let d = ((old_logps - rollout_logps)? * mask)?;
    let r = d.exp()?;
    let k3 = ((&r - 1.0)? - &d)?;
    let max_r = (r * mask)?.max_all()?.to_scalar::<f32>()? as f64;
    Ok((
        (k3 * mask)?.sum_all()?.to_scalar::<f32>()? as f64,
        d.abs()?.sum_all()?.to_scalar::<f32>()? as f64,
        max_r,
        mask.sum_all()?.to_scalar::<f32>()? as f64,
    ))
}

/// Generalised advantage estimation over one trajectory, positions in order, with
/// `actions[t]` marking the tokens the policy chose. Only actions are steps of the MDP:
/// the prompt and tool output in between are skipped, so that the value after an action
/// is the value at the next action, and the TD error never lands on a token the policy
/// did not choose (verl's `compute_gae_advantage_return` carries `nextvalues` and
/// `lastgaelam` across observation tokens; RL2's `compute_advantages` packs the action
/// tokens first; both give this):
///
/// δ_t = r_t + γ·V(s_next) − V(s_t),  A_t = δ_t + γλ·A_next,  R_t = A_t + V(s_t),
///
/// with V and A after the last action 0. Returns `(A, R)`; non-action positions hold 0.
pub fn gae(
    rewards: &[f64],
    values: &[f64],
    actions: &[bool],
    gamma: f64,
    lam: f64,
) -> (Vec<f64>, Vec<f64>) {
    let n = rewards.len();
    let (mut adv, mut ret) = (vec![0.0; n], vec![0.0; n]);
    let (mut next_value, mut next_adv) = (0.0, 0.0);
    for t in (0..n).rev().filter(|&t| actions[t]) {
        let delta = rewards[t] + gamma * next_value - values[t];
        next_adv = delta + gamma * lam * next_adv;
        next_value = values[t];
        adv[t] = next_adv;
        ret[t] = next_adv + values[t];
    }
    (adv, ret)
}

/// Whitens the action positions of every row together, as verl's `masked_whiten`:
/// (A − mean) / sqrt(var + 1e-8), var unbiased; other positions stay as they are.
pub fn whiten(advantages: &mut [Vec<f64>], actions: &[Vec<bool>]) {
    let picked = || {
        advantages
            .iter()
            .zip(actions)
            .flat_map(|(a, m)| a.iter().zip(m).filter(|(_, on)| **on).map(|(x, _)| *x))
    };
    let n = picked().count() as f64;
    if n < 2.0 {
        return;
    }
    let mean = picked().sum::<f64>() / n;
    let var = picked().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
    let scale = 1.0 / (var + 1e-8).sqrt();
    for (a, m) in advantages.iter_mut().zip(actions) {
        for (x, on) in a.iter_mut().zip(m) {
            if *on {
                *x = (*x - mean) * scale;
            }
        }
    }
}

/// PPO's clipped value loss per token (verl's `compute_value_loss`, TRL's PPO):
/// 0.5 · max((V − R)², (clip(V, V_old − c, V_old + c) − R)²). Returns the per-token loss
/// and a 0/1 tensor marking tokens where the clipped term was the larger.
pub fn value_loss(
    values: &Tensor,
    old_values: &Tensor,
    returns: &Tensor,
    clip: f64,
) -> Result<(Tensor, Tensor)> {
    let clipped = values
        .maximum(&(old_values - clip)?)?
        .minimum(&(old_values + clip)?)?;
    let l1 = (values - returns)?.sqr()?;
    let l2 = (clipped - returns)?.sqr()?;
    let used = l2.gt(&l1)?.to_dtype(candle_core::DType::F32)?;
    Ok(((l1.maximum(&l2)? * 0.5)?, used))
}

/// A group's rollouts as a tree (issue 67): node 0 is the root, the prompt, with no tokens
/// of its own; every other node is a segment that continues its parent (a turn, or the
/// tokens up to a branch point), listed after its parent; a leaf is a finished trajectory
/// and carries its reward. A flat group is a root whose children are its trajectories.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutTree {
    parents: Vec<Option<usize>>,
    /// Some for the leaves and only for them (checked when built), so a node is a leaf
    /// exactly when it has a reward.
    rewards: Vec<Option<f64>>,
}

impl RolloutTree {
    /// `parents[n]` is node n's parent (`None` for the root, node 0 alone); `rewards[n]`
    /// is a leaf's reward and `None` for a node with children. Refused with a message
    /// naming the node when the shape is not a tree listed parents first, or a leaf has no
    /// reward (or an inner node has one).
    pub fn new(
        parents: Vec<Option<usize>>,
        rewards: Vec<Option<f64>>,
    ) -> std::result::Result<Self, String> {
        if parents.is_empty() || parents.len() != rewards.len() {
            return Err(format!(
                "a rollout tree needs one parent and one reward slot per node ({} and {})",
                parents.len(),
                rewards.len()
            ));
        }
        let mut has_children = vec![false; parents.len()];
        for (n, p) in parents.iter().enumerate() {
            match (n, p) {
                (0, None) => {}
                (0, Some(_)) => return Err("node 0 is the root and has no parent".into()),
                (_, None) => {
                    return Err(format!("node {n} has no parent: only node 0 is the root"));
                }
                (_, Some(p)) if *p >= n => {
                    return Err(format!("node {n}'s parent {p} is not listed before it"));
                }
                (_, Some(p)) => has_children[*p] = true,
            }
        }
        if !has_children[0] {
            return Err("the tree has no trajectory: the root is a leaf".into());
        }
        for (n, r) in rewards.iter().enumerate() {
            match (has_children[n], r) {
                (false, None) => return Err(format!("leaf {n} has no reward")),
                (true, Some(_)) => {
                    return Err(format!(
                        "node {n} has children and a reward: only leaves have one"
                    ));
                }
                (false, Some(r)) if !r.is_finite() => {
                    return Err(format!("leaf {n}'s reward {r} is not finite"));
                }
                _ => {}
            }
        }
        Ok(RolloutTree { parents, rewards })
    }

    pub fn len(&self) -> usize {
        self.parents.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parents.is_empty()
    }

    /// The leaves, in node order.
    pub fn leaves(&self) -> Vec<usize> {
        (0..self.len())
            .filter(|&n| self.rewards[n].is_some())
            .collect()
    }

    /// The leaves' rewards, in node order.
    pub fn leaf_rewards(&self) -> Vec<f64> {
        self.rewards.iter().flatten().copied().collect()
    }

    /// The nodes from the root's first child down to `leaf`: the segments a trajectory
    /// is made of, in order.
    pub fn path(&self, leaf: usize) -> Vec<usize> {
        let mut out = vec![leaf];
        let mut n = leaf;
        while let Some(p) = self.parents[n] {
            if p == 0 {
                break;
            }
            out.push(p);
            n = p;
        }
        out.reverse();
        out
    }

    /// Each node's leaf count |L(n)| and value V(n) = (1/|L(n)|) Σ_{l ∈ L(n)} R_l, the
    /// mean reward of the trajectories that pass through it (TreeRL's node value).
    pub fn values(&self) -> (Vec<usize>, Vec<f64>) {
        let mut count = vec![0usize; self.len()];
        let mut sum = vec![0.0f64; self.len()];
        // Children come after their parents, so one pass from the back adds each subtree
        // into its parent once it is complete.
        for n in (0..self.len()).rev() {
            if let Some(r) = self.rewards[n] {
                count[n] += 1;
                sum[n] += r;
            }
            if let Some(p) = self.parents[n] {
                count[p] += count[n];
                sum[p] += sum[n];
            }
        }
        let values = sum.iter().zip(&count).map(|(s, &c)| s / c as f64).collect();
        (count, values)
    }
}

/// TreeRL's process advantage of each segment (Hou et al. 2025): with V(n) a node's mean
/// leaf reward ([`RolloutTree::values`]),
///
///   A(n) = (V(n) − V(root)) + (V(n) − V(parent(n)))          global plus local
///   A(n) = [(V(n) − V(root)) + (V(n) − V(parent(n)))] / √|L(n)|   with `reweight`
///
/// The global term says how much better than the prompt's average the trajectories
/// through n did, the local one what the step into n added over its parent; the
/// reweighting damps segments many trajectories share (they are trained once per path).
/// The root has no tokens and gets 0. As the paper writes it; TreeRL's released code
/// differs (leave-one-out-centred leaf rewards over the prompt's forest, the √ taken of
/// each value before the difference, and a zero local term replaced by the segment
/// before's): see docs/design/tree-advantages.md.
pub fn treerl_advantages(tree: &RolloutTree, reweight: bool) -> Vec<f64> {
    let (count, v) = tree.values();
    (0..tree.len())
        .map(|n| match tree.parents[n] {
            None => 0.0,
            Some(p) => {
                let a = (v[n] - v[0]) + (v[n] - v[p]);
                if reweight {
                    a / (count[n] as f64).sqrt()
                } else {
                    a
                }
            }
        })
        .collect()
}

/// GRPO over each tree's leaves: each trajectory against the others of its own tree,
///   A_l = (R_l − mean_{tree}(R)) / (std_{tree}(R) + ε)
/// std unbiased, as [`advantages`] (TRL) has it; a tree of one leaf gets 0. In leaf order
/// ([`RolloutTree::leaves`]).
pub fn leaf_grpo_advantages(tree: &RolloutTree, eps: f64) -> Vec<f64> {
    grpo_scores(&tree.leaf_rewards(), eps)
}

/// (R_i − mean(R)) / (std(R) + ε) over one group, as [`advantages`] gives it for GRPO,
/// and 0 where the divisor is 0 (a group of one, or equal rewards at ε = 0), where the
/// centred reward is 0 too.
fn grpo_scores(rewards: &[f64], eps: f64) -> Vec<f64> {
    let m = mean(rewards);
    let d = std_unbiased(rewards) + eps;
    rewards
        .iter()
        .map(|r| if d > 0.0 { (r - m) / d } else { 0.0 })
        .collect()
}

/// Tree-GRPO's advantages (Ji et al. 2025) for a prompt's trees: each leaf's intra-tree
/// GRPO score plus its inter-tree one over every leaf of the prompt,
///   A_l = (R_l − mean_{tree}) / (std_{tree} + ε) + (R_l − mean_{all}) / (std_{all} + ε)
/// std unbiased (as the released code's `torch.std`; its ε is 1e-6). A tree of one leaf
/// gets an intra score of 0 here, where the code's group of one gives the raw reward: a
/// trajectory with no sibling has nothing to be compared with. Per tree, in leaf order.
pub fn tree_grpo_advantages(trees: &[RolloutTree], eps: f64) -> Vec<Vec<f64>> {
    let per_tree: Vec<Vec<f64>> = trees.iter().map(RolloutTree::leaf_rewards).collect();
    let all: Vec<f64> = per_tree.iter().flatten().copied().collect();
    let mut inter = grpo_scores(&all, eps).into_iter();
    per_tree
        .iter()
        .map(|leaves| {
            grpo_scores(leaves, eps)
                .into_iter()
                .map(|intra| intra + inter.next().unwrap_or(0.0))
                .collect()
        })
        .collect()
}

/// A segment's advantage when a shared prefix is trained once, from its leaves' (in leaf
/// order): the mean over the trajectories through it (ARPO's and TreeAdv's attribution).
/// Trained once per path instead, each path's copy carries its leaf's advantage and a
/// segment n is weighted |L(n)| times; the mean keeps its total weight at one while its
/// sign and size follow the paths it leads to. The root gets 0.
pub fn per_segment_from_leaves(tree: &RolloutTree, leaf_advantages: &[f64]) -> Vec<f64> {
    let leaves = tree.leaves();
    let mut sum = vec![0.0f64; tree.len()];
    let mut count = vec![0usize; tree.len()];
    for (&leaf, &a) in leaves.iter().zip(leaf_advantages) {
        for n in tree.path(leaf) {
            sum[n] += a;
            count[n] += 1;
        }
    }
    sum.iter()
        .zip(&count)
        .map(|(s, &c)| if c == 0 { 0.0 } else { s / c as f64 })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol * (1.0 + b.abs())
    }

    fn t2(rows: &[&[f32]]) -> Tensor {
        let v: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_vec(v, (rows.len(), rows[0].len()), &Device::Cpu).unwrap()
    }

    /// Reference numbers from the formulas in the doc comments, computed with Python's
    /// `statistics` (stdev is Bessel-corrected, as torch.std):
    /// ```python
    /// import statistics as s
    /// g = [1.0, 0.0, 0.0, 1.0]; m = s.mean(g); sd = s.stdev(g)
    /// [(r - m) / (sd + 1e-4) for r in g]        # GRPO, TRL's eps
    /// # [0.8658..., -0.8658..., -0.8658..., 0.8658...]; sd = 0.5773502691896257
    /// g2 = [0.5, 0.25, 1.0]
    /// [r - (sum(g2) - r) / 2 for r in g2]       # RLOO: [-0.125, -0.5, 0.625]
    /// ```
    #[test]
    fn advantages_match_the_reference_formulas() {
        let g = vec![vec![1.0, 0.0, 0.0, 1.0], vec![0.5, 0.25, 1.0]];
        let grpo = advantages(&g, Estimator::Grpo, Scale::Group, 1e-4);
        let want = 0.5 / (0.5773502691896257 + 1e-4);
        assert!(close(grpo[0], want, 1e-12) && close(grpo[1], -want, 1e-12));
        // Group 2: mean 0.5833333, stdev 0.3818813079129867.
        assert!(close(
            grpo[6],
            (1.0 - 0.5833333333333334) / (0.3818813079129867 + 1e-4),
            1e-12
        ));
        let rloo = advantages(&g, Estimator::Rloo, Scale::None, 0.0);
        for (a, b) in rloo[4..].iter().zip([-0.125, -0.5, 0.625]) {
            assert!(close(*a, b, 1e-12), "{rloo:?}");
        }
        let dr = advantages(&g, Estimator::DrGrpo, Scale::None, 0.0);
        assert_eq!(dr[..4], [0.5, -0.5, -0.5, 0.5]);
        // Batch mean of all seven rewards = 3.75 / 7.
        let re = advantages(&g, Estimator::Reinforce, Scale::None, 0.0);
        assert!(close(re[0], 1.0 - 3.75 / 7.0, 1e-12));
        // All-equal group: GRPO gives zeros, not NaN.
        assert_eq!(
            advantages(&[vec![1.0; 4]], Estimator::Grpo, Scale::Group, 1e-4),
            [0.0; 4]
        );
        assert!(!informative(&[1.0, 1.0]) && informative(&[1.0, 0.0]));
    }

    /// Batch scaling: the group's mean is subtracted, the batch's std divides (TRL
    /// `scale_rewards = "batch"`); with the batch mean as baseline and float epsilon it is
    /// RL2's `_compute_reinforce_adv(global_norm=True, norm_var=True)`:
    /// ```python
    /// import statistics as s
    /// g = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.25, 1.0]]; rs = [r for x in g for r in x]
    /// sd = s.stdev(rs)                                          # 0.46611361786790223
    /// [(r - s.mean(x)) / (sd + 1e-4) for x in g for r in x]     # TRL "batch"
    /// # [1.072469745278163, -1.072469745278163, -1.072469745278163, 1.072469745278163,
    /// #  -0.1787449575463606, -0.7149798301854422, 0.8937247877318025]
    /// eps = 1.1920928955078125e-07                              # torch.finfo(float32).eps
    /// [(r - s.mean(rs)) / (sd + eps) for r in rs]               # RL2 global_norm
    /// # [0.9960781615171004, -1.1493209555966541, -1.1493209555966541, 0.9960781615171004,
    /// #  -0.07662139703977691, -0.6129711763182156, 0.9960781615171004]
    /// ```
    #[test]
    fn batch_scaling_matches_trl_and_rl2() {
        let g = vec![vec![1.0, 0.0, 0.0, 1.0], vec![0.5, 0.25, 1.0]];
        let trl = advantages(&g, Estimator::Grpo, Scale::Batch, 1e-4);
        let want = [
            1.072469745278163,
            -1.072469745278163,
            -1.072469745278163,
            1.072469745278163,
            -0.1787449575463606,
            -0.7149798301854422,
            0.8937247877318025,
        ];
        for (a, b) in trl.iter().zip(want) {
            assert!(close(*a, b, 1e-12), "{trl:?}");
        }
        let rl2 = advantages(&g, Estimator::Reinforce, Scale::Batch, f32::EPSILON as f64);
        let want = [
            0.9960781615171004,
            -1.1493209555966541,
            -1.1493209555966541,
            0.9960781615171004,
            -0.07662139703977691,
            -0.6129711763182156,
            0.9960781615171004,
        ];
        for (a, b) in rl2.iter().zip(want) {
            assert!(close(*a, b, 1e-12), "{rl2:?}");
        }
        // Group scaling of the reinforce baseline divides each group by its own std.
        let re = advantages(&g, Estimator::Reinforce, Scale::Group, 1e-4);
        assert!(close(
            re[0],
            (1.0 - 3.75 / 7.0) / (0.5773502691896257 + 1e-4),
            1e-12
        ));
    }

    /// `tests/fixtures/rl_reference.json`, made by `scripts/rl_reference.py` with verl's
    /// and RL2's own functions (and TRL's batch scaling) on one fixed batch.
    fn peers() -> serde_json::Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/rl_reference.json"
        );
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
    }

    fn floats(v: &serde_json::Value) -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    }

    /// Reference numbers from TRL's formulas (`grpo_trainer.py`, the
    /// `vllm_importance_sampling_correction` block) worked in Python by hand:
    /// d = (old − rollout)·mask; token_truncate: min(exp(d), 2); sequence_mask with a
    /// lower bound of 0.5: exp(Σ d) = [1.0, 3.3201, 0.3679] → [1.0, 0, 0].
    #[test]
    fn rollout_weights_follow_trls_importance_sampling_modes() {
        let t = |v: [[f32; 4]; 3]| Tensor::new(&v, &Device::Cpu).unwrap();
        let old = t([
            [-0.5, -1.2, -0.1, -2.0],
            [-0.3, -0.2, -1.5, 0.0],
            [-1.0, -2.0, -0.5, -0.5],
        ]);
        let roll = t([
            [-0.7, -1.0, -0.1, -1.2],
            [-0.2, -1.6, -1.4, 0.0],
            [-0.5, -1.5, -0.5, -0.5],
        ]);
        let mask = t([[1., 1., 1., 0.], [1., 1., 1., 0.], [1., 1., 1., 1.]]);
        let ids = Tensor::ones((3, 4), DType::U32, &Device::Cpu).unwrap();
        let got = |c| {
            rollout_weights(&old, &roll, &mask, &ids, c)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap()
        };
        let tis = got(RolloutCorrection::TokenTis { cap: 2.0 });
        let want = [
            [1.2214027581601699, 0.8187307530779819, 1.0, 1.0],
            [0.9048374180359596, 2.0, 0.9048374180359595, 1.0],
            [0.6065306597126334, 0.6065306597126334, 1.0, 1.0],
        ];
        for (g, w) in tis.iter().flatten().zip(want.iter().flatten()) {
            assert!((*g as f64 - w).abs() < 1e-6, "{g} vs {w}");
        }
        let mis = got(RolloutCorrection::SeqMis { min: 0.5, cap: 2.0 });
        let want = [[1.0; 4], [0.0; 4], [0.0; 4]];
        for (g, w) in mis.iter().flatten().zip(want.iter().flatten()) {
            assert!((g - w).abs() < 1e-6, "{mis:?}");
        }
        // Without the lower bound the third row keeps its ratio, as in TRL.
        let mis = got(RolloutCorrection::SeqMis { min: 0.0, cap: 2.0 });
        assert!((mis[2][0] as f64 - 0.36787944117144233).abs() < 1e-6);
        assert_eq!(got(RolloutCorrection::None), [[1.0; 4]; 3]);
        // The first two rows' first three tokens packed into one row of seven (one pad):
        // each sequence keeps its own ratio, the pad weighs 0.
        let cat = |x: &Tensor| {
            let v = x.to_vec2::<f32>().unwrap();
            let row: Vec<f32> = v[0][..3]
                .iter()
                .chain(&v[1][..3])
                .copied()
                .chain([0.0])
                .collect();
            Tensor::from_vec(row, (1, 7), &Device::Cpu).unwrap()
        };
        let ids = Tensor::new(&[[1u32, 1, 1, 2, 2, 2, 0]], &Device::Cpu).unwrap();
        let packed = rollout_weights(
            &cat(&old),
            &cat(&roll),
            &cat(&mask),
            &ids,
            RolloutCorrection::SeqMis {
                min: 0.0,
                cap: 10.0,
            },
        )
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
        let (a, b) = (1.0f64, 3.320116922736548f64);
        for (g, w) in packed[0].iter().zip([a, a, a, b, b, b, 0.0]) {
            assert!((*g as f64 - w).abs() < 1e-5, "{packed:?}");
        }
        let (k3, abs, max_r, n) = rollout_mismatch(&old, &roll, &mask).unwrap();
        assert_eq!(n, 10.0);
        assert!((k3 / n - 0.19180696335800132).abs() < 1e-6, "{}", k3 / n);
        assert!((abs / n - 0.3).abs() < 1e-6);
        assert!((max_r - 4.055199966844675).abs() < 1e-5);
    }

    fn matrix(v: &serde_json::Value) -> Tensor {
        let rows: Vec<Vec<f32>> = v
            .as_array()
            .unwrap()
            .iter()
            .map(|r| floats(r).into_iter().map(|x| x as f32).collect())
            .collect();
        let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        t2(&refs)
    }

    fn assert_all_close(ours: &[f64], theirs: &[f64], tol: f64, what: &str) {
        assert_eq!(ours.len(), theirs.len(), "{what}");
        for (a, b) in ours.iter().zip(theirs) {
            assert!(
                close(*a, *b, tol),
                "{what}: ours {ours:?}, theirs {theirs:?}"
            );
        }
    }

    /// Advantages, the clipped surrogate under every aggregation, and the KL estimators
    /// against the peers' functions on the same batch (f64 there; the losses run in f32
    /// here, hence 1e-6).
    #[test]
    fn the_math_matches_verl_rl2_and_trl_on_one_batch() {
        let p = peers();
        let groups: Vec<Vec<f64>> = p["rewards"]
            .as_array()
            .unwrap()
            .iter()
            .map(floats)
            .collect();
        let adv = &p["advantages"];
        for (estimator, scale, eps, key) in [
            (Estimator::Grpo, Scale::Group, 1e-4, "grpo"),
            (Estimator::DrGrpo, Scale::None, 1e-4, "dr_grpo"),
            (Estimator::Rloo, Scale::None, 1e-4, "rloo"),
            (Estimator::Grpo, Scale::Batch, 1e-4, "trl_batch_scale"),
            // RL2's ε is its dtype's epsilon; the script runs in f64.
            (
                Estimator::Reinforce,
                Scale::Batch,
                f64::EPSILON,
                "rl2_reinforce_global_norm",
            ),
        ] {
            let ours = advantages(&groups, estimator, scale, eps);
            assert_all_close(&ours, &floats(&adv[key]), 1e-12, key);
        }
        let (old, logps, refs, mask) = (
            matrix(&p["old_logps"]),
            matrix(&p["logps"]),
            matrix(&p["ref_logps"]),
            matrix(&p["mask"]),
        );
        let grpo: Vec<f32> = floats(&adv["grpo"]).into_iter().map(|a| a as f32).collect();
        let a = Tensor::from_vec(grpo, (8, 1), &Device::Cpu).unwrap();
        let (lo, hi) = (
            p["clip_low"].as_f64().unwrap(),
            p["clip_high"].as_f64().unwrap(),
        );
        let (loss, clipped) = clipped_surrogate(&logps, &old, &a, lo, hi).unwrap();
        let norm = p["norm_constant"].as_f64().unwrap();
        for (how, key) in [
            (Aggregation::TokenMean, "token-mean"),
            (Aggregation::SeqMeanTokenMean, "seq-mean-token-mean"),
            (Aggregation::SeqMeanTokenSum, "seq-mean-token-sum"),
            (Aggregation::SeqMeanTokenSumNorm, "seq-mean-token-sum-norm"),
        ] {
            let ours = aggregate(&loss, &mask, how, norm)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let theirs = p["policy_loss"][key].as_f64().unwrap();
            assert!(
                close(ours as f64, theirs, 1e-6),
                "{key}: ours {ours}, verl {theirs}"
            );
        }
        let frac = aggregate(&clipped, &mask, Aggregation::TokenMean, 0.0).unwrap();
        let theirs = p["clip_fraction"].as_f64().unwrap();
        assert!(close(frac.to_scalar::<f32>().unwrap() as f64, theirs, 1e-6));
        assert!(
            theirs > 0.1 && theirs < 0.9,
            "the batch clips some tokens, not all"
        );
        let flat = |t: Tensor| -> Vec<f64> {
            t.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .into_iter()
                .map(f64::from)
                .collect()
        };
        let kls = &p["kl"];
        let flat_ref =
            |k: &str| -> Vec<f64> { kls[k].as_array().unwrap().iter().flat_map(floats).collect() };
        for (est, keys) in [
            (KlEstimator::K1, &["rl2_k1", "verl_k1"][..]),
            (KlEstimator::K2, &["rl2_k2"][..]),
            // verl's low_var_kl is k3 clamped to [-10, 10]; nothing here reaches the clamp.
            (KlEstimator::K3, &["rl2_k3", "verl_low_var_kl"][..]),
        ] {
            let ours = flat(kl(&logps, &refs, est).unwrap());
            for key in keys {
                assert_all_close(&ours, &flat_ref(key), 1e-5, key);
            }
        }
    }

    /// GAE over action tokens with masked spans, verl's whitening and the clipped value
    /// loss, against verl's and RL2's functions on the fixture batch.
    #[test]
    fn gae_and_the_value_loss_match_verl_and_rl2() {
        let p = peers();
        let q = &p["ppo"];
        let rows =
            |k: &str| -> Vec<Vec<f64>> { q[k].as_array().unwrap().iter().map(floats).collect() };
        let mask: Vec<Vec<bool>> = p["mask"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| floats(r).into_iter().map(|x| x > 0.0).collect())
            .collect();
        let (rewards, values) = (rows("token_rewards"), rows("old_values"));
        let (gamma, lam) = (q["gamma"].as_f64().unwrap(), q["lam"].as_f64().unwrap());
        let (mut advs, mut rets) = (Vec::new(), Vec::new());
        for i in 0..rewards.len() {
            let (a, r) = gae(&rewards[i], &values[i], &mask[i], gamma, lam);
            advs.push(a);
            rets.push(r);
        }
        let verl_returns = rows("verl_returns");
        let rl2_returns = rows("rl2_returns_packed");
        for i in 0..rets.len() {
            let ours: Vec<f64> = (0..rets[i].len())
                .filter(|&t| mask[i][t])
                .map(|t| rets[i][t])
                .collect();
            let verl: Vec<f64> = (0..rets[i].len())
                .filter(|&t| mask[i][t])
                .map(|t| verl_returns[i][t])
                .collect();
            assert_all_close(&ours, &verl, 1e-12, "returns vs verl");
            assert_all_close(
                &ours,
                &rl2_returns[i][..ours.len()],
                1e-12,
                "returns vs RL2",
            );
        }
        whiten(&mut advs, &mask);
        let verl_adv = rows("verl_whitened_advantages");
        for i in 0..advs.len() {
            for t in (0..advs[i].len()).filter(|&t| mask[i][t]) {
                assert!(close(advs[i][t], verl_adv[i][t], 1e-9), "row {i} token {t}");
            }
        }
        let (v, old) = (matrix(&q["values"]), matrix(&q["old_values"]));
        let ret = matrix(&q["verl_returns"]);
        let m = matrix(&p["mask"]);
        let (loss, used) = value_loss(&v, &old, &ret, q["value_clip"].as_f64().unwrap()).unwrap();
        let ours = aggregate(&loss, &m, Aggregation::TokenMean, 0.0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let verl = q["verl_value_loss_token_mean"].as_f64().unwrap();
        assert!(
            close(ours as f64, verl, 1e-6),
            "value loss ours {ours}, verl {verl}"
        );
        let frac = aggregate(&used, &m, Aggregation::TokenMean, 0.0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let verl = q["verl_value_clip_fraction"].as_f64().unwrap();
        assert!(
            close(frac as f64, verl, 1e-6) && verl > 0.0,
            "clip fraction {frac} vs {verl}"
        );
    }

    #[test]
    fn overlong_penalty_ramps_linearly() {
        assert_eq!(overlong_penalty(80, 100, 20), 0.0);
        assert_eq!(overlong_penalty(90, 100, 20), -0.5);
        assert_eq!(overlong_penalty(100, 100, 20), -1.0);
        assert_eq!(overlong_penalty(101, 100, 20), -1.0);
    }

    /// k1 = d, k2 = d²/2, k3 = e^{-d} − 1 + d with d = logp − ref:
    /// ```python
    /// import math; d = -0.3 - (-0.5)     # 0.2
    /// d, d*d/2, math.exp(-d) - 1 + d      # 0.2, 0.02, 0.018730753077981832
    /// ```
    #[test]
    fn kl_estimators_match_and_have_the_right_sign() {
        let logp = t2(&[&[-0.3]]);
        let r = t2(&[&[-0.5]]);
        let v = |e| kl(&logp, &r, e).unwrap().to_vec2::<f32>().unwrap()[0][0] as f64;
        assert!(close(v(KlEstimator::K1), 0.2, 1e-6));
        assert!(close(v(KlEstimator::K2), 0.02, 1e-5));
        assert!(close(v(KlEstimator::K3), 0.018730753077981832, 1e-5));
        // The policy more likely than the reference: KL terms are positive.
        assert!(v(KlEstimator::K1) > 0.0 && v(KlEstimator::K3) > 0.0);
    }

    /// Clipped surrogate and aggregations on a 2 x 3 batch, against:
    /// ```python
    /// import math
    /// lp = [[-1.0, -0.5, -2.0], [-0.2, -1.5, -0.9]]; old = [[-1.2, -0.5, -1.0], [-0.2, -1.0, -0.9]]
    /// A = [1.0, -2.0]; mask = [[1, 1, 1], [1, 1, 0]]; lo, hi = 0.2, 0.28
    /// def tok(i, t):
    ///     r = math.exp(lp[i][t] - old[i][t]); a = A[i]
    ///     return -min(r * a, min(max(r, 1 - lo), 1 + hi) * a)
    /// L = [[tok(i, t) for t in range(3)] for i in range(2)]
    /// tm = sum(L[i][t] * mask[i][t] for i in range(2) for t in range(3)) / 5
    /// sm = sum(sum(L[i][t] * mask[i][t] for t in range(3)) / sum(mask[i]) for i in range(2)) / 2
    /// sn = sum(L[i][t] * mask[i][t] for i in range(2) for t in range(3)) / (2 * 4)
    /// ss = sum(sum(L[i][t] * mask[i][t] for t in range(3)) for i in range(2)) / 2  # verl
    /// # L = [[-1.2214027581601699, -1.0, -0.36787944117144233], [2.0, 1.6, 2.0]]
    /// ```
    /// (row 1, token 1: ratio e^-0.5 = 0.607 < 0.8 with A < 0, so the clipped term wins.)
    #[test]
    fn clipped_surrogate_and_aggregation_match_the_reference() {
        let lp = Var::from_tensor(&t2(&[&[-1.0, -0.5, -2.0], &[-0.2, -1.5, -0.9]])).unwrap();
        let old = t2(&[&[-1.2, -0.5, -1.0], &[-0.2, -1.0, -0.9]]);
        let adv = Tensor::new(&[[1f32], [-2.0]], &Device::Cpu).unwrap();
        let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
        let (loss, clipped) = clipped_surrogate(lp.as_tensor(), &old, &adv, 0.2, 0.28).unwrap();
        let l = loss.to_vec2::<f32>().unwrap();
        let r = |a: f64, b: f64| (a - b).exp();
        let tok = |lp: f64, old: f64, a: f64| {
            let ratio = r(lp, old);
            -(ratio * a).min(ratio.clamp(0.8, 1.28) * a)
        };
        let ref_l = [
            [
                tok(-1.0, -1.2, 1.0),
                tok(-0.5, -0.5, 1.0),
                tok(-2.0, -1.0, 1.0),
            ],
            [
                tok(-0.2, -0.2, -2.0),
                tok(-1.5, -1.0, -2.0),
                tok(-0.9, -0.9, -2.0),
            ],
        ];
        for i in 0..2 {
            for t in 0..3 {
                assert!(
                    close(l[i][t] as f64, ref_l[i][t], 1e-6),
                    "{l:?} vs {ref_l:?}"
                );
            }
        }
        // Row 1 token 1 is clipped: ratio 0.6065 < 0.8 with a negative advantage.
        let c = clipped.to_vec2::<f32>().unwrap();
        assert_eq!(c, [[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]);
        let m = |i: usize, t: usize| mask.to_vec2::<f32>().unwrap()[i][t] as f64;
        let sum: f64 = (0..2)
            .flat_map(|i| (0..3).map(move |t| (i, t)))
            .map(|(i, t)| ref_l[i][t] * m(i, t))
            .sum();
        let tm = aggregate(&loss, &mask, Aggregation::TokenMean, 0.0).unwrap();
        assert!(close(
            tm.to_scalar::<f32>().unwrap() as f64,
            sum / 5.0,
            1e-6
        ));
        let seq0 = (0..3).map(|t| ref_l[0][t]).sum::<f64>() / 3.0;
        let seq1 = (ref_l[1][0] + ref_l[1][1]) / 2.0;
        let sm = aggregate(&loss, &mask, Aggregation::SeqMeanTokenMean, 0.0).unwrap();
        assert!(close(
            sm.to_scalar::<f32>().unwrap() as f64,
            (seq0 + seq1) / 2.0,
            1e-6
        ));
        // verl's seq-mean-token-sum: each row's masked sum, averaged over rows.
        let ss = aggregate(&loss, &mask, Aggregation::SeqMeanTokenSum, 0.0).unwrap();
        assert!(close(
            ss.to_scalar::<f32>().unwrap() as f64,
            (seq0 * 3.0 + seq1 * 2.0) / 2.0,
            1e-6
        ));
        let sn = aggregate(&loss, &mask, Aggregation::SeqMeanTokenSumNorm, 4.0).unwrap();
        assert!(close(
            sn.to_scalar::<f32>().unwrap() as f64,
            sum / 8.0,
            1e-6
        ));
        // Gradients flow to logps only where the surrogate is not clipped.
        let grads = tm.backward().unwrap();
        let g = grads.get(lp.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(g[1][1], 0.0, "clipped token has no gradient");
        assert_eq!(g[1][2], 0.0, "masked token has no gradient");
        assert!(close(g[0][0] as f64, -r(-1.0, -1.2) / 5.0, 1e-5));
    }

    #[test]
    fn truncated_is_caps_the_weight_and_has_no_gradient() {
        let old = t2(&[&[-0.1, -2.0]]);
        let behavior = t2(&[&[-1.1, -2.0]]);
        let w = truncated_is(&old, &behavior, 2.0)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert!(close(w[0][0] as f64, 2.0, 1e-6), "e^1 = 2.718 capped at 2");
        assert!(close(w[0][1] as f64, 1.0, 1e-6));
    }
    /// The tree of docs/design/tree-advantages.md's examples: root → A, B; A → a1 (1),
    /// a2 (0); B → b1 (0), b2 (0). Nodes: 0 root, 1 A, 2 B, 3 a1, 4 a2, 5 b1, 6 b2.
    fn example_tree() -> RolloutTree {
        RolloutTree::new(
            vec![None, Some(0), Some(0), Some(1), Some(1), Some(2), Some(2)],
            vec![None, None, None, Some(1.0), Some(0.0), Some(0.0), Some(0.0)],
        )
        .unwrap()
    }

    #[test]
    fn a_tree_is_checked_when_built() {
        let t = |p: Vec<Option<usize>>, r: Vec<Option<f64>>| RolloutTree::new(p, r).unwrap_err();
        assert!(t(vec![None, Some(0)], vec![None]).contains("one parent and one reward"));
        assert!(t(vec![None, None], vec![None, Some(1.0)]).contains("node 1 has no parent"));
        assert!(
            t(vec![None, Some(2), Some(0)], vec![None, Some(1.0), None])
                .contains("not listed before")
        );
        assert!(t(vec![None, Some(0)], vec![None, None]).contains("leaf 1 has no reward"));
        assert!(
            t(
                vec![None, Some(0), Some(1)],
                vec![None, Some(1.0), Some(0.0)]
            )
            .contains("children and a reward")
        );
        assert!(t(vec![None], vec![None]).contains("root is a leaf"));
        assert!(t(vec![None, Some(0)], vec![None, Some(f64::NAN)]).contains("not finite"));
    }

    #[test]
    fn node_values_are_the_mean_of_their_leaves() {
        let tree = example_tree();
        let (count, v) = tree.values();
        assert_eq!(count, vec![4, 2, 2, 1, 1, 1, 1]);
        assert_eq!(v, vec![0.25, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0]);
        assert_eq!(tree.leaves(), vec![3, 4, 5, 6]);
        assert_eq!(tree.path(4), vec![1, 4]);
    }

    /// By hand: V(root) = 0.25, V(A) = 0.5, V(B) = 0.
    /// A: (0.5 − 0.25) + (0.5 − 0.25) = 0.5, reweighted 0.5/√2; B: −0.5, −0.5/√2;
    /// a1: (1 − 0.25) + (1 − 0.5) = 1.25; a2: −0.25 − 0.5 = −0.75; b1, b2: −0.25 + 0.
    #[test]
    fn treerl_advantages_by_hand() {
        let tree = example_tree();
        let a = treerl_advantages(&tree, false);
        assert_eq!(a, vec![0.0, 0.5, -0.5, 1.25, -0.75, -0.25, -0.25]);
        let w = treerl_advantages(&tree, true);
        let h = std::f64::consts::FRAC_1_SQRT_2;
        for (got, want) in w
            .iter()
            .zip([0.0, 0.5 * h, -0.5 * h, 1.25, -0.75, -0.25, -0.25])
        {
            assert!(close(*got, want, 1e-12), "{w:?}");
        }
    }

    /// By hand: rewards 1, 0, 0, 0: mean 0.25, unbiased std √((0.75² + 3·0.25²)/3) = 0.5;
    /// with ε = 1e-4: 0.75/0.5001 and −0.25/0.5001.
    #[test]
    fn leaf_grpo_by_hand() {
        let a = leaf_grpo_advantages(&example_tree(), 1e-4);
        let want = [
            0.75 / 0.5001,
            -0.25 / 0.5001,
            -0.25 / 0.5001,
            -0.25 / 0.5001,
        ];
        for (got, want) in a.iter().zip(want) {
            assert!(close(*got, want, 1e-12), "{a:?}");
        }
    }

    /// By hand, with a second tree of the same prompt whose leaves are 1, 1, 1, 0
    /// (mean 0.75, unbiased std 0.5): intra +1.5 / −0.5 in the first tree, +0.5 / −1.5
    /// in the second; inter over all eight (mean 0.5, std √(2/7)): ±0.5/√(2/7) = ±0.935414.
    #[test]
    fn tree_grpo_by_hand() {
        let second = RolloutTree::new(
            vec![None, Some(0), Some(0), Some(1), Some(1), Some(2), Some(2)],
            vec![None, None, None, Some(1.0), Some(1.0), Some(1.0), Some(0.0)],
        )
        .unwrap();
        let a = tree_grpo_advantages(&[example_tree(), second], 0.0);
        let inter = 0.5 / (2.0f64 / 7.0).sqrt();
        let want = [
            vec![1.5 + inter, -0.5 - inter, -0.5 - inter, -0.5 - inter],
            vec![0.5 + inter, 0.5 + inter, 0.5 + inter, -1.5 - inter],
        ];
        for (got, want) in a.iter().flatten().zip(want.iter().flatten()) {
            assert!(close(*got, *want, 1e-12), "{a:?}");
        }
        // A tree of one leaf has no sibling: its intra score is 0, its inter score stays.
        let lone = RolloutTree::new(vec![None, Some(0)], vec![None, Some(1.0)]).unwrap();
        let a = tree_grpo_advantages(&[lone, example_tree()], 0.0);
        let all = [1.0, 1.0, 0.0, 0.0, 0.0];
        let (m, sd) = (
            0.4,
            (all.iter().map(|r| (r - 0.4f64).powi(2)).sum::<f64>() / 4.0).sqrt(),
        );
        assert!(close(a[0][0], (1.0 - m) / sd, 1e-12), "{a:?}");
    }

    /// Leaf-GRPO's advantages (1.5, −0.5, −0.5, −0.5 at ε = 0) taken to the segments:
    /// A is the mean of a1 and a2 (0.5), B of b1 and b2 (−0.5), each leaf its own.
    #[test]
    fn a_shared_segment_trained_once_takes_its_leaves_mean() {
        let tree = example_tree();
        let leaf = leaf_grpo_advantages(&tree, 0.0);
        let seg = per_segment_from_leaves(&tree, &leaf);
        let want = [0.0, 0.5, -0.5, 1.5, -0.5, -0.5, -0.5];
        for (got, want) in seg.iter().zip(want) {
            assert!(close(*got, want, 1e-12), "{seg:?}");
        }
    }
}
