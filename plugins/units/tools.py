"""The functions: each call reads its arguments (already checked against the schema by the
host), computes, and returns the answer as text; input a function cannot use (an unknown
unit, a date out of range, a division by zero) is its own error, for the model to read."""

import datetime
import json
from fractions import Fraction
from typing import List

from componentize_py_types import Err
from wit_world.exports import tools
from wit_world.imports import types

# Factors to the base unit of each dimension; temperatures are converted by formula.
UNITS = {
    "length": {"m": 1, "km": 1000, "cm": Fraction(1, 100), "mm": Fraction(1, 1000), "mi": Fraction(1609344, 1000),
               "ft": Fraction(3048, 10000), "in": Fraction(254, 10000), "yd": Fraction(9144, 10000)},
    "mass": {"kg": 1, "g": Fraction(1, 1000), "lb": Fraction(45359237, 100000000), "oz": Fraction(45359237, 1600000000)},
    "time": {"s": 1, "min": 60, "h": 3600, "day": 86400},
}
TEMPERATURES = ("C", "F", "K")
ALL_UNITS = sorted({u for d in UNITS.values() for u in d} | set(TEMPERATURES))

FUNCTIONS = [
    types.FunctionSpec(
        name="convert",
        description="Convert a quantity between units of length, mass, time or temperature.",
        parameters=json.dumps({
            "type": "object",
            "properties": {
                "value": {"type": "number", "description": "The quantity."},
                "from": {"type": "string", "enum": ALL_UNITS},
                "to": {"type": "string", "enum": ALL_UNITS},
            },
            "required": ["value", "from", "to"],
            "additionalProperties": False,
        }),
        stateless=True,
    ),
    types.FunctionSpec(
        name="add_days",
        description="The date a number of days after (or before, if negative) a date given as YYYY-MM-DD.",
        parameters=json.dumps({
            "type": "object",
            "properties": {
                "date": {"type": "string", "description": "YYYY-MM-DD"},
                "days": {"type": "integer", "minimum": -1000000, "maximum": 1000000},
            },
            "required": ["date", "days"],
            "additionalProperties": False,
        }),
        stateless=True,
    ),
    types.FunctionSpec(
        name="exact",
        description="Exact arithmetic on fractions: a op b with op one of + - * /, as a reduced fraction.",
        parameters=json.dumps({
            "type": "object",
            "properties": {
                "a": {"type": "string", "description": "An integer or fraction, e.g. 3/4"},
                "op": {"type": "string", "enum": ["+", "-", "*", "/"]},
                "b": {"type": "string"},
            },
            "required": ["a", "op", "b"],
            "additionalProperties": False,
        }),
        stateless=True,
    ),
]


class Session(tools.Session):
    @classmethod
    def open(cls, config: str, sample: types.Sample) -> "Session":
        try:
            parsed = json.loads(config or "{}")
        except ValueError as e:
            raise Err(f"units config is not JSON: {e}")
        if not isinstance(parsed, dict) or parsed:
            raise Err("units takes no configuration: pass {}")
        return cls()

    def functions(self) -> List[types.FunctionSpec]:
        return FUNCTIONS

    def call(self, name: str, arguments: str) -> str:
        try:
            args = json.loads(arguments)
        except ValueError as e:
            raise Err(f"the arguments are not JSON: {e}")
        if not isinstance(args, dict):
            raise Err("the arguments must be an object")
        try:
            if name == "convert":
                return convert(args)
            if name == "add_days":
                return add_days(args)
            if name == "exact":
                return exact(args)
        except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
            raise Err(f"{name}: {type(e).__name__}: {e}")
        raise Err(f"there is no function {name!r}")


def convert(args: dict) -> str:
    value, src, dst = args["value"], args["from"], args["to"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("value must be a number")
    for other in (args.keys() - {"value", "from", "to"}):
        raise ValueError(f"unknown parameter {other!r}")
    x = Fraction(value)
    if src in TEMPERATURES or dst in TEMPERATURES:
        if src not in TEMPERATURES or dst not in TEMPERATURES:
            raise ValueError(f"cannot convert {src} to {dst}")
        kelvin = {"C": x + Fraction(27315, 100), "F": (x - 32) * Fraction(5, 9) + Fraction(27315, 100), "K": x}[src]
        out = {"C": kelvin - Fraction(27315, 100), "F": (kelvin - Fraction(27315, 100)) * Fraction(9, 5) + 32, "K": kelvin}[dst]
    else:
        dims = [d for d, units in UNITS.items() if src in units and dst in units]
        if not dims:
            raise ValueError(f"cannot convert {src} to {dst}")
        units = UNITS[dims[0]]
        out = x * units[src] / units[dst]
    return f"{float(out):.6g} {dst}"


def add_days(args: dict) -> str:
    start = datetime.date.fromisoformat(args["date"])
    days = args["days"]
    if isinstance(days, bool) or not isinstance(days, int):
        raise ValueError("days must be an integer")
    return (start + datetime.timedelta(days=days)).isoformat()


def exact(args: dict) -> str:
    a, b, op = Fraction(str(args["a"])), Fraction(str(args["b"])), args["op"]
    if op not in ("+", "-", "*", "/"):
        raise ValueError(f"unknown operation {op!r}")
    out = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[op]
    if out is None:
        raise ZeroDivisionError("division by zero")
    return str(out)


def _warm_up() -> None:
    """Every path once at build time, so the snapshot holds the warm caches."""
    convert({"value": 3, "from": "km", "to": "mi"})
    convert({"value": 100, "from": "C", "to": "F"})
    add_days({"date": "2026-11-26", "days": 30})
    exact({"a": "3/4", "op": "+", "b": "1/6"})


_warm_up()
