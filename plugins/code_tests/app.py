"""The code-tests reward, built into a WebAssembly component by componentize-py.

It takes the model's final ```python block and runs it against the sample's tests inside
rlhost's sandbox (no files, no network, no processes, a memory cap and a deadline), the
work verl's and DeepCoder's code rewards hand to a sandbox service:

- `assert` lines (MBPP's `test_list`), or a script defining `check(candidate)` called on
  the sample's `entry_point` (HumanEval);
- stdin/stdout cases (APPS, CodeContests): the program reads the case's input and its
  output is compared with the expected one, line by line;
- call cases (APPS with `fn_name`): the named function is called with the case's
  arguments and its value compared with the expected one.

Components: `passed` (the fraction of cases passed) and `all_passed` (1 when every case
did). The first failure is logged at `warn`; rlhost keeps it in the trajectory's record.

With `cases = "tests"` in the run's `[[rewards]]` entry, the host scores every case in a
fresh instance of this plugin under its own time and memory limit, so a case that loops or
exhausts memory fails alone. Without it, all cases run in one call here, each with fresh
globals and stdin/stdout.

This module holds `About`; the scorer lives in `reward.py` (componentize-py looks an
exported resource up in a module named after its interface).
"""

from wit_world import exports
from wit_world.imports import types


class About(exports.About):
    def info(self) -> types.PluginInfo:
        return types.PluginInfo(
            name="code_tests",
            version="0.1.0",
            description="Runs the model's final ```python block against the sample's tests",
        )
