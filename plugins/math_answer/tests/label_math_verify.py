#!/usr/bin/env python3
"""Fill in math-verify's verdicts on answers.jsonl (the labels, "same", are hand-written).

Three readings, each stored (any exception counts as False):
- "math_verify": the gold, when it has no \boxed{} or $, wrapped in $...$ (a bare MATH
  answer such as `2x+1` is not found, or only partly, by the default extraction), then
  ``verify(parse(gold), parse(completion))`` with the default configs: math-verify at its
  best on these pairs, the one the plugin's tests hold math_answer to;
- "math_verify_default": ``verify(parse(gold), parse(completion))`` as given;
- "math_verify_trl": as TRL's trl/rewards/accuracy_rewards.py parses (boxed first, no
  anchor-less extraction, first match).
The file is rewritten in place, order and every other field kept. Prints each reading's
agreement with the labels, per class.

Setup: python3 -m venv /tmp/mv-venv && /tmp/mv-venv/bin/pip install 'math-verify[antlr4_13_2]'
Run:   /tmp/mv-venv/bin/python plugins/math_answer/tests/label_math_verify.py [answers.jsonl]

"""
import json
import sys
from collections import defaultdict
from pathlib import Path

from math_verify import parse, verify


def judge(gold: str, completion: str) -> bool:
    try:
        return bool(verify(parse(gold), parse(completion)))
    except Exception:
        return False


def judge_trl(gold: str, completion: str) -> bool:
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig

    try:
        gold_parsed = parse(gold, extraction_mode="first_match")
        if not gold_parsed:
            return False  # TRL gives None (skips the sample); counted as not accepted here
        answer = parse(
            completion,
            extraction_config=[
                LatexExtractionConfig(
                    normalization_config=NormalizationConfig(
                        nits=False, malformed_operators=False, basic_latex=True,
                        boxed="all", units=True,
                    ),
                    boxed_match_priority=0,
                    try_extract_without_anchor=False,
                )
            ],
            extraction_mode="first_match",
        )
        return bool(verify(gold_parsed, answer))
    except Exception:
        return False


def judge_wrapped(gold: str, completion: str) -> bool:
    if "\\boxed" not in gold and "$" not in gold:
        gold = f"${gold}$"
    return judge(gold, completion)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    path = Path(args[0]) if args else Path(__file__).with_name("answers.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        row["math_verify"] = judge_wrapped(row["gold"], row["completion"])
        row["math_verify_default"] = judge(row["gold"], row["completion"])
        row["math_verify_trl"] = judge_trl(row["gold"], row["completion"])
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))

    stats = defaultdict(lambda: [0, 0, 0, 0])  # pairs, agree, false accepts, false rejects
    for r in rows:
        s = stats[r["class"]]
        s[0] += 1
        s[1] += r["math_verify"] == r["same"]
        s[2] += r["math_verify"] and not r["same"]
        s[3] += r["same"] and not r["math_verify"]
    total = [sum(s[i] for s in stats.values()) for i in range(4)]
    print(f"{'class':<12}{'pairs':>6}{'agree':>7}{'pct':>6}{'wrong+':>8}{'wrong-':>8}")
    for cls, s in list(stats.items()) + [("TOTAL", total)]:
        print(f"{cls:<12}{s[0]:>6}{s[1]:>7}{100 * s[1] / s[0]:>5.0f}%{s[2]:>8}{s[3]:>8}")
    print("wrong+ = math-verify accepts a pair labelled false; wrong- = rejects one labelled true")

    for name in ("math_verify_default", "math_verify_trl"):
        per = defaultdict(lambda: [0, 0])
        for r in rows:
            per[r["class"]][0] += 1
            per[r["class"]][1] += r[name] == r["same"]
        n, a = len(rows), sum(v[1] for v in per.values())
        print(f"reading {name}: agree {a}/{n} ({100 * a / n:.0f}%); "
              + ", ".join(f"{c} {v[1]}/{v[0]}" for c, v in per.items()))


if __name__ == "__main__":
    main()
