#!/usr/bin/env python3
"""A DPO step, rlhost against TRL's `DPOTrainer` with PEFT, side by side in one run: time
and peak RSS on the CPU (issue 65).

Not a test: run by developers on a quiet machine, numbers go in docs/src/benchmarks.md.

    python3 -m venv /tmp/dpovenv
    /tmp/dpovenv/bin/pip install torch transformers peft trl accelerate datasets safetensors
    cargo build --release -p rlhost --example model_bench
    /tmp/dpovenv/bin/python bench/dpo_speed.py [--threads 2] [--small] [--rounds 3]

Both sides take the same step on the same random model of Qwen2.5-0.5B's shape (that of
bench/model_speed.py, under bench/.work; --small: 4 layers): LoRA r16 (alpha 32) on all
seven projections, the sigmoid loss with beta 0.1, one optimizer step (AdamW, lr 1e-4,
gradients clipped at 1.0) over --pairs pairs whose chosen and rejected replies are
--reply-len tokens after a shared --prompt-len-token prompt, in f32. The reference
log-probs are the model with its adapter off on both sides: TRL does so itself for a
PEFT model without a `ref_model` (`use_adapter`/`null_ref_context`), rlhost always.
TRL's step is `Trainer.training_step` on a batch its own collator made from the ids, with
`precompute_ref_log_probs` off (the reference forward is inside the step, as in rlhost),
and the optimizer's step and `zero_grad` after it. The two alternate for --rounds runs,
each measurement in its own process with its peak RSS from wait4(); the medians are
compared and each round's ratio printed.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_speed import BIN, ROOT, WORK, make_model, run  # noqa: E402


def ids(n, salt):
    """Token ids below 500 from a fixed linear congruential sequence (the model is random)."""
    s = (0x2545F4914F6CDD1D ^ salt) & (2**64 - 1)
    out = []
    for _ in range(n):
        s = (s * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
        out.append((s >> 33) % 500)
    return out


def trl_worker(args):
    """Runs inside a child process: TRL's DPO step on a PEFT model."""
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    # The random model has no tokenizer; the trainer wants one to exist, and the batch is
    # collated from ids, so the fixture's serves.
    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "tests/fixtures/models/qwen2"))
    config = DPOConfig(
        output_dir=os.path.join(WORK, "trl-dpo"),
        loss_type=["sigmoid"],
        beta=0.1,
        learning_rate=1e-4,
        max_grad_norm=1.0,
        per_device_train_batch_size=args.pairs,
        max_length=None,
        report_to=[],
        use_cpu=True,
        bf16=False,
        precompute_ref_log_probs=False,
    )
    trainer = DPOTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_list([{"prompt": "1+1=", "chosen": "2", "rejected": "3"}]),
        processing_class=tok,
    )
    rows = []
    for i in range(args.pairs):
        rows.append({"prompt_ids": ids(args.prompt_len, 100 + i),
                     "chosen_ids": ids(args.reply_len, 200 + i),
                     "rejected_ids": ids(args.reply_len, 300 + i)})
    batch = trainer.data_collator(rows)
    trainer.create_optimizer_and_scheduler(num_training_steps=args.steps + 1)
    opt = trainer.optimizer
    # What Trainer's own loop sets before its first step (no accumulation here).
    trainer.current_gradient_accumulation_steps = 1
    times = []
    for step in range(args.steps + 1):
        t = time.perf_counter()
        loss = trainer.training_step(trainer.model, batch)
        torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t
        print(f"step {step}: loss {float(loss):.4f}, {elapsed:.2f} s", file=sys.stderr, flush=True)
        if step > 0:
            times.append(elapsed)
    print(json.dumps({"impl": "trl", "mode": "dpo", "step_seconds": sum(times) / len(times),
                      "steps": times}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="4 layers instead of 24 (quick check)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--reply-len", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--model")
    args = ap.parse_args()
    if args.worker:
        return trl_worker(args)
    if not os.path.exists(BIN):
        sys.exit(f"{BIN} missing: cargo build --release -p rlhost --example model_bench")
    layers = 4 if args.small else 24
    model = os.path.join(WORK, f"qwen2.5-0.5b-shape-{layers}l")
    make_model(model, layers)
    shape = ["--pairs", str(args.pairs), "--prompt-len", str(args.prompt_len),
             "--reply-len", str(args.reply_len), "--rank", str(args.rank), "--steps", str(args.steps)]
    ours_cmd = [BIN, "dpo", "--model", model] + shape
    theirs_cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model,
                  "--threads", str(args.threads)] + shape
    print(f"DPO step, {args.pairs} pairs of {args.prompt_len} + 2 x {args.reply_len} tokens, "
          f"LoRA r{args.rank}, {layers} layers, {args.threads} threads", flush=True)
    rounds = []
    for i in range(max(1, args.rounds)):
        ours = run(ours_cmd, args.threads)
        theirs = run(theirs_cmd, args.threads)
        rounds.append({"rlhost": ours, "trl": theirs})
        print(f"  round {i + 1}: rlhost {ours['step_seconds']:.2f} s ({ours['peak_rss_gb']:.2f} GB), "
              f"TRL + PEFT {theirs['step_seconds']:.2f} s ({theirs['peak_rss_gb']:.2f} GB), "
              f"ratio {theirs['step_seconds'] / ours['step_seconds']:.2f}x", flush=True)
    med = {side: {k: statistics.median([r[side][k] for r in rounds]) for k in ("step_seconds", "peak_rss_gb")}
           for side in ("rlhost", "trl")}
    print(f"step seconds: rlhost {med['rlhost']['step_seconds']:.2f}, TRL + PEFT "
          f"{med['trl']['step_seconds']:.2f}: {med['trl']['step_seconds'] / med['rlhost']['step_seconds']:.2f}x")
    print(f"peak RSS GB: rlhost {med['rlhost']['peak_rss_gb']:.2f}, TRL + PEFT "
          f"{med['trl']['peak_rss_gb']:.2f}: {med['rlhost']['peak_rss_gb'] / med['trl']['peak_rss_gb']:.2f} of TRL's")
    os.makedirs(WORK, exist_ok=True)
    with open(os.path.join(WORK, "dpo_speed.json"), "w") as f:
        json.dump({"rounds": rounds, "median": med}, f, indent=2)


if __name__ == "__main__":
    main()
