#!/usr/bin/env bash
# Every run behind docs/benchmarks/rl_drafter/objectives/engine_view_*, on one GPU machine
# (after the parts of bundle.sh are in /tmp/stage). Results go under $OUT as they come.
#
# What it is for (issue #40): whether megatron's engine drafts with the MTP layer's attention
# over the batch's other requests (benchmarks/rl_drafter/engine_draft_attention.py, on
# Transformer Engine's layers), and whether the teacher-forced walk over drafts computed as
# the engine computes them predicts the engine with one request at a time. Arms C and P only
# (P is the arm the issue found 30% off), greedy and sampled at once: no timer counts here.
set -uo pipefail
RUN="$(cd "$(dirname "$0")/.." && pwd)/run.sh"

bash "$RUN" stage || exit 1
ARM_TIMEOUT=120 bash "$RUN" script engine_draft_attention \
    benchmarks/rl_drafter/engine_draft_attention.py
MASTER_PORT=29556 ARM_TIMEOUT=420 bash "$RUN" drafter engine_view_greedy --arms C,P \
    --rl-steps 100 --every 25 &
MASTER_PORT=29557 ARM_TIMEOUT=420 bash "$RUN" drafter engine_view_sampled --arms C,P \
    --temperature 1 --rl-steps 100 --every 25 &
wait
