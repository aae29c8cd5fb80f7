#!/usr/bin/env python3
"""The `math_answer` reward against `math-verify` on the same (gold, completion) pairs.

Not a test: a measurement (issue 36). Needs `math-verify` (`pip install
'math-verify[antlr4_13_2]'`), the built plugin and an rlhost binary:

    python3 scripts/math_pairs.py --out /tmp/pairs.jsonl
    python3 bench/math_agreement.py /tmp/pairs.jsonl [--rlhost target/debug/rlhost]

math-verify is called as TRL's `accuracy_reward` calls it on a completion: `verify(
parse(gold), parse(completion))`. Each pair is labelled equivalent or not by
construction, so for every disagreement the table says which side is right. Prints the
agreement rate, each side's accuracy against the labels, and the disagreement classes.
"""

import argparse
import collections
import concurrent.futures as cf
import json
import os
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ours(rlhost, plugin, pair, work, i):
    sample = os.path.join(work, f"s{i}.json")
    with open(sample, "w") as f:
        json.dump({"messages": [{"role": "user", "content": "q"}], "metadata": {"answer": pair["gold"]}}, f)
    out = subprocess.run([rlhost, "plugin", "call", plugin, "reward", "--sample", sample,
                          "--text", pair["completion"], "--json", "-q"],
                         capture_output=True, text=True, check=True).stdout
    comps = {c["name"]: c["value"] for c in json.loads(out)["components"]}
    return comps["correct"] == 1.0


def theirs(pair):
    from math_verify import parse, verify
    try:
        return bool(verify(parse(pair["gold"]), parse(pair["completion"])))
    except Exception:
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pairs")
    ap.add_argument("--rlhost", default=os.path.join(ROOT, "target/debug/rlhost"))
    ap.add_argument("--plugin", default=os.path.join(ROOT, "plugins/dist/math_answer.wasm"))
    a = ap.parse_args()
    pairs = [json.loads(l) for l in open(a.pairs)]
    work = tempfile.mkdtemp(prefix="rlhost-math-")
    with cf.ThreadPoolExecutor(4) as ex:
        mine = list(ex.map(lambda ip: ours(a.rlhost, a.plugin, ip[1], work, ip[0]), enumerate(pairs)))
    mv = [theirs(p) for p in pairs]
    n = len(pairs)
    agree = sum(x == y for x, y in zip(mine, mv))
    right_ours = sum(x == p["same"] for x, p in zip(mine, pairs))
    right_mv = sum(y == p["same"] for y, p in zip(mv, pairs))
    print(f"{n} pairs: agreement {agree / n:.1%} ({agree}); right by construction: math_answer "
          f"{right_ours / n:.1%}, math-verify {right_mv / n:.1%}")
    by_set = collections.defaultdict(lambda: [0, 0])
    for x, y, p in zip(mine, mv, pairs):
        by_set[p["set"]][0] += x == y
        by_set[p["set"]][1] += 1
    for s, (k, t) in sorted(by_set.items()):
        print(f"  {s:12} agreement {k / t:.1%} of {t}")
    classes = collections.Counter()
    example = {}
    for x, y, p in zip(mine, mv, pairs):
        if x != y:
            key = (p["set"], p["kind"], x, y, p["same"])
            classes[key] += 1
            example.setdefault(key, p)
    print("\ndisagreements (set, kind, math_answer, math-verify, truth: right side, count, example):")
    for (s, kind, x, y, same), count in classes.most_common():
        right = "math_answer" if x == same else "math-verify"
        e = example[(s, kind, x, y, same)]
        print(f"  {s:11} {kind:28} ours {x!s:5} mv {y!s:5} same {same!s:5} -> {right:11} x{count}  "
              f"gold {e['gold'][-40:]!r} vs {e['completion'][-40:]!r}")
    wrong = collections.Counter((p["set"], p["kind"], x, y) for x, y, p in zip(mine, mv, pairs) if x != p["same"])
    if wrong:
        print("\nmath_answer against the construction (set, kind, ours, math-verify, count):")
        for (s_, kind, x, y), count in wrong.most_common():
            print(f"  {s_:11} {kind:28} ours {x!s:5} mv {y!s:5} x{count}")


if __name__ == "__main__":
    main()
