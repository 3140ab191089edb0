#!/usr/bin/env bash
# The Nemotron-3 benchmarks and GPU tests on one GPU machine without a network; all under $OUT.
#   run.sh stage            parts in /tmp/stage (made by bundle.sh) -> packages in /tmp/site,
#                           Transformer Engine's torch extension built there (about 90 s)
#   run.sh tests [ARGS]     tests/gpu (the Nemotron module by default) on the staged packages
#   run.sh bench NAME ARGS  benchmarks/gpu_mtp.py --model nemotron --spec te ARGS; NAME small,
#                           large or moe16 with no ARGS runs that size of docs/benchmarks.md
#   run.sh ab NAME [ARGS]   benchmarks/gpu_hooks_ab.py --model nemotron --spec te --pair skip:
#                           skip against the trunk built without MTP beside the trunk measured
#                           twice (the control); NAME small, large or moe16 as for bench
#   run.sh demo             the README's demo with its Nemotron-3-shaped model, on the GPU
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
LOG="$OUT/log.txt"
say() { echo ">> $(date +%T) $*" | tee -a "$LOG"; }

site_env() {
    export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$REPO"
    export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1 NVTE_ALLOW_NONDETERMINISTIC_ALGO=0
}

stage() {
    cat /tmp/stage/p[0-9][0-9] > /tmp/bundle.tar
    [ "$(sha256sum /tmp/bundle.tar | cut -d' ' -f1)" = "$(cat /tmp/stage/SHA256)" ] \
        || { say "bundle sha256 mismatch"; return 1; }
    rm -rf /tmp/b && mkdir -p /tmp/b && tar -xf /tmp/bundle.tar -C /tmp/b && rm /tmp/bundle.tar
    # a bundle made with NO_FLASH_ATTENTION=1 has no fa/: the engine tests then skip
    shopt -s nullglob
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        /tmp/b/te/*.whl /tmp/b/fa/*.whl /tmp/b/mc/*.whl /tmp/b/mamba/*.whl 2>&1 | tail -3 | tee -a "$LOG"
    shopt -u nullglob
    # mamba-ssm's package init imports its CUDA selective-scan extension, which this
    # Triton-only build lacks and megatron never calls: keep only its version there.
    echo '__version__ = "2.3.2.post1"' > /tmp/site/mamba_ssm/__init__.py
    (cd /tmp/b && tar -xzf te/transformer_engine_torch-*.tar.gz && cd transformer_engine_torch-* \
        && PYTHONPATH=/tmp/site NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_WITH_NCCL_EP=0 MAX_JOBS=16 \
           python3 -m pip wheel -q --no-deps --no-build-isolation --no-index -w /tmp/b/tew . \
           >>"$LOG" 2>&1) || { say "TE build failed"; return 1; }
    (cd /tmp/site && python3 -m zipfile -e /tmp/b/tew/*.whl .)
    site_env
    python3 -c "import importlib.util, transformer_engine.pytorch, causal_conv1d, megatron.core
from megatron.core.ssm import mamba_mixer; print('imports ok, HAVE_MAMBA_SSM', mamba_mixer.HAVE_MAMBA_SSM,
'flash_attn', importlib.util.find_spec('flash_attn') is not None)" 2>&1 | tail -2 | tee -a "$LOG"
}

tests() {
    site_env
    say "tests ${*:-tests/gpu/test_nemotron_on_te.py}"
    (cd "$REPO" && timeout -k 10 "${TEST_TIMEOUT:-540}" python3 -m pytest -p no:cacheprovider -s -q \
        -o addopts="" --timeout 500 "${@:-tests/gpu/test_nemotron_on_te.py}") >"$OUT/gpu_tests.log" 2>&1
    say "tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"
}

# The two sizes of docs/benchmarks.md: Nemotron 3's layer kinds at 0.21B and 1.38B, the
# larger with Nemotron 3's vocabulary (131072) and its trunk pattern twice as deep.
SMALL=(--hidden 1024 --ffn 1024 --vocab 32768 --experts 8 --pattern "M*MEME/*E/*E")
LARGE=(--hidden 2048 --ffn 2048 --vocab 131072 --experts 8 --pattern "M*MEMEM*MEME/*E/*E")
# The reliability issue's layout: the megatron_rl benchmark's hybrid (16 experts top-4, Nemotron
# 3's trunk order), 2 sequences of 1024 tokens.
MOE16=(--hidden 2048 --ffn 1024 --vocab 131072 --experts 16 --topk 4 --seq 1024 --batch 2
    --pattern "MEMEM*EMEMEM*E/*E/*E")

bench() {
    site_env
    local name="$1"; shift
    if [ $# -eq 0 ] && [ "$name" = small ]; then set -- "${SMALL[@]}" --iters 30 --warmup 5; fi
    if [ $# -eq 0 ] && [ "$name" = large ]; then set -- "${LARGE[@]}" --iters 30 --warmup 5; fi
    if [ $# -eq 0 ] && [ "$name" = moe16 ]; then set -- "${MOE16[@]}" --iters 30 --warmup 5; fi
    say "bench $name: $*"
    (cd "$REPO" && timeout -k 10 "${BENCH_TIMEOUT:-400}" python3 benchmarks/gpu_mtp.py --model nemotron \
        --spec te --out "$OUT/$name" "$@") >"$OUT/$name.log" 2>&1
    say "bench $name rc=$?"
}

ab() {
    site_env
    local name="$1"; shift
    local size=()
    [ "$name" = small ] && size=("${SMALL[@]}")
    [ "$name" = large ] && size=("${LARGE[@]}")
    [ "$name" = moe16 ] && size=("${MOE16[@]}")
    say "ab $name: ${size[*]} $*"
    (cd "$REPO" && timeout -k 10 "${BENCH_TIMEOUT:-400}" python3 benchmarks/gpu_hooks_ab.py \
        --model nemotron --spec te --pair skip "${size[@]}" --out "$OUT/ab_$name" "$@") \
        >"$OUT/ab_$name.log" 2>&1
    say "ab $name rc=$?"
}

demo() {
    site_env
    say "demo --models nemotron"
    (cd "$REPO" && timeout -k 10 "${DEMO_TIMEOUT:-200}" python3 -m mtp_hooks demo --models nemotron) \
        >"$OUT/demo.log" 2>&1
    say "demo rc=$?"
}

"$@"
