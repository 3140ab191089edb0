#!/usr/bin/env bash
# One seed of issue #68 on one GPU machine, from a bare machine (after the parts of bundle.sh
# are in /tmp/stage) to its records: the Nemotron-3-shaped hybrid (run.sh's model_args),
# pretrained, then the timed arms one after another, never sharing the GPU. Results go under
# $OUT as they come, so that a caller can collect them while later runs go on.
#   SEED=1 OUT=/tmp/res setsid bash sessions/hybrid_seed.sh
# ARMS lists the arms as ARM:K, most needed first, so that a session cut short loses the last;
# ARM:K:packed@M runs that arm with its sequences packed into rollout-long rows (PACK=1,
# PACK_LENGTH=128) for M minutes, a check of what packing does to a step beside the same arm
# unpacked on the same host (its records end in _packed).
# Two 9-minute arms fit 30 device minutes beside staging and pretraining (1,584 s held on
# 2026-12-07), three do not: the default is H with k=2 and k=0 (the rollout-speed goal), and a
# seed's M with k=2 (the step and acceptance goals) runs in another session, ARMS="M:2", with
# the same seed (pretraining is seeded; compare its logged losses between the two sessions,
# since MoE kernels and the time limit may differ).
# Arm A (the AcceptanceController on the engine's counters) takes A_OPTIONS, for example
# A_OPTIONS="--stale-steps 10 --step-cost 0.5": S's policy for 10 steps, then the controller,
# recording each step whether the drafter died and the draft depth it advises.
# Each arm ends by its step count or by megatron's own time limit (ARM_MINUTES, counted from
# the arm's start, its start-up included). GPU_TESTS=1 runs tests/gpu once after staging, before
# anything is timed, so that a session that changed the library checks it on the GPU first.
set -uo pipefail
RUN="$(cd "$(dirname "$0")/.." && pwd)/run.sh"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
# PACK stays 0 unless asked: packing into rows longer than the rollout limit stops megatron
# (launch.py refuses it, and says why)
export MODEL=hybrid PACK="${PACK:-0}" SEED="${SEED:-1}"
STEPS="${STEPS:-40}"; MINUTES="${ARM_MINUTES:-9}"; ARMS="${ARMS:-H:2 H:0}"

bash "$RUN" stage || exit 1
[ "${GPU_TESTS:-0}" = 1 ] && bash "$RUN" gpu_tests
PRETRAIN_MINUTES="${PRETRAIN_MINUTES:-4}" bash "$RUN" pretrain "${PRETRAIN_ITERS:-300}"
[ -d /tmp/ckpt ] || { echo ">> no checkpoint: no arm can load one" >> "$OUT/log.txt"; exit 1; }

for spec in $ARMS; do
    minutes="$MINUTES"
    [[ "$spec" == *@* ]] && minutes="${spec##*@}" spec="${spec%@*}"
    IFS=: read -r arm k packed <<< "$spec"
    more=() suffix="" pack="$PACK"
    [ "$packed" = packed ] && suffix=_packed pack=1
    # arm A takes launch.py's --stale-steps and --step-cost from A_OPTIONS
    # shellcheck disable=SC2206
    [ "$arm" = A ] && more=(${A_OPTIONS:-})
    PACK="$pack" PACK_LENGTH="${PACK_LENGTH:-128}" ARM_TIMEOUT=$((minutes * 60 + 90)) \
        EXTRA="--exit-duration-in-mins $minutes" \
        bash "$RUN" arm "${arm}_k${k}_s$SEED$suffix" "$arm" "$k" "$STEPS" "${more[@]}"
done
echo ">> session done" >> "$OUT/log.txt"
