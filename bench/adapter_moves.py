"""What moved the weights (issue 63): how far each update of a LoRA run moved the model.

Usage: adapter_moves.py MODEL_DIR CHECKPOINT [CHECKPOINT ...]

For each checkpoint of a run (`<out>/checkpoints/step-NNNNNN`, in step order) prints:
- the adapter's weight change, `|ΔW| / |W|`, with ΔW = (alpha / r) · B · A and W the base
  model's weight, median and largest over the adapted modules, and for each checkpoint after
  the first the same of the update between it and the one before;
- Adam's step per coordinate in units of the learning rate, `|m̂| / (√v̂ + eps)` from the
  optimizer state the checkpoint holds (bias-corrected at its `optimizer_step`): close to 1
  on most coordinates means that every weight moved by about the learning rate whatever its
  gradient, noise included, as Adam's first steps do.

A benchmark's tool, not a test: nothing is asserted. It needs numpy and safetensors (any
of the project's venvs has them, e.g. `~/.cache/rlhost/tinker-venv/bin/python`). Run with
`train.save_every = 1` (and, for an early step, `--stop-after N`) to keep the checkpoints.
"""

import json
import os
import sys

import numpy as np
from safetensors.numpy import load_file

BETA1, BETA2, EPS = 0.9, 0.999, 1e-8


def base_weights(model_dir):
    """The base model's tensors, from one or several safetensors files."""
    out = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(model_dir, name)))
    if not out:
        sys.exit(f"{model_dir}: no .safetensors file (the run's model.path)")
    return out


def deltas(checkpoint):
    """Each adapted module's ΔW = scale · B · A, named as the base model names it."""
    cfg = json.load(open(os.path.join(checkpoint, "adapter_config.json")))
    rank = cfg["r"]
    scale = cfg["lora_alpha"] / (rank**0.5 if cfg.get("use_rslora") else rank)
    tensors = load_file(os.path.join(checkpoint, "adapter_model.safetensors"))
    out = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        out[name] = scale * (b.astype(np.float64) @ a.astype(np.float64))
    return out


def adam_steps(checkpoint):
    """|m̂| / (√v̂ + eps) over every coordinate of the optimizer's state."""
    path = os.path.join(checkpoint, "optimizer.safetensors")
    if not os.path.exists(path):
        return None
    t = json.load(open(os.path.join(checkpoint, "trainer_state.json")))["optimizer_step"]
    state = load_file(path)
    ratios = []
    for key, m in state.items():
        if key.startswith("exp_avg."):
            v = state["exp_avg_sq." + key.removeprefix("exp_avg.")]
            m_hat = m.astype(np.float64) / (1 - BETA1**t)
            v_hat = v.astype(np.float64) / (1 - BETA2**t)
            ratios.append((np.abs(m_hat) / (np.sqrt(v_hat) + EPS)).ravel())
    return np.concatenate(ratios) if ratios else None


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    base = base_weights(sys.argv[1])
    norms = {}
    before = None
    for ck in sys.argv[2:]:
        d = deltas(ck)
        missing = [n for n in d if n not in base]
        if missing:
            sys.exit(f"{ck}: {missing[0]} is not a weight of {sys.argv[1]} (another run's model?)")
        for n in d:
            norms.setdefault(n, np.linalg.norm(base[n].astype(np.float64)))
        rel = {n: np.linalg.norm(d[n]) / norms[n] for n in d}
        top = max(rel, key=rel.get)
        line = f"{os.path.basename(ck.rstrip('/'))}: |ΔW|/|W| median {np.median(list(rel.values())):.3f}, largest {rel[top]:.3f} ({top})"
        if before is not None:
            step = {n: np.linalg.norm(d[n] - before[n]) / norms[n] for n in d}
            line += f"; this update median {np.median(list(step.values())):.3f}, largest {max(step.values()):.3f}"
        r = adam_steps(ck)
        if r is not None:
            line += f"; Adam's step / lr: median {np.median(r):.2f}, share over 0.5 {np.mean(r > 0.5):.2f}"
        print(line)
        before = d


if __name__ == "__main__":
    main()
