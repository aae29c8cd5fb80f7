"""An agent written against the OpenAI API, trained by rlhost without a change.

It solves the built-in units tasks (conversions, dates, exact fractions) with three
functions it implements itself, in Python, outside rlhost: it takes a task from the
gateway, calls the model with `tools=`, runs the calls the model makes, sends the results
back as `tool` messages, and ends the session. The reward is left to the run's
`units_task` reward plugin (or, with --reward-self, the agent reports its own).

    rlhost train --config configs/gateway-units.toml        # prints the gateway's URL
    python examples/agents/units_agent.py --url http://127.0.0.1:8000

It runs `--workers` sessions at once (their calls are decoded together) until the gateway
goes away (the run ended). Needs only the official `openai` package.
"""

import argparse
import datetime
import json
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from fractions import Fraction

import openai
from openai import OpenAI

UNITS = {
    "length": {"m": 1, "km": 1000, "cm": Fraction(1, 100), "mm": Fraction(1, 1000), "mi": Fraction(1609344, 1000),
               "ft": Fraction(3048, 10000), "in": Fraction(254, 10000), "yd": Fraction(9144, 10000)},
    "mass": {"kg": 1, "g": Fraction(1, 1000), "lb": Fraction(45359237, 100000000), "oz": Fraction(45359237, 1600000000)},
    "time": {"s": 1, "min": 60, "h": 3600, "day": 86400},
}
TEMPERATURES = ("C", "F", "K")
ALL_UNITS = sorted({u for d in UNITS.values() for u in d} | set(TEMPERATURES))

# Declared as the agent's own functions (the same schemas the units plugin declares, so
# that the built-in model, warm-started on those, reads them as it learned them).
TOOLS = [
    {"type": "function", "function": {
        "name": "convert",
        "description": "Convert a quantity between units of length, mass, time or temperature.",
        "parameters": {"type": "object", "properties": {
            "value": {"type": "number", "description": "The quantity."},
            "from": {"type": "string", "enum": ALL_UNITS},
            "to": {"type": "string", "enum": ALL_UNITS}},
            "required": ["value", "from", "to"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add_days",
        "description": "The date a number of days after (or before, if negative) a date given as YYYY-MM-DD.",
        "parameters": {"type": "object", "properties": {
            "date": {"type": "string", "description": "YYYY-MM-DD"},
            "days": {"type": "integer", "minimum": -1000000, "maximum": 1000000}},
            "required": ["date", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "exact",
        "description": "Exact arithmetic on fractions: a op b with op one of + - * /, as a reduced fraction.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "string", "description": "An integer or fraction, e.g. 3/4"},
            "op": {"type": "string", "enum": ["+", "-", "*", "/"]},
            "b": {"type": "string"}},
            "required": ["a", "op", "b"], "additionalProperties": False}}},
]


def convert(args):
    value, src, dst = args["value"], args["from"], args["to"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("value must be a number")
    x = Fraction(value)
    if src in TEMPERATURES or dst in TEMPERATURES:
        if src not in TEMPERATURES or dst not in TEMPERATURES:
            raise ValueError(f"cannot convert {src} to {dst}")
        kelvin = {"C": x + Fraction(27315, 100), "F": (x - 32) * Fraction(5, 9) + Fraction(27315, 100), "K": x}[src]
        out = {"C": kelvin - Fraction(27315, 100), "F": (kelvin - Fraction(27315, 100)) * Fraction(9, 5) + 32,
               "K": kelvin}[dst]
    else:
        dims = [d for d, units in UNITS.items() if src in units and dst in units]
        if not dims:
            raise ValueError(f"cannot convert {src} to {dst}")
        units = UNITS[dims[0]]
        out = x * units[src] / units[dst]
    return f"{float(out):.6g} {dst}"


def add_days(args):
    start = datetime.date.fromisoformat(args["date"])
    days = args["days"]
    if isinstance(days, bool) or not isinstance(days, int):
        raise ValueError("days must be an integer")
    return (start + datetime.timedelta(days=days)).isoformat()


def exact(args):
    a, b, op = Fraction(str(args["a"])), Fraction(str(args["b"])), args["op"]
    if op not in ("+", "-", "*", "/"):
        raise ValueError(f"unknown operation {op!r}")
    if op == "/" and b == 0:
        raise ZeroDivisionError("division by zero")
    return str({"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else 0}[op])


FUNCTIONS = {"convert": convert, "add_days": add_days, "exact": exact}


def run_call(name, arguments):
    """A call's result as the model reads it: the answer, or `error: …`."""
    try:
        args = json.loads(arguments)
        if not isinstance(args, dict):
            raise ValueError("the arguments must be an object")
        return FUNCTIONS[name](args)
    except KeyError as e:
        return f"error: {name}: missing {e}" if name in FUNCTIONS else f"error: there is no function {name!r}"
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {name}: {type(e).__name__}: {e}"


def post(url, body=None):
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(),
                                 headers={"content-type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.sessions = self.calls = self.correct = 0


def episode(base, args, tally):
    s = post(f"{base}/rl/tasks/next")
    model = OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=5, timeout=600)
    messages = list(s["task"]["messages"])
    answer = None
    for _ in range(args.max_turns):
        r = model.chat.completions.create(model=s["model"], messages=messages, tools=TOOLS,
                                          max_tokens=args.max_tokens, temperature=1.0)
        m = r.choices[0].message
        messages.append(m.model_dump(exclude_none=True))
        if not m.tool_calls:
            answer = m.content or ""
            break
        for call in m.tool_calls:
            with tally.lock:
                tally.calls += 1
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_call(call.function.name, call.function.arguments)})
    body = {}
    expected = s["task"]["metadata"].get("answer")
    got = re.search(r"<answer>(.*?)</answer>", answer or "", re.S)
    right = bool(got) and expected is not None and got.group(1).strip() == str(expected).strip()
    if args.reward_self:
        body = {"reward": 1.0 if right else 0.0}
    post(f"{base}/sessions/{s['session_id']}/end", body)
    with tally.lock:
        tally.sessions += 1
        tally.correct += right


def worker(base, args, tally, stop):
    while not stop.is_set():
        try:
            episode(base, args, tally)
        except (urllib.error.URLError, ConnectionError, openai.APIConnectionError):
            stop.set()  # the run ended: the gateway is gone
        except openai.APIStatusError as e:
            print(f"units_agent: {e}", file=sys.stderr)
            time.sleep(1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway (without /v1)")
    p.add_argument("--workers", type=int, default=16, help="sessions at once")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reward-self", action="store_true",
                   help="report 1/0 for a right/wrong <answer> instead of leaving it to the run's reward")
    p.add_argument("--wait", type=float, default=600, help="seconds to wait for the gateway to come up")
    args = p.parse_args()
    base = args.url.rstrip("/").removesuffix("/v1")
    deadline = time.time() + args.wait
    while True:
        try:
            urllib.request.urlopen(f"{base}/status", timeout=5).read()
            break
        except (urllib.error.URLError, ConnectionError):
            if time.time() > deadline:
                sys.exit(f"units_agent: no gateway at {base} after {args.wait:.0f} s")
            time.sleep(1)
    tally, stop = Tally(), threading.Event()
    threads = [threading.Thread(target=worker, args=(base, args, tally, stop), daemon=True)
               for _ in range(args.workers)]
    t0 = time.time()
    for t in threads:
        t.start()
    last = 0.0
    while any(t.is_alive() for t in threads):
        time.sleep(1)
        if time.time() - last > 30:
            last = time.time()
            with tally.lock:
                print(f"units_agent: {tally.sessions} sessions, {tally.calls} calls, "
                      f"{tally.correct} right, {time.time() - t0:.0f} s", flush=True)
    print(f"units_agent: done: {tally.sessions} sessions, {tally.calls} function calls, "
          f"{tally.correct} right answers", flush=True)


if __name__ == "__main__":
    main()
