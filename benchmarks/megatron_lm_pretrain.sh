#!/usr/bin/env bash
# Megatron-LM's pretrain() on one GPU, three ways, with mtp-hooks switched on by the environment
# only. Prints each run's log tail ("mtp_1 loss", the evaluate timer) and MTP forward counts.
set -uo pipefail
cd "$(dirname "$0")/.."
# The megatron-core wheel ships the compiled dataset helper but not the Makefile that
# Megatron-LM's initialize() runs `make` on; an empty one lets it find the helper as built.
DATASETS=$(python3 -c 'import megatron.core.datasets as d, os; print(os.path.dirname(d.__file__))')
[ -f "$DATASETS/Makefile" ] || printf 'all:\n\t@true\n' > "$DATASETS/Makefile"
FLAGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --transformer-impl local
       --position-embedding-type rope --no-rope-fusion --attention-backend unfused
       --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion
       --no-bias-dropout-fusion --no-persist-layer-norm --mtp-num-layers 1
       --num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256
       --max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 8 --bf16
       --train-iters 12 --lr 1e-4 --eval-interval 6 --eval-iters 4 --log-interval 1
       --timing-log-level 2)
run() {  # $1 label, rest: env assignments
    local label=$1; shift
    echo "=== $label: $*"
    env "$@" torchrun --nproc-per-node 1 --master-port "$((29500 + RANDOM % 1000))" \
        benchmarks/megatron_lm_pretrain.py "${FLAGS[@]}" 2>&1 \
        > "/tmp/pretrain-$label.log"
    grep -E "iteration +[0-9]+/|evaluate .*:|validation loss|MTP_FORWARDS" "/tmp/pretrain-$label.log"
    grep -c "mtp_hooks decision" "/tmp/pretrain-$label.log" | sed 's/^/mtp_hooks decisions traced: /'
    grep -E "Error|error:" "/tmp/pretrain-$label.log" | tail -n 5
}
run default MTP_HOOKS_AUTO=0
run eval-skip MTP_HOOKS_AUTO=1 MTP_HOOKS_TRACE=1 "MTP_HOOKS_POLICY=train=run,eval=skip"
run train-skip MTP_HOOKS_AUTO=1 "MTP_HOOKS_POLICY=train=skip,eval=skip"
