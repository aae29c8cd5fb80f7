#!/usr/bin/env python3
"""QLoRA against f32, rlhost against itself, side by side in one run: the LoRA training
step and greedy decoding of a Qwen2.5-0.5B-shaped model with its projections in f32 and
in NF4 (`model.quantize = "nf4"`, double-quantized absmax), time and peak RSS.

Not a test: run by developers on a quiet machine, numbers go in the README and notes.

    python3 -m venv /tmp/benchvenv
    /tmp/benchvenv/bin/pip install torch transformers safetensors   # to make the model once
    cargo build --release -p rlhost --example model_bench
    /tmp/benchvenv/bin/python bench/qlora_speed.py [--threads 2] [--small] [--rounds 2]

The model and the measurements are those of bench/model_speed.py (same random model
under bench/.work, same worker, each measurement in its own process with its peak RSS
from wait4). The NF4 process loads the f32 checkpoint and quantizes it; the figure
compared is the peak of the measured phase alone (`VmHWM` reset through
/proc/self/clear_refs after loading, which resets wait4's peak too), with the RSS when
the phase starts (the weights). The training
step is measured with activations kept and with `gradient_checkpointing` (each layer
recomputed in the backward, the head's logits too), both sides alike.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_speed import BIN, WORK, make_model, run  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="4 layers instead of 24 (quick check)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating training-step rounds")
    args = ap.parse_args()
    if not os.path.exists(BIN):
        sys.exit(f"{BIN} missing: cargo build --release -p rlhost --example model_bench")
    layers = 4 if args.small else 24
    model = os.path.join(WORK, f"qwen2.5-0.5b-shape-{layers}l")
    make_model(model, layers)
    t = args.threads

    def show(name, f32, nf4, key):
        print(f"{name:<36} f32 {f32[key]:9.3f}   nf4 {nf4[key]:9.3f}   nf4/f32 {nf4[key] / f32[key]:5.2f}", flush=True)

    for b in (1, 8):
        f32 = run([BIN, "decode", "--model", model, "--batch", str(b)], t)
        nf4 = run([BIN, "decode", "--model", model, "--batch", str(b), "--quantize", "nf4"], t)
        show(f"greedy decode tokens/s, batch {b}", f32, nf4, "tokens_per_s")
        show(f"  peak RSS while decoding, GB", f32, nf4, "phase_peak_rss_gb")
    for ckpt in (0, 1):
        label = "recomputed (gradient_checkpointing)" if ckpt else "activations kept"
        rounds = []
        for i in range(max(1, args.rounds)):
            extra = ["--checkpointing", str(ckpt)]
            f32 = run([BIN, "train", "--model", model] + extra, t)
            nf4 = run([BIN, "train", "--model", model, "--quantize", "nf4"] + extra, t)
            rounds.append((f32, nf4))
            print(f"  {label}, round {i + 1}: f32 {f32['step_seconds']:.2f} s {f32['phase_peak_rss_gb']:.2f} GB, "
                  f"nf4 {nf4['step_seconds']:.2f} s {nf4['phase_peak_rss_gb']:.2f} GB", flush=True)
        keys = ("step_seconds", "phase_peak_rss_gb", "start_rss_gb")
        med = lambda side, k: statistics.median(r[side][k] for r in rounds)  # noqa: E731
        f32 = {k: med(0, k) for k in keys}
        nf4 = {k: med(1, k) for k in keys}
        print(f"LoRA r16 step 4x256, {label}:")
        show("  seconds", f32, nf4, "step_seconds")
        show("  peak RSS of the steps, GB", f32, nf4, "phase_peak_rss_gb")
        show("  RSS before the steps (weights), GB", f32, nf4, "start_rss_gb")


if __name__ == "__main__":
    main()
