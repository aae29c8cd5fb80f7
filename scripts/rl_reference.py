#!/usr/bin/env python3
"""Reference numbers for rlhost's RL math, made by the peers' own functions.

It writes tests/fixtures/rl_reference.json: one fixed batch (rewards in groups, per-token
log-probs under the current, old and reference policies, a loss mask with masked spans)
and what these compute from it:

* verl (`verl.trainer.ppo.core_algos`): GRPO and Dr. GRPO advantages
  (`compute_grpo_outcome_advantage`, with and without `norm_adv_by_std_in_grpo`), RLOO
  (`compute_rloo_outcome_advantage`), the clipped surrogate under each loss aggregation
  (`compute_policy_loss_vanilla` with `clip_ratio_low/high`, which calls `agg_loss`), and
  the KL penalties (`kl_penalty`: k1 and "low_var_kl", i.e. k3 clamped to [-10, 10]).
* RL2 (`RL2/utils/algorithms.py`, from a checkout given with --rl2): REINFORCE with the
  batch baseline and std (`_compute_reinforce_adv(global_norm=True, norm_var=True)`),
  and `compute_approx_kl` with k1, k2, k3.
* PPO: GAE and returns over the action tokens only (verl's
  `compute_gae_advantage_return` with `masked_whiten`, RL2's `_compute_gae` on packed
  action tokens) and verl's clipped `compute_value_loss`.
* TRL's `scale_rewards = "batch"` (group mean subtracted, the batch's std + 1e-4
  dividing) has no function of its own in TRL (it is inline in
  `GRPOTrainer._generate_and_score_completions`), so it is computed here with torch from
  verl's group means, as TRL does.

It is run by developers, not by CI (rlhost's tests read the JSON):

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch numpy packaging ray tensordict omegaconf \
        transformers codetiming orjson
    /tmp/refvenv/bin/pip install --no-deps verl
    # RL2 is not on PyPI: a checkout of github.com/ChenmienTan/RL2
    /tmp/refvenv/bin/python scripts/rl_reference.py --rl2 /path/to/RL2 [--out FILE]

RL2's algorithms module imports wandb, omegaconf and its own data code at the top; the
functions used here need none of them, so those imports are given empty stand-ins.

Last run with: torch==2.15.0 verl==0.9.1 numpy==2.4.6, RL2 at commit 9161ede (Python
3.11.7, CPU).
"""

import argparse
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import torch

torch.set_default_dtype(torch.float64)


def load_rl2(root: Path):
    """RL2's algorithms module with its unused top-level imports stood in for."""
    for name in ["wandb", "RL2", "RL2.datasets", "RL2.utils", "RL2.utils.functions", "RL2.utils.logging"]:
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["RL2.datasets"].pack_tensor_dicts = None
    sys.modules["RL2.utils.functions"].aggregate_values = None
    sys.modules["RL2.utils.logging"].time_logger = lambda _name: (lambda f: f)
    path = root / "RL2" / "utils" / "algorithms.py"
    spec = importlib.util.spec_from_file_location("rl2_algorithms", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batch():
    """Two groups of four trajectories, seven token positions each; masked spans stand
    for prompt padding and tool output. Log-probs are fixed numbers, not a model's."""
    g = torch.Generator().manual_seed(21)
    rewards = [[1.0, 0.0, 0.5, 1.0], [0.0, 0.0, 0.25, 1.0]]
    b, t = 8, 7
    old = -torch.rand(b, t, generator=g) * 2.0 - 0.1
    # The current policy moved from the old one by up to ±0.4 per token: some ratios
    # leave [0.8, 1.28] and are clipped, most stay inside.
    logps = old + (torch.rand(b, t, generator=g) - 0.5) * 0.8
    ref = old + (torch.rand(b, t, generator=g) - 0.5) * 0.6
    mask = torch.ones(b, t)
    mask[0, 5:] = 0  # short answer
    mask[1, 2:4] = 0  # a tool's output
    mask[4, 0] = 0
    mask[6, 3:6] = 0
    mask[7, 6] = 0
    return rewards, old, logps, ref, mask


def ppo(verl, rl2, rewards, logps, ref, mask):
    """GAE, returns and the clipped value loss on the batch's action tokens (mask 1; the
    masked spans stand for prompt and tool output, which are not actions). Token rewards:
    the outcome reward on each row's last action, and −β·k1 to the reference on every
    action (KL in the reward)."""
    g = torch.Generator().manual_seed(5)
    flat = torch.tensor([r for grp in rewards for r in grp])
    b, t = mask.shape
    gamma, lam, beta, clip = 0.99, 0.95, 0.05, 0.2
    values = torch.rand(b, t, generator=g) - 0.5
    new_values = values + (torch.rand(b, t, generator=g) - 0.5) * 0.8
    token_rewards = -beta * verl.kl_penalty(logps, ref, "k1") * mask
    last = [max(i for i in range(t) if mask[row, i] > 0) for row in range(b)]
    for row, i in enumerate(last):
        token_rewards[row, i] += flat[row]
    whitened, returns = verl.compute_gae_advantage_return(token_rewards, values, mask, torch.tensor(gamma), torch.tensor(lam))
    # RL2 runs GAE on each row's action tokens packed together (right-padded).
    packed = lambda x: torch.nn.utils.rnn.pad_sequence([x[r][mask[r] > 0] for r in range(b)], batch_first=True)
    rl2_out = rl2._compute_gae(
        {"old_values": packed(values), "rewards": packed(token_rewards), "action_mask": packed(mask)}, gamma, lam
    )
    vf_loss, vf_clipfrac = verl.compute_value_loss(new_values, returns, values, mask, clip, loss_agg_mode="token-mean")
    return {
        "gamma": gamma,
        "lam": lam,
        "value_clip": clip,
        "token_rewards": token_rewards.tolist(),
        "old_values": values.tolist(),
        "values": new_values.tolist(),
        "verl_returns": returns.tolist(),
        "verl_whitened_advantages": whitened.tolist(),
        "rl2_returns_packed": rl2_out["returns"].tolist(),
        "verl_value_loss_token_mean": float(vf_loss),
        "verl_value_clip_fraction": float(vf_clipfrac),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rl2", type=Path, required=True, help="a checkout of ChenmienTan/RL2")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests/fixtures/rl_reference.json")
    args = ap.parse_args()

    from verl.trainer.ppo import core_algos as verl
    from verl.workers.config.actor import ActorConfig

    rl2 = load_rl2(args.rl2)
    rewards, old, logps, ref, mask = batch()
    flat = torch.tensor([r for grp in rewards for r in grp])
    index = np.array([i for i, grp in enumerate(rewards) for _ in grp])
    # Outcome rewards sit on the last response token (verl sums them over the response).
    token_rewards = torch.zeros_like(mask)
    token_rewards[:, -1] = flat
    ones = torch.ones_like(mask)
    out = {
        "rewards": rewards,
        "old_logps": old.tolist(),
        "logps": logps.tolist(),
        "ref_logps": ref.tolist(),
        "mask": mask.tolist(),
        "clip_low": 0.2,
        "clip_high": 0.28,
        "norm_constant": 16.0,
    }

    adv = {}
    a, _ = verl.compute_grpo_outcome_advantage(token_rewards, ones, index, epsilon=1e-4)
    adv["grpo"] = a[:, 0].tolist()
    a, _ = verl.compute_grpo_outcome_advantage(token_rewards, ones, index, epsilon=1e-4, norm_adv_by_std_in_grpo=False)
    adv["dr_grpo"] = a[:, 0].tolist()
    a, _ = verl.compute_rloo_outcome_advantage(token_rewards, ones, index)
    adv["rloo"] = a[:, 0].tolist()
    r = rl2._compute_reinforce_adv({"rewards": token_rewards, "action_mask": ones}, 4, True, True)
    adv["rl2_reinforce_global_norm"] = r["advantages"][:, 0].tolist()
    group_mean = flat.view(-1, 4).mean(dim=1).repeat_interleave(4)
    adv["trl_batch_scale"] = ((flat - group_mean) / (flat.std() + 1e-4)).tolist()
    out["advantages"] = adv

    # The policy loss under each aggregation, with the GRPO advantages. verl's vanilla loss
    # also caps negative-advantage losses at 3·|A| (dual clip); ratios here stay below
    # e^0.4 < 3, so it never binds and the loss is the plain clipped surrogate.
    config = ActorConfig(
        strategy="fsdp",
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        # What verl's actor hands agg_loss: Dr. GRPO's constant for the -norm mode.
        global_batch_info={"loss_scale_factor": out["norm_constant"]},
    )
    grpo = torch.tensor(adv["grpo"]).unsqueeze(1).expand_as(mask)
    losses = {}
    for mode in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        loss, metrics = verl.compute_policy_loss_vanilla(old, logps, grpo, mask, loss_agg_mode=mode, config=config)
        losses[mode] = float(loss)
        if mode == "token-mean":
            out["clip_fraction"] = float(metrics["actor/pg_clipfrac"])
    out["policy_loss"] = losses

    out["kl"] = {
        "verl_k1": verl.kl_penalty(logps, ref, "k1").tolist(),
        "verl_low_var_kl": verl.kl_penalty(logps, ref, "low_var_kl").tolist(),
        "rl2_k1": rl2.compute_approx_kl(logps, ref, "k1").tolist(),
        "rl2_k2": rl2.compute_approx_kl(logps, ref, "k2").tolist(),
        "rl2_k3": rl2.compute_approx_kl(logps, ref, "k3").tolist(),
    }
    out["ppo"] = ppo(verl, rl2, rewards, logps, ref, mask)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
