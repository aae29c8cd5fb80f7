#!/usr/bin/env bash
# The GPU checks of issue 39, run on a machine with an NVIDIA GPU and the driver, from
# what `scripts/build_cuda.sh --pack PACK` made elsewhere (that machine needs no Rust):
# the model tests on the GPU, the built-in run on the GPU (and on the CPU beside it),
# bench/gpu_speed.py (which wants torch with CUDA, transformers and peft), and a profile
# of the compute entry points (RLHOST_PROFILE=1).
#
#   scripts/gpu_check.sh PACK OUT [tests] [train] [qlora] [bench] [bench7b] [profile] [ops]
#                                 [qlorastep] [packing]  # default: tests train qlora bench profile
#
# Issue 64's checks in one call (~8 minutes: the model tests, the rollout row beside
# transformers' generate with the decode step's floor, and with a rank-16 adapter, the
# decode and training profiles (with nsys, every decode kernel counted; a CUDA graph of
# the decode step against the eager step), the QLoRA step against the LoRA step and NF4
# decode, packed against padded updates, the built-in run on the GPU):
#   RLHOST_GPU_BENCH=decode RLHOST_GPU_TRAIN_DEVICES=cuda \
#       scripts/gpu_check.sh PACK OUT tests bench profile qlorastep packing train
#
# Each part writes one file under OUT (tests.txt, train.txt, qlora.txt, bench.txt, bench7b.txt,
# profile.txt, ops.txt, qlorastep.txt, packing.txt and, with nsys, step_*.csv),
# stops at its own time limit (RLHOST_GPU_LIMIT_<PART> seconds) and goes on when another
# fails; summary.txt has each part's exit status and time; the exit status is the number
# of parts that failed. Plugins come from RLHOST_PLUGIN_DIR (default plugins/dist).
set -uo pipefail
cd "$(dirname "$0")/.."
pack=$(realpath "${1:?usage: gpu_check.sh PACK OUT [tests] [train] [qlora] [bench] [profile]}")
out=$(realpath -m "${2:?usage: gpu_check.sh PACK OUT [tests] [train] [qlora] [bench] [profile]}")
shift 2
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests train qlora bench profile)
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
# Wheels carried in .whl (liger-kernel for the bench's second peer: the machine has no
# network), installed beside the machine's own packages.
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/rlhost-site .whl/*.whl \
        && export PYTHONPATH=/tmp/rlhost-site${PYTHONPATH:+:$PYTHONPATH}
fi

plugins=${RLHOST_PLUGIN_DIR:-$PWD/plugins/dist}
work=$(mktemp -d)
# Runs the rest of the line under a time limit of $1 seconds, output appended to $2.
limited() {
    local secs=$1 file=$2
    shift 2
    echo "\$ $*" >> "$file"
    timeout --kill-after=5 "$secs" "$@" >> "$file" 2>&1
}

failed=0
for part in "${parts[@]}"; do
    start=$(date +%s)
    var=RLHOST_GPU_LIMIT_${part^^}
    case $part in
        tests)
            # Every model test with its fixtures on the GPU (f32, and bf16/f16 where a
            # test asks for them); the CPU kernels do not apply there, so the composed
            # forms run throughout.
            RLHOST_TEST_DEVICE=cuda limited "${!var:-150}" "$out/tests.txt" \
                "$pack/rlhost-lib-tests" model:: --test-threads 1
            first=$?
            # The sampler's decode and continuous batching on the GPU: the draw with the
            # next step queued behind it, through holds, releases and resumes.
            RLHOST_TEST_DEVICE=cuda limited "${!var:-150}" "$out/tests.txt" \
                "$pack/rlhost-lib-tests" sampler::decode:: sampler::local:: --test-threads 1 \
                && [ $first -eq 0 ] ;;
        train)
            # The built-in calculator run on this machine's CPU (which builds its model
            # once), then the same run on the GPU (in bf16), each timed, with its
            # held-out figures. RLHOST_GPU_TRAIN_DEVICES="cuda" runs only the GPU one.
            status=0
            for device in ${RLHOST_GPU_TRAIN_DEVICES:-cpu cuda}; do
                t=$(date +%s.%N)
                rc=0
                RLHOST_PLUGIN_DIR="$plugins" limited "${!var:-120}" "$out/train.txt" \
                    "$pack/rlhost" train --set model.device="\"$device\"" \
                    --out "$work/run-$device" --overwrite || rc=$?
                [ $rc -eq 0 ] || status=$rc
                echo "built-in run on $device: exit $rc, $(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $t }") s wall" \
                    | tee -a "$out/train.txt"
                python3 -c 'import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("eval_accuracy") is not None:
        print("  step", m.get("step"), "held-out accuracy", m["eval_accuracy"])' \
                    "$work/run-$device/metrics.jsonl" >> "$out/train.txt" 2>&1
            done
            [ $status -eq 0 ] ;;
        qlora)
            # QLoRA on the GPU: the built-in calculator run on an NF4 base (the codes on
            # the GPU, dequantized there per product), a few steps and one held-out eval.
            t=$(date +%s.%N)
            RLHOST_PLUGIN_DIR="$plugins" limited "${!var:-120}" "$out/qlora.txt" \
                "$pack/rlhost" train --config configs/multiply-qlora.toml \
                --set model.device='"cuda"' --set train.steps=10 --set train.eval_every=10 \
                --out "$work/run-qlora" --overwrite
            rc=$?
            echo "QLoRA run on cuda: exit $rc, $(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $t }") s wall" \
                | tee -a "$out/qlora.txt"
            [ $rc -eq 0 ] ;;
        bench)
            # The training step first (shorter), then the rollout: each half makes its
            # line of the table even when the other runs out of time. The step keeps
            # every layer's activations unless RLHOST_GPU_CHECKPOINTING=1 (25 GB at
            # 8 x 1024 on the 1.5B shape with the fused CUDA ops, measured on an H100);
            # PEFT + Liger is the second peer when liger-kernel's wheel is in .whl/, and
            # rlhost with its attention as cuBLAS products (the form before the flash
            # kernels) and its QLoRA step further rows. RLHOST_GPU_BENCH="train" or
            # "decode" runs one half.
            first=0
            if [[ " ${RLHOST_GPU_BENCH:-train decode} " == *" train "* ]]; then
                limited "${!var:-300}" "$out/bench.txt" \
                    python3 bench/gpu_speed.py --bin "$pack/model_bench" --rounds 1 --skip-decode \
                    --cublas-attention --qlora ${RLHOST_GPU_CHECKPOINTING:+--checkpointing}
                first=$?
            fi
            if [[ " ${RLHOST_GPU_BENCH:-train decode} " == *" decode "* ]]; then
                limited "${!var:-300}" "$out/bench.txt" \
                    python3 bench/gpu_speed.py --bin "$pack/model_bench" --rounds 1 --skip-train
            fi && [ $first -eq 0 ] ;;
        bench7b)
            # The training step on Qwen2.5-7B's shape against plain PEFT (the model is made
            # on the GPU and saved in bf16 first: ~15 GB, about a minute).
            limited "${!var:-420}" "$out/bench7b.txt" \
                python3 bench/gpu_speed.py --bin "$pack/model_bench" --rounds 1 --skip-decode \
                --shape 7b --no-liger ;;
        profile)
            # Where the time goes: each compute entry point timed alone (the device
            # waited for around each call), on the bench's model (made by the bench).
            model=$(ls -d bench/.work/qwen2.5-1.5b-shape-28l-bf16 2>/dev/null || true)
            [ -n "$model" ] || python3 -c 'import sys; sys.path.insert(0, "bench"); import gpu_speed as g; g.make_model("bench/.work/qwen2.5-1.5b-shape-28l-bf16", 28)'
            model=bench/.work/qwen2.5-1.5b-shape-28l-bf16
            # The decode profile samples as a rollout does: a rank-16 adapter on every
            # projection, read from a frozen copy of its version.
            RLHOST_PROFILE=1 limited "${!var:-90}" "$out/profile.txt" "$pack/model_bench" decode \
                --model "$model" --device cuda --dtype bf16 --batch 64 --prompt-len 128 --new 16 \
                --temperature 1 --adapter-rank 16
            first=$?
            # Whether a CUDA graph of that decode step pays (issue 64 item 4): the step at
            # batch 64 and position 192, eagerly and replayed from a graph, with the
            # replay's logits against the eager step's.
            limited "${!var:-90}" "$out/profile.txt" "$pack/model_bench" graph \
                --model "$model" --device cuda --dtype bf16 --batch 64 --prompt-len 128 \
                --at 64 --iters 50 --adapter-rank 16
            # Every kernel of those 16 steps (and the prefill) by count and GPU time, where
            # the machine has Nsight Systems: the launches a decode step makes, counted.
            if command -v nsys > /dev/null; then
                limited "${!var:-90}" "$out/profile.txt" nsys profile --trace=cuda \
                    --force-overwrite true -o "$work/decode" "$pack/model_bench" decode \
                    --model "$model" --device cuda --dtype bf16 --batch 64 --prompt-len 128 \
                    --new 16 --temperature 1 --adapter-rank 16
                nsys stats --report cuda_gpu_kern_sum --format csv -o "$out/decode" \
                    "$work/decode.nsys-rep" >> "$out/profile.txt" 2>&1
            fi
            RLHOST_PROFILE=1 limited "${!var:-90}" "$out/profile.txt" "$pack/model_bench" train \
                --model "$model" --device cuda --dtype bf16 --batch 8 --seq 1024 --rank 16 --steps 1 \
                --checkpointing "${RLHOST_GPU_CHECKPOINTING:-0}" && [ $first -eq 0 ] ;;
        ops)
            # Single ops timed alone (model_bench ops: attention flash vs cuBLAS, one LoRA
            # projection, a gradient edge), then, where the machine has Nsight Systems,
            # every kernel and memory operation of one 1.5B training step by GPU time.
            model=bench/.work/qwen2.5-1.5b-shape-28l-bf16
            [ -e "$model/model.safetensors" ] || python3 -c 'import sys; sys.path.insert(0, "bench"); import gpu_speed as g; g.make_model("bench/.work/qwen2.5-1.5b-shape-28l-bf16", 28)'
            limited "${!var:-60}" "$out/ops.txt" "$pack/model_bench" ops --device cuda --dtype bf16
            first=$?
            if command -v nsys > /dev/null; then
                limited "${!var:-60}" "$out/ops.txt" nsys profile --trace=cuda --force-overwrite true \
                    -o "$work/step" "$pack/model_bench" train --model "$model" --device cuda \
                    --dtype bf16 --batch 8 --seq 1024 --rank 16 --steps 1
                for report in cuda_gpu_kern_sum cuda_gpu_mem_time_sum cuda_api_sum; do
                    nsys stats --report "$report" --format csv -o "$out/step" "$work/step.nsys-rep" \
                        >> "$out/ops.txt" 2>&1
                done
            else
                echo "no nsys on this machine" >> "$out/ops.txt"
            fi
            [ $first -eq 0 ] ;;
        qlorastep)
            # The QLoRA step against the LoRA step on the 1.5B shape in bf16 (8 x 1024, rank
            # 16), rlhost alone: the base in NF4 dequantized per product, the adapters as
            # in the LoRA step (issue 64's goal: at most 1.3x the LoRA step).
            model=bench/.work/qwen2.5-1.5b-shape-28l-bf16
            [ -e "$model/model.safetensors" ] || python3 -c 'import sys; sys.path.insert(0, "bench"); import gpu_speed as g; g.make_model("bench/.work/qwen2.5-1.5b-shape-28l-bf16", 28)'
            rc=0
            for quantize in none nf4; do
                extra=()
                [ "$quantize" = none ] || extra=(--quantize "$quantize")
                limited "${!var:-90}" "$out/qlorastep.txt" "$pack/model_bench" train --model "$model" \
                    --device cuda --dtype bf16 --batch 8 --seq 1024 --rank 16 --steps 3 "${extra[@]}" \
                    || rc=$?
            done
            python3 -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
if len(rows) >= 2:
    lora, nf4 = rows[-2]["step_seconds"], rows[-1]["step_seconds"]
    print(f"QLoRA step {nf4:.3f} s vs LoRA step {lora:.3f} s: {nf4 / lora:.2f}x")' \
                "$out/qlorastep.txt" | tee -a "$out/qlorastep.txt"
            # NF4 decode in the same call: 64 x (128 + 64) with a rank-16 adapter, as a
            # QLoRA run's rollouts sample (each weight dequantized per product).
            limited "${!var:-90}" "$out/qlorastep.txt" "$pack/model_bench" decode --model "$model" \
                --device cuda --dtype bf16 --batch 64 --prompt-len 128 --new 64 --temperature 1 \
                --adapter-rank 16 --quantize nf4 || rc=$?
            [ $rc -eq 0 ] ;;
        packing)
            # Sequence packing in the RL update on the 1.5B shape in bf16: 16 trajectories
            # of 128 to 1024 tokens, packed into lanes beside one a lane padded to the
            # longest, alternating in one process (model_bench update prints both medians
            # and their ratio).
            model=bench/.work/qwen2.5-1.5b-shape-28l-bf16
            [ -e "$model/model.safetensors" ] || python3 -c 'import sys; sys.path.insert(0, "bench"); import gpu_speed as g; g.make_model("bench/.work/qwen2.5-1.5b-shape-28l-bf16", 28)'
            limited "${!var:-120}" "$out/packing.txt" "$pack/model_bench" update --model "$model" \
                --device cuda --dtype bf16 --rows 16 --min-len 128 --max-len 1024 --rounds 3 \
                --micro-batch-tokens 8192 ;;
        *)
            echo "unknown part $part (tests, train, qlora, bench, bench7b, profile, ops, qlorastep, packing)" >&2
            false ;;
    esac
    status=$?
    echo "$part: exit $status in $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
    [ $status -eq 0 ] || failed=$((failed + 1))
done
exit $failed
