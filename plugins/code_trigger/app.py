"""The Python code tool, built into a WebAssembly component by componentize-py.

The model writes a fenced ```python block; when the closing fence is generated, the host
calls `fire`, this plugin runs the block with `exec()` and returns what it printed, the
value of a last bare expression (as a notebook would show it), or the traceback, inside
<output>…</output>. It runs inside rlhost's sandbox: no files, no network, no environment,
a memory cap and a deadline, so an infinite loop or a memory bomb in model-written code
ends the call, never the run.

This module holds `About`; the session lives in `trigger.py` (componentize-py looks an
exported resource up in a module named after its interface).
"""

from wit_world import exports
from wit_world.imports import types


class About(exports.About):
    def info(self) -> types.PluginInfo:
        return types.PluginInfo(
            name="code_trigger",
            version="0.1.0",
            description="Runs ```python blocks the model writes, returns <output>...</output>",
        )
