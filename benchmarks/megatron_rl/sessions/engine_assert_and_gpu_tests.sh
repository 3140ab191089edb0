#!/usr/bin/env bash
# Every run behind docs/benchmarks/megatron_rl/engine_assert_and_gpu_tests/, on one GPU machine
# (after the parts of bundle.sh are in /tmp/stage). Results go under $OUT as they come.
#
# What it is for: the GPU tests against the staged tree and Transformer Engine (the one for
# local CUDA graphs toggled off had never run on a GPU), and whether megatron's engine asserts
# with k=2 from random weights, where every request runs to the agent's token cap: M (mtp-hooks
# not imported) with k=2, then the same model and weights with k=0 as the control.
set -uo pipefail
RUN="$(cd "$(dirname "$0")/.." && pwd)/run.sh"
HERE="$(dirname "$RUN")"

bash "$RUN" stage || exit 1
bash "$RUN" gpu_tests
# Random weights need only the tokenizer, not the corpus and the pretraining.
PYTHONPATH=/tmp/site python3 "$HERE/tokenizer.py" /tmp/tok
LOAD= ARM_TIMEOUT=240 bash "$RUN" arm Mfresh_k2 M 2 6
LOAD= ARM_TIMEOUT=170 bash "$RUN" arm Mfresh_k0 M 0 2
