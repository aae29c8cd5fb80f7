#!/usr/bin/env bash
# Load check for the status server (not a CI test). The same short training run three
# times on this machine:
#   quiet     no client at all
#   watched   what people and tools really do: 4 dashboards' event streams, and once a
#             second /status, /history, /rollouts/latest and a Prometheus scrape
#   flood     wrk hammering /status and /metrics flat out (CONNS connections each)
# Prints requests/s, latency percentiles and errors per endpoint under the flood, and
# how much the mean training step time changed in each case. The load generator shares
# the machine's cores with training, so the flood's step-time change is an upper bound
# (WRK_NICE=19 runs wrk niced, as a load from elsewhere would be).
#
#   bash bench/status_load.sh
#   STEPS=60 CONNS=64 WRK_NICE=19 bash bench/status_load.sh
#
# Needs wrk and curl (Debian: apt-get install wrk curl); builds the release binary.
set -euo pipefail
cd "$(dirname "$0")/.."

STEPS=${STEPS:-30}
CONNS=${CONNS:-32}
WRK_NICE=${WRK_NICE:-0}
OUT=${OUT:-/tmp/rlhost-status-load}

for tool in wrk curl; do
    command -v $tool >/dev/null || { echo "$tool is missing: apt-get install $tool" >&2; exit 1; }
done
cargo build --release -p rlhost -q
(cd plugins && bash build.sh >/dev/null)
BIN=target/release/rlhost
rm -rf "$OUT"; mkdir -p "$OUT"

train() { # $1 = run dir; starts in the background, sets $pid and $url
    "$BIN" train --config configs/fixture-countdown.toml --quiet \
        --set rollout.group_size=4 --set rollout.prompts_per_step=4 \
        --set sampling.max_new_tokens=32 --set train.save_every=1000 \
        --steps "$STEPS" --status-addr 127.0.0.1:0 --status-linger 30 \
        --out "$1" > "$1.stdout" 2> "$1.stderr" &
    pid=$!
    url=""
    for _ in $(seq 600); do
        url=$(grep -o 'http://[0-9.:]*/' "$1.stderr" 2>/dev/null | head -1 || true)
        [ -n "$url" ] && break
        sleep 0.1
    done
    [ -n "$url" ] || { echo "no status URL in $1.stderr" >&2; exit 1; }
    # Load starts with the first step: it measures training, not model loading.
    until [ -s "$1/metrics.jsonl" ]; do sleep 0.1; done
}

wait_steps() { # until $1/metrics.jsonl has STEPS lines (the server lingers after)
    until [ "$(wc -l < "$1/metrics.jsonl")" -ge "$STEPS" ]; do sleep 0.2; done
}

mean_step() { # mean step_s over steps 3.. (the first steps pay warm-up)
    python3 -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
xs = [r["step_s"] for r in rows[2:]]
print(f"{sum(xs)/len(xs):.4f}")' "$1/metrics.jsonl"
}

echo "== quiet: $STEPS steps"
train "$OUT/quiet"; wait_steps "$OUT/quiet"; kill "$pid"; wait "$pid" 2>/dev/null || true
quiet=$(mean_step "$OUT/quiet")

echo "== watched: 4 event streams + /status, /history, /rollouts/latest, /metrics each second"
train "$OUT/watched"
sse=()
for _ in 1 2 3 4; do curl -sN "${url}events" > /dev/null & sse+=($!); done
(
    n=0; fail=0
    while [ "$(wc -l < "$OUT/watched/metrics.jsonl")" -lt "$STEPS" ]; do
        for ep in status history "rollouts/latest?n=8" metrics; do
            curl -sf -o /dev/null "${url}${ep}" && n=$((n+1)) || fail=$((fail+1))
        done
        sleep 1
    done
    echo "$n ok, $fail failed" > "$OUT/watched-requests.txt"
) & poller=$!
wait "$poller"
kill "${sse[@]}" "$pid" 2>/dev/null || true; wait 2>/dev/null || true
watched=$(mean_step "$OUT/watched")

echo "== flood: wrk -c$CONNS on /status and on /metrics (nice $WRK_NICE) for the whole run"
train "$OUT/flood"
nice -n "$WRK_NICE" wrk -t1 -c"$CONNS" -d600s --latency "${url}status" > "$OUT/wrk-status.txt" 2>&1 & w1=$!
nice -n "$WRK_NICE" wrk -t1 -c"$CONNS" -d600s --latency "${url}metrics" > "$OUT/wrk-metrics.txt" 2>&1 & w2=$!
wait_steps "$OUT/flood"
# wrk prints its report on SIGINT; the server is still up (it lingers), so every error
# counted happened during training.
kill -INT "$w1" "$w2"; wait "$w1" "$w2" 2>/dev/null || true
kill "$pid"; wait "$pid" 2>/dev/null || true
flood=$(mean_step "$OUT/flood")

for ep in status metrics; do
    f="$OUT/wrk-$ep.txt"
    rps=$(awk '/Requests\/sec/ {print $2}' "$f")
    p50=$(awk '$1=="50%" {print $2}' "$f")
    p99=$(awk '$1=="99%" {print $2}' "$f")
    errs=$(grep -E "Socket errors|Non-2xx" "$f" | tr -s ' ' | tr '\n' ';' || true)
    printf 'flood /%-8s %10s req/s   p50 %8s   p99 %8s   errors: %s\n' "$ep" "$rps" "$p50" "$p99" "${errs:-none}"
done
echo "watched: $(cat "$OUT/watched-requests.txt") polling requests"
python3 -c '
import sys
q, w, f = map(float, sys.argv[1:])
print(f"mean step time (steps 3..): quiet {q:.3f} s, watched {w:.3f} s ({100*(w-q)/q:+.1f}%), flood {f:.3f} s ({100*(f-q)/q:+.1f}%)")
' "$quiet" "$watched" "$flood"
echo "reports: $OUT/"
