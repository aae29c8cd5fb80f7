"""The code-tests scorer: finds the model's code, turns the sample's tests into cases, runs
each case with fresh globals and stdin/stdout, and scores the fraction that passed."""

import ast
import builtins
import io
import json
import math
import re
import sys
import traceback
from typing import Any, List, Optional, Tuple

# componentize-py bundles only the modules imported at top level. These are the ones
# model-written solutions and the datasets' tests reach for; importing them here makes
# `import heapq` work in a solution.
import array  # noqa: F401
import bisect  # noqa: F401
import cmath  # noqa: F401
import collections  # noqa: F401
import copy  # noqa: F401
import datetime  # noqa: F401
import decimal  # noqa: F401
import fractions  # noqa: F401
import functools  # noqa: F401
import heapq  # noqa: F401
import itertools  # noqa: F401
import operator  # noqa: F401
import random  # noqa: F401
import statistics  # noqa: F401
import string  # noqa: F401
import textwrap  # noqa: F401
import typing  # noqa: F401

from componentize_py_types import Err
from wit_world.exports import reward
from wit_world.imports import host, types

DEFAULTS = {
    "tests_key": "tests",
    "entry_point_key": "entry_point",
    "setup_key": "test_setup_code",
    "compare": "lines",
    "tolerance": 1e-6,
    "block": "last",
    "max_output_chars": 1_000_000,
}
COMPARES = ("exact", "lines", "tokens")
BLOCKS = ("last", "all")
# A fenced block in Python (or with no language, as models often write it).
BLOCK = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)
# How much of a value a failure message shows.
SHOWN = 160
CODE = "<solution>"
TEST = "<test>"


class Scorer(reward.Scorer):
    @classmethod
    def open(cls, config: str) -> "Scorer":
        try:
            parsed = json.loads(config or "{}")
        except ValueError as e:
            raise Err(f"code_tests config is not JSON: {e}")
        if not isinstance(parsed, dict):
            raise Err("code_tests config must be a JSON object")
        unknown = sorted(set(parsed) - set(DEFAULTS))
        if unknown:
            raise Err(f"code_tests config: unknown field `{unknown[0]}`, expected one of {sorted(DEFAULTS)}")
        merged = {**DEFAULTS, **parsed}
        for key in ("tests_key", "entry_point_key", "setup_key"):
            if not isinstance(merged[key], str) or not merged[key]:
                raise Err(f"code_tests config: `{key}` must be a non-empty string")
        if merged["compare"] not in COMPARES:
            raise Err(f"code_tests config: `compare` is {merged['compare']!r}, expected one of {list(COMPARES)}")
        if merged["block"] not in BLOCKS:
            raise Err(f"code_tests config: `block` is {merged['block']!r}, expected one of {list(BLOCKS)}")
        tolerance = merged["tolerance"]
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
            raise Err(f"code_tests config: `tolerance` is {tolerance!r}, expected a number in [0, 1)")
        chars = merged["max_output_chars"]
        if isinstance(chars, bool) or not isinstance(chars, int) or chars < 1:
            raise Err(f"code_tests config: `max_output_chars` is {chars!r}, expected a positive integer")
        scorer = cls()
        scorer.config = merged
        return scorer

    def score(self, trajectory: types.Trajectory) -> List[types.Component]:
        c = self.config
        try:
            meta = json.loads(trajectory.metadata or "{}")
        except ValueError as e:
            raise Err(f"the sample's metadata is not JSON: {e}")
        if not isinstance(meta, dict):
            raise Err("the sample's metadata is not a JSON object")
        if c["tests_key"] not in meta:
            raise Err(
                f"the sample's metadata has no `{c['tests_key']}` (code_tests config `tests_key`; "
                f"`data.tests_key` copies a column there); its fields: {sorted(meta)}"
            )
        cases = to_cases(meta[c["tests_key"]], meta, c)
        if not cases:
            raise Err(f"the sample's `{c['tests_key']}` holds no test cases")
        # Scored one case at a time by the host (`cases` in the run's reward entry), this
        # call holds case `index` of the sample's tests: name it so in the message.
        first_index = 0
        where = meta.get("rlhost_case")
        if isinstance(where, dict) and isinstance(where.get("index"), int):
            first_index = where["index"]

        code, problem = solution(trajectory.completion, c["block"])
        failures: List[Optional[str]] = []
        for case in cases:
            failures.append(problem if problem is not None else run_case(code, case, meta, c))
        passed = sum(1 for f in failures if f is None)
        first = next(((i, f) for i, f in enumerate(failures) if f is not None), None)
        if first is not None:
            host.log(host.Level.WARN, f"case {first_index + first[0]}: {first[1]}")
        return [
            types.Component(name="passed", value=passed / len(cases)),
            types.Component(name="all_passed", value=1.0 if passed == len(cases) else 0.0),
        ]


# ---- the solution -------------------------------------------------------------------


def solution(completion: str, block: str) -> Tuple[str, Optional[str]]:
    """The code to test (the last python block, or all of them joined) and, when there is
    none or it does not compile, why every case fails."""
    blocks = [m.group(2) for m in BLOCK.finditer(completion)]
    if not blocks:
        return "", "no ```python block in the completion"
    code = blocks[-1] if block == "last" else "\n".join(blocks)
    try:
        compile(code, CODE, "exec")
    except SyntaxError as e:
        return code, f"the code does not compile: {e.msg} (line {e.lineno})"
    except (ValueError, MemoryError, RecursionError) as e:
        return code, f"the code does not compile: {type(e).__name__}: {e}"
    return code, None


# ---- the cases ----------------------------------------------------------------------


class Case:
    """One test case: `kind` is `script` (assert lines or a test script), `check`
    (HumanEval's `check(candidate)`), `io` (stdin → stdout) or `call` (a function's value)."""

    def __init__(self, kind: str, **fields: Any) -> None:
        self.kind = kind
        self.__dict__.update(fields)


def to_cases(raw: Any, meta: dict, c: dict) -> List[Case]:
    """The cases in a sample's tests, in any of the layouts the datasets use: a list of
    assert lines (MBPP), a test script (HumanEval, with `entry_point`), a list of
    `{"input", "output"}` objects, or an object of parallel lists (APPS' `input_output`
    with `inputs`/`outputs` and maybe `fn_name`, CodeContests' `input`/`output`); any of
    them may arrive as JSON text (a CSV cell, APPS' string column)."""
    if isinstance(raw, str) and raw.strip()[:1] in ("[", "{"):
        try:
            raw = json.loads(raw)
        except ValueError:
            pass  # code that starts with a bracket
    if isinstance(raw, str):
        return [script_case(raw, meta, c)]
    if isinstance(raw, dict):
        raw = unzip(raw)
    if not isinstance(raw, list):
        raise Err(f"the sample's `{c['tests_key']}` is {kind_of(raw)}: expected test code, a list of cases or an object of parallel lists")
    return [one_case(item, i, meta, c) for i, item in enumerate(raw)]


def unzip(d: dict) -> list:
    """An object of parallel lists as a list of objects, one per position; scalar fields are
    copied into each (`fn_name`). An object without lists is one case."""
    lengths = {len(v) for v in d.values() if isinstance(v, list)}
    if not lengths:
        return [d]
    if len(lengths) > 1:
        sizes = {k: len(v) for k, v in d.items() if isinstance(v, list)}
        raise Err(f"the test lists have different lengths: {sizes}")
    n = lengths.pop()
    return [{k: (v[i] if isinstance(v, list) else v) for k, v in d.items()} for i in range(n)]


def script_case(text: str, meta: dict, c: dict) -> Case:
    setup = meta.get(c["setup_key"])
    setup = setup if isinstance(setup, str) else ""
    if re.search(r"^def check\(", text, re.MULTILINE):
        entry = meta.get(c["entry_point_key"])
        if not isinstance(entry, str) or not entry:
            raise Err(f"the test defines check(candidate) but the sample has no `{c['entry_point_key']}` (config entry_point_key) naming the function to check")
        return Case("check", setup=setup, test=text, entry=entry)
    return Case("script", setup=setup, test=text)


def one_case(item: Any, i: int, meta: dict, c: dict) -> Case:
    if isinstance(item, str):
        return script_case(item, meta, c)
    if not isinstance(item, dict):
        raise Err(f"test case {i} is {kind_of(item)}: expected test code or an object with input and output")
    given = first_of(item, ("input", "inputs", "stdin"))
    expected = first_of(item, ("output", "outputs", "expected_output", "stdout"))
    if given is None or expected is None:
        raise Err(f"test case {i} has fields {sorted(item)}: expected `input` and `output` (or APPS' `inputs`/`outputs`)")
    fn_name = item.get("fn_name")
    if isinstance(fn_name, str) and fn_name:
        return Case("call", fn_name=fn_name, args=given if isinstance(given, list) else [given], expected=expected)
    return Case("io", given=as_text(given), expected=as_text(expected))


def first_of(item: dict, keys: Tuple[str, ...]) -> Any:
    return next((item[k] for k in keys if k in item), None)


def as_text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value) + "\n"
    return value if isinstance(value, str) else str(value)


def kind_of(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


# ---- running one case ---------------------------------------------------------------


class CappedBytes(io.RawIOBase):
    """A stdout that keeps at most `cap` bytes and remembers that it overflowed."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()
        self.over = False

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        room = self.cap - len(self.data)
        if len(b) > room:
            self.over = True
        self.data += bytes(b[: max(room, 0)])
        return len(b)

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


def run_case(code: str, case: Case, meta: dict, c: dict) -> Optional[str]:
    """Runs one case with fresh globals, stdin and stdout; None when it passed, else why
    it failed. Whatever the code does to the interpreter's shared state (stdio, builtins,
    the recursion limit) is put back afterwards."""
    saved = (sys.stdin, sys.stdout, sys.stderr, dict(builtins.__dict__), sys.getrecursionlimit())
    out = CappedBytes(c["max_output_chars"])
    given = case.given if case.kind == "io" else ""
    sys.stdin = io.TextIOWrapper(io.BytesIO(given.encode("utf-8")), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(CappedBytes(4096), encoding="utf-8", write_through=True)
    try:
        return run_in(code, case, out, c)
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved[0], saved[1], saved[2]
        builtins.__dict__.clear()
        builtins.__dict__.update(saved[3])
        sys.setrecursionlimit(saved[4])


def run_in(code: str, case: Case, out: CappedBytes, c: dict) -> Optional[str]:
    # A program reading stdin runs as a script; solutions under function tests are loaded
    # as a module would be, so that a demo under `if __name__ == "__main__"` stays quiet.
    scope = {"__name__": "__main__" if case.kind == "io" else "solution", "__builtins__": builtins}
    sources = {CODE: code}
    failure = execute(code, scope, CODE, sources)
    if failure is not None:
        return failure
    if case.kind == "io":
        sys.stdout.flush()
        if out.over:
            return f"the output is longer than {c['max_output_chars']} bytes (config max_output_chars)"
        got = out.text()
        if same_output(got, case.expected, c["compare"], c["tolerance"]):
            return None
        return f"wrong output for input {short(case.given)}: expected {short(case.expected)}, got {short(got)}"
    if case.kind == "call":
        fn = scope.get(case.fn_name)
        if fn is None and isinstance(scope.get("Solution"), type):
            # LeetCode-style: the function is a method of `Solution`.
            try:
                fn = getattr(scope["Solution"](), case.fn_name, None)
            except BaseException as e:  # noqa: BLE001 - the model's constructor
                return f"Solution() raised {type(e).__name__}: {e}"
        if not callable(fn):
            return f"the code defines no function `{case.fn_name}`"
        try:
            value = fn(*case.args)
        except BaseException as e:  # noqa: BLE001 - whatever the model's function raises
            return f"{case.fn_name}{short(tuple(case.args))} raised {describe(e, sources)}"
        if same_value(value, case.expected, c["tolerance"]):
            return None
        return f"{case.fn_name}{short(tuple(case.args))} returned {short(value)}, expected {short(case.expected)}"
    test = (case.setup + "\n" + case.test) if case.setup else case.test
    sources[TEST] = test
    failure = execute(test, scope, TEST, sources)
    if failure is not None or case.kind == "script":
        return failure
    try:
        scope["check"](scope[case.entry])
    except KeyError:
        return f"the code defines no function `{case.entry}`"
    except BaseException as e:  # noqa: BLE001
        return describe(e, sources)
    return None


def execute(source: str, scope: dict, filename: str, sources: dict) -> Optional[str]:
    try:
        exec(compile(source, filename, "exec"), scope)
    except SystemExit as e:
        if e.code not in (None, 0):
            return f"the program exited with status {e.code!r}"
    except SyntaxError as e:
        return f"{'the test' if filename == TEST else 'the code'} does not compile: {e.msg} (line {e.lineno})"
    except BaseException as e:  # noqa: BLE001 - every error is a failed case
        return describe(e, sources)
    return None


def describe(e: BaseException, sources: dict) -> str:
    """An exception as one line: the failing line of the test (an assert) or of the code,
    then the error."""
    frame = None
    for tb, lineno in traceback.walk_tb(e.__traceback__):
        if tb.f_code.co_filename in sources:
            frame = (tb.f_code.co_filename, lineno)
    where = ""
    if frame is not None:
        lines = sources[frame[0]].splitlines()
        text = lines[frame[1] - 1].strip() if 0 < frame[1] <= len(lines) else ""
        place = "the test" if frame[0] == TEST else "the code"
        where = f" at {place}, line {frame[1]}: {short(text, quote=False)}"
    message = str(e)
    if isinstance(e, AssertionError):
        return f"assertion failed{where}" + (f" ({short(message, quote=False)})" if message else "")
    return f"{type(e).__name__}" + (f": {short(message, quote=False)}" if message else "") + where


# ---- comparing ----------------------------------------------------------------------


def same_output(got: str, expected: str, compare: str, tolerance: float) -> bool:
    if compare == "exact":
        return got == expected
    if compare == "lines":
        return lines(got) == lines(expected)
    a, b = got.split(), expected.split()
    return len(a) == len(b) and all(x == y or close(x, y, tolerance) for x, y in zip(a, b))


def lines(text: str) -> List[str]:
    """The lines of `text` without trailing whitespace, and without trailing empty lines:
    the judges' usual leniency."""
    out = [line.rstrip() for line in text.splitlines()]
    while out and not out[-1]:
        out.pop()
    return out


def close(x: str, y: str, tolerance: float) -> bool:
    try:
        a, b = float(x), float(y)
    except ValueError:
        return False
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= tolerance * max(1.0, abs(b))


def same_value(value: Any, expected: Any, tolerance: float) -> bool:
    value = plain(value)
    if equal(value, expected, tolerance):
        return True
    # APPS keeps each expected value in a one-element list.
    return isinstance(expected, list) and len(expected) == 1 and equal(value, expected[0], tolerance)


def plain(value: Any) -> Any:
    """Tuples as lists, as the expected values arrive from JSON."""
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def equal(a: Any, b: Any, tolerance: float) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b if isinstance(a, bool) and isinstance(b, bool) else False
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= tolerance * max(1.0, abs(b)))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(equal(x, y, tolerance) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except BaseException:  # noqa: BLE001 - the model's __eq__
        return False


def short(value: Any, quote: bool = True) -> str:
    text = repr(value) if quote else str(value)
    if len(text) > SHOWN:
        text = text[: SHOWN - 1] + "…"
    return text


def _warm_up() -> None:
    """Exercises every path once at build time: componentize-py snapshots the interpreter
    after importing this module, so lazily filled caches (compiled regular expressions,
    interned names, traceback's machinery) are already full in every fresh instance, which
    the host opens per case."""
    c = dict(DEFAULTS)
    meta = {"entry_point": "f", "tests": [], "test_setup_code": ""}
    completion = "```python\ndef f(x):\n    return x + 1\nprint(int(input()) + 1)\n```"
    code, _ = solution(completion, "last")
    cases = to_cases('{"inputs": ["1\\n"], "outputs": ["2\\n"]}', meta, c)
    cases += to_cases(["assert f(1) == 2", "assert f(1) == 3"], meta, c)
    cases += to_cases("def check(candidate):\n    assert candidate(1) == 2\n", meta, c)
    cases += to_cases({"fn_name": "f", "inputs": [[1]], "outputs": [[2]]}, meta, c)
    for case in cases:
        run_case(code, case, meta, c)
    run_case("1 / 0", Case("io", given="", expected=""), meta, c)
    json.loads('{"a": [1, 2.5, "x", true, null]}')
    ast.parse("x = 1")


_warm_up()
