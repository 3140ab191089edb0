#!/usr/bin/env bash
# Every run behind docs/benchmarks/house_pass/moe_layout/, on one GPU machine (after the parts
# of bundle.sh are in /tmp/stage). Results go under $OUT as they come.
#
# What it is for: the GPU tests against the gate as it now is (the options record and the
# policy snapshot had not run on a GPU), and the reliability issue's larger MoE layout: does
# its eval forward under skip read slower than the trunk built without MTP, with the trunk
# timed twice as the control and one round of each case profiled (host time apart from
# device time); and which module of the trunk computes a different output from the same
# input, with megatron's deterministic_mode and without it.
set -uo pipefail
RUN="$(cd "$(dirname "$0")/.." && pwd)/run.sh"
OUT="${OUT:-/tmp/out}"

bash "$RUN" stage || exit 1
bash "$RUN" gpu_tests
# the Nemotron-3-shaped layout of the issue: 16 experts top-4, Nemotron 3's vocabulary,
# 2 sequences of 1024 tokens (benchmarks/nemotron/run.sh's size moe16)
MOE=(--model nemotron --spec te --hidden 2048 --ffn 1024 --vocab 131072 --experts 16 --topk 4
    --seq 1024 --batch 2)
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0  # as benchmarks/nemotron/run.sh runs its benchmarks
ARM_TIMEOUT=300 bash "$RUN" script ab_moe16 benchmarks/gpu_hooks_ab.py "${MOE[@]}" \
    --pattern "MEMEM*EMEMEM*E/*E/*E" --pair skip --rounds 60 --warmup 5 --profile \
    --out "$OUT/ab_moe16"
ARM_TIMEOUT=200 bash "$RUN" script determinism_moe16 benchmarks/nemotron/determinism.py \
    "${MOE[@]}" --pattern "MEMEM*EMEMEM*E" --deterministic --out "$OUT/determinism_moe16"
ARM_TIMEOUT=200 bash "$RUN" script determinism_moe16_default benchmarks/nemotron/determinism.py \
    "${MOE[@]}" --pattern "MEMEM*EMEMEM*E" --out "$OUT/determinism_moe16_default"
echo ">> session done" >> "$OUT/log.txt"
