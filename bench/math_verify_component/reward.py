"""The scorer: `correct` = math_verify.verify(parse(gold), parse(completion)), called as TRL's
`accuracy_reward` calls it, with math-verify's signal-based timeouts turned off
(`parsing_timeout=None`, `timeout_seconds=None`): there are no signals in a component, and
the host's per-call deadline (epoch interruption) bounds a runaway sympy call instead.

Config (JSON): {"answer_key": "answer", "mode": "verify" | "noop", "wrap_gold": true,
"repeat": 1}. `repeat` > 1 grades the pair again that many times, with math-verify's parse
caches cleared, and logs the median: the time a long-lived instance takes per score.
`wrap_gold` puts a gold answer that has no `$` and no `\\boxed` between `$...$` first:
math-verify only reads LaTeX between delimiters, so a bare `\\frac{1}{2}` or `e^{2}` does
not parse at all and a bare `2x+1` parses as its first number, `2`. False: as TRL. `noop` returns
`correct` = 0 without parsing anything: the same component's per-call overhead, to subtract.
Each score logs, at info, the milliseconds spent inside parse + verify (time.perf_counter
over WASI's monotonic clock).
"""

import json
import logging
import time
from typing import List

from componentize_py_types import Err
from wit_world.exports import reward
from wit_world.imports import host, types

# Imported at build time, so componentize-py's pre-initialisation (wizer) snapshots the
# interpreter with sympy, latex2sympy2_extended and the antlr4 runtime already imported.
from latex2sympy2_extended import NormalizationConfig
from math_verify import LatexExtractionConfig, parse, verify


def _import_everything() -> int:
    """Imports every submodule of sympy, mpmath, latex2sympy2_extended, antlr4 and
    math_verify at build time. componentize-py bundles only the modules imported while it
    pre-initialises, and sympy imports much lazily inside functions (`exp` imports
    `sympy.sets.setexpr` on first use): a module first needed while scoring would be a
    ModuleNotFoundError at run time. Tests, benchmarks, plotting and modules that need a
    library not bundled (numpy, llvmlite, lxml, ...) are left out."""
    import warnings
    # `this` prints the Zen of SymPy; deprecated aliases warn.
    skip = ("tests", "benchmarks", "plotting", "testing", "llvmjitcode", "autolev", "tasks", "this")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _import_all(skip)


def _import_all(skip) -> int:
    import importlib
    import pkgutil
    count = 0
    for top in ("sympy", "mpmath", "latex2sympy2_extended", "antlr4", "math_verify"):
        pkg = importlib.import_module(top)
        for info in pkgutil.walk_packages(pkg.__path__, top + ".", onerror=lambda _: None):
            if any(part in skip for part in info.name.split(".")):
                continue
            try:
                importlib.import_module(info.name)
                count += 1
            except Exception:  # noqa: BLE001 - optional dependency missing: not bundled
                pass
    return count


IMPORTED = _import_everything()

# math-verify warns once that timeouts are off; keep the host's log quiet.
logging.getLogger("math_verify").setLevel(logging.ERROR)

DEFAULTS = {"answer_key": "answer", "mode": "verify", "wrap_gold": True, "repeat": 1}

# The completion side as TRL's accuracy_reward parses it: LaTeX only, \boxed first, no
# anchor-less extraction.
ANSWER_CONFIG = [
    LatexExtractionConfig(
        normalization_config=NormalizationConfig(
            nits=False,
            malformed_operators=False,
            basic_latex=True,
            boxed="all",
            units=True,
        ),
        boxed_match_priority=0,
        try_extract_without_anchor=False,
    )
]


def grade(gold: str, completion: str):
    """(correct, gold_parsed): TRL's accuracy_reward without timeouts. `correct` is None
    when the gold answer does not parse (TRL skips such a sample)."""
    gold_parsed = parse(gold, extraction_mode="first_match", parsing_timeout=None)
    if len(gold_parsed) == 0:
        return None, gold_parsed
    answer_parsed = parse(
        completion,
        extraction_config=ANSWER_CONFIG,
        extraction_mode="first_match",
        parsing_timeout=None,
    )
    try:
        return bool(verify(gold_parsed, answer_parsed, timeout_seconds=None)), (gold_parsed, answer_parsed)
    except Exception as e:  # noqa: BLE001 - TRL gives None; a component must give a number
        host.log(host.Level.WARN, f"verify raised {type(e).__name__}: {e}")
        return False, (gold_parsed, answer_parsed)


class Scorer(reward.Scorer):
    @classmethod
    def open(cls, config: str) -> "Scorer":
        try:
            parsed = json.loads(config or "{}")
        except ValueError as e:
            raise Err(f"math_verify config is not JSON: {e}")
        if not isinstance(parsed, dict) or set(parsed) - set(DEFAULTS):
            raise Err(f"math_verify config: expected an object with fields {sorted(DEFAULTS)}")
        merged = {**DEFAULTS, **parsed}
        if not isinstance(merged["wrap_gold"], bool):
            raise Err("math_verify config: `wrap_gold` is true or false")
        if isinstance(merged["repeat"], bool) or not isinstance(merged["repeat"], int) or merged["repeat"] < 1:
            raise Err("math_verify config: `repeat` is a positive integer")
        if merged["mode"] not in ("verify", "noop"):
            raise Err("math_verify config: `mode` is `verify` or `noop`")
        scorer = cls()
        scorer.config = merged
        return scorer

    def score(self, trajectory: types.Trajectory) -> List[types.Component]:
        c = self.config
        try:
            meta = json.loads(trajectory.metadata or "{}")
        except ValueError as e:
            raise Err(f"the sample's metadata is not JSON: {e}")
        if not isinstance(meta, dict) or not isinstance(meta.get(c["answer_key"]), str):
            raise Err(f"the sample's metadata has no string `{c['answer_key']}`")
        if c["mode"] == "noop":
            return [types.Component(name="correct", value=0.0)]
        gold = meta[c["answer_key"]]
        if c["wrap_gold"] and "$" not in gold and "\\boxed" not in gold:
            gold = f"${gold}$"
        start = time.perf_counter()
        correct, parsed = grade(gold, trajectory.completion)
        ms = (time.perf_counter() - start) * 1000
        host.log(host.Level.INFO, f"parse+verify {ms:.3f} ms")
        if c["repeat"] > 1:
            import math_verify.parser as P
            times = []
            for _ in range(c["repeat"]):
                P.parse_latex_cached.cache_clear()
                P.parse_expr_cached.cache_clear()
                start = time.perf_counter()
                grade(gold, trajectory.completion)
                times.append((time.perf_counter() - start) * 1000)
            times.sort()
            host.log(host.Level.INFO, f"repeat median {times[len(times) // 2]:.3f} ms over {len(times)}")
        host.log(host.Level.DEBUG, f"parsed {parsed!r}")
        if correct is None:
            raise Err(f"the gold answer {meta[c['answer_key']]!r} does not parse")
        return [types.Component(name="correct", value=1.0 if correct else 0.0)]


def _warm_up() -> None:
    """Runs each path once at build time so that what math-verify and sympy fill lazily
    (the antlr ATN, compiled regexes, sympy's caches of assumptions) is in the snapshot.
    Uses inputs unlike the benchmark's pairs, so the parse lru_caches do not answer them."""
    for gold, completion in (
        ("3y-4", r"so \boxed{-4+3y}"),
        (r"\frac{3}{4}", r"\boxed{0.75}"),
        (r"\{4,5\}", r"\boxed{\{5,4\}}"),
        (r"\sqrt{3}", r"\boxed{3^{1/2}}"),
        ("x=2", r"\boxed{2}"),
        (r"\begin{pmatrix}1\\2\end{pmatrix}", r"\boxed{(1,2)}"),
        ("(0, 1]", r"\boxed{(0,1]}"),
        ("10\\%", r"\boxed{0.1}"),
    ):
        grade(gold, completion)
        grade(f"${gold}$", completion)


_warm_up()
