#!/usr/bin/env python3
"""The Tinker API's cost, and many adapters on one base: `rlhost serve --tinker` driven by
the official `tinker` SDK, against the same work run inside rlhost directly, side by side
in one run (a benchmark, not a test: nothing is asserted).

    python3 bench/tinker_speed.py                       # a made model, this CPU
    python3 bench/tinker_speed.py --model-dir DIR --rows 16 --len 512

What it runs, on one model (by default one it makes: the built-in multiply model's
tokenizer and random weights of a larger shape, `--hidden`/`--layers`):
1. The work directly (`cargo run --release --example tinker_direct`): a `forward_backward`
   (cross-entropy, ROWS x LEN tokens) with an `optim_step`, and sampling SAMPLES prompts of
   16 tokens for SAMPLE_TOKENS tokens each, ROUNDS times each.
2. The same through the API with one training client: forward_backward + optim_step, then
   `save_weights_and_get_sampling_client` and the same sampling (all prompts at once).
   Steps 1 and 2 alternate twice; medians; the ratio is what the API costs.
3. 1, 2 and 4 training clients at once (a fresh server each), every client with the same
   workload: the time a round of steps takes, the tokens trained per second in all, and the
   server's peak memory (VmHWM); then as many sampling clients, each sampling its own
   adapter, all at once (their sequences decode in the same forwards).

Needs the SDK's venv (`bash scripts/tinker.sh install`) and a release build
(`cargo build --release -p rlhost --bin rlhost --example tinker_direct`; the script builds
it).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def release_build(example="tinker_direct"):
    """The release binary and `example`'s, built if needed."""
    subprocess.run(
        ["cargo", "build", "--release", "-q", "-p", "rlhost", "--bin", "rlhost", "--example", example],
        cwd=ROOT,
        check=True,
    )
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    return os.path.join(target, "release", "rlhost"), os.path.join(target, "release", "examples", example)


def builtin_dir(rlhost):
    """The built-in multiply model's folder (built once, as the default run builds it)."""
    p = subprocess.run([rlhost, "eval", "--prompts", "1"], capture_output=True, text=True, cwd=ROOT)
    for line in p.stderr.splitlines() + p.stdout.splitlines():
        for prefix in ("built-in model builtin:multiply: ", "building the built-in model builtin:multiply into "):
            if line.startswith(prefix):
                return line[len(prefix):].removesuffix(" (once)").strip()
    sys.exit(f"could not find the built-in model's folder:\n{p.stderr[-2000:]}")


def make_model(tokenizer_dir, out, hidden, layers):
    """A Qwen2-shaped model with random weights and the built-in model's tokenizer."""
    import numpy as np
    from safetensors.numpy import save_file

    cfg = json.load(open(os.path.join(tokenizer_dir, "config.json")))
    heads = max(1, hidden // 64)
    cfg.update(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        intermediate_size=3 * hidden,
    )
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(tokenizer_dir):
        if f not in ("config.json", "model.safetensors"):
            with open(os.path.join(tokenizer_dir, f), "rb") as src, open(os.path.join(out, f), "wb") as dst:
                dst.write(src.read())
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
    rng = np.random.default_rng(0)
    v, h, i = cfg["vocab_size"], hidden, cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * 64
    q = heads * 64

    def w(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    t = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": np.ones(h, np.float32), "lm_head.weight": w(v, h)}
    for l in range(layers):
        p = f"model.layers.{l}."
        t.update({
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
            p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.q_proj.bias": np.zeros(q, np.float32),
            p + "self_attn.k_proj.weight": w(kv, h), p + "self_attn.k_proj.bias": np.zeros(kv, np.float32),
            p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.v_proj.bias": np.zeros(kv, np.float32),
            p + "self_attn.o_proj.weight": w(h, q),
            p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h), p + "mlp.down_proj.weight": w(h, i),
        })
    save_file(t, os.path.join(out, "model.safetensors"))
    return out


class Server:
    def __init__(self, rlhost, model_dir, work):
        os.makedirs(work, exist_ok=True)
        config = os.path.join(work, "bench.toml")
        with open(config, "w") as f:
            f.write(f'[model]\npath = "{model_dir}"\n[data]\npath = "none.jsonl"\n')
        open(os.path.join(work, "none.jsonl"), "w").write('{"prompt": "x"}\n')
        self.p = subprocess.Popen(
            [rlhost, "serve", "--tinker", "--addr", "127.0.0.1:0", "--config", config,
             "--checkpoints", os.path.join(work, "ck")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        line = self.p.stdout.readline()
        if "http://" not in line:
            sys.exit(f"serve --tinker did not start: {line}{self.p.stderr.read()[-2000:]}")
        self.url = next(w for w in line.split() if w.startswith("http://"))

    def peak_mb(self):
        for line in open(f"/proc/{self.p.pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self):
        self.p.kill()
        self.p.wait()


def workload(tok_count, rows, length):
    ids = lambda i: (i * 2_654_435_761) % tok_count  # noqa: E731
    seqs = [[ids(r * 7919 + t) for t in range(length + 1)] for r in range(rows)]
    return seqs


def api_rounds(url, seqs, rank, rounds, samples, sample_tokens, clients=1):
    """Each of `clients` training clients runs `rounds` steps at once, then as many
    sampling clients sample at once; returns per-round seconds of both."""
    os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY="tml-bench", TINKER_TELEMETRY="0")
    import tinker
    from tinker import types

    service = tinker.ServiceClient()
    base = service.get_server_capabilities().supported_models[0].model_name
    ready = lambda x: x.result() if hasattr(x, "result") else x  # noqa: E731
    tcs = [ready(service.create_lora_training_client(base_model=base, rank=rank, train_unembed=False, seed=c))
           for c in range(clients)]
    data = [
        types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                    loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)})
        for s in seqs
    ]
    vocab = max(max(s) for s in seqs) + 1
    prompts = [[(p * 104_729 + t) * 2_654_435_761 % vocab for t in range(16)] for p in range(samples)]

    def together(f):
        ts = [threading.Thread(target=f, args=(c,)) for c in range(clients)]
        t0 = time.time()
        [t.start() for t in ts]
        [t.join() for t in ts]
        return time.time() - t0

    def step(c):
        fb = tcs[c].forward_backward(data, "cross_entropy")
        op = tcs[c].optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result(), op.result()

    step_s = [together(step) for _ in range(rounds)]
    samplers = [ready(tc.save_weights_and_get_sampling_client()) for tc in tcs]
    params = types.SamplingParams(max_tokens=sample_tokens, temperature=1.0, stop=[], seed=1)

    def sample(c):
        futures = [samplers[c].sample(prompt=types.ModelInput.from_ints(p), num_samples=1, sampling_params=params)
                   for p in prompts]
        for f in futures:
            assert len(f.result().sequences[0].tokens) == sample_tokens

    sample_s = [together(sample) for _ in range(rounds)]
    return step_s, sample_s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", help="a Hugging Face model folder (default: a made one)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--sample-tokens", type=int, default=64)
    a = ap.parse_args()
    try:
        import tinker  # noqa: F401
    except ImportError:
        sys.exit("run it with the SDK's python: $(bash scripts/tinker.sh python) bench/tinker_speed.py")
    rlhost, direct = release_build()
    work = tempfile.mkdtemp(prefix="tinker-bench-")
    model = a.model_dir or make_model(builtin_dir(rlhost), os.path.join(work, "model"), a.hidden, a.layers)
    tokens = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    seqs = workload(min(tokens, 300), a.rows, a.len)
    print(f"model {model}; step: {a.rows} x {a.len} tokens, rank {a.rank}; sampling: {a.samples} prompts x {a.sample_tokens} tokens; {a.rounds} rounds\n")

    direct_step, direct_sample, api_step, api_sample = [], [], [], []
    for _ in range(2):
        p = subprocess.run([direct, model, str(a.rows), str(a.len), str(a.rank), str(a.rounds),
                            str(a.samples), str(a.sample_tokens)], capture_output=True, text=True, check=True)
        d = json.loads(p.stdout)
        direct_step += d["step_s"]
        direct_sample += d["sample_s"]
        server = Server(rlhost, model, os.path.join(work, f"api-{len(api_step)}"))
        try:
            s, t = api_rounds(server.url, seqs, a.rank, a.rounds, a.samples, a.sample_tokens)
        finally:
            server.stop()
        api_step += s
        api_sample += t
    med = statistics.median
    print("| | directly | through the API | API / direct |")
    print("|---|---|---|---|")
    print(f"| forward_backward + optim_step | {med(direct_step):.3f} s | {med(api_step):.3f} s | {med(api_step) / med(direct_step):.3f} |")
    print(f"| sample {a.samples} x {a.sample_tokens} tokens | {med(direct_sample):.3f} s | {med(api_sample):.3f} s | {med(api_sample) / med(direct_sample):.3f} |")

    print("\n| adapters at once | round of steps | tokens trained / s | vs one | peak memory | sampling round | sampled tokens / s | vs one |")
    print("|---|---|---|---|---|---|---|---|")
    one = None
    for k in (1, 2, 4):
        server = Server(rlhost, model, os.path.join(work, f"multi-{k}"))
        try:
            s, t = api_rounds(server.url, seqs, a.rank, a.rounds, a.samples, a.sample_tokens, clients=k)
            peak = server.peak_mb()
        finally:
            server.stop()
        trained = k * a.rows * a.len / med(s)
        sampled = k * a.samples * a.sample_tokens / med(t)
        if one is None:
            one = (trained, sampled)
        print(f"| {k} | {med(s):.3f} s | {trained:,.0f} | {trained / one[0]:.2f}x | {peak:,.0f} MB | "
              f"{med(t):.3f} s | {sampled:,.0f} | {sampled / one[1]:.2f}x |")


if __name__ == "__main__":
    main()
