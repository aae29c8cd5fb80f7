#!/usr/bin/env python3
"""Does a run learn whatever its seed? (issue 63): runs one `rlhost train` configuration over
N values of `run.seed`, one after another (the 2 cores are the run's), and prints a table
per seed with the median and range of each column. A benchmark, not a test: nothing is
asserted; the exit status is 0 unless a run failed to run.

    python3 bench/seed_sweep.py                                   # the README's main job, seeds 1-10
    python3 bench/seed_sweep.py --plugin plugins/dist/code_trigger.wasm --seeds 1-5
    python3 bench/seed_sweep.py --config configs/units.toml --set train.steps=60
    python3 bench/seed_sweep.py --seeds 2,3,6 -- --set train.lr=3e-4   # anything after -- goes to train
    python3 bench/seed_sweep.py --config configs/gateway-units.toml --set gateway.addr=127.0.0.1:0 \
        --agent "$VENV/bin/python examples/agents/units_agent.py --url {url}"  # the gateway agent's run

Each seed is a run of its own, built-in model included: the built-in model's warm start
depends on the seed, so each seed builds (once; cached like any built-in model) and
probes its own. The columns:
- `calls`/`copies`: the warm start's probe on unseen problems (greedy) of the model RL got:
  reference calls written exactly, tool outputs copied into the answer (what `train`
  prints when it builds the model; blank when the model came from the cache, unless
  --fresh); `warm-start rounds`: how many rounds (over all sets of weights) it took;
- `held-out acc`, `tool use`: the held-out split (greedy) before the first step and after
  the last, as `train`'s last line gives them; `gain`: the accuracy's rise in points;
- `flat`: the share of groups whose rewards were all equal (nothing to learn from), over
  the run, and in its first five steps;
- `worst drop`: the largest fall of the training batch's mean reward in one step, as a
  share of the reward before it (the goal: never more than half); each step's batch holds
  new prompts, so one batch of hard prompts makes such a fall with no harm done;
  `lasting drop`: the largest fall from one step to the mean of the three after it (a
  collapse lasts); `held-out drop`: the largest fall of the held-out accuracy from one
  evaluation to the next, as a share of the one before; with `--set train.eval_every=1`
  that is what one update did to the same problems, with no new batch to blame;
- `entropy`, `grad`, `clip`: means over the run of the sampled tokens' entropy, the
  gradient's norm before clipping and the clip fraction.

Needs a release build (`cargo build --release`) and the plugins (`bash plugins/build.sh`).
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = re.compile(
    r"warm start, (?:[^:\n]*: )?on (\d+) unseen problems.*?exactly for (\d+).*?answer for (\d+)"
)
HELD_OUT = re.compile(
    r"held-out \((\d+) prompts, greedy\), start -> step (\d+): accuracy ([\d.]+)% -> ([\d.]+)%,"
    # A run with functions (`rollout.tools`) reports its malformed calls between the two.
    r" tool use ([\d.]+)% -> ([\d.]+)%,(?: malformed calls [^,]*,)? reward ([-\d.]+) -> ([-\d.]+)"
)


def seeds(text):
    """`1-10`, `2,3,6` or a mix."""
    out = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out


def run_one(args, seed, extra):
    out_dir = os.path.join(args.out, f"seed-{seed}")
    log_path = out_dir + ".log"
    cmd = [args.rlhost, "train", "--no-status", "--overwrite"]
    if args.config:
        cmd += ["--config", args.config]
    for p in args.plugin:
        cmd += ["--plugin", p]
    cmd += ["--set", f"run.seed={seed}", "--set", f"run.out_dir={os.path.abspath(out_dir)}"]
    for s in args.set:
        cmd += ["--set", s]
    cmd += extra
    env = dict(os.environ)
    if args.fresh:
        env["RLHOST_CACHE_DIR"] = os.path.join(os.path.abspath(args.out), "cache")
    t0 = time.time()
    with open(log_path, "w") as log:
        if args.agent:
            rc = run_with_agent(args.agent, cmd, env, log, log_path, out_dir + ".agent.log")
        else:
            rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    return read_run(seed, out_dir, rc, time.time() - t0)


GATEWAY = re.compile(r"gateway: (http://\S+?)/v1 ")


def run_with_agent(agent, cmd, env, log, log_path, agent_log):
    """A gateway run: `train`, then `agent` (its `{url}` the address train prints) once the
    gateway listens. The agent ends by itself when the gateway goes (the run ended); one
    still running 60 s after is stopped."""
    train = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = None
    while url is None and train.poll() is None:
        time.sleep(1)
        if m := GATEWAY.search(open(log_path, errors="replace").read()):
            url = m.group(1)
    if url is None:
        return train.wait()
    with open(agent_log, "w") as out:
        client = subprocess.Popen(shlex.split(agent.replace("{url}", url)), cwd=ROOT,
                                  stdout=out, stderr=subprocess.STDOUT)
        rc = train.wait()
        try:
            client.wait(timeout=60)
        except subprocess.TimeoutExpired:
            client.kill()
            client.wait()
    return rc


def read_run(seed, out_dir, rc=0, seconds=None):
    """What a finished run's log and metrics say."""
    log_path = out_dir + ".log"
    text = open(log_path, errors="replace").read().replace("\r", "\n")
    row = {"seed": seed, "rc": rc, "log": log_path}
    if seconds is not None:
        row["s"] = seconds
    probes = PROBE.findall(text)
    if probes:
        # The last probe is the model RL got; the count of probes is the warm start's rounds.
        n, calls, copies = probes[-1]
        row["probe"], row["calls"], row["copies"] = int(n), int(calls), int(copies)
        row["rounds"] = len(probes)
    if m := HELD_OUT.search(text):
        row["acc0"], row["acc1"] = float(m.group(3)), float(m.group(4))
        row["use0"], row["use1"] = float(m.group(5)), float(m.group(6))
        row["rew0"], row["rew1"] = float(m.group(7)), float(m.group(8))
        row["gain"] = row["acc1"] - row["acc0"]
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        steps = [json.loads(l) for l in open(metrics) if l.strip()]
        if steps:
            row.update(summarise(steps))
            start = os.path.join(out_dir, "eval_start.json")
            held = [json.load(open(start))["accuracy"]] if os.path.exists(start) else []
            held += [s["eval_accuracy"] for s in steps if s.get("eval_accuracy") is not None]
            # With `--set train.eval_every=1`, what each update alone did: the same held-out
            # problems before and after it, greedy, so no batch of hard prompts moves it.
            falls = [(a - b) / a for a, b in zip(held, held[1:]) if a > 0 and b < a]
            if len(held) > 1:
                row["held_drop"] = max(falls, default=0.0)
    return row


def summarise(steps):
    rewards = [s["reward_mean"] for s in steps]
    drops = [
        (a - b) / abs(a) for a, b in zip(rewards, rewards[1:]) if a > 0 and b < a
    ]
    # A step's batch is new prompts: one batch of hard ones (4-digit products, for the
    # calculator) halves the mean with no harm done. A collapse lasts: the fall to the mean
    # of the next three steps.
    lasting = [
        (rewards[i] - statistics.fmean(rewards[i + 1 : i + 4])) / abs(rewards[i])
        for i in range(len(rewards) - 3)
        if rewards[i] > 0
    ]
    mean = lambda key: statistics.fmean(s[key] for s in steps if s.get(key) is not None)
    flat = [
        None if s.get("groups_flat") is None else s["groups_flat"] + s["groups_dropped"]
        for s in steps
    ]
    row = {
        "worst_drop": max(drops, default=0.0),
        "lasting_drop": max(lasting, default=0.0),
        "entropy": mean("entropy"),
        "grad": mean("grad_norm"),
        "clip": mean("clip_fraction"),
        "batch_acc_last": statistics.fmean(s.get("accuracy") or 0.0 for s in steps[-5:]),
    }
    if all(f is not None for f in flat):
        groups = [max(s["groups"] + s["groups_dropped"], 1) for s in steps]
        row["flat"] = sum(flat) / sum(groups)
        row["flat5"] = sum(flat[:5]) / sum(groups[:5])
    return row


COLUMNS = [
    ("seed", "seed", "{:d}"),
    ("calls", "calls", "{:d}"),
    ("copies", "copies", "{:d}"),
    ("rounds", "warm-start rounds", "{:d}"),
    ("acc0", "acc start %", "{:.0f}"),
    ("acc1", "acc end %", "{:.0f}"),
    ("gain", "gain pts", "{:+.0f}"),
    ("use0", "use start %", "{:.0f}"),
    ("use1", "use end %", "{:.0f}"),
    ("rew0", "reward start", "{:.3f}"),
    ("rew1", "reward end", "{:.3f}"),
    ("flat", "flat", "{:.2f}"),
    ("flat5", "flat 1-5", "{:.2f}"),
    ("worst_drop", "worst drop", "{:.2f}"),
    ("lasting_drop", "lasting drop", "{:.2f}"),
    ("held_drop", "held-out drop", "{:.2f}"),
    ("entropy", "entropy", "{:.3f}"),
    ("grad", "grad", "{:.3f}"),
    ("clip", "clip", "{:.3f}"),
    ("s", "seconds", "{:.0f}"),
]


def table(rows, min_gain):
    shown = [c for c in COLUMNS if any(c[0] in r for r in rows)]
    lines = ["| " + " | ".join(c[1] for c in shown) + " |", "|" + "---|" * len(shown)]
    for r in rows:
        cells = [c[2].format(r[c[0]]) if c[0] in r else "" for c in shown]
        if r["rc"] != 0:
            cells[0] += f" (exit {r['rc']})"
        lines.append("| " + " | ".join(cells) + " |")
    for name, f in (("median", statistics.median), ("min", min), ("max", max)):
        cells = []
        for key, _, fmt in shown:
            values = [r[key] for r in rows if key in r]
            cells.append(fmt.replace(":d", ":.0f").format(f(values)) if values and key != "seed" else "")
        cells[0] = name
        lines.append("| " + " | ".join(cells) + " |")
    learned = [r for r in rows if r.get("gain") is not None and r["gain"] >= min_gain]
    halved = [r for r in rows if r.get("worst_drop", 0.0) > 0.5]
    collapsed = [r for r in rows if r.get("lasting_drop", 0.0) > 0.5]
    lines.append("")
    lines.append(
        f"{len(learned)} of {len(rows)} seeds raised held-out accuracy by at least {min_gain:g} points;"
        f" {len(halved)} had a step that more than halved the training reward"
        + (f" (seeds {', '.join(str(r['seed']) for r in halved)})" if halved else "")
        + f", {len(collapsed)} one that halved it for the three steps after"
        + (f" (seeds {', '.join(str(r['seed']) for r in collapsed)})" if collapsed else "")
    )
    return "\n".join(lines)


def main():
    extra = []
    argv = sys.argv[1:]
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="1-10", help="run.seed values: 1-10, 2,3,6 (default 1-10)")
    ap.add_argument("--config", help="a run config (default: the built-in run the plugins choose)")
    ap.add_argument("--plugin", action="append", default=[], help="as train's --plugin")
    ap.add_argument("--set", action="append", default=[], help="as train's --set KEY=VALUE")
    ap.add_argument("--rlhost", default=os.path.join(ROOT, "target/release/rlhost"))
    ap.add_argument("--out", default=os.path.join(ROOT, "runs/seed-sweep"))
    ap.add_argument("--fresh", action="store_true",
                    help="build each seed's built-in model anew in OUT/cache (the warm start's probe is printed only when it is built)")
    ap.add_argument("--reprint", action="store_true",
                    help="run nothing: print the table of the runs already in OUT for these seeds")
    ap.add_argument("--agent",
                    help="for a run with a [gateway]: the agent's command, started when the run prints the "
                         "gateway's address, which replaces {url} in it (its output in OUT/seed-N.agent.log)")
    ap.add_argument("--min-gain", type=float, default=40.0, help="the held-out gain counted as learning (points)")
    args = ap.parse_args(argv)
    if not os.path.exists(args.rlhost):
        sys.exit(f"no {args.rlhost}: build it with `cargo build --release`")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for seed in seeds(args.seeds):
        if args.reprint:
            run_dir = os.path.join(args.out, f"seed-{seed}")
            if not os.path.exists(run_dir + ".log"):
                print(f"seed {seed}: no run in {args.out}", file=sys.stderr)
                continue
            rows.append(read_run(seed, run_dir))
            continue
        row = run_one(args, seed, extra)
        rows.append(row)
        done = f"acc {row.get('acc0', float('nan')):.0f}% -> {row.get('acc1', float('nan')):.0f}%"
        print(f"seed {seed}: {done} in {row['s']:.0f} s (log {row['log']})", file=sys.stderr, flush=True)
    if not rows:
        sys.exit(f"no runs of seeds {args.seeds} in {args.out} (each as seed-N.log and seed-N/)")
    print(table(rows, args.min_gain))
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)
    sys.exit(0 if all(r["rc"] == 0 for r in rows) else 1)


if __name__ == "__main__":
    main()
