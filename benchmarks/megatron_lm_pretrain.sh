#!/usr/bin/env bash
# Megatron-LM's pretrain() on one GPU, with mtp-hooks switched on by the environment only.
# Prints each run's log tail ("mtp_1 loss", validation loss, the evaluate timer), MTP forward
# counts and mtp-hooks' refusals.
#
#   benchmarks/megatron_lm_pretrain.sh [VARIANT...]
#
# VARIANT: local (megatron's local layers, the default), te (--transformer-impl
# transformer_engine), te-fp8 (te with --fp8-format hybrid --fp8-recipe tensorwise),
# te-graphs-local / te-graphs-te (te with --cuda-graph-impl local / transformer_engine),
# te-fp8-graphs-te (te-fp8 with --cuda-graph-impl transformer_engine), te-graphs-full /
# local-graphs-full (te / local with --cuda-graph-impl full_iteration; its capture needs the
# timers' barriers off and no NaN check). A graphs variant may
# name megatron's capture regions after a +: te-graphs-te+attn+mlp adds
# --cuda-graph-modules attn mlp. EXTRA_FLAGS (a string) is added to every run, e.g.
# EXTRA_FLAGS="--hidden-dropout 0 --attention-dropout 0". RUNS (default "default eval-skip
# third") picks which of each variant's three runs to make; "third" is train-skip, or for
# te-graphs-local the refused train-skip-eval-run.
set -uo pipefail
cd "$(dirname "$0")/.."
# The megatron-core wheel ships the compiled dataset helper but not the Makefile that
# Megatron-LM's initialize() runs `make` on; an empty one lets it find the helper as built.
DATASETS=$(python3 -c 'import megatron.core.datasets as d, os; print(os.path.dirname(d.__file__))')
[ -f "$DATASETS/Makefile" ] || printf 'all:\n\t@true\n' > "$DATASETS/Makefile"
COMMON=(--mock-data --tokenizer-type NullTokenizer --vocab-size 1024
        --position-embedding-type rope --no-rope-fusion --mtp-num-layers 1
        --num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256
        --max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 8 --bf16
        --train-iters 12 --lr 1e-4 --eval-interval 6 --eval-iters 4 --log-interval 1
        --timing-log-level 2 --seed 1234)
LOCAL=(--transformer-impl local --attention-backend unfused --no-gradient-accumulation-fusion
       --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion
       --no-persist-layer-norm)
TE=(--transformer-impl transformer_engine --no-gradient-accumulation-fusion)
FULL=(--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad --timing-log-level 0)
run() {  # $1 variant, $2 label, rest: env assignments
    local variant=$1 label=$2; shift 2
    local flags modules=()
    [[ $variant == *+* ]] && IFS=+ read -ra modules <<< "${variant#*+}"
    case ${variant%%+*} in
        local) flags=("${LOCAL[@]}") ;;
        te) flags=("${TE[@]}") ;;
        te-fp8) flags=("${TE[@]}" --fp8-format hybrid --fp8-recipe tensorwise) ;;
        te-graphs-local) flags=("${TE[@]}" --cuda-graph-impl local) ;;
        te-graphs-te) flags=("${TE[@]}" --cuda-graph-impl transformer_engine) ;;
        te-fp8-graphs-te) flags=("${TE[@]}" --fp8-format hybrid --fp8-recipe tensorwise
                                 --cuda-graph-impl transformer_engine) ;;
        te-graphs-full) flags=("${TE[@]}" "${FULL[@]}") ;;
        local-graphs-full) flags=("${LOCAL[@]}" "${FULL[@]}") ;;
        *) echo "unknown variant $variant" >&2; return 2 ;;
    esac
    [ ${#modules[@]} -gt 0 ] && flags+=(--cuda-graph-modules "${modules[@]}")
    local log="${LOG_DIR:-/tmp}/pretrain-$variant-$label.log"
    echo "=== $variant / $label: $*"
    env "$@" torchrun --nproc-per-node 1 --master-port "$((29500 + RANDOM % 1000))" \
        benchmarks/megatron_lm_pretrain.py "${COMMON[@]}" "${flags[@]}" ${EXTRA_FLAGS:-} > "$log" 2>&1
    echo "exit status: $?"
    grep -E "iteration +[0-9]+/|evaluate .*:|validation loss|MTP_FORWARDS" "$log"
    grep -c "mtp_hooks decision" "$log" | sed 's/^/mtp_hooks decisions traced: /'
    grep -oE "(lm loss|mtp_1 loss|lm loss value): [0-9.E+-]+" "$log" | md5sum |
        sed 's/ .*//; s/^/hash of every logged loss: /'
    grep -E "UnsupportedModelError|Error|error:" "$log" | tail -n 5
}
wanted() { [[ " ${RUNS:-default eval-skip third} " == *" $1 "* ]]; }
for variant in "${@:-local}"; do
    wanted default && run "$variant" default MTP_HOOKS_AUTO=0
    wanted eval-skip &&
        run "$variant" eval-skip MTP_HOOKS_AUTO=1 MTP_HOOKS_TRACE=1 "MTP_HOOKS_POLICY=train=run,eval=skip"
    wanted third || continue
    case ${variant%%+*} in
        te-graphs-local)  # refused at the first training forward, before any step
            run "$variant" train-skip-eval-run MTP_HOOKS_AUTO=1 "MTP_HOOKS_POLICY=train=skip,eval=run" ;;
        *) run "$variant" train-skip MTP_HOOKS_AUTO=1 "MTP_HOOKS_POLICY=train=skip,eval=skip" ;;
    esac
done
