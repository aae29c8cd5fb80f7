#!/usr/bin/env python3
"""GPU speed and memory, rlhost (candle, CUDA) vs transformers/PEFT, side by side in one run.

Not a test: run on a GPU machine (issue 17, point 6); the numbers go in issue notes.
The machine needs torch (a CUDA build), transformers and peft, and the CUDA build of
`model_bench` (built elsewhere with `scripts/build_cuda.sh build --release -p rlhost
--example model_bench`, carried over):

    python3 bench/gpu_speed.py --bin PATH/model_bench [--small] [--rounds 2]

What it does, on a random model of Qwen2.5-1.5B's shape (hidden 1536, 28 layers, 12/2
heads, intermediate 8960, vocab 151,936, tied embeddings) saved in bf16 under
bench/.work/ (once; --small uses 4 layers for a quick check), everything in bf16:
1. Rollout throughput: 64 prompts of 128 tokens, 256 sampled tokens each (temperature 1,
   no truncation, EOS ignored), tokens/s: rlhost's batched decoding vs transformers
   `generate` with the same batch (sdpa attention), prefill included in both.
2. One LoRA r16 step, all 7 projections, on 8 x 1024 tokens: forward, mean next-token NLL,
   backward, gradient clipping at 1.0, AdamW; the mean of the timed steps after a warm-up: rlhost vs PyTorch + PEFT
   (sdpa); `--checkpointing` recomputes each decoder layer in the backward, on both sides.
   Peak GPU memory of each process from `nvidia-smi` polled every 20 ms (the same
   yardstick for both: PyTorch's caching allocator and candle's allocations alike), and
   PyTorch's own `max_memory_reserved` beside it. A second peer, PEFT with Liger's kernels
   (liger-kernel, `--no-liger` leaves it out), runs the same step from its fused head.
`--cublas-attention` adds rlhost with its attention as cuBLAS products around a softmax pass
(the form before the flash kernels), `--qlora` rlhost's QLoRA step (the base in NF4).
`--shape 7b` takes Qwen2.5-7B's shape instead (hidden 3584, 28/4 heads, intermediate 18,944,
vocabulary 152,064, untied head). Each measurement runs in its own process (the model is made
in one of its own too); rlhost and the peer alternate for --rounds and
the medians are compared. Prints one table with the ratios (> 1: rlhost better).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(ROOT, "bench", ".work")

SHAPES = {
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                 max_position_embeddings=32768, tie_word_embeddings=True),
    # Qwen2.5-7B's shape (issue 50's second goal: its step on one 80 GB H100).
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
               max_position_embeddings=32768, tie_word_embeddings=False),
}
SHAPE = SHAPES["1.5b"]
PROMPTS, PROMPT_LEN, NEW = 64, 128, 256
TRAIN_BATCH, TRAIN_SEQ, RANK = 8, 1024, 16


def make_model(path, layers, shape="1.5b"):
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(**{**SHAPES[shape], "num_hidden_layers": layers}, rope_theta=1000000.0,
                      rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)
    # Initialised on the GPU where there is one: a 1.5B model's random init in f32 on
    # the CPU takes longer than the measurements.
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def gpu_used_mib():
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                          "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
                         capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[0])


def run(cmd, env=None):
    """Runs one measurement (with `env` added to the environment); returns its JSON line
    with the GPU's peak memory use above what was in use before it started."""
    base = gpu_used_mib()
    peak = [base]
    done = threading.Event()

    def poll():
        while not done.is_set():
            peak[0] = max(peak[0], gpu_used_mib())
            time.sleep(0.02)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, **(env or {})})
    done.set()
    poller.join()
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["gpu_peak_gb"] = (peak[0] - base) * 1024 * 1024 / 1e9
    return result


def torch_worker(args):
    """Runs inside a child process: one transformers/PEFT measurement on the GPU."""
    import torch
    from transformers import AutoModelForCausalLM
    if args.worker == "bandwidth":
        # Device memory bandwidth as a copy of 1 GiB measures it (read and write), best of 5.
        x = torch.zeros(1 << 29, dtype=torch.bfloat16, device=torch.device("cuda"))
        best = 0.0
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            x.clone()
            torch.cuda.synchronize()
            best = max(best, 2 * (1 << 30) / (time.perf_counter() - t))
        print(json.dumps({"mode": "bandwidth", "gb_per_s": best / 1e9}))
        return
    if args.liger:
        # Liger's Triton kernels patched into transformers' Qwen2 before the model loads
        # (RoPE, RMSNorm, SwiGLU, and the LM head fused with the cross-entropy, which
        # never makes the full logits): the fastest PyTorch peer measured (issue 50).
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2
        apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    dev = torch.device("cuda")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").to(dev)
    g = torch.Generator().manual_seed(0)
    if args.worker == "decode":
        model.eval()
        ids = torch.randint(0, 500, (PROMPTS, PROMPT_LEN), generator=g).to(dev)
        mask = torch.ones_like(ids)

        def gen(n):
            with torch.inference_mode():
                torch.cuda.synchronize()
                t = time.perf_counter()
                model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0,
                               top_k=0, top_p=1.0, max_new_tokens=n, min_new_tokens=n,
                               pad_token_id=0)
                torch.cuda.synchronize()
                return time.perf_counter() - t
        gen(2)
        secs = gen(NEW)
        print(json.dumps({"impl": "transformers", "mode": "decode", "seconds": secs,
                          "tokens_per_s": PROMPTS * NEW / secs}))
    else:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(
            r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        if args.checkpointing:
            # Per decoder layer, as rlhost's `gradient_checkpointing`; PEFT needs the
            # inputs to require grad for the recomputed layers to carry one.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        ids = torch.randint(0, 500, (TRAIN_BATCH, TRAIN_SEQ), generator=g).to(dev)
        times = []
        torch.cuda.reset_peak_memory_stats()
        for step in range(args.steps + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            if args.liger:
                # The same mean next-token NLL, from Liger's fused head (labels shift inside).
                loss = model(input_ids=ids, labels=ids).loss
            else:
                logits = model(input_ids=ids).logits[:, :-1].float()
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                         ids[:, 1:].reshape(-1))
                del logits
            loss.backward()
            # Clipped at 1.0 as TRL's default and rlhost's trainer do, both sides.
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
            torch.cuda.synchronize()
            if step > 0:
                times.append(time.perf_counter() - t)
        print(json.dumps({"impl": "peft+liger" if args.liger else "peft", "mode": "train", "step_seconds": sum(times) / len(times),
                          "steps": times,
                          "torch_max_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
                          "torch_max_allocated_gb": torch.cuda.max_memory_allocated() / 1e9}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "examples", "model_bench"))
    ap.add_argument("--small", action="store_true", help="4 layers instead of 28 (quick check)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.5b",
                    help="the random model's shape: Qwen2.5-1.5B's (default) or Qwen2.5-7B's")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--checkpointing", action="store_true",
                    help="the training step with per-layer gradient checkpointing, both sides")
    ap.add_argument("--cublas-attention", action="store_true",
                    help="a third rlhost row: attention as cuBLAS products around a softmax pass "
                         "(RLHOST_ATTENTION=cublas, the form before the flash kernels)")
    ap.add_argument("--qlora", action="store_true",
                    help="a row for rlhost's QLoRA step (the base in NF4) against its LoRA step")
    ap.add_argument("--no-liger", action="store_true",
                    help="leave out the PEFT + Liger peer (it needs liger-kernel installed)")
    ap.add_argument("--liger", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=["decode", "train", "bandwidth"])
    ap.add_argument("--model")
    args = ap.parse_args()
    if args.worker:
        return torch_worker(args)
    if not os.path.exists(args.bin):
        sys.exit(f"{args.bin} missing: scripts/build_cuda.sh build --release -p rlhost --example model_bench")
    layers = 4 if args.small else SHAPES[args.shape]["num_hidden_layers"]
    model = os.path.join(WORK, f"qwen2.5-{args.shape}-shape-{layers}l-bf16")
    # In a process of its own: torch keeps the memory it made the model with reserved
    # until its process ends, and a 7B model made in f32 on the GPU holds ~30 GB, which
    # the measured processes would then not have (an 80 GB H100 ran out that way).
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                    "import gpu_speed; gpu_speed.make_model(sys.argv[2], int(sys.argv[3]), sys.argv[4])",
                    os.path.dirname(os.path.abspath(__file__)), model, str(layers), args.shape],
                   check=True)
    py = [sys.executable, os.path.abspath(__file__), "--model", model, "--steps", str(args.steps)]
    py += ["--checkpointing"] if args.checkpointing else []
    ours = [args.bin, "--model", model, "--device", "cuda", "--dtype", "bf16"]
    rows = []

    def compare(name, mine, peer, key, higher_is_better):
        a = statistics.median(r[key] for r in mine)
        b = statistics.median(r[key] for r in peer)
        ratio = a / b if higher_is_better else b / a
        rows.append((name, a, b, ratio))

    if not args.skip_decode:
        mine, peer, composed, adapted, adapted_before = [], [], [], [], []
        # A decode step's floor: what it must read (the weights, the keys and values its
        # sequences attend to) at the device's copy bandwidth.
        bandwidth = run(py + ["--worker", "bandwidth"])["gb_per_s"]
        # `--logprob-check 4`: after the timing, four sequences' sampled log-probs against the
        # trainer's forward (the new kernels checked end to end on this model); its forward
        # adds a little to the peak GPU memory the poll sees.
        decode = [ours[0], "decode", *ours[1:], "--batch", str(PROMPTS), "--prompt-len",
                  str(PROMPT_LEN), "--new", str(NEW), "--temperature", "1", "--logprob-check", "4"]
        for _ in range(args.rounds):
            mine.append(run(decode))
            peer.append(run(py + ["--worker", "decode"]))
            # Sampling as before issue 64: prompts prefilled sequence by sequence, the decode
            # step's attention composed (products over the pool's whole capacity, mask,
            # softmax), the draw as tensor ops, q/k/v and gate/up one product a projection,
            # and each step's tokens on the host before the next step is queued, instead of
            # the batched prefill, the flash-decoding kernel, the fused draw, the joined
            # products and the draw with the next step queued behind it.
            before = {"RLHOST_PREFILL": "sequences", "RLHOST_DECODE_ATTENTION": "composed",
                      "RLHOST_DRAW": "composed", "RLHOST_PROJECTIONS": "separate",
                      "RLHOST_DECODE_AHEAD": "off"}
            composed.append(run(decode, before))
            # As a rollout samples: a rank-16 adapter on every projection, read from a
            # frozen copy of its version (cast once, q/k/v and gate/up each one product);
            # and as before issue 64, from the live adapter (cast every call, one product
            # a projection) with the forms above.
            adapted.append(run(decode + ["--adapter-rank", "16"]))
            adapted_before.append(run(decode + ["--adapter-rank", "16", "--live-adapter", "1"],
                                      before))
            m = mine[-1]
            m["floor_step_ms"] = (m["weights_gb"] + m["kv_gb_per_step"]) / bandwidth * 1e3
            m["floor_fraction"] = m["floor_step_ms"] / m["decode_step_ms"]
            print(f"decode round: rlhost {m['tokens_per_s']:.0f} tok/s (prefill "
                  f"{m['prefill_s'] * 1e3:.1f} ms, decode step {m['decode_step_ms']:.2f} ms, "
                  f"its floor {m['floor_step_ms']:.2f} ms = {m['weights_gb']:.2f} GB of weights + "
                  f"{m['kv_gb_per_step']:.2f} GB of keys and values at {bandwidth:.0f} GB/s: "
                  f"{100 * m['floor_fraction']:.0f}% of the floor), as before issue 64 "
                  f"{composed[-1]['tokens_per_s']:.0f} tok/s (step {composed[-1]['decode_step_ms']:.2f} ms), "
                  f"transformers {peer[-1]['tokens_per_s']:.0f} tok/s; sampled log-probs from the "
                  f"trainer's: max {m['logprob_gap_max']:.3g}, mean {m['logprob_gap_mean']:.3g} "
                  f"(as before: max {composed[-1]['logprob_gap_max']:.3g}, mean "
                  f"{composed[-1]['logprob_gap_mean']:.3g})", flush=True)
        compare(f"rollout {PROMPTS}x{PROMPT_LEN}+{NEW}, tokens/s", mine, peer, "tokens_per_s", True)
        compare("  its peak GPU memory, GB", mine, peer, "gpu_peak_gb", False)
        compare("  tokens/s (rlhost, composed forms)", mine, composed, "tokens_per_s", True)
        compare("  decode step, ms (rlhost, composed forms)", mine, composed, "decode_step_ms", False)
        compare("  prefill, s (rlhost, per sequence)", mine, composed, "prefill_s", False)
        compare("  with a rank-16 adapter: tokens/s (rlhost, as before issue 64)", adapted,
                adapted_before, "tokens_per_s", True)
        compare("  with a rank-16 adapter: decode step, ms (rlhost, as before)", adapted,
                adapted_before, "decode_step_ms", False)
        print(f"rollout with a rank-16 adapter: sampled log-probs from the trainer's: max "
              f"{max(r['logprob_gap_max'] for r in adapted):.3g}, mean "
              f"{statistics.median(r['logprob_gap_mean'] for r in adapted):.3g}", flush=True)
        print(f"rollout: decode step {statistics.median(r['decode_step_ms'] for r in mine):.2f} ms, "
              f"{100 * statistics.median(r['floor_fraction'] for r in mine):.0f}% of its bandwidth floor "
              f"({statistics.median(r['floor_step_ms'] for r in mine):.2f} ms)", flush=True)
    if not args.skip_train:
        liger = not args.no_liger
        mine, peer, peer_liger, cublas, qlora = [], [], [], [], []
        train = [ours[0], "train", *ours[1:], "--batch", str(TRAIN_BATCH), "--seq",
                 str(TRAIN_SEQ), "--rank", str(RANK), "--steps", str(args.steps),
                 "--checkpointing", str(int(args.checkpointing))]
        for _ in range(args.rounds):
            mine.append(run(train))
            peer.append(run(py + ["--worker", "train"]))
            line = (f"train round: rlhost {mine[-1]['step_seconds']:.3f} s "
                    f"({mine[-1]['gpu_peak_gb']:.1f} GB), PEFT {peer[-1]['step_seconds']:.3f} s "
                    f"({peer[-1]['gpu_peak_gb']:.1f} GB; torch reserved "
                    f"{peer[-1]['torch_max_reserved_gb']:.1f} GB)")
            if liger:
                peer_liger.append(run(py + ["--worker", "train", "--liger"]))
                line += (f", PEFT + Liger {peer_liger[-1]['step_seconds']:.3f} s "
                         f"({peer_liger[-1]['gpu_peak_gb']:.1f} GB; torch reserved "
                         f"{peer_liger[-1]['torch_max_reserved_gb']:.1f} GB)")
            if args.cublas_attention:
                cublas.append(run(train, {"RLHOST_ATTENTION": "cublas"}))
                line += (f", rlhost with cuBLAS attention {cublas[-1]['step_seconds']:.3f} s "
                         f"({cublas[-1]['gpu_peak_gb']:.1f} GB)")
            if args.qlora:
                qlora.append(run(train + ["--quantize", "nf4"]))
                line += (f", rlhost QLoRA {qlora[-1]['step_seconds']:.3f} s "
                         f"({qlora[-1]['gpu_peak_gb']:.1f} GB)")
            print(line, flush=True)
        ckpt = ", checkpointed" if args.checkpointing else ""
        compare(f"{args.shape}: LoRA r{RANK} step {TRAIN_BATCH}x{TRAIN_SEQ}{ckpt}, s (PEFT)", mine, peer,
                "step_seconds", False)
        compare("  its peak GPU memory, GB", mine, peer, "gpu_peak_gb", False)
        if liger:
            compare("  the step, s (PEFT + Liger)", mine, peer_liger, "step_seconds", False)
            compare("  its peak GPU memory, GB", mine, peer_liger, "gpu_peak_gb", False)
        if args.cublas_attention:
            compare("  the step, s (rlhost, cuBLAS attention)", mine, cublas, "step_seconds", False)
        if args.qlora:
            # Here "rlhost" is the LoRA step and the peer rlhost's own QLoRA step: the ratio
            # is how much of the LoRA step's speed QLoRA keeps (issue 50: at most 1.3x slower).
            compare("  rlhost LoRA vs its QLoRA step, s", mine, qlora, "step_seconds", False)
            compare("  their peak GPU memory, GB", mine, qlora, "gpu_peak_gb", False)
    print(f"\n{'':44} {'rlhost':>10} {'peer':>10} {'ratio':>7}  (> 1: rlhost better)")
    for name, a, b, ratio in rows:
        print(f"{name:44} {a:10.3f} {b:10.3f} {ratio:6.2f}x")


if __name__ == "__main__":
    main()
