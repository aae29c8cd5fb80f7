#!/usr/bin/env bash
# Builds every plugin into plugins/dist/*.wasm:
# the Rust ones with cargo (target wasm32-wasip2), the Python code tool with componentize-py.
# Needs: rustup target add wasm32-wasip2; pip install componentize-py==0.25.1
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here"
mkdir -p dist

# Build for wasm whatever the caller's environment says (this may run from a build script).
unset CARGO_ENCODED_RUSTFLAGS RUSTFLAGS CARGO_BUILD_TARGET
cargo build --release --quiet --target wasm32-wasip2 --target-dir "$here/target"
for plugin in calculator none countdown hostile guess_number pattern_reward multiply code_task future_version not_a_plugin; do
  cp -f "target/wasm32-wasip2/release/$plugin.wasm" "dist/$plugin.wasm.tmp"
  mv -f "dist/$plugin.wasm.tmp" "dist/$plugin.wasm"
done

# componentize-py takes ~20 s: rebuild only when a source or the WIT changed.
py_out=dist/code_trigger.wasm
if [ ! -f "$py_out" ] || [ -n "$(find code_trigger ../wit -newer "$py_out" -type f -not -path '*/__pycache__/*' | head -1)" ]; then
  if ! command -v componentize-py >/dev/null; then
    echo "componentize-py not found: pip install componentize-py==0.25.1" >&2
    exit 1
  fi
  (cd code_trigger && componentize-py -d ../../wit/v0.1.0 -w trigger-plugin componentize app -o "../$py_out.tmp" >/dev/null)
  mv -f "$py_out.tmp" "$py_out"
fi
