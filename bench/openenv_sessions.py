#!/usr/bin/env python3
"""What an OpenEnv session costs: `rlhost env serve` against OpenEnv's own template server.

Not a test: a measurement (issue 47). Both servers are driven by openenv-core's
GenericEnvClient, one session after another: connect and reset (a session's start), one
step, close. The template is what `openenv init` writes (an echo environment, FastAPI and
uvicorn, no Docker); rlhost serves plugins/dist/guess_number.wasm on one sample.

    bash scripts/openenv.sh install        # the client (rlhost's side)
    python3 -m venv /tmp/oe-venv && /tmp/oe-venv/bin/pip install openenv-core==0.3.0
    (cd /tmp && /tmp/oe-venv/bin/openenv init demo_env)
    /tmp/oe-venv/bin/python bench/openenv_sessions.py --template /tmp/demo_env \\
        --rlhost target/debug/rlhost [--sessions 50]

Prints per server the median and p90 of a session's start and of a step, and each
server's start-up time (process start to its first answered session).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from openenv import GenericEnvClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_first_session(url, action, deadline=120):
    started = time.perf_counter()
    while time.perf_counter() - started < deadline:
        try:
            with GenericEnvClient(base_url=url, message_timeout_s=30).sync() as env:
                env.reset()
                env.step(action)
            return
        except Exception:
            time.sleep(0.05)
    raise RuntimeError(f"{url}: no session answered in {deadline} s")


def sessions(url, action, n):
    starts, steps = [], []
    for i in range(n):
        t0 = time.perf_counter()
        env = GenericEnvClient(base_url=url, message_timeout_s=30).sync()
        env.connect()
        env.reset(seed=i)
        t1 = time.perf_counter()
        env.step(action)
        t2 = time.perf_counter()
        env.close()
        starts.append(t1 - t0)
        steps.append(t2 - t1)
    return starts, steps


def report(name, boot, starts, steps):
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1e3
    print(f"{name:28} start-up {boot:6.2f} s | session start median {statistics.median(starts) * 1e3:7.2f} ms, "
          f"p90 {q(starts, 0.9):7.2f} ms | step median {statistics.median(steps) * 1e3:6.2f} ms, p90 {q(steps, 0.9):6.2f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--template", required=True, help="the directory `openenv init` wrote")
    ap.add_argument("--rlhost", default=os.path.join(ROOT, "target/debug/rlhost"))
    ap.add_argument("--sessions", type=int, default=50)
    ap.add_argument("--port", type=int, default=8931)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="rlhost-openenv-")
    data = os.path.join(work, "guess.jsonl")
    with open(data, "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "Guess my number."}],
                            "metadata": {"secret": 42}}) + "\n")

    servers = [
        ("rlhost env serve (wasm)",
         [a.rlhost, "env", "serve", os.path.join(ROOT, "plugins/dist/guess_number.wasm"), "--data", data,
          "--port", str(a.port)], None, {"message": "I guess 50."}, a.port),
        ("openenv template (uvicorn)",
         [sys.executable, "-m", "uvicorn", "server.app:app", "--port", str(a.port + 1)], a.template,
         {"message": "hello"}, a.port + 1),
    ]
    for name, cmd, cwd, action, port in servers:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_first_session(url, action)
            boot = time.perf_counter() - t0
            starts, steps = sessions(url, action, a.sessions)
            report(name, boot, starts, steps)
        finally:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
