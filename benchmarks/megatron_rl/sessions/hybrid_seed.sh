#!/usr/bin/env bash
# One seed of issue #68 on one GPU machine, from a bare machine (after the parts of bundle.sh
# are in /tmp/stage) to its records: the Nemotron-3-shaped hybrid (run.sh's model_args),
# pretrained, then the timed arms one after another, never sharing the GPU. Results go under
# $OUT as they come, so that a caller can collect them while later runs go on.
#   SEED=1 OUT=/tmp/res setsid bash sessions/hybrid_seed.sh
# The arms, most needed first, so that a session cut short loses the last: H with k=2 and
# k=0 (the rollout-speed goal), then M with k=2 (the step and acceptance goals). Each arm ends
# by its step count or by megatron's own time limit (ARM_MINUTES), whichever comes first.
set -uo pipefail
RUN="$(cd "$(dirname "$0")/.." && pwd)/run.sh"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export MODEL=hybrid PACK="${PACK:-1}" SEED="${SEED:-1}"
STEPS="${STEPS:-40}"; MINUTES="${ARM_MINUTES:-4}"

bash "$RUN" stage || exit 1
PRETRAIN_MINUTES="${PRETRAIN_MINUTES:-4}" bash "$RUN" pretrain "${PRETRAIN_ITERS:-300}"
[ -d /tmp/ckpt ] || { echo ">> no checkpoint: no arm can load one" >> "$OUT/log.txt"; exit 1; }

export ARM_TIMEOUT=$((MINUTES * 60 + 90)) EXTRA="--exit-duration-in-mins $MINUTES"
bash "$RUN" arm "H_k2_s$SEED" H 2 "$STEPS"
# packing is new to this benchmark: if the first arm made no step with it, the rest go without
if [ "$PACK" = 1 ] && ! grep -q '"rollout_s"' "$OUT/H_k2_s$SEED.jsonl" 2>/dev/null; then
    echo ">> H_k2_s$SEED made no step with PACK=1: the next arms run with PACK=0" >> "$OUT/log.txt"
    export PACK=0
fi
bash "$RUN" arm "H_k0_s$SEED" H 0 "$STEPS"
bash "$RUN" arm "M_k2_s$SEED" M 2 "$STEPS"
echo ">> session done" >> "$OUT/log.txt"
