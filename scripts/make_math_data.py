#!/usr/bin/env python3
"""Writes small math datasets in the layouts researchers download them in, for the math
run (configs/fixture-math.toml) and its tests: no download, seeded, so the files repeat.

    python3 scripts/make_math_data.py            # writes configs/data/gsm8k-sample.jsonl
                                                 # and configs/data/math-sample.jsonl

- GSM8K's layout (`openai/gsm8k`, `main`): `question`, and `answer` holding the worked
  solution ending in `#### N`.
- MATH's layout (`hendrycks/competition_math`): `problem`, `level`, `type`, and
  `solution` holding the worked solution with the answer in `\\boxed{}`.
The problems are simple arithmetic word problems and fraction/root questions made here,
in those datasets' styles.
"""

import json
import os
import random
from fractions import Fraction

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ["Natalia", "Weng", "Betty", "James", "Julie", "Ken", "Alexis", "Tina"]
ITEMS = ["clips", "apples", "books", "stickers", "marbles", "pencils"]


def gsm8k(r):
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(12, 480), r.randint(2, 9)
    total = a * b
    question = f"{name} sells {a} {item} each day for {b} days. How many {item} does {name} sell in all?"
    answer = f"{name} sells {a} * {b} = <<{a}*{b}={total}>>{total} {item}.\n#### {total}"
    return {"question": question, "answer": answer}


def math(r):
    kind = r.choice(["fraction", "root", "sum"])
    if kind == "fraction":
        x, y = Fraction(r.randint(1, 9), r.randint(2, 9)), Fraction(r.randint(1, 9), r.randint(2, 9))
        s = x + y
        problem = f"Compute $\\frac{{{x.numerator}}}{{{x.denominator}}} + \\frac{{{y.numerator}}}{{{y.denominator}}}$."
        boxed = f"\\frac{{{s.numerator}}}{{{s.denominator}}}" if s.denominator != 1 else str(s.numerator)
        solution = f"Over a common denominator the sum is ${boxed}$, so the answer is $\\boxed{{{boxed}}}$."
        return {"problem": problem, "level": "Level 1", "type": "Prealgebra", "solution": solution}
    if kind == "root":
        a, b = r.randint(2, 7), r.choice([2, 3, 5, 6, 7])
        problem = f"Simplify $\\sqrt{{{a * a * b}}}$."
        solution = f"Since ${a * a * b} = {a}^2 \\cdot {b}$, we get $\\boxed{{{a}\\sqrt{{{b}}}}}$."
        return {"problem": problem, "level": "Level 2", "type": "Algebra", "solution": solution}
    n = r.randint(5, 40)
    problem = f"What is the sum of the integers from 1 to {n}?"
    solution = f"The sum is $\\frac{{{n}({n}+1)}}{{2}} = \\boxed{{{n * (n + 1) // 2}}}$."
    return {"problem": problem, "level": "Level 1", "type": "Algebra", "solution": solution}


def main():
    out = os.path.join(ROOT, "configs", "data")
    os.makedirs(out, exist_ok=True)
    for name, make, n in [("gsm8k-sample.jsonl", gsm8k, 48), ("math-sample.jsonl", math, 48)]:
        r = random.Random(name)
        with open(os.path.join(out, name), "w") as f:
            for _ in range(n):
                f.write(json.dumps(make(r)) + "\n")
        print(f"wrote {n} rows to configs/data/{name}")


if __name__ == "__main__":
    main()
