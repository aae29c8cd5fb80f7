#!/usr/bin/env bash
# Issue 47's comparison (a benchmark, not a test): one task learned by GRPO with its
# functions (a) in process, `rollout.tools = ["units"]`, and (b) through OpenEnv, the same
# plugin served by `rlhost env serve` and reached with `[rollout.openenv]`'s call mapping.
# Same model, data, seed and steps; prints each run's held-out accuracy by step, its wall
# time, and the time of one function call (`tool_busy_s` over the calls), whose difference
# is the cost of the WebSocket hop.
#
#   bash bench/openenv_learning.sh [STEPS] [OUT_DIR]      # defaults: 30, /tmp/openenv-learning
#
# The model is the integration tests' small units model (host/examples/units_model.rs: the
# units recipe warm-started on `add_days` problems, ~3 min on two cores, cached in
# OUT_DIR/../openenv-learning-cache); the task its `add_days` problems, scored by the task's
# own reward's `tool_use` component (as the tests reward it: this small model calls
# `add_days` in ~40% of its first trajectories and does not copy its answers well enough
# for `correct` to teach it anything in 30 steps). Uses target/debug/rlhost (the dev profile optimises the
# host: `cargo build -p rlhost`) and plugins/dist (bash plugins/build.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-30}
OUT=${2:-/tmp/openenv-learning}
TARGET=${CARGO_TARGET_DIR:-target}
BIN=${RLHOST_BIN:-$TARGET/debug/rlhost}
[ -x "$BIN" ] || { echo "no $BIN: cargo build -p rlhost" >&2; exit 1; }
rm -rf "$OUT" && mkdir -p "$OUT"
ROOT=$PWD
echo "== the model"
MODEL=$(cargo run -q --example units_model -- "$OUT-cache" "$ROOT/plugins/dist" | tail -1)
[ -d "$MODEL" ] || { echo "no model folder: $MODEL" >&2; exit 1; }

# The shared part of both runs.
common() {
  cat <<EOF
[run]
seed = 7
[lora]
r = 16
alpha = 32
[model]
path = "$MODEL"
[data]
plugin = "units_task"
plugin_config = { kinds = ["add_days"] }
eval_size = 200
[sampling]
temperature = 1.0
max_new_tokens = 48
[plugins.units_task]
path = "$ROOT/plugins/dist/units_task.wasm"
[[rewards]]
plugin = "units_task"
weights = { tool_use = 1.0, correct = 0.0, format = 0.0 }
[train]
steps = $STEPS
lr = 0.004
save_every = 1000
eval_every = 10
eval_prompts = 100
EOF
}

{
  common
  cat <<EOF
[rollout]
group_size = 8
prompts_per_step = 8
tools = ["units"]
max_total_tokens = 768
[plugins.units]
path = "$ROOT/plugins/dist/units.wasm"
EOF
} > "$OUT/in_process.toml"

echo "== (a) in process"
t0=$(date +%s.%N)
"$BIN" train --no-status --config "$OUT/in_process.toml" --out "$OUT/a" 2> "$OUT/a.log" || { tail -20 "$OUT/a.log"; exit 1; }
t1=$(date +%s.%N)
"$BIN" env serve "$ROOT/plugins/dist/units.wasm" --port 0 --max-sessions 64 > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 50); do grep -q "http://" "$OUT/serve.log" && break; sleep 0.1; done
URL=$(grep -o "http://127.0.0.1:[0-9]*" "$OUT/serve.log" | head -1)
{
  common
  cat <<EOF
[rollout]
group_size = 8
prompts_per_step = 8
max_total_tokens = 768
[rollout.openenv]
url = "$URL"
allow = ["$URL"]
observation = ["result", "error"]
errors = ["error"]
action = { kind = "call" }
max_sessions = 64
EOF
} > "$OUT/openenv.toml"

echo "== (b) through OpenEnv at $URL"
t2=$(date +%s.%N)
"$BIN" train --no-status --config "$OUT/openenv.toml" --out "$OUT/b" 2> "$OUT/b.log" || { tail -20 "$OUT/b.log"; exit 1; }
t3=$(date +%s.%N)

python3 - "$OUT" "$t0" "$t1" "$t2" "$t3" <<'EOF'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1]); t0, t1, t2, t3 = map(float, sys.argv[2:])
def figures(run):
    rows = [json.loads(l) for l in (out / run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("eval_accuracy") is not None]
    calls = sum(r["tool_calls"] * r["trajectories"] for r in rows)
    busy = sum(r.get("tool_busy_s", 0.0) for r in rows)
    return {
        "held_out_reward_by_step": {r["step"]: r["eval_reward"] for r in evals},
        "calls_first_step": rows[0]["tool_calls"],
        "calls_last_5": sum(r["tool_calls"] for r in rows[-5:]) / 5,
        "tool_calls": calls,
        "ms_per_call": 1e3 * busy / calls if calls else None,
        "rollout_s": sum(r["rollout_s"] for r in rows),
        "step_s": sum(r["step_s"] for r in rows),
    }
a, b = figures("a"), figures("b")
a["wall_s"], b["wall_s"] = t1 - t0, t3 - t2
print(json.dumps({"in_process": a, "openenv": b}, indent=2))
if a["ms_per_call"] and b["ms_per_call"]:
    print(f"WebSocket hop: {b['ms_per_call'] - a['ms_per_call']:.2f} ms a call "
          f"({a['ms_per_call']:.2f} ms in process, {b['ms_per_call']:.2f} ms through OpenEnv)")
EOF
