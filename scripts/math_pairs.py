#!/usr/bin/env python3
"""Writes realistic (gold answer, model completion) pairs in the formats GSM8K, MATH and
competition sets use, each labelled equivalent or not by construction, for measuring the
`math_answer` reward against `math-verify` (bench/math_agreement.py).

    python3 scripts/math_pairs.py --out pairs.jsonl [--n 2400] [--seed 0]

Each line: {"set": "gsm8k" | "math" | "competition", "kind": what was varied,
"gold": the dataset's answer field, "completion": the model's text, "same": bool}.
The spellings are the ones those datasets and models write: GSM8K's `#### N` solutions
and "The answer is N." completions, MATH's `\\boxed{}` with \\frac/\\dfrac, roots, pi,
tuples, intervals, degrees and percents, AIME's three-digit integers and AMC's lettered
choices. Seeded: the same arguments write the same file.
"""

import argparse
import json
import math
import random
from fractions import Fraction


def thousands(n):
    return f"{n:,}"


def gsm8k(r):
    n = r.randint(2, 250000)
    gold = f"She has {n - 5} and gets 5 more, {n - 5} + 5 = {n}.\n#### {n}"
    wrong = n + r.choice([-10, -1, 1, 2, 100])
    forms = [
        ("hash", f"So the total is {n}.\n#### {n}", True),
        ("answer_is", f"Adding them up, the answer is {n}.", True),
        ("answer_is_dollars", f"The answer is ${thousands(n)}.", True),
        ("thousands", f"In total: {thousands(n)}", True),
        ("trailing_zero", f"The answer is {n}.0", True),
        ("boxed", f"Therefore the answer is $\\boxed{{{n}}}$.", True),
        ("unit", f"The answer is {n} apples.", True),
        ("last_number", f"First {n // 2}, then {n}", True),
        ("wrong", f"The answer is {wrong}.", False),
        ("wrong_hash", f"#### {wrong}", False),
        ("wrong_last", f"so {n} is not it, the total is {wrong}", False),
    ]
    kind, completion, same = r.choice(forms)
    return {"set": "gsm8k", "kind": kind, "gold": gold, "completion": completion, "same": same}


def frac_tex(f, style="frac"):
    sign = "-" if f < 0 else ""
    return f"{sign}\\{style}{{{abs(f.numerator)}}}{{{f.denominator}}}"


def math_set(r):
    kind = r.choice(["integer", "fraction", "root", "pi", "tuple", "interval", "degree",
                     "percent", "decimal", "negative", "equation", "root_frac"])
    if kind == "integer":
        n = r.randint(-50, 2000)
        gold = str(n)
        variants = [("same", f"\\boxed{{{n}}}", True), ("spaced", f"\\boxed{{ {n} }}", True),
                    ("dollar", f"$\\boxed{{{n}}}$", True), ("off", f"\\boxed{{{n + 1}}}", False)]
    elif kind == "fraction":
        f = Fraction(r.randint(1, 40), r.choice([2, 3, 4, 5, 6, 7, 8, 9, 12, 16]))
        while f.denominator == 1:
            f = Fraction(r.randint(1, 40), r.choice([3, 7, 9]))
        gold = frac_tex(f)
        exact_decimal = f.denominator in (2, 4, 5, 8, 16)
        variants = [("dfrac", f"\\boxed{{{frac_tex(f, 'dfrac')}}}", True),
                    ("slash", f"\\boxed{{{f.numerator}/{f.denominator}}}", True),
                    ("unreduced", f"\\boxed{{\\frac{{{2 * f.numerator}}}{{{2 * f.denominator}}}}}", True),
                    ("inverted", f"\\boxed{{{f.denominator}/{f.numerator}}}", f.numerator == f.denominator),
                    ("decimal", f"\\boxed{{{float(f):.6g}}}" if exact_decimal else f"\\boxed{{{float(f):.3f}}}",
                     exact_decimal)]
        if f.numerator < 10 and f.denominator < 10:
            variants.append(("short_frac", f"\\boxed{{\\frac{f.numerator}{f.denominator}}}", True))
    elif kind == "root":
        a, b = r.randint(2, 9), r.choice([2, 3, 5, 6, 7, 10, 11])
        gold = f"{a}\\sqrt{{{b}}}"
        variants = [("inside", f"\\boxed{{\\sqrt{{{a * a * b}}}}}", True),
                    ("nobrace", f"\\boxed{{{a}\\sqrt{b}}}" if b < 10 else f"\\boxed{{{a}\\sqrt{{{b}}}}}", True),
                    ("decimal", f"\\boxed{{{a * math.sqrt(b):.4f}}}", False),
                    ("off", f"\\boxed{{{a + 1}\\sqrt{{{b}}}}}", False)]
    elif kind == "pi":
        k = r.randint(2, 30)
        gold = f"{k}\\pi"
        variants = [("same", f"\\boxed{{{k}\\pi}}", True), ("times", f"\\boxed{{{k} \\cdot \\pi}}", True),
                    ("decimal", f"\\boxed{{{k * math.pi:.2f}}}", False), ("off", f"\\boxed{{{k + 2}\\pi}}", False)]
    elif kind == "tuple":
        x, y = r.randint(-9, 9), r.randint(-9, 9)
        gold = f"({x}, {y})"
        variants = [("spaces", f"\\boxed{{({x},{y})}}", True),
                    ("leftright", f"\\boxed{{\\left( {x}, {y} \\right)}}", True),
                    ("swapped", f"\\boxed{{({y}, {x})}}", x == y),
                    ("off", f"\\boxed{{({x}, {y + 1})}}", False)]
    elif kind == "interval":
        lo, hi = r.randint(-9, 0), r.randint(1, 9)
        gold = f"[{lo}, {hi})"
        variants = [("same", f"\\boxed{{[{lo},{hi})}}", True),
                    ("leftright", f"\\boxed{{\\left[{lo}, {hi}\\right)}}", True),
                    ("closed", f"\\boxed{{[{lo}, {hi}]}}", False),
                    ("open", f"\\boxed{{({lo}, {hi})}}", False)]
    elif kind == "degree":
        d = r.choice([30, 45, 60, 72, 90, 108, 120, 135, 150])
        gold = f"{d}^\\circ"
        variants = [("bare", f"\\boxed{{{d}}}", True), ("braced", f"\\boxed{{{d}^{{\\circ}}}}", True),
                    ("text", f"\\boxed{{{d} \\text{{ degrees}}}}", True), ("off", f"\\boxed{{{180 - d}^\\circ}}", d == 90)]
    elif kind == "percent":
        p = r.randint(1, 99)
        gold = f"{p}\\%"
        variants = [("bare", f"\\boxed{{{p}}}", True), ("sign", f"\\boxed{{{p}\\%}}", True),
                    ("fraction_of_one", f"\\boxed{{{p / 100:g}}}", True), ("off", f"\\boxed{{{p + 1}\\%}}", False)]
    elif kind == "decimal":
        v = r.randint(1, 9999) / 100
        gold = f"{v:g}"
        variants = [("zeros", f"\\boxed{{{v:.4f}}}", True), ("same", f"\\boxed{{{v:g}}}", True),
                    ("rounded", f"\\boxed{{{round(v, 1):g}}}", round(v, 1) == v),
                    ("off", f"\\boxed{{{v + 0.01:g}}}", False)]
    elif kind == "negative":
        f = -Fraction(r.randint(1, 20), r.choice([3, 4, 5]))
        gold = frac_tex(f)
        variants = [("minus_outside", f"\\boxed{{-\\frac{{{-f.numerator}}}{{{f.denominator}}}}}", True),
                    ("minus_inside", f"\\boxed{{\\frac{{{f.numerator}}}{{{f.denominator}}}}}", True),
                    ("sign_lost", f"\\boxed{{{frac_tex(-f)}}}", False)]
    elif kind == "equation":
        n = r.randint(-20, 20)
        gold = str(n)
        variants = [("x_equals", f"\\boxed{{x = {n}}}", True), ("same", f"\\boxed{{{n}}}", True),
                    ("x_equals_off", f"\\boxed{{x = {n + 3}}}", False)]
    else:  # root_frac
        a, b, c = r.randint(1, 5), r.choice([2, 3, 5]), r.choice([2, 3, 4, 7])
        gold = f"\\frac{{{a}\\sqrt{{{b}}}}}{{{c}}}"
        variants = [("dfrac", f"\\boxed{{\\dfrac{{{a}\\sqrt{{{b}}}}}{{{c}}}}}", True),
                    ("split", f"\\boxed{{\\frac{{{a}}}{{{c}}}\\sqrt{{{b}}}}}", True),
                    ("off", f"\\boxed{{\\frac{{{a}\\sqrt{{{b}}}}}{{{c + 1}}}}}", False)]
    vk, body, same = r.choice(variants)
    lead = r.choice(["So ", "Therefore, the answer is ", "Hence $", "We get "])
    completion = lead + body + ("$." if lead.endswith("$") else ".")
    solution = f"Working through it gives $\\boxed{{{gold}}}$."
    return {"set": "math", "kind": f"{kind}:{vk}", "gold": solution, "completion": completion, "same": same}


def competition(r):
    if r.random() < 0.6:
        n = r.randint(0, 999)
        gold = str(n)
        variants = [("aime_padded", f"The answer is $\\boxed{{{n:03d}}}$", True),
                    ("aime_plain", f"$\\boxed{{{n}}}$", True),
                    ("aime_off", f"$\\boxed{{{(n + 7) % 1000}}}$", False)]
        kind = "aime"
    else:
        letter = r.choice("ABCDE")
        gold = f"\\textbf{{({letter})}}"
        other = r.choice([x for x in "ABCDE" if x != letter])
        variants = [("amc_same", f"$\\boxed{{\\textbf{{({letter})}}}}$", True),
                    ("amc_letter", f"$\\boxed{{{letter}}}$", True),
                    ("amc_paren", f"$\\boxed{{({letter})}}$", True),
                    ("amc_other", f"$\\boxed{{\\textbf{{({other})}}}}$", False)]
        kind = "amc"
    vk, completion, same = r.choice(variants)
    return {"set": "competition", "kind": f"{kind}:{vk}", "gold": gold, "completion": completion, "same": same}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=2400)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    r = random.Random(a.seed)
    makers = [gsm8k, math_set, math_set, competition]
    with open(a.out, "w") as f:
        for i in range(a.n):
            f.write(json.dumps(makers[i % len(makers)](r)) + "\n")


if __name__ == "__main__":
    main()
