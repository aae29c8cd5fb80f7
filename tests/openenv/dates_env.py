"""An OpenEnv environment written with openenv-core's own base class (`MCPEnvironment`, an
`Environment` whose tools are a FastMCP server), for the tests of training against OpenEnv
(issue 47): one tool, `add_days`, that the small built-in units model learns to call.

    cd tests/openenv && python -m uvicorn dates_env:app --host 127.0.0.1 --port 0

Served as the OpenEnv template's `server/app.py` serves its environment (`create_app`,
uvicorn, no Docker). Actions are OpenEnv's MCP `CallToolAction`
(`{"type": "call_tool", "tool_name": …, "arguments": {…}}`); observations its
`CallToolObservation` (`result`, or `error`). `reset` takes the sample's `answer` (rlhost
sends a sample's metadata fields with `reset`, as TRL's environment_factory does) and
reports it back in its metadata; rewards are the run's own (the units task's reward
plugin scores the final answer).
"""

import datetime

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Observation, State

mcp = FastMCP("dates")


@mcp.tool()
def add_days(date: str, days: int) -> str:
    """The date a number of days after (or before, if negative) a date given as YYYY-MM-DD."""
    return (datetime.date.fromisoformat(date) + datetime.timedelta(days=days)).isoformat()


class DatesEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__(mcp)
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed=None, episode_id=None, answer=None, **kwargs):
        self._state = State(episode_id=episode_id, step_count=0)
        return Observation(done=False, reward=None, metadata={"answer": answer, "seed": seed})

    def _step_impl(self, action, timeout_s=None, **kwargs):
        return Observation(done=False, reward=None, metadata={"error": "only call_tool actions"})

    @property
    def state(self):
        return self._state


app = create_app(
    DatesEnvironment,
    CallToolAction,
    CallToolObservation,
    env_name="dates",
    max_concurrent_envs=64,
)
