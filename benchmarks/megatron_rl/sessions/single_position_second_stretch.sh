#!/usr/bin/env bash
# The seventh session after its first stretch (gpu_tests_and_single_position.sh), whose machine
# was taken back with its drafter runs. Records: docs/benchmarks/rl_drafter/single_position_on_te/.
#
# Twice a fresh machine was staged and this script started with the drafter lines at the end
# (arm P first, then C, greedy and sampled sharing the GPU, ARM_TIMEOUT 600 then 450); both
# times the machine was taken back within five minutes and nothing came back. The last
# stretch, with about six device minutes left, ran only what stands above the drafters, in the
# foreground of one call: the Transformer Engine tests after their fix (the engine's inputs
# made under inference mode) and the attention script; then, on the same warm machine, the
# attention test again after its tolerance for request 0 was amended (see
# docs/benchmarks.md, "The GPU tests"). Results go under $OUT as they come.
set -uo pipefail
RUN="$(cd "$(dirname "$0")/.." && pwd)/run.sh"

bash "$RUN" stage || exit 1
ARM_TIMEOUT=150 bash "$RUN" gpu_tests -k on_te
ARM_TIMEOUT=90 bash "$RUN" script engine_draft_attention \
    benchmarks/rl_drafter/engine_draft_attention.py
ARM_TIMEOUT=100 bash "$RUN" gpu_tests tests/gpu/test_single_position_figures_on_te.py \
    -k drafted_in_a_batch
[ -n "${WITH_DRAFTERS:-}" ] || exit 0
MASTER_PORT=29556 ARM_TIMEOUT=450 bash "$RUN" drafter single_position_greedy --arms P,C \
    --rl-steps 100 --every 25 &
MASTER_PORT=29557 ARM_TIMEOUT=450 bash "$RUN" drafter single_position_sampled --arms P,C \
    --temperature 1 --rl-steps 100 --every 25 &
wait
