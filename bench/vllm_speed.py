#!/usr/bin/env python3
"""Rollout throughput: rlhost's local engine against its vLLM engine, and rlhost's vLLM
engine against the same requests sent straight to the server, side by side in one run.

    python3 bench/vllm_speed.py                      # the built-in multiply model, this CPU
    python3 bench/vllm_speed.py --model-dir DIR --config my.toml --vllm-args "--dtype bfloat16 --gpu-memory-utilization 0.5"

What it runs (a benchmark, not a test: nothing is asserted):
1. `rlhost rollout` with the local engine: the config's held-out prompts, G per prompt, with
   the tool (the calculator) in the loop.
2. The same with `rollout.engine = "vllm"` on a server started by scripts/vllm.sh on the
   same model directory (or `--url`), and `--adapter` if given (its load time is reported).
3. First turns only (the trigger removed, its stop pattern a stop string, so that each
   trajectory is exactly one request), all in one batch: rlhost's vLLM engine, then the same requests
   (prompt ids, sampling parameters, seeds) sent straight to the server by this script
   with as many in flight as rlhost allows (`rollout.vllm.max_in_flight`). The ratio is
   what rlhost's client costs.
The local engine's CPU time (user and system) is printed too.

On a GPU machine: build rlhost with `--features cuda`, point `--model-dir` at a model of
the shape you care about (e.g. Qwen2.5-1.5B's), `--device cuda --dtype bf16`, and pass the
server's GPU flags with `--vllm-args` (the script's defaults are the CPU ones of
scripts/vllm.sh).
"""

import argparse
import concurrent.futures as cf
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sh(cmd, env=None):
    """Runs `cmd`; returns (stdout, stderr, wall seconds, user s, system s)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{p.stderr[-3000:]}")
    return p.stdout, p.stderr, wall, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime


def summary(out):
    """The figures of `rlhost rollout`'s summary."""
    m = re.search(r"throughput\s+([\d.]+) trajectories/s, ([\d.]+) sampled tokens/s", out)
    t = re.search(r"time\s+([\d.]+) s", out)
    r = re.search(r"vLLM\s+(\d+) requests, waiting on the servers ([\d.]+) s.*?loading adapters ([\d.]+) s", out)
    w = re.search(r"waiting on plugins ([\d.]+) s", out)
    return {
        "traj_s": float(m.group(1)),
        "tok_s": float(m.group(2)),
        "wall_s": float(t.group(1)),
        "requests": int(r.group(1)) if r else None,
        "server_wait_s": float(r.group(2)) if r else None,
        "adapter_load_s": float(r.group(3)) if r else None,
        "plugin_wait_s": float(w.group(1)) if w else None,
    }


def post(url, body, timeout=300, raw=False):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        data = r.read()
        return data if raw else json.loads(data)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rlhost", default=os.path.join(ROOT, "target/release/rlhost"))
    ap.add_argument("--config", default=os.path.join(ROOT, "configs/multiply.toml"))
    ap.add_argument("--model-dir", help="default: the built-in model's cache folder")
    ap.add_argument("--adapter", help="a PEFT adapter to sample with (both engines)")
    ap.add_argument("--url", help="a running server instead of starting one")
    ap.add_argument("--served-name", default="multiply")
    ap.add_argument("--port", type=int, default=8770)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--stop", default="</calc>", help="the trigger's stop pattern")
    ap.add_argument("--max-in-flight", type=int, default=64)
    ap.add_argument("--vllm-args", default="", help="extra flags for the server")
    ap.add_argument("--set", action="append", default=[], help="extra --set for every rlhost run")
    a = ap.parse_args()

    model_dir = a.model_dir
    if not model_dir:
        _, err, *_ = sh([a.rlhost, "eval", "--config", a.config, "--prompts", "1"])
        found = re.findall(r"built-in model \S+: (\S+)|building the built-in model \S+ into (\S+) \(once\)", err)
        if not found:
            sys.exit("could not find the built-in model's folder; pass --model-dir")
        model_dir = next(x for x in found[-1] if x)
    url = a.url
    started = False
    if not url:
        out = subprocess.run(
            ["bash", os.path.join(ROOT, "scripts/vllm.sh"), "start", model_dir, str(a.port), a.served_name, *a.vllm_args.split()],
            capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(out.stderr)
        url, started = out.stdout.strip().splitlines()[-1], True
    try:
        run(a, model_dir, url)
    finally:
        if started:
            subprocess.run(["bash", os.path.join(ROOT, "scripts/vllm.sh"), "stop", str(a.port)], capture_output=True)


def run(a, model_dir, url):
    work = tempfile.mkdtemp(prefix="rlhost-vllm-bench-")
    base = ["--config", a.config, "--set", f"model.path={json.dumps(model_dir)}", "--group-size", str(a.group), "--show", "0"]
    common = base + ["--prompts", str(a.prompts)]
    for s in a.set:
        common += ["--set", s]
    if a.adapter:
        common += ["--adapter", a.adapter]
    vllm = ["--set", 'rollout.engine="vllm"', "--set", f"rollout.vllm.servers=[{json.dumps(url)}]",
            "--set", f"rollout.vllm.model={json.dumps(a.served_name)}",
            "--set", f"rollout.vllm.max_in_flight={a.max_in_flight}",
            "--set", f"rollout.vllm.adapter_dir={json.dumps(os.path.join(work, 'adapters'))}"]
    env = dict(os.environ, RUST_LOG="rlhost::sampler::vllm=info")

    # 1-2: the whole rollout, tool in the loop, both engines (the server warmed first).
    sh([a.rlhost, "rollout", *base, *vllm, "--prompts", "8", "--out", os.path.join(work, "warm.jsonl")], env)
    out, _, wall, user, sys_ = sh([a.rlhost, "rollout", *common, "--out", os.path.join(work, "local.jsonl")])
    local = summary(out)
    local.update(cpu_user_s=user, cpu_sys_s=sys_, process_wall_s=wall)
    out, err, *_ = sh([a.rlhost, "rollout", *common, *vllm, "--out", os.path.join(work, "vllm.jsonl")], env)
    remote = summary(out)
    loads = [float(x) for x in re.findall(r"loaded adapter version \d+ as \S+ in ([\d.]+) s", err)]

    # 3: first turns only: no trigger, its pattern a stop string.
    cfg = open(a.config).read()
    no_trigger = os.path.join(os.path.dirname(os.path.abspath(a.config)), ".bench-first-turn.toml")
    with open(no_trigger, "w") as f:
        f.write(re.sub(r'(?m)^trigger\s*=.*$', "", cfg))
    try:
        # One batch of every trajectory, as the straight requests below run: the batches
        # of `rollout.prompts_per_step` each wait for their slowest trajectory.
        ft = [x if x != a.config else no_trigger for x in common] + [
            "--set", f"sampling.stop=[{json.dumps(a.stop)}]", "--set", f"rollout.prompts_per_step={a.prompts}"]
        out, _, *_ = sh([a.rlhost, "rollout", *ft, *vllm, "--out", os.path.join(work, "first.jsonl")], env)
    finally:
        os.remove(no_trigger)
    ours = summary(out)

    # The same first-turn requests, straight to the server.
    trajs = [json.loads(l) for l in open(os.path.join(work, "first.jsonl"))]
    gen = json.load(open(os.path.join(model_dir, "generation_config.json")))
    eos = gen.get("eos_token_id", [])
    eos = eos if isinstance(eos, list) else [eos]
    max_new = int(re.search(r"max_new_tokens\s*=\s*(\d+)", cfg).group(1))
    temp = float(re.search(r"temperature\s*=\s*([\d.]+)", cfg).group(1))

    # With an adapter, the straight requests sample with it too (loaded under a name of
    # their own: rlhost unloads its versions when it exits).
    model = a.served_name
    if a.adapter:
        model = f"bench-straight-{os.getpid()}"
        post(f"{url}/v1/load_lora_adapter", {"lora_name": model, "lora_path": os.path.abspath(a.adapter)}, raw=True)

    def one(i_t):
        i, t = i_t
        body = {"model": model, "prompt": t["tokens"][: t["prompt_len"]], "max_tokens": max_new,
                "temperature": temp, "top_k": -1, "top_p": 1.0, "seed": 1000 + i, "n": 1, "stop": [a.stop],
                "stop_token_ids": eos, "ignore_eos": True, "logprobs": 0, "return_token_ids": True}
        r = post(f"{url}/v1/completions", body)
        return len(r["choices"][0]["token_ids"])

    t0 = time.time()
    with cf.ThreadPoolExecutor(a.max_in_flight) as ex:
        tokens = sum(ex.map(one, enumerate(trajs)))
    direct_wall = time.time() - t0
    direct = {"tok_s": tokens / direct_wall, "traj_s": len(trajs) / direct_wall, "wall_s": direct_wall}
    if a.adapter:
        post(f"{url}/v1/unload_lora_adapter", {"lora_name": model}, raw=True)

    n = a.prompts * a.group
    print(f"# {a.prompts} prompts x {a.group} = {n} trajectories, {model_dir}")
    print(f"{'':34}{'trajectories/s':>16}{'sampled tok/s':>16}{'wall s':>9}")
    print(f"{'local engine (tool in the loop)':34}{local['traj_s']:>16.1f}{local['tok_s']:>16.0f}{local['wall_s']:>9.1f}")
    print(f"{'vLLM engine (tool in the loop)':34}{remote['traj_s']:>16.1f}{remote['tok_s']:>16.0f}{remote['wall_s']:>9.1f}")
    print(f"{'vLLM engine, first turns':34}{ours['traj_s']:>16.1f}{ours['tok_s']:>16.0f}{ours['wall_s']:>9.1f}")
    print(f"{'same requests, straight':34}{direct['traj_s']:>16.1f}{direct['tok_s']:>16.0f}{direct['wall_s']:>9.1f}")
    print(f"local / vLLM engine: {local['tok_s'] / remote['tok_s']:.2f}x;  local / straight to vLLM: {local['tok_s'] / direct['tok_s']:.2f}x")
    print(f"rlhost's client: {100 * (1 - ours['tok_s'] / direct['tok_s']):.1f}% below the straight requests")
    cpu = local["cpu_user_s"] + local["cpu_sys_s"]
    print(f"local engine CPU: user {local['cpu_user_s']:.1f} s, system {local['cpu_sys_s']:.1f} s ({100 * local['cpu_sys_s'] / max(cpu, 1e-9):.1f}% system)")
    print(f"vLLM engine: {remote['requests']} requests for {n} trajectories")
    if remote["server_wait_s"] is not None:
        rest = remote["wall_s"] - remote["server_wait_s"] - remote["adapter_load_s"] - (remote["plugin_wait_s"] or 0)
        print(f"where the vLLM engine's {remote['wall_s']:.1f} s went: waiting on the servers {remote['server_wait_s']:.1f} s, "
              f"loading adapters {remote['adapter_load_s']:.2f} s, waiting on plugins {remote['plugin_wait_s'] or 0:.2f} s, "
              f"the rest (scheduling, tokens, scoring) {rest:.2f} s")
    if loads:
        print(f"adapter versions loaded: {len(loads)}, {sum(loads) / len(loads):.2f} s each")


if __name__ == "__main__":
    main()
