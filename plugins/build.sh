#!/usr/bin/env bash
# Builds every plugin into plugins/dist/*.wasm: the Rust ones with cargo (target
# wasm32-wasip2), the Python code tool, code-tests reward and units tools with
# componentize-py, the JavaScript code tool with componentize-qjs, the C reward with clang
# + wasi-libc and jco (the WASI preview-1 adapter).
# The Rust SDK's plugins and units target WIT 0.2.0; one plugin per language stays on
# 0.1.0 to prove that the first contract still loads: calculator_v0_1_0 (Rust),
# code_trigger and code_tests (Python), js_trigger (JavaScript) and c_reward (C).
# Needs: rustup target add wasm32-wasip2; pip install componentize-py==0.25.1;
#        apt-get install clang lld wasi-libc libclang-rt-14-dev-wasm32 nodejs npm
# (the npm packages, pinned in package-lock.json, are installed here with `npm ci`).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here"
mkdir -p dist

# Build for wasm whatever the caller's environment says (this may run from a build script).
unset CARGO_ENCODED_RUSTFLAGS RUSTFLAGS CARGO_BUILD_TARGET
cargo build --release --quiet --target wasm32-wasip2 --target-dir "$here/target"
for plugin in calculator calculator_v0_1_0 none countdown hostile guess_number pattern_reward multiply code_task units_task math_answer search judge sim_user future_version not_a_plugin; do
  cp -f "target/wasm32-wasip2/release/$plugin.wasm" "dist/$plugin.wasm.tmp"
  mv -f "dist/$plugin.wasm.tmp" "dist/$plugin.wasm"
done

# True when $1 is missing or older than any file under the other arguments.
stale() {
  local out="$1"
  shift
  [ ! -f "$out" ] || [ -n "$(find "$@" -newer "$out" -type f -not -path '*/__pycache__/*' | head -1)" ]
}

need() {
  if ! command -v "$1" >/dev/null; then
    echo "plugins/build.sh: $1 not found: $2" >&2
    exit 1
  fi
}

# componentize-py takes ~20 s: rebuild only when a source or the WIT changed.
py_out=dist/code_trigger.wasm
if stale "$py_out" code_trigger ../wit; then
  if ! command -v componentize-py >/dev/null; then
    echo "componentize-py not found: pip install componentize-py==0.25.1" >&2
    exit 1
  fi
  (cd code_trigger && componentize-py -d ../../wit/v0.1.0 -w trigger-plugin componentize app -o "../$py_out.tmp" >/dev/null)
  mv -f "$py_out.tmp" "$py_out"
fi
# The units tools plugin (native function calling) targets WIT 0.2.0.
py_out=dist/units.wasm
if stale "$py_out" units ../wit; then
  need componentize-py "pip install componentize-py==0.25.1"
  (cd units && componentize-py -d ../../wit/v0.2.0 -w tools-plugin componentize app -o "../$py_out.tmp" >/dev/null)
  mv -f "$py_out.tmp" "$py_out"
fi
py_out=dist/code_tests.wasm
if stale "$py_out" code_tests ../wit; then
  need componentize-py "pip install componentize-py==0.25.1"
  (cd code_tests && componentize-py -d ../../wit/v0.1.0 -w reward-plugin componentize app -o "../$py_out.tmp" >/dev/null)
  mv -f "$py_out.tmp" "$py_out"
fi

# JavaScript and C: componentize-qjs and jco from npm, at the versions package-lock.json pins.
if [ ! -f node_modules/.package-lock.json ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  need npm "apt-get install nodejs npm"
  npm ci --no-audit --no-fund --loglevel=error >/dev/null
fi

# The JavaScript code tool (QuickJS; --sync: the host calls exports synchronously).
js_out=dist/js_trigger.wasm
if stale "$js_out" js_trigger ../wit; then
  node_modules/.bin/componentize-qjs --sync --wit ../wit/v0.1.0 --world trigger-plugin \
    --js js_trigger/app.js -o "$js_out.tmp" >/dev/null
  mv -f "$js_out.tmp" "$js_out"
fi

# The C reward: a wasm32-wasi (preview 1) reactor module from clang and wasi-libc, with
# the component type wit-bindgen's C bindings carry; jco wraps it with the preview-1
# adapter into a component.
c_out=dist/c_reward.wasm
if stale "$c_out" c_reward ../wit; then
  need clang "apt-get install clang lld wasi-libc libclang-rt-14-dev-wasm32"
  mkdir -p target/c
  clang --target=wasm32-wasi -mexec-model=reactor -O2 -Wall -Wextra -Werror \
    -o target/c/c_reward.core.wasm c_reward/c_reward.c c_reward/bindings/reward_plugin.c \
    c_reward/bindings/reward_plugin_component_type.o
  node_modules/.bin/jco new target/c/c_reward.core.wasm --wasi-reactor -o "$c_out.tmp" >/dev/null
  mv -f "$c_out.tmp" "$c_out"
fi
