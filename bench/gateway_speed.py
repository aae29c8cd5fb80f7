#!/usr/bin/env python3
"""What the OpenAI-compatible gateway costs (issue 46, point 7): SESSIONS concurrent
sessions' completion calls through `rlhost serve`, against the same requests sampled by the
same in-process sampler directly (`host/examples/gateway_direct.rs`), side by side in one
run (a benchmark, not a test: nothing is asserted).

    python3 bench/gateway_speed.py                      # a made model, this CPU
    python3 bench/gateway_speed.py --sessions 64 --max-tokens 64 --model-dir DIR

Each session opens its own session (`POST /rl/sessions`) and sends one `POST
/sessions/{id}/v1/completions` with PROMPT_LEN fixed pseudo-random token ids, MAX_TOKENS at
temperature 1 and the seed `1000 + i`, all at once from SESSIONS threads (plain HTTP from
the standard library, so the client's own cost stays small); the call is recorded in its
session as an agent's is. The direct side admits the same requests (the same ids, seeds
and stop ids: the same tokens are sampled) into one sampler and steps it until all are
done. Direct and gateway rounds alternate; medians; the ratio is what the gateway costs
(HTTP, JSON, sessions, the recording, the model thread's queue).

Needs a release build (`cargo build --release -p rlhost --bin rlhost --example
gateway_direct`; the script builds it) and numpy + safetensors for the made model (the
Tinker SDK's venv has them: `$(bash scripts/tinker.sh python) bench/gateway_speed.py`).
"""

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tinker_speed import builtin_dir, make_model, release_build  # noqa: E402


def tokenizer_vocab(model_dir):
    """The ids the tokenizer knows (what the gateway accepts): its vocabulary and added
    tokens; the model's `vocab_size` may be padded past them."""
    tok = json.load(open(os.path.join(model_dir, "tokenizer.json")))
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok.get("added_tokens", [])]
    return max(ids) + 1


def prompt(i, length, vocab):
    """Session i's ids: the same formula as gateway_direct's."""
    return [((i * 7919 + t) * 2_654_435_761) % vocab for t in range(length)]


class Serve:
    def __init__(self, rlhost, model_dir, work):
        os.makedirs(work, exist_ok=True)
        config = os.path.join(work, "bench.toml")
        with open(config, "w") as f:
            f.write(f'[model]\npath = "{model_dir}"\n[data]\npath = "none.jsonl"\n')
        open(os.path.join(work, "none.jsonl"), "w").write('{"prompt": "x"}\n')
        self.p = subprocess.Popen(
            [rlhost, "serve", "-q", "--addr", "127.0.0.1:0", "--config", config],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=work,
        )
        line = self.p.stdout.readline()
        if "http://" not in line:
            sys.exit(f"rlhost serve did not start: {line}{self.p.stderr.read()[-2000:]}")
        url = next(w for w in line.split() if w.startswith("http://"))
        self.host, port = url.removeprefix("http://").split("/")[0].split(":")
        self.port = int(port)

    def post(self, path, body):
        c = http.client.HTTPConnection(self.host, self.port, timeout=600)
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        c.close()
        if r.status not in (200, 201):
            sys.exit(f"{path}: {r.status} {data[:500]!r}")
        return json.loads(data)

    def stop(self):
        self.p.kill()
        self.p.wait()


def gateway_round(serve, sessions, prompt_len, max_tokens, vocab):
    """All sessions' calls at once: the wall time from the first call sent to the last
    answer, and the completion tokens answered."""
    ids = [serve.post("/rl/sessions", {"messages": [{"role": "user", "content": "bench"}]})["session_id"]
           for _ in range(sessions)]
    tokens = [0] * sessions
    failed = []
    start = threading.Barrier(sessions + 1)

    def call(i):
        body = {"model": "policy", "prompt": prompt(i, prompt_len, vocab), "max_tokens": max_tokens,
                "temperature": 1.0, "seed": 1000 + i}
        start.wait()
        try:
            r = serve.post(f"/sessions/{ids[i]}/v1/completions", body)
            tokens[i] = r["usage"]["completion_tokens"]
        except BaseException as e:  # noqa: BLE001 (a thread's sys.exit would go unseen)
            failed.append(f"session {i}: {e}")

    threads = [threading.Thread(target=call, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if failed:
        sys.exit("calls failed: " + "; ".join(failed[:3]))
    for s in ids:
        serve.post(f"/sessions/{s}/end", {})
    return wall, sum(tokens)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", help="a Hugging Face model folder (default: a made one)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    rlhost, direct = release_build("gateway_direct")
    work = tempfile.mkdtemp(prefix="gateway-bench-")
    model = a.model_dir or make_model(builtin_dir(rlhost), os.path.join(work, "model"), a.hidden, a.layers)
    vocab = tokenizer_vocab(model)
    print(f"model {model}; {a.sessions} sessions x {a.prompt_len} prompt ids, up to {a.max_tokens} tokens each, "
          f"T = 1; {a.rounds} rounds each side, alternating\n")

    serve = Serve(rlhost, model, os.path.join(work, "serve"))
    direct_s, gateway_s, tokens = [], [], set()
    try:
        # One warm-up call: the first forward pays for the allocator's pages.
        gateway_round(serve, 1, a.prompt_len, 4, vocab)
        for _ in range(a.rounds):
            p = subprocess.run([direct, model, str(a.sessions), str(a.prompt_len), str(a.max_tokens), "1", str(vocab)],
                               capture_output=True, text=True, check=True)
            d = json.loads(p.stdout.splitlines()[-1])
            direct_s.append(d["wall_s"])
            tokens.add(("direct", d["tokens"]))
            wall, n = gateway_round(serve, a.sessions, a.prompt_len, a.max_tokens, vocab)
            gateway_s.append(wall)
            tokens.add(("gateway", n))
    finally:
        serve.stop()
    counts = {n for _, n in tokens}
    if len(counts) != 1:
        print(f"warning: the two sides sampled different numbers of tokens: {sorted(tokens)}")
    n = max(counts)
    med = statistics.median
    print("| | wall (median) | tokens / s | gateway / direct |")
    print("|---|---|---|---|")
    print(f"| directly (one sampler) | {med(direct_s):.3f} s | {n / med(direct_s):,.0f} | |")
    print(f"| through the gateway | {med(gateway_s):.3f} s | {n / med(gateway_s):,.0f} | "
          f"{med(gateway_s) / med(direct_s):.3f} |")
    print(f"\n{n} tokens a round on each side; rounds: direct {[round(x, 3) for x in direct_s]}, "
          f"gateway {[round(x, 3) for x in gateway_s]}")


if __name__ == "__main__":
    main()
