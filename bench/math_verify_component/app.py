"""A benchmark reward (issue 48): the real `math-verify` package (sympy, latex2sympy2_extended,
the antlr4 runtime) bundled into a WebAssembly component by componentize-py.

Not a shipped plugin: it exists to measure size, load time, per-score time and memory of
this option against the native `math_answer` plugin. The scorer lives in `reward.py`
(componentize-py looks an exported resource up in a module named after its interface).
"""

from wit_world import exports
from wit_world.imports import types


class About(exports.About):
    def info(self) -> types.PluginInfo:
        return types.PluginInfo(
            name="math_verify",
            version="0.0.1",
            description="math-verify (sympy) in a component: verify(parse(gold), parse(completion))",
        )
