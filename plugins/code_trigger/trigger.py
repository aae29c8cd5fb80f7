"""The code tool's trigger session: one per trajectory, with its own globals, so a block
can use what an earlier block of the same trajectory defined."""

import ast
import contextlib
import io
import json
import traceback
from typing import List, Optional

# componentize-py bundles only the modules imported at top level. These are the ones
# model-written code reaches for; importing them here makes `import math` work in a block.
import bisect  # noqa: F401
import cmath  # noqa: F401
import collections  # noqa: F401
import datetime  # noqa: F401
import decimal  # noqa: F401
import fractions  # noqa: F401
import functools  # noqa: F401
import heapq  # noqa: F401
import itertools  # noqa: F401
import math  # noqa: F401
import operator  # noqa: F401
import random  # noqa: F401
import re  # noqa: F401
import statistics  # noqa: F401
import string  # noqa: F401
import textwrap  # noqa: F401

from componentize_py_types import Err
from wit_world.exports import trigger
from wit_world.imports import types

FENCE = "```"
LANGUAGES = {"python", "py", "python3"}
DEFAULTS = {"max_output_chars": 2000, "persist": True}
SURROGATES = re.compile("[\ud800-\udfff]")


class Session(trigger.Session):
    @classmethod
    def open(cls, config: str, sample: types.Sample) -> "Session":
        try:
            parsed = json.loads(config or "{}")
        except ValueError as e:
            raise Err(f"code_trigger config is not JSON: {e}")
        if not isinstance(parsed, dict):
            raise Err("code_trigger config must be a JSON object")
        unknown = sorted(set(parsed) - set(DEFAULTS))
        if unknown:
            raise Err(f"code_trigger config: unknown field `{unknown[0]}`, expected one of {sorted(DEFAULTS)}")
        session = cls()
        session.max_output_chars = int(parsed.get("max_output_chars", DEFAULTS["max_output_chars"]))
        session.persist = bool(parsed.get("persist", DEFAULTS["persist"]))
        session.globals = {"__name__": "__main__"}
        return session

    def stop_patterns(self) -> List[str]:
        return [FENCE]

    def fire(self, text: str) -> Optional[str]:
        code = closed_block(text)
        if code is None:
            return None
        if not self.persist:
            self.globals = {"__name__": "__main__"}
        output = valid_text(run(code, self.globals))
        if len(output) > self.max_output_chars:
            cut = len(output) - self.max_output_chars
            output = output[: self.max_output_chars] + f"\n...[{cut} more characters]\n"
        # A fence in the output would unbalance the fences the host and this plugin count.
        output = output.replace(FENCE, "'''")
        if output and not output.endswith("\n"):
            output += "\n"
        return f"\n<output>\n{output}</output>\n"


def closed_block(text: str) -> Optional[str]:
    """The code of the python block that `text`'s last fence closes, or None if that fence
    opens a block (or closes one in another language)."""
    if not text.endswith(FENCE) or text.count(FENCE) % 2 == 1:
        return None
    start = text.rfind(FENCE, 0, len(text) - len(FENCE))
    header_end = text.find("\n", start)
    if header_end == -1 or header_end > len(text) - len(FENCE):
        return None
    language = text[start + len(FENCE) : header_end].strip().lower()
    if language not in LANGUAGES:
        return None
    return text[header_end + 1 : len(text) - len(FENCE)]


def run(code: str, scope: dict) -> str:
    """Runs `code` in `scope`; returns stdout and stderr, then the value of a last bare
    expression or the traceback."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            tree = ast.parse(code, "<code>", "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, "<code>", "exec"), scope)
            if last is not None:
                value = eval(compile(last, "<code>", "eval"), scope)
                if value is not None:
                    print(repr(value))
        except SystemExit:
            pass
        except BaseException as e:  # noqa: BLE001 - the model must see every error
            print(format_error(e), end="")
    return buffer.getvalue()


def valid_text(text: str) -> str:
    """`text` with lone surrogates (`print("\\ud800")`) as U+FFFD: a WIT string must be valid
    Unicode, and returning one that is not traps the plugin, losing the trajectory's globals."""
    return SURROGATES.sub("\ufffd", text)


def format_error(e: BaseException) -> str:
    if isinstance(e, SyntaxError):
        return "".join(traceback.format_exception_only(type(e), e))
    # Drop the frames of this module: the model should see its own code only.
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb))


def _warm_up() -> None:
    """Exercises every path once at build time. componentize-py snapshots the interpreter
    after importing this module, so caches that Python fills lazily (compiled regular
    expressions in `json`, `ast` and `traceback`, interned names) are already full in every
    fresh instance, instead of being rebuilt by each trajectory's first call."""
    json.loads('{"a": [1, 2.5, "x", true, null]}')
    scope = {"__name__": "__main__"}
    for code in ("x = [i * i for i in range(3)]\nprint(x)\nx", "1 / 0", "def f(:"):
        run(code, scope)
    closed_block("```python\nprint(1)\n```")


_warm_up()
