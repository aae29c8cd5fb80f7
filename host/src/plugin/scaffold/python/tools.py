"""{{name}}: tools (functions the model calls in its own tool-call format). This one has
two: `add`, the sum of two integers (stateless), and `tally`, which adds an amount to the
trajectory's running total and returns the total (it keeps state). Replace them with
yours.

In a run the host checks each call against the function's JSON Schema before it gets
here; the checks below still refuse what does not fit (`rlhost plugin test` sends such
calls), and a raised `Err` is the function's own refusal, which the model reads.

Config (JSON): {"start": 0} (optional): the running total when a trajectory starts."""

import json
from typing import List

from app import parse_config
from componentize_py_types import Err
from wit_world.exports import tools
from wit_world.imports import types

# The largest magnitude of an argument and of the total.
LIMIT = 1_000_000_000
INTEGER = {"type": "integer", "minimum": -LIMIT, "maximum": LIMIT}

FUNCTIONS = [
    types.FunctionSpec(
        name="add",
        description="The sum of two integers.",
        parameters=json.dumps({
            "type": "object",
            "properties": {"a": INTEGER, "b": INTEGER},
            "required": ["a", "b"],
            "additionalProperties": False,
        }),
        # Reads no state: its calls may run at once, each in a fresh instance.
        stateless=True,
    ),
    types.FunctionSpec(
        name="tally",
        description="Adds an amount to the running total and returns the total.",
        parameters=json.dumps({
            "type": "object",
            "properties": {"amount": INTEGER},
            "required": ["amount"],
            "additionalProperties": False,
        }),
        stateless=False,
    ),
]


class Session(tools.Session):
    """One trajectory's session: its state lives as long as the trajectory."""

    @classmethod
    def open(cls, config: str, sample: types.Sample) -> "Session":
        parsed = parse_config(config, {"start": 0})
        session = cls()
        session.total = integer(parsed, "start", "{{name}} config: ")
        return session

    def functions(self) -> List[types.FunctionSpec]:
        return FUNCTIONS

    def call(self, name: str, arguments: str) -> str:
        try:
            args = json.loads(arguments)
        except ValueError as e:
            raise Err(f"bad arguments: {e}")
        if name == "add":
            args = fields(args, ["a", "b"])
            return str(integer(args, "a") + integer(args, "b"))
        if name == "tally":
            amount = integer(fields(args, ["amount"]), "amount")
            total = self.total + amount
            if abs(total) > LIMIT:
                raise Err(f"the total would leave -{LIMIT}..{LIMIT}; it stays {self.total}")
            self.total = total
            return str(total)
        raise Err(f"there is no function `{name}`")


def fields(args, names: List[str]) -> dict:
    """`args` if it is an object with exactly these fields, else the refusal."""
    if not isinstance(args, dict):
        raise Err("bad arguments: expected a JSON object")
    for name in args:
        if name not in names:
            raise Err(f"bad arguments: unknown field `{name}`, expected {', '.join(names)}")
    for name in names:
        if name not in args:
            raise Err(f"bad arguments: missing field `{name}`")
    return args


def integer(args: dict, name: str, prefix: str = "") -> int:
    x = args[name]
    if not isinstance(x, int) or isinstance(x, bool) or abs(x) > LIMIT:
        raise Err(f"{prefix}`{name}` must be an integer from -{LIMIT} to {LIMIT}")
    return x
