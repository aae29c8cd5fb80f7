#!/usr/bin/env python3
"""Model speed and memory, rlhost (candle) vs transformers/PEFT, side by side in one run.

Not a test: run by developers on a quiet machine, numbers go in issue notes.

    python3 -m venv /tmp/benchvenv
    /tmp/benchvenv/bin/pip install torch transformers peft safetensors
    cargo build --release -p rlhost --example model_bench
    /tmp/benchvenv/bin/python bench/model_speed.py [--threads 2] [--small] [--rounds 3]

What it does:
1. Makes a random model of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14/2 heads,
   intermediate 4864, vocab 151,936, tied embeddings, f32) with transformers and saves it
   under bench/.work/ (once; --small uses a 4-layer model for a quick check).
2. Greedy decode of 64 new tokens after a 32-token prompt at batch 1 and 8: rlhost vs
   transformers `generate` (prefill included in both).
3. One LoRA r16 training step (all 7 projections) on 4 x 256 tokens: forward, mean
   next-token NLL, backward, gradient clipping at 1.0, AdamW; mean of 2 timed steps after a warm-up, and the peak
   RSS of the whole process, rlhost vs PyTorch + PEFT. The two alternate for --rounds
   runs each (default 3); the medians are compared, and each round's ratio is printed.
4. Memory read bandwidth with the same thread count, and batch-1 decode as a fraction of
   the limit it implies (bytes of weights read per token / bandwidth).
5. Sequence packing in the RL update (rlhost against itself): one GRPO update on 16
   trajectories of 100 to 400 tokens (evenly spread), the rows packed into lanes beside
   one row a lane padded to the longest, alternating in one process; the medians, their
   ratio and the tokens each layout feeds the model.

`--against OLD_BIN` makes the peer another build of `model_bench` (say, one built from an
older commit) instead of transformers/PEFT: the same rows, alternating the two binaries
(its results under `against` in model_speed.json, where transformers' and PEFT's are under
`transformers` and `peft`),
to show that a change of the code's layout left the figures where they were (torch and
transformers are then needed only to make the random model; PEFT not at all).
`--bin NEW_BIN` names our side's binary (default: target/release/examples/model_bench).

Every measurement runs in its own process with the same thread count (RAYON_NUM_THREADS
and torch.set_num_threads), and its peak RSS comes from wait4().
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(ROOT, "bench", ".work")
BIN = os.path.join(ROOT, "target", "release", "examples", "model_bench")

SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
             max_position_embeddings=32768, tie_word_embeddings=True)


def make_model(path, layers):
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(**{**SHAPE, "num_hidden_layers": layers}, rope_theta=1000000.0,
                      rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    # The fixtures' tokenizer: rlhost loads a tokenizer only for `generate`, not here.


def run(cmd, threads):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        sys.exit(f"failed ({status}): {' '.join(cmd)}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_gb"] = usage.ru_maxrss * 1024 / 1e9  # ru_maxrss is KiB on Linux
    return result


def torch_worker(args):
    """Runs inside a child process: one transformers/PEFT measurement."""
    import torch
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    if args.worker == "decode":
        model.eval()
        ids = torch.randint(0, 500, (args.batch, 32), generator=g)
        mask = torch.ones_like(ids)

        def gen(n):
            with torch.inference_mode():
                t = time.perf_counter()
                model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                               min_new_tokens=n, pad_token_id=0)
                return time.perf_counter() - t
        gen(2)
        secs = gen(64)
        print(json.dumps({"impl": "transformers", "mode": "decode", "batch": args.batch,
                          "seconds": secs, "tokens_per_s": args.batch * 64 / secs}))
    else:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        ids = torch.randint(0, 500, (4, 256), generator=g)
        times = []
        for step in range(3):
            t = time.perf_counter()
            logits = model(input_ids=ids).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     ids[:, 1:].reshape(-1))
            loss.backward()
            # Clipped at 1.0, as model_bench's step (rlhost's trainer) is.
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            del logits, loss
            if step > 0:
                times.append(time.perf_counter() - t)
        print(json.dumps({"impl": "peft", "mode": "train", "step_seconds": sum(times) / len(times),
                          "steps": times}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="4 layers instead of 24 (quick check)")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-packing", action="store_true")
    ap.add_argument("--worker", choices=["decode", "train"])
    ap.add_argument("--model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--bin", default=BIN, help="our side's model_bench")
    ap.add_argument("--against", metavar="OLD_BIN",
                    help="another model_bench build as the peer, in place of transformers/PEFT")
    ap.add_argument("--rounds", type=int, default=3,
                    help="training step: alternate rlhost and the peer this many times; the "
                         "medians are compared (this VM's speed drifts by 15-20%% within minutes)")
    args = ap.parse_args()
    if args.worker:
        return torch_worker(args)
    ours_bin = args.bin
    for b in [ours_bin] + ([args.against] if args.against else []):
        if not os.path.exists(b):
            sys.exit(f"{b} missing: cargo build --release -p rlhost --example model_bench")
    layers = 4 if args.small else 24
    model = os.path.join(WORK, f"qwen2.5-0.5b-shape-{layers}l")
    make_model(model, layers)
    py = [sys.executable, os.path.abspath(__file__), "--model", model, "--threads", str(args.threads)]

    def peer(mode, *extra):
        """The peer's command for a decode or train measurement."""
        if args.against:
            return [args.against, mode, "--model", model, *extra]
        return py + ["--worker", mode, *extra]
    t = args.threads
    rows = []
    # The peer's key in model_speed.json: what it was, so that a file read later says.
    decode_peer, train_peer = ("against", "against") if args.against else ("transformers", "peft")

    def show(name, ours, theirs, key, higher_is_better=True):
        ratio = ours[key] / theirs[key] if higher_is_better else theirs[key] / ours[key]
        rows.append((name, ours[key], theirs[key], ratio))
        print(f"{name:<34} rlhost {ours[key]:9.3f}   peer {theirs[key]:9.3f}   ratio {ratio:5.2f}x", flush=True)

    n_params = None
    from safetensors import safe_open
    with safe_open(os.path.join(model, "model.safetensors"), "np") as f:
        n_params = sum(int(__import__("numpy").prod(f.get_slice(k).get_shape())) for k in f.keys())
    bw = run([ours_bin, "bandwidth", "--threads", str(t)], t)
    print(f"memory read bandwidth ({t} threads): {bw['gb_per_s']:.1f} GB/s; model {n_params / 1e6:.0f} M params", flush=True)
    results = {"bandwidth": bw, "params": n_params}
    for b in () if args.skip_decode else (1, 8):
        ours = run([ours_bin, "decode", "--model", model, "--batch", str(b)], t)
        theirs = run(peer("decode", "--batch", str(b)), t)
        show(f"greedy decode tokens/s, batch {b}", ours, theirs, "tokens_per_s")
        results[f"decode_b{b}"] = {"rlhost": ours, decode_peer: theirs}
        if b == 1:
            # Each token reads every weight once (the tied embedding as lm_head), in f32.
            limit = bw["gb_per_s"] * 1e9 / (n_params * 4)
            frac = ours["tokens_per_s"] / limit
            print(f"  batch-1 limit {limit:.1f} tokens/s from bandwidth; rlhost reaches {frac:.0%}", flush=True)
            results["decode_b1_fraction_of_limit"] = frac
    if not args.skip_train:
        # Alternating runs, so that a slow spell of the machine hits both sides alike; each
        # round's ratio compares two neighbouring runs.
        rounds = []
        for i in range(max(1, args.rounds)):
            ours = run([ours_bin, "train", "--model", model], t)
            theirs = run(peer("train"), t)
            rounds.append({"rlhost": ours, train_peer: theirs})
            print(f"  round {i + 1}: rlhost {ours['step_seconds']:.2f} s, peer "
                  f"{theirs['step_seconds']:.2f} s, ratio "
                  f"{theirs['step_seconds'] / ours['step_seconds']:.2f}x", flush=True)
        ours = {k: statistics.median([r["rlhost"][k] for r in rounds]) for k in ("step_seconds", "peak_rss_gb")}
        theirs = {k: statistics.median([r[train_peer][k] for r in rounds]) for k in ("step_seconds", "peak_rss_gb")}
        show("LoRA r16 step 4x256, seconds", ours, theirs, "step_seconds", higher_is_better=False)
        show("LoRA r16 step peak RSS, GB", ours, theirs, "peak_rss_gb", higher_is_better=False)
        ratios = [r[train_peer]["step_seconds"] / r["rlhost"]["step_seconds"] for r in rounds]
        print(f"  per-round step ratios {', '.join(f'{x:.2f}x' for x in ratios)}; median "
              f"{statistics.median(ratios):.2f}x", flush=True)
        results["train"] = {"rlhost": ours, train_peer: theirs, "rounds": rounds,
                            "median_round_ratio": statistics.median(ratios)}
    if not args.skip_packing:
        def update(binary):
            return run([binary, "update", "--model", model, "--rounds", str(max(3, args.rounds))], t)
        upd = update(ours_bin)
        if args.against:
            old = update(args.against)
            print(f"RL update, packed: {upd['packed_seconds']:.2f} s, peer {old['packed_seconds']:.2f} s; "
                  f"one row a lane: {upd['padded_seconds']:.2f} s, peer {old['padded_seconds']:.2f} s", flush=True)
            results["update_packing_peer"] = old
        print(f"RL update, 16 rows of 100-400 tokens: packed {upd['packed_seconds']:.2f} s, one row "
              f"a lane {upd['padded_seconds']:.2f} s, {upd['padded_over_packed']:.2f}x; tokens fed "
              f"{upd['packed_tokens']} vs {upd['padded_tokens']} ({upd['real_tokens']} real), peak "
              f"RSS {upd['peak_rss_gb']:.2f} GB", flush=True)
        results["update_packing"] = upd
    os.makedirs(WORK, exist_ok=True)
    with open(os.path.join(WORK, "model_speed.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"(ratios > 1 favour rlhost; raw results in {os.path.join(WORK, 'model_speed.json')})")


if __name__ == "__main__":
    main()
