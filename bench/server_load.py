#!/usr/bin/env python3
"""Load check for the servers facing clients (issue 68; a benchmark, not a CI test).

For each server (the gateway `rlhost serve`, the Tinker API `rlhost serve --tinker`, and
OpenEnv `rlhost env serve`), on the built-in model and on plugins/dist/guess_number.wasm:

  idle    no client; /health timed
  stalled 1,030 connections that each send a request header and part of a body, then
          nothing (1,030 of them stopped /healthz before the front policy)
  busy    256 clients at once, each sending real requests back to back (a short chat
          completion, an `asample` of 8 tokens, a reset + step)

During each phase the health route is timed every 100 ms, and the server's resident
memory read from /proc. Prints, per server and phase: the health route's median and
worst time and how many probes failed, requests answered / refused, and memory before,
at its peak during, and after.

Then, alone on a quiet server, one request at a time of the largest and most demanding
kinds each server takes or refuses (bodies near the cap, the sizes a client picks at
their limits and past them): the rise of the server's peak resident memory (VmHWM, reset
through /proc/PID/clear_refs before each) against the issue's bound, 10x the body or
256 MiB, whichever is smaller.

  python3 bench/server_load.py                 # all three, 20 s a phase
  python3 bench/server_load.py --seconds 10 --servers tinker

Needs the release binary (`cargo build --release -p rlhost`) and the plugins
(`bash plugins/build.sh`); raises the open-file limit to fit the stalled connections.
"""

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reset_hwm(pid):
    # "5" resets the peak resident set size to the current one (Linux 4.0 and later).
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def status_mib(pid, field):
    """A memory line of /proc/PID/status (VmRSS: resident now, VmHWM: its peak), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def rss_mib(pid):
    return status_mib(pid, "VmRSS")


def hwm_mib(pid):
    return status_mib(pid, "VmHWM")


def http(addr, method, path, body=None, timeout=30, headers=""):
    data = json.dumps(body).encode() if body is not None else b""
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=timeout)
    try:
        try:
            s.sendall(
                f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data
            )
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered (a refusal) before the whole body was read: read the answer
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
    finally:
        s.close()
    status = int(out[9:12]) if out[:5] == b"HTTP/" else 0
    body = out.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in out else b""
    return status, body


def start(cmd, ready_word):
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    while True:
        line = p.stdout.readline()
        if not line:
            sys.exit(f"{cmd[:3]} ended before it listened")
        if ready_word in line:
            url = next(w for w in line.split() if w.startswith("http://"))
            addr = url[len("http://"):].split("/")[0]
            # Keep reading stdout so that the server never blocks on a full pipe.
            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
            return p, addr


class Probe(threading.Thread):
    """Times the health route every 100 ms until stopped; samples memory too."""

    def __init__(self, addr, path, pid):
        super().__init__(daemon=True)
        self.addr, self.path, self.pid = addr, path, pid
        self.times, self.failed, self.peak = [], 0, 0.0
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            t0 = time.time()
            try:
                status, _ = http(self.addr, "GET", self.path, timeout=10)
                ok = status == 200
            except OSError:
                ok = False
            if ok:
                self.times.append(time.time() - t0)
            else:
                self.failed += 1
            self.peak = max(self.peak, rss_mib(self.pid))
            time.sleep(0.1)


def stalled(addr, n, path, headers):
    host, port = addr.rsplit(":", 1)
    held = []
    for _ in range(n):
        try:
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{headers}Content-Length: 100\r\n\r\n{{\"a".encode())
            held.append(s)
        except OSError:
            break
    return held


def clients(addr, n, seconds, request):
    counts = {"answered": 0, "refused": 0, "failed": 0}
    lock = threading.Lock()
    end = time.time() + seconds

    def worker():
        while time.time() < end:
            try:
                status = request(addr)
                key = "answered" if status == 200 else "refused"
            except OSError:
                key = "failed"
            with lock:
                counts[key] += 1

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts


def gateway_request(addr):
    return http(addr, "POST", "/v1/chat/completions",
                {"model": "policy", "messages": [{"role": "user", "content": "What is 12 * 34?"}], "max_tokens": 8})[0]


def tinker_request(addr):
    status, body = http(addr, "POST", "/api/v1/asample",
                        {"num_samples": 1, "base_model": "builtin:multiply",
                         "prompt": {"chunks": [{"tokens": [5, 6, 7]}]}, "sampling_params": {"max_tokens": 8}})
    if status != 200:
        return status
    request = json.loads(body)["request_id"]
    while True:
        status, _ = http(addr, "POST", "/api/v1/retrieve_future", {"request_id": request}, timeout=60)
        if status != 408:
            return status


def openenv_request(addr):
    status, _ = http(addr, "POST", "/reset", {})
    if status != 200:
        return status
    return http(addr, "POST", "/step", {"action": {"message": "I guess 50."}})[0]


def big(mib):
    return "7 " * (mib << 19)


def settle(addr, status, body):
    """The final status of a Tinker call: its future's, polled, when it made one."""
    if status != 200:
        return status
    request = json.loads(body).get("request_id")
    if request is None:
        return status
    while True:
        status, answer = http(addr, "POST", "/api/v1/retrieve_future", {"request_id": request}, timeout=120)
        if status != 408:
            # A refused operation's future answers 200 with Tinker's error shape.
            return "error" if status == 200 and b'"error"' in answer else status


def one_request_cases(name):
    """(what, method, path, body) for each single request of a server's memory check."""
    chat = "/v1/chat/completions"
    if name == "gateway":
        return [
            ("a 15 MiB message", "POST", chat,
             {"model": "policy", "messages": [{"role": "user", "content": big(15)}], "max_tokens": 8}),
            ("4 MiB of tools", "POST", chat,
             {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
              "tools": [{"type": "function", "function": {"name": f"f{i}", "description": "x" * 4000,
                                                          "parameters": {"type": "object", "properties": {}}}}
                        for i in range(1000)]}),
            ("n = 128, 900 tokens each, top 20 log-probs", "POST", chat,
             {"model": "policy", "messages": [{"role": "user", "content": "What is 12 * 34?"}],
              "max_tokens": 900, "n": 128, "logprobs": True, "top_logprobs": 20, "temperature": 1.0}),
            ("n = 64, 900 tokens each", "POST", chat,
             {"model": "policy", "messages": [{"role": "user", "content": "What is 12 * 34?"}],
              "max_tokens": 900, "n": 64, "temperature": 1.0}),
            ("n = 10^6 (refused)", "POST", chat,
             {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "n": 1000000}),
        ]
    if name == "tinker":
        sample = {"base_model": "builtin:multiply", "prompt": {"chunks": [{"tokens": [5, 6, 7]}]}}
        return [
            ("asample, top-k 10^9 (refused)", "POST", "/api/v1/asample",
             dict(sample, num_samples=1, sampling_params={"max_tokens": 8}, topk_sample_logprobs=10**9)),
            ("asample, 256 samples x 256 top-k x 500 (refused)", "POST", "/api/v1/asample",
             dict(sample, num_samples=256, sampling_params={"max_tokens": 500}, topk_sample_logprobs=256)),
            ("asample, 256 samples x 900 tokens", "POST", "/api/v1/asample",
             dict(sample, num_samples=256, sampling_params={"max_tokens": 900, "stop": []})),
            ("asample, 64 samples x 900 tokens", "POST", "/api/v1/asample",
             dict(sample, num_samples=64, sampling_params={"max_tokens": 900, "stop": []})),
            ("asample, a 60 MiB prompt (refused)", "POST", "/api/v1/asample",
             dict(sample, num_samples=1, prompt={"chunks": [{"tokens": [5] * (30 << 20)}]},
                  sampling_params={"max_tokens": 8})),
            ("create_model, rank 128", "POST", "/api/v1/create_model", "session:128"),
            ("create_model, rank 10^6 (refused)", "POST", "/api/v1/create_model", "session:1000000"),
        ]
    return [
        ("step, a 15 MiB action", "POST", "/step", {"action": {"message": big(15)}}),
        ("reset", "POST", "/reset", {}),
    ]


def one_request(name, addr, pid):
    rows = []
    session = None
    for what, method, path, body in one_request_cases(name):
        if isinstance(body, str) and body.startswith("session:"):
            if session is None:
                _, b = http(addr, "POST", "/api/v1/create_session", {"tags": []})
                session = json.loads(b)["session_id"]
            body = {"session_id": session, "model_seq_id": len(rows), "base_model": "builtin:multiply",
                    "lora_config": {"rank": int(body.split(":")[1])}}
        size = len(json.dumps(body).encode())
        time.sleep(0.5)
        reset_hwm(pid)
        before = rss_mib(pid)
        status, answer = http(addr, method, path, body, timeout=600)
        if name == "tinker":
            status = settle(addr, status, answer)
        rise = hwm_mib(pid) - before
        bound = min(10 * size / 2**20, 256)
        rows.append((name, what, size / 2**20, status, rise, bound))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--servers", default="gateway,tinker,openenv")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--stalled", type=int, default=1030)
    ap.add_argument("--no-single", action="store_true", help="skip the one-request memory check")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    binary = os.path.join(ROOT, "target/release/rlhost")
    data = "/tmp/rlhost-load-guess.jsonl"
    with open(data, "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "Guess my number."}],
                            "metadata": {"secret": 42}}) + "\n")
    servers = {
        "gateway": ([binary, "serve", "--addr", "127.0.0.1:0"], "rlhost serve:", "/status", gateway_request, "/v1/chat/completions"),
        "tinker": ([binary, "serve", "--tinker", "--addr", "127.0.0.1:0", "--checkpoints", "/tmp/rlhost-load-ckpt"],
                   "rlhost serve --tinker", "/api/v1/healthz", tinker_request, "/api/v1/asample"),
        "openenv": ([binary, "env", "serve", os.path.join(ROOT, "plugins/dist/guess_number.wasm"), "--data", data, "--port", "0", "--max-sessions", "512"],
                    "serving", "/health", openenv_request, "/reset"),
    }
    rows, singles = [], []
    for name in args.servers.split(","):
        cmd, ready, health, request, post_path = servers[name]
        p, addr = start(cmd, ready)
        time.sleep(1)
        before = rss_mib(p.pid)
        for phase in ["idle", "stalled", "busy"]:
            probe = Probe(addr, health, p.pid)
            probe.start()
            counts, held = {}, []
            if phase == "stalled":
                held = stalled(addr, args.stalled, post_path, "")
                time.sleep(args.seconds)
                counts = {"held": len(held)}
            elif phase == "busy":
                counts = clients(addr, args.clients, args.seconds, request)
            else:
                time.sleep(args.seconds)
            probe.stop.set()
            probe.join()
            for s in held:
                s.close()
            time.sleep(1)
            after = rss_mib(p.pid)
            t = probe.times or [float("nan")]
            rows.append((name, phase, statistics.median(t) * 1000, max(t) * 1000, probe.failed, counts, before, probe.peak, after))
        if not args.no_single:
            singles += one_request(name, addr, p.pid)
        p.terminate()
        p.wait()
    print(f"{'server':8} {'phase':8} {'health median':>14} {'worst':>9} {'failed':>7}  {'memory before / peak / after (MiB)':>36}  requests")
    for name, phase, med, worst, failed, counts, before, peak, after in rows:
        print(f"{name:8} {phase:8} {med:11.1f} ms {worst:6.0f} ms {failed:7}  {before:10.0f} / {peak:6.0f} / {after:6.0f}  {counts}")
    if singles:
        print()
        print(f"{'server':8} {'one request':50} {'body':>9} {'status':>6} {'peak rise':>10} {'bound':>9}")
        for name, what, size, status, rise, bound in singles:
            # Under 1 MiB is the allocator's own noise, whatever the body.
            mark = "" if rise <= max(bound, 1.0) else "  over"
            print(f"{name:8} {what:50} {size:5.2f} MiB {status!s:>6} {rise:6.1f} MiB {bound:5.1f} MiB{mark}")


if __name__ == "__main__":
    main()
