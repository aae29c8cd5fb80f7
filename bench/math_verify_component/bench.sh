#!/usr/bin/env bash
# Measures math_verify.wasm with `rlhost plugin call` (no cargo): cold compile, cached load,
# per-pair score (one process per call: load + instantiate + open + score), the noop
# mode's overhead, and the smallest memory cap that works.
# Env: RLHOST (the binary; default ../../target/release/rlhost), OUT (a scratch dir).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
R="${RLHOST:-$here/../../target/release/rlhost}"
W="$here/math_verify.wasm"
OUT="${OUT:-/tmp/math_verify_bench}"
mkdir -p "$OUT"
export RUST_LOG="${RUST_LOG:-rlhost::plugin::runtime=debug,plugin=info}"
NO_COLOR=1; export NO_COLOR
call() { # gold completion [extra args...]: prints "wall_s<TAB>log"
  local gold="$1" text="$2"; shift 2
  python3 -c 'import json,sys; json.dump({"messages":[{"role":"user","content":"q"}],"metadata":{"answer":sys.argv[1]}}, open(sys.argv[2],"w"))' "$gold" "$OUT/s.json"
  local t0 t1
  t0=$(date +%s.%N)
  "$R" plugin call "$W" reward --sample "$OUT/s.json" --text "$text" --json "$@" > "$OUT/out" 2>&1 || true
  t1=$(date +%s.%N)
  printf '%.3f\t%s\n' "$(echo "$t1 - $t0" | bc)" "$(sed 's/\x1b\[[0-9;]*m//g' "$OUT/out" | tr '\n' ' ' | grep -o 'repeat median [0-9.]* ms\|compiled [^ ]* in [^ ]*\|loaded cached [^ ]* in [^ ]*\|parse+verify [0-9.]* ms\|"value": [0-9.]*\|guest-error in [a-z.]*: .*\|out-of-memory in [a-z.]*: .*' | sed 's#/[^ ]*/##' | tr '\n' ' ')"
}
echo "size_bytes $(stat -c %s "$W")"
export RLHOST_CACHE_DIR="$OUT/cache"
for i in 1 2; do rm -rf "$OUT/cache"; echo "cold $i: $(call 'e^{2}' '\boxed{e^2}')"; done
for i in 1 2 3; do echo "cached $i: $(call 'e^{2}' '\boxed{e^2}')"; done
for i in 1 2 3 4 5; do echo "noop $i: $(call 'e^{2}' '\boxed{e^2}' --config '{"mode":"noop"}')"; done
python3 -c 'import json,sys; [print(g+"\t"+c) for g,c in json.load(open(sys.argv[1]))]' "$here/pairs.json" |
while IFS=$'\t' read -r gold text; do
  for i in 1 2 3; do echo "pair [$gold] [$text] $i: $(call "$gold" "$text" --config '{"wrap_gold":false}')"; done
  echo "pair [$gold] [$text] warm: $(call "$gold" "$text" --config '{"wrap_gold":false,"repeat":5}')"
done
for mib in 56 63 64 256; do echo "memory_mib $mib: $(call '$x^2-1$' '\boxed{(x-1)(x+1)}' --memory-mib $mib)"; done
