#!/usr/bin/env bash
# Every run behind docs/benchmarks/megatron_rl/counting_alone_and_together/, in the order they ran, on one
# GPU machine (after the parts of bundle.sh are in /tmp/stage). Results go under $OUT as they
# come, so that a caller can collect them while later runs go on.
#
# What shares the GPU and why: the arms that only count (rewards, accepted lengths, which steps
# trained MTP) run together, isolated, beside the drafter benchmark of issue #40; every run that
# is timed runs alone afterwards, once those have ended.
set -uo pipefail
RUN="$(cd "$(dirname "$0")/.." && pwd)/run.sh"

bash "$RUN" stage || exit 1
ARM_TIMEOUT=1000 bash "$RUN" drafter drafter_sampled \
    --arms C,K,T,P --temperature 1 --rl-steps 100 --every 25 &
drafter=$!
bash "$RUN" pretrain 400
ARM_TIMEOUT=600 bash "$RUN" together "M_k2 M 2 20" "H_k2 H 2 20" "A_k2 A 2 20" "K_k2 K 2 20"
wait "$drafter"

# Alone, most needed first: H against M (the step), against a model without MTP (the log-prob
# passes) and against itself without drafting (the rollouts); then the same under CUDA graphs.
export ARM_TIMEOUT=240
bash "$RUN" arm Halone_k2 H 2 6
MTP_LAYERS=0 bash "$RUN" arm Nalone_k0 M 0 6
# If megatron will not load the MTP checkpoint into a model without MTP, time one untrained
# (its rollouts then differ, so its log-prob passes see other lengths: said where reported).
grep -q '"rollout_s"' "${OUT:-/tmp/out}/Nalone_k0.jsonl" 2>/dev/null \
    || MTP_LAYERS=0 LOAD= bash "$RUN" arm Nalone_fresh_k0 M 0 6
bash "$RUN" arm Halone_k0 H 0 6
bash "$RUN" arm Malone_k2 M 2 6
EXTRA="--cuda-graph-impl local" bash "$RUN" arm Hgraphs_k2 H 2 6
EXTRA="--cuda-graph-impl local" bash "$RUN" arm Hgraphs_k0 H 0 6
