#!/usr/bin/env python3
"""Writes small code datasets in the layouts researchers download them in, for the
code-tests run (configs/fixture-code-tests.toml) and its tests: no download, seeded, so
the files repeat.

    python3 scripts/make_code_data.py     # writes configs/data/{mbpp,humaneval,apps}-sample.jsonl

- MBPP's layout (`mbpp`, `full`): `task_id`, `text`, `code` (a reference solution),
  `test_list` (three `assert` lines), `test_setup_code`, `challenge_test_list`.
- HumanEval's layout (`openai_humaneval`): `task_id`, `prompt` (signature and docstring),
  `canonical_solution`, `test` (a `check(candidate)` function), `entry_point`.
- APPS' layout (`codeparrot/apps`): `problem_id`, `question`, `solutions` and
  `input_output` as JSON text (`{"inputs": [...], "outputs": [...]}` for stdin/stdout
  problems, with `fn_name` for call-based ones), `difficulty`, `url`, `starter_code`.
The problems are small ones made here in those datasets' styles; every expected value is
what the reference solution computes, so the references pass their tests by construction
(tests/integration/code_tests.rs checks it through the sandboxed reward).
"""

import io
import json
import os
import random
import sys
from contextlib import redirect_stdout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, description, reference code, argument makers): function problems.
FUNCTIONS = [
    ("sum_digits", "Write a function to find the sum of the digits of a non-negative integer.",
     "def sum_digits(n):\n    return sum(int(d) for d in str(n))", lambda r: (r.randint(0, 99999),)),
    ("count_vowels", "Write a function to count the vowels in a string.",
     "def count_vowels(s):\n    return sum(1 for c in s.lower() if c in 'aeiou')",
     lambda r: ("".join(r.choice("abcdeioxyzu ") for _ in range(r.randint(3, 12))),)),
    ("max_of_three", "Write a function to find the largest of three numbers.",
     "def max_of_three(a, b, c):\n    return max(a, b, c)", lambda r: tuple(r.randint(-50, 50) for _ in range(3))),
    ("is_prime", "Write a function to check whether a number is prime.",
     "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0:\n            return False\n        i += 1\n    return True",
     lambda r: (r.randint(0, 200),)),
    ("gcd", "Write a function to find the greatest common divisor of two positive integers.",
     "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a", lambda r: (r.randint(1, 500), r.randint(1, 500))),
    ("reverse_words", "Write a function to reverse the order of the words in a sentence.",
     "def reverse_words(s):\n    return ' '.join(s.split()[::-1])",
     lambda r: (" ".join(r.choice(["red", "fox", "jumps", "over", "the", "lazy", "dog"]) for _ in range(r.randint(2, 5))),)),
    ("fib", "Write a function to return the n-th Fibonacci number (fib(0) = 0, fib(1) = 1).",
     "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a", lambda r: (r.randint(0, 40),)),
    ("running_sum", "Write a function to return the running sums of a list of numbers.",
     "def running_sum(xs):\n    out, total = [], 0\n    for x in xs:\n        total += x\n        out.append(total)\n    return out",
     lambda r: ([r.randint(-9, 9) for _ in range(r.randint(1, 6))],)),
]

# (description, reference program, input maker): stdin/stdout problems.
PROGRAMS = [
    ("You are given two integers a and b on one line. Print a + b.",
     "a, b = map(int, input().split())\nprint(a + b)", lambda r: f"{r.randint(-999, 999)} {r.randint(-999, 999)}\n"),
    ("The first line holds n, the second n integers. Print the largest and the smallest, separated by a space.",
     "n = int(input())\nxs = list(map(int, input().split()))\nprint(max(xs), min(xs))",
     lambda r: (lambda xs: f"{len(xs)}\n{' '.join(map(str, xs))}\n")([r.randint(-99, 99) for _ in range(r.randint(1, 8))])),
    ("Given a word on one line, print YES if it reads the same backwards and NO otherwise.",
     "s = input().strip()\nprint('YES' if s == s[::-1] else 'NO')",
     lambda r: r.choice(["level", "rotor", "abc", "noon", "rlhost", "a", "ab"]) + "\n"),
    ("The first line holds t, the number of test cases; each of the next t lines holds an integer n. For each, print n! modulo 1000000007.",
     "import sys\ndata = sys.stdin.read().split()\nt = int(data[0])\nM = 10**9 + 7\nfor k in range(1, t + 1):\n    n = int(data[k])\n    f = 1\n    for i in range(2, n + 1):\n        f = f * i % M\n    print(f)",
     lambda r: (lambda ns: f"{len(ns)}\n" + "".join(f"{n}\n" for n in ns))([r.randint(0, 60) for _ in range(r.randint(1, 4))])),
]


def call(code, name, args):
    scope = {}
    exec(code, scope)
    return scope[name](*args)


def run(code, given):
    out = io.StringIO()
    stdin = sys.stdin
    sys.stdin = io.StringIO(given)
    try:
        with redirect_stdout(out):
            exec(code, {"__name__": "__main__"})
    finally:
        sys.stdin = stdin
    return out.getvalue()


def distinct_args(r, make, n):
    seen, out = set(), []
    while len(out) < n:
        args = make(r)
        key = repr(args)
        if key not in seen or len(seen) > 50:
            seen.add(key)
            out.append(args)
    return out


def mbpp(r, i):
    name, text, code, make = FUNCTIONS[i % len(FUNCTIONS)]
    tests = [f"assert {name}({', '.join(map(repr, a))}) == {call(code, name, a)!r}" for a in distinct_args(r, make, 3)]
    return {"task_id": 11 + i, "text": text, "code": code, "test_list": tests, "test_setup_code": "", "challenge_test_list": []}


def humaneval(r, i):
    name, text, code, make = FUNCTIONS[i % len(FUNCTIONS)]
    signature, body = code.split("\n", 1)
    prompt = f'{signature}\n    """{text}"""\n'
    checks = "".join(f"    assert candidate({', '.join(map(repr, a))}) == {call(code, name, a)!r}\n" for a in distinct_args(r, make, 4))
    test = f"\n\nMETADATA = {{'author': 'rlhost', 'dataset': 'test'}}\n\n\ndef check(candidate):\n{checks}\n"
    return {"task_id": f"HumanEval/{i}", "prompt": prompt, "canonical_solution": body + "\n", "test": test, "entry_point": name}


def apps(r, i):
    if i % 3 == 2:
        name, text, code, make = FUNCTIONS[i % len(FUNCTIONS)]
        args = distinct_args(r, make, 3)
        io_ = {"fn_name": name, "inputs": [list(a) for a in args], "outputs": [[call(code, name, a)] for a in args]}
        question = f"{text}\n\nYour function is called `{name}`."
        starter = code.split("\n", 1)[0] + "\n"
    else:
        text, code, make = PROGRAMS[i % len(PROGRAMS)]
        inputs = [make(r) for _ in range(r.randint(2, 4))]
        io_ = {"inputs": inputs, "outputs": [run(code, x) for x in inputs]}
        question = f"{text}\n\n-----Input-----\n\nFrom standard input.\n\n-----Output-----\n\nTo standard output."
        starter = ""
    return {"problem_id": 4000 + i, "question": question, "solutions": json.dumps([code]),
            "input_output": json.dumps(io_), "difficulty": "introductory",
            "url": f"https://example.org/problems/{4000 + i}", "starter_code": starter}


def main():
    r = random.Random(36)
    out = os.path.join(ROOT, "configs", "data")
    os.makedirs(out, exist_ok=True)
    for name, make, n in [("mbpp", mbpp, 24), ("humaneval", humaneval, 16), ("apps", apps, 24)]:
        path = os.path.join(out, f"{name}-sample.jsonl")
        with open(path, "w") as f:
            for i in range(n):
                f.write(json.dumps(make(r, i)) + "\n")
        print(f"wrote {path} ({n} rows)")


if __name__ == "__main__":
    main()
