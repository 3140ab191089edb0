#!/usr/bin/env bash
# The megatron_rl benchmark on one GPU machine without a network; every stage writes under $OUT.
#   run.sh stage                  parts in /tmp/stage (made by bundle.sh) -> wheels in /tmp/site,
#                                 TE built, the pinned Megatron-LM trees in /tmp/mlm/<name>,
#                                 mamba-ssm and causal-conv1d where the bundle has them
#   run.sh pretrain [ITERS]       the tokenizer, the corpus and the pretrained checkpoint
#   run.sh arm NAME ARM K STEPS [launch.py options]   one GRPO run of train_rl.py (see launch.py)
#   run.sh isolated NAME ARM K STEPS [...]   the same, in its own network, host-name and process
#                                 namespaces, so that several arms can share the GPU at once
#   run.sh together "NAME ARM K STEPS [...]" ...   several isolated arms at once; waits for all
#   run.sh drafter NAME [gpu_rl_drafter.py options]   benchmarks/rl_drafter on the staged packages
#   run.sh script NAME FILE [options]   one of the repository's scripts on the staged packages
#   run.sh gpu_tests [pytest options]   tests/gpu against the staged tree and Transformer Engine
#   run.sh collect [SECONDS]      wait (540 s at most) for a session under sessions/ started in
#                                 the background with OUT=$RESULTS (/tmp/res), then pack it
#                                 into $OUT/results.tgz
# Environment: TREE (a pinned tree's name, default core_v0.19.0: main's engine asserted with
# k=2, see docs/benchmarks.md), SEED (1), OUT; MODEL (gpt, the 12-layer GPT of the earlier
# sessions, or hybrid, the Nemotron-3-shaped model of model_args), MTP_LAYERS (2), PACK (0; 1:
# arms pack their sequences into rows of PACK_LENGTH tokens, 2048), MICRO_BATCH (1: the arms'
# log-prob passes and update take one row a forward; more needs PACK=1, since unpacked megatron
# describes one row to every forward, and launch.py refuses it).
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
TREE="${TREE:-core_v0.19.0}"; SEED="${SEED:-1}"
LOG="$OUT/log.txt"
say() { echo ">> $(date +%T) $*" | tee -a "$LOG"; }

site_env() {
    # mtp-hooks and mtp-hooks-drafting (arm A's controller, rl_drafter's draft depth) from the tree
    export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$REPO:$REPO/plugins/mtp-hooks-drafting"
    export HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
    export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1 NO_PROXY='*' no_proxy='*'
    # Mamba-2's Triton kernels autotune in every new process (about a minute cold); Triton
    # keeps what it found on disk with this set, so later arms start sooner
    export TRITON_CACHE_AUTOTUNING=1
    unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY
}

stage() {
    cat /tmp/stage/p[0-9][0-9] > /tmp/bundle.tar
    [ "$(sha256sum /tmp/bundle.tar | cut -d' ' -f1)" = "$(cat /tmp/stage/SHA256)" ] \
        || { say "bundle sha256 mismatch"; return 1; }
    rm -rf /tmp/b && mkdir -p /tmp/b /tmp/mlm && tar -xf /tmp/bundle.tar -C /tmp/b && rm /tmp/bundle.tar
    # megatron-core comes from the pinned tree, so a wheel of it in the bundle stays out
    shopt -s nullglob
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        /tmp/b/te/*.whl /tmp/b/fa/*.whl /tmp/b/rl/*.whl /tmp/b/mamba/*.whl 2>&1 | tail -3 | tee -a "$LOG"
    shopt -u nullglob
    # mamba-ssm's package init imports its CUDA selective-scan extension, which its Triton-only
    # wheel lacks and megatron never calls: keep only its version there.
    [ -d /tmp/site/mamba_ssm ] && echo '__version__ = "2.3.2.post1"' > /tmp/site/mamba_ssm/__init__.py
    (cd /tmp/b && tar -xzf te/transformer_engine_torch-*.tar.gz && cd transformer_engine_torch-* \
        && PYTHONPATH=/tmp/site NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_WITH_NCCL_EP=0 MAX_JOBS=16 \
           python3 -m pip wheel -q --no-deps --no-build-isolation --no-index -w /tmp/b/tew . \
           >>"$LOG" 2>&1) || { say "TE build failed"; return 1; }
    (cd /tmp/site && python3 -m zipfile -e /tmp/b/tew/*.whl .)
    for f in /tmp/b/mlm_*.tar.xz; do
        n="$(basename "$f" .tar.xz)"; n="${n#mlm_}"; [ "${#n}" = 40 ] && n=main
        mkdir -p "/tmp/mlm/$n" && tar -xJf "$f" -C "/tmp/mlm/$n" --strip-components=1
    done
    site_env
    python3 -c "import transformer_engine.pytorch, flash_attn.cute, zmq, quart, openai, wandb; print('imports ok')" 2>&1 | tail -2 | tee -a "$LOG"
}

# The model, into the array MODEL_ARGS (an array: the hybrid pattern's '*' must not glob).
#   gpt: 12 layers, hidden 1024, rotary positions (the sessions before the hybrid's).
#   hybrid: Nemotron 3's layer kinds, 1.6B parameters: the pattern MEMEM*EMEMEM*E (Mamba-2,
#     MoE of 16 experts top-4, attention) with one *E layer pair per MTP depth, hidden 2048,
#     no positional embedding (as Nemotron 3), and the task's 206-token vocabulary padded to
#     Nemotron 3's 131072, so that the output layer costs what it costs there.
model_args() {
    local seq="${1:-128}" depth pattern="MEMEM*EMEMEM*E"
    if [ "${MODEL:-gpt}" = hybrid ]; then
        for ((depth = 0; depth < ${MTP_LAYERS:-2}; depth++)); do pattern+="/*E"; done
        MODEL_ARGS=(--hybrid-layer-pattern "$pattern"
            --spec megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec
            --hidden-size 2048 --num-attention-heads 16 --kv-channels 128
            --group-query-attention --num-query-groups 2
            --ffn-hidden-size 1024 --moe-ffn-hidden-size 1024 --swiglu
            --num-experts 16 --moe-router-topk 4 --moe-grouped-gemm
            --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss
            --moe-aux-loss-coeff 1e-2 --position-embedding-type none --normalization RMSNorm
            --disable-bias-linear --untie-embeddings-and-output-weights
            --make-vocab-size-divisible-by 131072)
    else
        MODEL_ARGS=(--num-layers 12 --hidden-size 1024 --num-attention-heads 16
            --ffn-hidden-size 4096 --position-embedding-type rope
            --mtp-num-layers "${MTP_LAYERS:-2}")
    fi
    MODEL_ARGS+=(--seq-length "$seq" --max-position-embeddings "$seq"
        --transformer-impl transformer_engine --bf16
        --attention-backend auto --no-gradient-accumulation-fusion
        --attention-dropout 0 --hidden-dropout 0
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model /tmp/tok --seed "$SEED")
}

pretrain() {
    site_env
    local iters="${1:-400}"
    python3 "$HERE/tokenizer.py" /tmp/tok >>"$LOG" 2>&1
    mkdir -p /tmp/corpus
    (cd "$HERE" && PYTHONPATH="/tmp/mlm/$TREE:$PYTHONPATH" python3 corpus.py /tmp/tok /tmp/corpus/c \
        --documents 60000 --seed "$SEED") 2>&1 | tail -1 | tee -a "$LOG"
    model_args 128
    local script=pretrain_gpt.py lr=5e-4 more=(--log-interval 50)
    # the hybrid: a lower peak rate for its 1.6B parameters, the weights alone saved (the arms
    # load no optimizer state), and a time limit that saves and ends the run where it is
    if [ "${MODEL:-gpt}" = hybrid ]; then
        script=pretrain_hybrid.py lr=3e-4
        more=(--no-save-optim --no-save-rng --exit-duration-in-mins "${PRETRAIN_MINUTES:-5}"
            --log-interval 25)
    fi
    say "pretrain $script $iters iterations"
    (cd "/tmp/mlm/$TREE" && timeout -k 10 "${PRETRAIN_TIMEOUT:-420}" torchrun --nproc-per-node 1 \
        --master-port 29400 "$script" "${MODEL_ARGS[@]}" --micro-batch-size 64 \
        --global-batch-size 64 --train-iters "$iters" --lr "$lr" --min-lr 5e-5 \
        --lr-decay-style cosine --lr-warmup-iters 40 --weight-decay 0.01 --clip-grad 1.0 \
        --data-path /tmp/corpus/c --split 100,0,0 --eval-iters 0 --eval-interval 100000 \
        --save /tmp/ckpt --save-interval "$iters" "${more[@]}") >>"$LOG" 2>&1
    say "pretrain rc=$? $(grep -o 'lm loss: [0-9.E+-]*' "$LOG" | tail -1)"
}

arm() {
    site_env
    local name="$1" arm="$2" k="$3" iters="$4"; shift 4
    cat > /tmp/env.yaml <<YAML
- agent_type: MTPCountAgent
  agent_args: {seed: $SEED}
  weight: 1.0
YAML
    # PACK=1: one row of PACK_LENGTH tokens holds many trajectories, so a log-prob pass or an
    # update is a few forwards instead of one per trajectory (megatron then wants one row a
    # micro-batch); the rollouts' own length limit stays --inference-max-seq-length.
    local pack=()
    if [ "${PACK:-0}" = 1 ]; then
        model_args "${PACK_LENGTH:-2048}"; pack=(--rl-use-sequence-packing)
    else
        model_args 128
    fi
    say "arm $name: $arm k=$k $iters steps $*"
    timeout -k 10 "${ARM_TIMEOUT:-300}" torchrun --nproc-per-node 1 --master-port 29410 \
        "$HERE/launch.py" --megatron-lm "/tmp/mlm/$TREE" --arm "$arm" --record "$OUT/$name.jsonl" "$@" -- \
        "${MODEL_ARGS[@]}" "${pack[@]}" --perform-rl-step --langrl-env-config /tmp/env.yaml \
        --grpo-group-size 8 --grpo-prompts-per-step 4 --grpo-iterations 1 \
        --grpo-clamp-eps-lower 0.2 --grpo-clamp-eps-upper 0.2 \
        --micro-batch-size "${MICRO_BATCH:-1}" --global-batch-size 32 --train-iters "$iters" \
        --lr 5e-5 --lr-decay-style constant --weight-decay 0.0 --clip-grad 1.0 \
        $( [ -n "${LOAD-/tmp/ckpt}" ] && echo --load "${LOAD-/tmp/ckpt}" --finetune --no-load-optim --no-load-rng ) \
        --inference-max-seq-length 128 --inference-dynamic-batching-buffer-size-gb 2 \
        --inference-dynamic-batching-sampling-backend torch --num-speculative-tokens "$k" \
        --eval-iters 0 --eval-interval 100000 --log-interval 1 --timing-log-level 1 \
        ${EXTRA:-} >>"$OUT/$name.log" 2>&1
    local rc=$?
    pkill -9 -f "multiprocessing|hypercorn|launch.py" 2>/dev/null; sleep 1
    say "arm $name rc=$rc steps=$(grep -c '"rollout_s"' "$OUT/$name.jsonl" 2>/dev/null)"
    tail -5 "$OUT/$name.log" | cut -c1-300 >> "$LOG"
}

isolated() {
    # train_rl.py serves its rollouts on port 8294 with SO_REUSEPORT: two arms in one network
    # namespace would share that port, and the kernel would hand one arm's requests to the
    # other's engine. Each arm therefore gets a network namespace with only loopback, a host
    # name that resolves there (the engine binds ZMQ to gethostname()), and a process namespace,
    # so that the arm's cleanup kills its own processes and no one else's.
    MEGATRON_RL_SHARED_GPU=1 unshare --net --uts --pid --fork --mount-proc bash -c '
        hostname localhost
        python3 -c "import fcntl, socket, struct
fcntl.ioctl(socket.socket(socket.AF_INET, socket.SOCK_DGRAM), 0x8914,
            struct.pack(\"16sh22x\", b\"lo\", 0x1 | 0x8 | 0x40))"
        exec bash "$0" arm "$@"' "$HERE/run.sh" "$@"
}

together() {
    # Only for what does not depend on time (rewards, acceptance, which steps trained MTP):
    # arms that share the GPU time the sharing, and their headers say so (shared_gpu).
    local spec
    for spec in "$@"; do
        # shellcheck disable=SC2086
        isolated $spec &
        sleep 1
    done
    wait
}

drafter() {
    site_env
    local name="$1"; shift
    export PYTHONPATH="/tmp/mlm/$TREE:$PYTHONPATH"
    say "drafter $name: $*"
    timeout -k 10 "${ARM_TIMEOUT:-600}" python3 "$REPO/benchmarks/rl_drafter/gpu_rl_drafter.py" \
        --out "$OUT/$name" "$@" >"$OUT/$name.log" 2>&1
    say "drafter $name rc=$?"
}

script() {
    site_env
    local name="$1"; shift
    export PYTHONPATH="/tmp/mlm/$TREE:$PYTHONPATH"
    say "script $name: $*"
    (cd "$REPO" && timeout -k 10 "${ARM_TIMEOUT:-600}" python3 "$@") >"$OUT/$name.log" 2>&1
    say "script $name rc=$?"
}

gpu_tests() {
    site_env
    export PYTHONPATH="/tmp/mlm/$TREE:$PYTHONPATH"
    say "gpu_tests $*"
    (cd "$REPO" && timeout -k 10 "${ARM_TIMEOUT:-600}" python3 -m pytest tests/gpu -v -rA "$@") \
        >"$OUT/gpu_tests.log" 2>&1
    say "gpu_tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"
}

collect() {
    # A device call lasts 10 minutes at most, so a session runs in the background and later
    # calls collect it. The machine can be taken back between two calls, and the next call
    # then lands on a fresh one without the results: say so at once instead of waiting.
    local results="${RESULTS:-/tmp/res}" seconds="${1:-540}" waited=0
    if [ ! -d "$results" ]; then
        echo "collect: no $results on this machine: it is a fresh one, and the session is lost"
        return 3
    fi
    while [ "$waited" -lt "$seconds" ] && pgrep -f "megatron_rl/sessions/" >/dev/null; do
        sleep 10; waited=$((waited + 10))
    done
    tar czf "$OUT/results.tgz" -C "$results" .
    grep -h "^>>" "$results/log.txt" 2>/dev/null | tail -20
    pgrep -f "megatron_rl/sessions/" >/dev/null && echo "collect: still running" || echo "collect: done"
}

"$@"
