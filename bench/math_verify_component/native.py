#!/usr/bin/env python3
"""Native CPython timing of the very same grade() (reward.py, imported with stand-ins for
the component bindings), after the same build-time imports and warm-up the component
snapshots. Usage: PYTHONPATH=<site with unpatched math-verify> python3 native.py pairs.json
Prints one JSON line per pair: correct, first call (as the component's fresh instance
makes it) and the median of 5 repeats with math-verify's parse caches cleared."""
import json
import os
import sys
import time
import types

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
stub = lambda name, **kw: sys.modules.setdefault(name, types.ModuleType(name)).__dict__.update(kw)
ns = types.SimpleNamespace
stub("componentize_py_types", Err=Exception)
stub("wit_world")
stub("wit_world.exports", reward=ns(Scorer=object))
stub("wit_world.imports", types=ns(Trajectory=object, Component=object), host=ns(log=lambda *a: None, Level=ns(WARN=3, INFO=2, DEBUG=1)))
t = time.perf_counter()
import reward  # noqa: E402  (imports everything, then warms up, as at build time)
print(json.dumps({"import_and_warm_up_ms": round((time.perf_counter() - t) * 1000), "modules": len(sys.modules)}))
import math_verify.parser as P  # noqa: E402

for gold, completion in json.load(open(sys.argv[1])):
    t = time.perf_counter()
    correct, _ = reward.grade(gold, completion)
    first = (time.perf_counter() - t) * 1000
    reps = []
    for _ in range(5):
        P.parse_latex_cached.cache_clear()
        P.parse_expr_cached.cache_clear()
        t = time.perf_counter()
        reward.grade(gold, completion)
        reps.append((time.perf_counter() - t) * 1000)
    print(json.dumps({"gold": gold, "completion": completion, "correct": correct,
                      "first_ms": round(first, 2), "median_ms": round(sorted(reps)[2], 2)}))
