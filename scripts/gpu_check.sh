#!/usr/bin/env bash
# The GPU checks of issue 17 (point 5), run on a machine with an NVIDIA GPU and the
# driver, from what `scripts/build_cuda.sh --pack PACK` made elsewhere (that machine needs
# no Rust): the model tests on the GPU, a short `rlhost train` there, and
# bench/gpu_speed.py (which wants torch with CUDA, transformers and peft).
#
#   scripts/gpu_check.sh PACK OUT [tests] [train] [bench]    # default: all three
#
# Each part writes its output under OUT (tests.txt, train.txt, bench.txt) and goes on
# when another fails; the exit status is the number of parts that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
pack=$(realpath "${1:?usage: gpu_check.sh PACK OUT [tests] [train] [bench]}")
out=$(realpath -m "${2:?usage: gpu_check.sh PACK OUT [tests] [train] [bench]}")
shift 2
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests train bench)
mkdir -p "$out"

for f in "$pack"/*.xz; do
    [ -f "${f%.xz}" ] || xz -dk "$f"
done
chmod +x "$pack/rlhost" "$pack/rlhost-lib-tests" "$pack/model_bench"
# The test executable reads tests/fixtures at the path it was built in.
built=$(cat "$pack/built-in")
if [ "$built" != "$PWD" ] && [ ! -e "$built" ]; then
    mkdir -p "$(dirname "$built")"
    ln -s "$PWD" "$built"
fi
# cuBLAS, cuRAND and the CUDA runtime: from PyTorch's CUDA 13 wheels where they are.
nvlib=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13/lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH="${nvlib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1

failed=0
for part in "${parts[@]}"; do
    start=$(date +%s)
    case $part in
        tests)
            # Every model test with its fixtures on the GPU (f32, and bf16/f16 where a
            # test asks for them); the CPU kernels do not apply there, so the composed
            # forms run throughout.
            RLHOST_TEST_DEVICE=cuda "$pack/rlhost-lib-tests" model:: --test-threads 1 \
                > "$out/tests.txt" 2>&1 ;;
        train)
            # The built-in calculator run on the GPU: its model is built (on the CPU) and
            # trained there in bf16.
            RLHOST_PLUGIN_DIR="$PWD/plugins/dist" "$pack/rlhost" train --set train.steps=20 \
                --set model.device='"cuda"' --out "$out/run" --overwrite \
                > "$out/train.txt" 2>&1 ;;
        bench)
            python3 bench/gpu_speed.py --bin "$pack/model_bench" > "$out/bench.txt" 2>&1 ;;
        *)
            echo "unknown part $part (tests, train, bench)" >&2
            false ;;
    esac
    status=$?
    echo "$part: exit $status in $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
    [ $status -eq 0 ] || failed=$((failed + 1))
done
exit $failed
