#!/usr/bin/env bash
# Builds rlhost with the `cuda` feature on a machine with no GPU and no system CUDA:
# nvcc and the CUDA libraries come from NVIDIA's PyPI wheels, and the linker gets a stub
# libcuda (the real driver is loaded at run time on the GPU machine).
#
#   scripts/build_cuda.sh                         # cargo build --release -p rlhost --features cuda
#   scripts/build_cuda.sh test --no-run -p rlhost # any cargo command; --features cuda is added
#   scripts/build_cuda.sh --pack DIR              # the release binary, model_bench and the
#                                                 # lib tests, stripped and xz-compressed
#                                                 # into DIR, for scripts/gpu_check.sh on a
#                                                 # GPU machine
#
# Environment: RLHOST_CUDA_ENV, where the toolchain goes (default ~/.cache/rlhost/cuda,
# about 1 GiB, made once); CUDA_COMPUTE_CAP, the GPU generation the kernels are compiled
# for (default 90: H100/H200).
#
# What it pins and why (measured on these machines; see also ../shared/TOOLCHAIN.md):
# nvcc, crt and nvvm 13.0.x (pip's newest nvcc pulls 13.5 parts whose PTX a 580 driver may
# not load); cccl for `<nv/target>`, which cuda_bf16.h includes; the wheels ship only
# versioned `.so.13` names, so the unversioned ones the linker asks for are made here.
set -euo pipefail
cd "$(dirname "$0")/.."

ENV_DIR=${RLHOST_CUDA_ENV:-$HOME/.cache/rlhost/cuda}
WHEELS=(
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
    nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96 nvidia-cuda-nvrtc==13.0.88
    nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35
)

if [ ! -x "$ENV_DIR/bin/python" ] || [ "$(cat "$ENV_DIR/.wheels" 2>/dev/null)" != "${WHEELS[*]}" ]; then
    echo "build_cuda: installing nvcc and the CUDA libraries into $ENV_DIR (once)" >&2
    rm -rf "$ENV_DIR"
    python3 -m venv "$ENV_DIR"
    "$ENV_DIR/bin/pip" install --quiet --disable-pip-version-check "${WHEELS[@]}"
    echo "${WHEELS[*]}" > "$ENV_DIR/.wheels"
fi
CU=$("$ENV_DIR/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
for l in cublas cublasLt cudart nvrtc; do ln -sf "lib$l.so.13" "$CU/lib/lib$l.so"; done
ln -sf libcurand.so.10 "$CU/lib/libcurand.so"

# The stub libcuda: every driver entry point cudarc names, each returning an error. The
# binary records the soname libcuda.so.1 and loads the real driver on the GPU machine.
if [ ! -f "$CU/lib/stubs/libcuda.so" ]; then
    cargo fetch --quiet
    registry=${CARGO_HOME:-$HOME/.cargo}/registry/src
    version=$(sed -n '/^name = "cudarc"$/{n;s/^version = "\(.*\)"$/\1/p}' Cargo.lock)
    sys=$(ls "$registry"/*/"cudarc-$version"/src/driver/sys/mod.rs 2>/dev/null | head -1)
    if [ -z "$sys" ]; then
        echo "build_cuda: cudarc $version's sources are not in $registry (cargo fetch failed?)" >&2
        exit 1
    fi
    mkdir -p "$CU/lib/stubs"
    grep -ohE '^pub unsafe fn cu[A-Za-z0-9_]+' "$sys" | awk '{print $4}' | sort -u \
        | awk '{print "int " $1 "(void) { return 999; }"}' > "$CU/lib/stubs/libcuda_stub.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CU/lib/stubs/libcuda.so" "$CU/lib/stubs/libcuda_stub.c"
fi

# cudarc finds the libraries (the stub among them) under CUDA_ROOT and reads the CUDA
# version from nvcc; candle-kernels finds nvcc on PATH and compiles for CUDA_COMPUTE_CAP
# without asking nvidia-smi. RUSTFLAGS stay untouched: changing them would rebuild every
# dependency instead of sharing the CPU build's.
export PATH="$CU/bin:$PATH" CUDA_HOME="$CU" CUDA_PATH="$CU" CUDA_ROOT="$CU"
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}

if [ "${1:-}" = "--pack" ]; then
    out=${2:?--pack needs a directory}
    mkdir -p "$out"
    cargo build --release -p rlhost --features cuda --bin rlhost --example model_bench
    # The lib tests (the model's parity tests among them) as one executable.
    tests=$(cargo test --release -p rlhost --features cuda --lib --no-run --message-format=json \
        | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
    for pair in "target/release/rlhost:rlhost" "target/release/examples/model_bench:model_bench" \
        "$tests:rlhost-lib-tests"; do
        strip -o "$out/${pair##*:}" "${pair%:*}"
        xz -T0 -6 -f "$out/${pair##*:}"
        echo "$out/${pair##*:}.xz: $(du -h "$out/${pair##*:}.xz" | cut -f1)"
    done
    # Where the tests look for tests/fixtures (scripts/gpu_check.sh links it there).
    echo "$PWD" > "$out/built-in"
    exit 0
fi

if [ $# -eq 0 ]; then
    set -- build --release -p rlhost
fi
# `--features cuda` goes before a `--` (clippy's `-- -D warnings`), where cargo reads it.
args=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do args+=("$1"); shift; done
exec cargo "${args[@]}" --features cuda "$@"
