#!/usr/bin/env bash
# Every run behind docs/benchmarks/rl_drafter/objectives/single_position_* and the GPU tests
# of the seventh session, on one GPU machine (after the parts of bundle.sh are in /tmp/stage).
# Results go under $OUT as they come.
#
# What it is for (issue #40): the GPU tests that had never run on a GPU (the single-position
# figures and the engine's cross-request attention on Transformer Engine's layers), the
# attention script that failed its first GPU try, and arms C and P, greedy and sampled, with
# the library's own single-position figures in every measurement beside the engine batched and
# one request at a time. No timer counts here, so greedy and sampled share the GPU.
set -uo pipefail
RUN="$(cd "$(dirname "$0")/.." && pwd)/run.sh"

bash "$RUN" stage || exit 1
ARM_TIMEOUT=300 bash "$RUN" gpu_tests
ARM_TIMEOUT=120 bash "$RUN" script engine_draft_attention \
    benchmarks/rl_drafter/engine_draft_attention.py
MASTER_PORT=29556 ARM_TIMEOUT=720 bash "$RUN" drafter single_position_greedy --arms C,P \
    --rl-steps 100 --every 25 &
MASTER_PORT=29557 ARM_TIMEOUT=720 bash "$RUN" drafter single_position_sampled --arms C,P \
    --temperature 1 --rl-steps 100 --every 25 &
wait
