#!/usr/bin/env bash
# Every run behind docs/benchmarks/rl_drafter/objectives/walk_*, on one GPU machine (after the
# parts of bundle.sh are in /tmp/stage). Results go under $OUT as they come.
#
# What it is for (issue #40): the walk-based sampled figure against megatron's engine under
# sampling at temperature 1, which no GPU run had measured, and arm P (MTP trained on prompt,
# response and padding) under greedy rollouts, where the teacher-forced figure once read 30%
# above the engine. Each run has the GPU to itself, so that its train-step timers count;
# greedy first, because its step times are the ones the goal on an objective's cost reads.
set -uo pipefail
RUN="$(cd "$(dirname "$0")/.." && pwd)/run.sh"

bash "$RUN" stage || exit 1
ARM_TIMEOUT=600 bash "$RUN" drafter walk_greedy --arms C,K,T,P --rl-steps 100 --every 25
ARM_TIMEOUT=560 bash "$RUN" drafter walk_sampled --arms C,K,T,P --temperature 1 \
    --rl-steps 100 --every 25
