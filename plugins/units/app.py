"""Three functions a model calls in its own tool-call format (WIT 0.2.0's `tools` role):
unit conversion, date arithmetic and exact arithmetic on fractions. The example of native
function calling; the session lives in `tools.py`."""

from wit_world import exports
from wit_world.imports import types


class About(exports.About):
    def info(self) -> types.PluginInfo:
        return types.PluginInfo(
            name="units",
            version="0.1.0",
            description="convert units, add days to dates, exact fraction arithmetic",
        )
