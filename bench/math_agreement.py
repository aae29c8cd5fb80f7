#!/usr/bin/env python3
"""The `math_answer` reward against `math-verify` on the same labelled (gold, completion) pairs.

Not a test: a measurement (issues 36 and 48). Needs `math-verify` (`pip install
'math-verify[antlr4_13_2]'`), the built plugin and an rlhost binary. Pair files:

- plugins/math_answer/tests/answers.jsonl: hand-written and hand-labelled, every class of
  answer (the plugin's unit tests hold it to these labels); answers_heldout.jsonl beside
  it: written by someone else after the plugin was, never tuned on;
- scripts/math_pairs.py --out /tmp/pairs.jsonl: generated numbers in different
  spellings, labelled by construction.

    python3 bench/math_agreement.py plugins/math_answer/tests/answers.jsonl [--rlhost target/debug/rlhost]

Each pair is scored by the plugin in rlhost's sandbox (`rlhost plugin call ... reward
--repeat N`: the time per score on a loaded, open scorer) and by math-verify in this
process, the gold wrapped in `$…$` when it has neither `\\boxed{}` nor `$` (a bare MATH
answer such as `2x+1` is otherwise not found, or found in part) and both parsed with the
default configs: math-verify at its best on these pairs. Prints the agreement, each
side's rightness against the labels per class, the time per score of each per class
(median), and every pair where they differ.
"""

import argparse
import collections
import json
import os
import statistics
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ours(rlhost, plugin, pair, work, i, repeat):
    sample = os.path.join(work, f"s{i}.json")
    with open(sample, "w") as f:
        json.dump({"messages": [{"role": "user", "content": "q"}], "metadata": {"answer": pair["gold"]}}, f)
    out = subprocess.run([rlhost, "plugin", "call", plugin, "reward", "--sample", sample,
                          "--text", pair["completion"], "--repeat", str(repeat), "--json", "-q"],
                         capture_output=True, text=True, check=True).stdout
    out = json.loads(out)
    comps = {c["name"]: c["value"] for c in out["components"]}
    return comps["correct"] == 1.0, out["seconds_per_score"]


def theirs(pair):
    from math_verify import parse, verify
    gold = pair["gold"]
    if "\\boxed" not in gold and "$" not in gold:
        gold = f"${gold}$"
    started = time.perf_counter()
    try:
        verdict = bool(verify(parse(gold), parse(pair["completion"])))
    except Exception:
        verdict = False
    return verdict, time.perf_counter() - started


def kind(pair):
    return pair.get("class") or f"{pair['set']}/{pair['kind']}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pairs")
    ap.add_argument("--rlhost", default=os.path.join(ROOT, "target/debug/rlhost"))
    ap.add_argument("--plugin", default=os.path.join(ROOT, "plugins/dist/math_answer.wasm"))
    ap.add_argument("--repeat", type=int, default=20, help="scores per pair timed in the sandbox")
    a = ap.parse_args()
    pairs = [json.loads(l) for l in open(a.pairs) if l.strip()]
    work = tempfile.mkdtemp(prefix="rlhost-math-")
    # One at a time: the times are per score, and two processes would share the cores.
    mine = [ours(a.rlhost, a.plugin, p, work, i, a.repeat) for i, p in enumerate(pairs)]
    mv = [theirs(p) for p in pairs]
    n = len(pairs)
    agree = sum(x[0] == y[0] for x, y in zip(mine, mv))
    right_ours = sum(x[0] == p["same"] for x, p in zip(mine, pairs))
    right_mv = sum(y[0] == p["same"] for y, p in zip(mv, pairs))
    print(f"{n} pairs: agreement {agree / n:.1%} ({agree}); right against the labels: math_answer "
          f"{right_ours / n:.1%} ({right_ours}), math-verify {right_mv / n:.1%} ({right_mv})")
    by = collections.defaultdict(list)
    for x, y, p in zip(mine, mv, pairs):
        by[kind(p)].append((x, y, p))
    print(f"\n  {'class':20} {'pairs':>5} {'math_answer':>11} {'math-verify':>11} "
          f"{'µs/score (ours)':>16} {'µs/score (mv)':>14}")
    for k, rows in sorted(by.items()):
        ro = sum(x[0] == p["same"] for x, _, p in rows)
        rm = sum(y[0] == p["same"] for _, y, p in rows)
        to = statistics.median(x[1] for x, _, _ in rows) * 1e6
        tm = statistics.median(y[1] for _, y, _ in rows) * 1e6
        print(f"  {k:20} {len(rows):>5} {ro:>11} {rm:>11} {to:>16.1f} {tm:>14.0f}")
    print(f"  {'all':20} {n:>5} {right_ours:>11} {right_mv:>11} "
          f"{statistics.median(x[1] for x in mine) * 1e6:>16.1f} "
          f"{statistics.median(y[1] for y in mv) * 1e6:>14.0f}")
    print("\nwhere they differ (class, truth, math_answer, math-verify, right side, gold, completion):")
    for x, y, p in zip(mine, mv, pairs):
        if x[0] != y[0]:
            right = "math_answer" if x[0] == p["same"] else "math-verify"
            print(f"  {kind(p):20} same {p['same']!s:5} ours {x[0]!s:5} mv {y[0]!s:5} -> {right:11} "
                  f"gold {p['gold'][-40:]!r} vs {p['completion'][-50:]!r}")
    wrong = [(x, y, p) for x, y, p in zip(mine, mv, pairs) if x[0] != p["same"] and x[0] == y[0]]
    if wrong:
        print("\nboth wrong:")
        for x, y, p in wrong:
            print(f"  {kind(p):20} same {p['same']!s:5} gold {p['gold'][-40:]!r} vs {p['completion'][-50:]!r}")


if __name__ == "__main__":
    main()
