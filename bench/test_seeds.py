#!/usr/bin/env python3
"""Do the learning tests hold on any seed? (issue 63): runs each learning test of the
integration suite once per `run.seed`, one after another, and prints a table of passes.
A benchmark, not a test: CI runs each test once, on the seed its config names.

    python3 bench/test_seeds.py                        # every learning test, seeds 1-5
    python3 bench/test_seeds.py --seeds 6-10 --test train_cli::ppo_learns_a_simple_reward

Each run sets `RLHOST_TEST_SEED=N`, which the tests' `TestCommand` turns into
`--set run.seed=N` on every `train`, `rollout`, `sft`, `dpo` and `rm` it runs (see
`tests/src/lib.rs`). Models a test builds itself (the code and units tasks' small
fixtures) keep their own seeds; the run's seed moves its adapter's initialisation, its
sampling and its data order. The tests run on the debug build as CI runs them
(`cargo build -p rlhost` and `bash plugins/build.sh` first).
"""

import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from seed_sweep import seeds  # noqa: E402  (`1-5`, `2,3,6` or a mix)

# Every test that asserts that a run learns (its reward or accuracy rises), by module.
LEARNING = [
    "train_cli::a_simple_reward_is_learned",
    "train_cli::ppo_learns_a_simple_reward",
    "train_cli::qlora_learns_a_simple_reward",
    "train_cli::sft_learns_assistant_turns_and_writes_an_adapter_and_a_merged_model",
    "code_task::the_python_tool_is_learned_and_its_output_is_never_trained_on",
    "code_task::the_javascript_tool_is_learned_and_the_c_reward_scores_the_run",
    "units_task::the_units_functions_are_learned_and_their_answers_never_trained_on",
    "openenv_train::a_model_learns_to_call_an_openenv_mcp_environment",
    "preference::dpo_learns_the_pairs_and_a_resumed_run_takes_the_same_steps",
    "preference::rm_learns_which_reply_is_preferred_and_saves_a_sequence_classifier",
    "preference::a_grpo_run_learns_what_a_reward_model_prefers",
    "distill::a_student_learns_what_its_teacher_says_from_its_log_probs_alone",
]


def test_binary():
    """The integration tests' executable, built if it is not."""
    out = subprocess.run(
        ["cargo", "test", "-p", "rlhost-tests", "--test", "integration", "--no-run"],
        cwd=ROOT, capture_output=True, text=True,
    )
    if out.returncode != 0:
        sys.exit(f"building the integration tests failed:\n{out.stderr}")
    found = re.findall(r"Executable (?:tests/)?integration/main\.rs \((.+?)\)", out.stderr)
    if not found:
        sys.exit(f"cannot find the integration tests' executable in cargo's output:\n{out.stderr}")
    return os.path.join(ROOT, found[-1])


def why(text):
    """The line a failed test's panic gives, shortened."""
    for line in text.splitlines():
        if "panicked at" in line:
            continue
        if any(k in line for k in ("did not", "assert", "expected", "rose", "<", ">")):
            return line.strip()[:100]
    return "failed"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="1-5", help="run.seed values: 1-5, 2,3,6 (default 1-5)")
    ap.add_argument("--test", action="append", default=[],
                    help="a test's path in the integration suite (default: every learning test)")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs/test-seeds"), help="where the logs go")
    args = ap.parse_args()
    tests = args.test or LEARNING
    binary = test_binary()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for test in tests:
        row = {"test": test, "seeds": {}}
        for seed in seeds(args.seeds):
            env = dict(os.environ, RLHOST_TEST_SEED=str(seed))
            log = os.path.join(args.out, f"{test.replace('::', '-')}-seed-{seed}.log")
            t0 = time.time()
            with open(log, "w") as f:
                rc = subprocess.call([binary, "--exact", test, "--nocapture"], cwd=os.path.join(ROOT, "tests"),
                                     stdout=f, stderr=subprocess.STDOUT, env=env)
            text = open(log, errors="replace").read()
            if "running 0 tests" in text or "0 passed; 0 failed" in text:
                sys.exit(f"no test named {test} (log {log})")
            row["seeds"][seed] = ("pass" if rc == 0 else f"FAIL: {why(text)}", time.time() - t0)
            print(f"{test} seed {seed}: {row['seeds'][seed][0]} in {time.time() - t0:.0f} s",
                  file=sys.stderr, flush=True)
        rows.append(row)
    print("| test | " + " | ".join(f"seed {s}" for s in seeds(args.seeds)) + " | passed |")
    print("|---|" + "---|" * (len(seeds(args.seeds)) + 1))
    for row in rows:
        cells = [("pass" if v[0] == "pass" else "**fail**") for v in row["seeds"].values()]
        n = sum(c == "pass" for c in cells)
        print(f"| `{row['test']}` | " + " | ".join(cells) + f" | {n} of {len(cells)} |")
    failures = [(r["test"], s, v[0]) for r in rows for s, v in r["seeds"].items() if v[0] != "pass"]
    for test, seed, what in failures:
        print(f"- {test} seed {seed}: {what}")


if __name__ == "__main__":
    main()
