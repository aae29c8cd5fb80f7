"""Unit tests of the scorer's logic, run by CPython here (`python3 -m unittest` in
plugins/code_tests; scripts/test.sh runs them). The WIT bindings componentize-py generates
are replaced by the small stand-ins below; the component itself is tested by the host's
integration tests (tests/integration/code_tests.rs), in the sandbox."""

import json
import sys
import types as pytypes
import unittest
from dataclasses import dataclass
from enum import Enum


class Err(Exception):
    def __init__(self, value):
        super().__init__(value)
        self.value = value


def _bindings():
    logged = []
    cpt = pytypes.ModuleType("componentize_py_types")
    cpt.Err = Err

    class Level(Enum):
        TRACE = 0
        DEBUG = 1
        INFO = 2
        WARN = 3
        ERROR = 4

    host = pytypes.ModuleType("wit_world.imports.host")
    host.Level = Level
    host.log = lambda level, message: logged.append((level, message))

    @dataclass
    class Component:
        name: str
        value: float

    @dataclass
    class Trajectory:
        messages: list
        completion: str
        metadata: str
        turns: int
        truncated: bool

    wtypes = pytypes.ModuleType("wit_world.imports.types")
    wtypes.Component, wtypes.Trajectory = Component, Trajectory
    reward = pytypes.ModuleType("wit_world.exports.reward")
    reward.Scorer = object
    imports = pytypes.ModuleType("wit_world.imports")
    imports.host, imports.types = host, wtypes
    exports = pytypes.ModuleType("wit_world.exports")
    exports.reward = reward
    world = pytypes.ModuleType("wit_world")
    world.imports, world.exports = imports, exports
    sys.modules.update({
        "componentize_py_types": cpt,
        "wit_world": world,
        "wit_world.imports": imports,
        "wit_world.imports.host": host,
        "wit_world.imports.types": wtypes,
        "wit_world.exports": exports,
        "wit_world.exports.reward": reward,
    })
    return logged, Trajectory


LOGGED, Trajectory = _bindings()
import reward  # noqa: E402


def score(completion, metadata, config="{}"):
    LOGGED.clear()
    scorer = reward.Scorer.open(config)
    t = Trajectory([], completion, json.dumps(metadata), 1, False)
    parts = {c.name: c.value for c in scorer.score(t)}
    return parts["passed"], parts["all_passed"], (LOGGED[0][1] if LOGGED else None)


def block(code):
    return f"Here it is.\n```python\n{code}\n```\nDone."


ADD = block("def add(a, b):\n    return a + b")


class Layouts(unittest.TestCase):
    def test_mbpp_assert_lines(self):
        meta = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 1"]}
        passed, all_passed, note = score(ADD, meta)
        self.assertAlmostEqual(passed, 2 / 3)
        self.assertEqual(all_passed, 0.0)
        self.assertEqual(note, "case 2: assertion failed at the test, line 1: assert add(0, 0) == 1")

    def test_mbpp_setup_code_runs_first(self):
        meta = {"tests": ["assert add(K, 1) == 11"], "test_setup_code": "K = 10"}
        self.assertEqual(score(ADD, meta)[:2], (1.0, 1.0))

    def test_humaneval_check_on_the_entry_point(self):
        test = "METADATA = {}\n\ndef check(candidate):\n    assert candidate(1, 1) == 2\n    assert candidate(2, 3) == 5\n"
        self.assertEqual(score(ADD, {"tests": test, "entry_point": "add"})[:2], (1.0, 1.0))
        wrong = block("def add(a, b):\n    return a - b")
        passed, _, note = score(wrong, {"tests": test, "entry_point": "add"})
        self.assertEqual(passed, 0.0)
        self.assertIn("assert candidate(1, 1) == 2", note)
        with self.assertRaises(Err) as e:
            score(ADD, {"tests": test})
        self.assertIn("entry_point", e.exception.value)

    def test_stdin_stdout_cases(self):
        code = block("a, b = map(int, input().split())\nprint(a + b)")
        meta = {"tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10  \n\n"},
                          {"input": "2 2\n", "output": "5\n"}]}
        passed, _, note = score(code, meta)
        self.assertAlmostEqual(passed, 2 / 3)
        self.assertEqual(note, "case 2: wrong output for input '2 2\\n': expected '5\\n', got '4\\n'")

    def test_apps_input_output_as_json_text(self):
        code = block("import sys\ndata = sys.stdin.buffer.read().split()\nprint(sum(map(int, data)))")
        io = json.dumps({"inputs": ["1 2\n", "3 4 5\n"], "outputs": ["3\n", "12\n"]})
        self.assertEqual(score(code, {"tests": io})[:2], (1.0, 1.0))

    def test_codecontests_parallel_lists(self):
        code = block("print(input()[::-1])")
        meta = {"tests": {"input": ["abc\n", "xy\n"], "output": ["cba\n", "yx"]}}
        self.assertEqual(score(code, meta)[:2], (1.0, 1.0))
        with self.assertRaises(Err) as e:
            score(code, {"tests": {"input": ["a"], "output": []}})
        self.assertIn("different lengths", e.exception.value)

    def test_apps_call_cases_and_leetcode_classes(self):
        meta = {"tests": json.dumps({"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]]})}
        self.assertEqual(score(ADD, meta)[:2], (1.0, 1.0))
        cls = block("class Solution:\n    def add(self, a, b):\n        return (a + b, a)")
        meta = {"tests": [{"fn_name": "add", "inputs": [1, 2], "outputs": [3, 1]}]}
        self.assertEqual(score(cls, meta)[:2], (1.0, 1.0))

    def test_compare_modes(self):
        code = block("print('0.3333333 x')")
        meta = {"tests": [{"input": "", "output": "0.333333333 x"}]}
        self.assertEqual(score(code, meta)[0], 0.0)
        self.assertEqual(score(code, meta, '{"compare": "tokens"}')[0], 1.0)
        self.assertEqual(score(block("print('a')"), {"tests": [{"input": "", "output": "a"}]}, '{"compare": "exact"}')[0], 0.0)


class Solutions(unittest.TestCase):
    def test_the_last_block_is_tested(self):
        two = block("def add(a, b):\n    return 0") + "\nBetter:\n" + ADD
        self.assertEqual(score(two, {"tests": ["assert add(1, 2) == 3"]})[0], 1.0)
        joined = block("K = 1") + block("def add(a, b):\n    return a + b + K")
        self.assertEqual(score(joined, {"tests": ["assert add(1, 2) == 4"]}, '{"block": "all"}')[0], 1.0)

    def test_no_block_and_syntax_errors_fail_every_case(self):
        meta = {"tests": ["assert add(1, 2) == 3", "assert True"]}
        self.assertEqual(score("def add(a, b): return a + b", meta), (0.0, 0.0, "case 0: no ```python block in the completion"))
        passed, _, note = score(block("def add(a, b) return a"), meta)
        self.assertEqual(passed, 0.0)
        self.assertTrue(note.startswith("case 0: the code does not compile"), note)

    def test_errors_name_the_line(self):
        code = block("def add(a, b):\n    return a + c")
        _, _, note = score(code, {"tests": ["assert add(1, 2) == 3"]})
        self.assertEqual(note, "case 0: NameError: name 'c' is not defined at the code, line 2: return a + c")

    def test_each_case_starts_afresh(self):
        code = block("import builtins, sys\nseen = globals().setdefault('n', 0)\nbuiltins.len = lambda x: 99\nsys.stdout = None\nprint = None")
        meta = {"tests": ["assert n == 0\nn += 1", "assert n == 0", "assert len([1]) == 99"]}
        passed, _, note = score(code, meta)
        self.assertAlmostEqual(passed, 1.0)
        self.assertEqual(len([1]), 1, "builtins are put back")
        self.assertIsNotNone(sys.stdout)

    def test_a_huge_output_is_cut_and_fails(self):
        code = block("print('x' * 100)")
        _, _, note = score(code, {"tests": [{"input": "", "output": "x"}]}, '{"max_output_chars": 10}')
        self.assertIn("longer than 10 bytes", note)

    def test_exit_codes(self):
        self.assertEqual(score(block("import sys\nprint(1)\nsys.exit(0)"), {"tests": [{"input": "", "output": "1"}]})[0], 1.0)
        _, _, note = score(block("import sys\nsys.exit(3)"), {"tests": [{"input": "", "output": ""}]})
        self.assertIn("status 3", note)

    def test_the_host_case_index_names_the_case(self):
        meta = {"tests": ["assert add(1, 2) == 4"], "rlhost_case": {"index": 7, "count": 9}}
        self.assertTrue(score(ADD, meta)[2].startswith("case 7: "))


class Config(unittest.TestCase):
    def test_bad_configs_name_the_field(self):
        for config, field in [('{"compare": "fuzzy"}', "compare"), ('{"tolerance": -1}', "tolerance"),
                              ('{"tests": "x"}', "unknown field `tests`"), ('{"max_output_chars": 0}', "max_output_chars"),
                              ("[1]", "JSON object"), ("{", "not JSON")]:
            with self.assertRaises(Err) as e:
                reward.Scorer.open(config)
            self.assertIn(field, e.exception.value)

    def test_bad_metadata_names_the_key(self):
        with self.assertRaises(Err) as e:
            score(ADD, {"test_list": []})
        self.assertIn("no `tests`", e.exception.value)
        self.assertIn("test_list", e.exception.value)
        with self.assertRaises(Err) as e:
            score(ADD, {"tests": []})
        self.assertIn("no test cases", e.exception.value)
        with self.assertRaises(Err) as e:
            score(ADD, {"tests": [{"stdin": "1"}]})
        self.assertIn("test case 0", e.exception.value)


if __name__ == "__main__":
    unittest.main()
