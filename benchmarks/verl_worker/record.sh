#!/usr/bin/env bash
# veRL 0.9.1's own actor worker on one GPU, with mtp-hooks-verl and without it: a 1.26B
# Nemotron-3-shaped HybridModel (Mamba-2, MoE, attention; vocabulary 131072; one MTP depth),
# packed (THD) batches, each veRL MTP config that veRL 0.9.1 can run on a HybridModel.
#   record.sh stage          parts in /tmp/stage -> packages in /tmp/site
#   record.sh tests          tests/gpu/test_verl_on_gpu.py on them
#   record.sh large MTP...   the record: each config (off, load) with the plugin and without,
#                            one JSON per run in $OUT
# The parts come from bundle.sh here; carry them one device call each into /tmp/stage, back
# to back (the machine goes back after 30 s idle), SHA256 with the last.
# summarize.py turns the JSONs into the table of docs/benchmarks.md's veRL section.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
LOG="$OUT/record.log"
say() { echo ">> $(date +%T) $*" | tee -a "$LOG"; }

stage() {
    cat /tmp/stage/p* > /tmp/verl.tar
    [ "$(sha256sum /tmp/verl.tar | cut -d' ' -f1)" = "$(cat /tmp/stage/SHA256)" ] \
        || { say "bundle sha256 mismatch"; return 1; }
    rm -rf /tmp/w && mkdir -p /tmp/w && tar -xf /tmp/verl.tar -C /tmp/w && rm /tmp/verl.tar
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl \
        2>&1 | tail -3 | tee -a "$LOG"
    # mamba-ssm's package init imports its CUDA selective-scan extension, which this
    # Triton-only build lacks and megatron never calls: keep only its version there.
    echo '__version__ = "2.3.2.post1"' > /tmp/site/mamba_ssm/__init__.py
    say "staged: $(PYTHONPATH=/tmp/site python3 -c 'import verl, ray, megatron.core, causal_conv1d; print("verl", verl.__version__)' 2>&1 | tail -1)"
}

site_env() {
    export PYTHONPATH="/tmp/site:$REPO" PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
    cd "$REPO" || exit 1
}

tests() {
    site_env
    say "gpu tests"
    timeout -k 10 240 python3 -m pytest -p no:cacheprovider -q -o addopts="" \
        tests/gpu/test_verl_on_gpu.py >"$OUT/gpu_tests.log" 2>&1
    say "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"
}

large() {  # large MTP...: each config with the plugin and without, interleaved
    site_env
    for mtp in "$@"; do
        for plugin in with without; do
            flag=""; [ "$plugin" = without ] && flag="--no-plugin"
            say "large $mtp $plugin"
            timeout -k 10 "${RUN_TIMEOUT:-170}" python3 tests/verl_worker.py --model nemotron \
                --size large --mtp "$mtp" --format thd --steps "${STEPS:-8}" --port 29611 $flag \
                >"$OUT/large_${mtp}_${plugin}.json" 2>"/tmp/large_${mtp}_${plugin}.err"
            rc=$?
            say "rc=$rc $(grep -E 'Error|error' "/tmp/large_${mtp}_${plugin}.err" | tail -1)"
        done
    done
}

"$@"
