#!/usr/bin/env bash
# The seventh session's second stretch on a fresh machine (the first one's was taken back with
# its drafter runs): the two Transformer Engine tests again after their fix (the engine's
# inputs made under inference mode), the attention script, and arm P first, then C, greedy and
# sampled sharing the GPU (no timer counts here). Results go under $OUT as they come.
set -uo pipefail
RUN="$(cd "$(dirname "$0")/.." && pwd)/run.sh"

bash "$RUN" stage || exit 1
ARM_TIMEOUT=200 bash "$RUN" gpu_tests -k on_te
ARM_TIMEOUT=120 bash "$RUN" script engine_draft_attention \
    benchmarks/rl_drafter/engine_draft_attention.py
MASTER_PORT=29556 ARM_TIMEOUT=600 bash "$RUN" drafter single_position_greedy --arms P,C \
    --rl-steps 100 --every 25 &
MASTER_PORT=29557 ARM_TIMEOUT=600 bash "$RUN" drafter single_position_sampled --arms P,C \
    --temperature 1 --rl-steps 100 --every 25 &
wait
