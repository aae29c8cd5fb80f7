"""{{name}}: an rlhost {{role}} plugin in Python, built into a WebAssembly component by
componentize-py. This module says who the plugin is; the role lives in `{{role}}.py`
(componentize-py looks an exported resource up in a module named after its interface)
and reads its configuration with `parse_config` below."""

import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import types


class About(exports.About):
    def info(self) -> types.PluginInfo:
        return types.PluginInfo(
            name="{{name}}",
            version="0.1.0",
            description="{{description}}",
        )


def parse_config(config: str, defaults: dict) -> dict:
    """The JSON object `config` over `defaults`; unknown fields and bad JSON are errors."""
    try:
        parsed = json.loads(config or "{}")
    except ValueError as e:
        raise Err(f"{{name}} config is not JSON: {e}")
    if not isinstance(parsed, dict):
        raise Err("{{name}} config must be a JSON object")
    unknown = sorted(set(parsed) - set(defaults))
    if unknown:
        raise Err(f"{{name}} config: unknown field `{unknown[0]}`, expected one of {sorted(defaults)}")
    return {**defaults, **parsed}
