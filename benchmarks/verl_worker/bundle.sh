#!/usr/bin/env bash
# The CPU side of record.sh: every package veRL 0.9.1's actor worker needs on the GPU machine
# beyond its image (torch 2.11, transformers, accelerate, numpy there), as wheels, tarred and
# split into parts that each fit one device call beside the work tree.
#   bundle.sh OUTDIR MAMBA_WHEELS
# MAMBA_WHEELS: the dl/mamba folder that benchmarks/nemotron/bundle.sh makes (mamba-ssm as a
# pure-Python wheel, causal-conv1d built for sm_90); megatron's Mamba-2 layer takes packed
# sequences only with causal-conv1d. On the GPU machine each part is copied to
# /tmp/stage, with SHA256 beside the last, and `record.sh stage` joins, checks and installs them.
set -euo pipefail
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
MAMBA="$(cd "$2" && pwd)"
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
PY="${PYTHON:-python3.12}"
W="$OUT/wheels"; rm -rf "$W" && mkdir -p "$W"
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
for n in 17 24 26 27 28 31 34 35; do P="$P --platform manylinux_2_${n}_x86_64"; done
P="$P --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
# shellcheck disable=SC2086
"$PY" -m pip download -q $P -d "$W" \
    verl==0.9.1 megatron-core==0.19.2 ray==2.60.0 tensordict==0.10.0 pyvers==0.1.0 \
    codetiming==1.4.0 omegaconf==2.3.1 hydra-core==1.3.8 peft==0.21.2 datasets==5.2.0 \
    dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 pyarrow==26.0.1 pandas==3.1.1 \
    tzdata==2026.6 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 h11==0.16.0 \
    annotated-doc==0.0.7 cachetools==8.0.3 opentelemetry-api==1.45.3 importlib-metadata==10.2.0 \
    zipp==4.1.2 orjson==3.13.0 cloudpickle==3.1.3 msgpack==1.2.4 nvidia-ml-py==13.615.71 \
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
    rpds-py==2026.9.1 attrs==26.1.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 einops==0.8.2
"$PY" -m pip wheel -q --no-deps -w "$W" antlr4-python3-runtime==4.9.3  # an sdist only
cp "$MAMBA"/mamba_ssm-*.whl "$MAMBA"/causal_conv1d-*.whl "$W/"
# mtp-hooks and its veRL plugin as wheels: the plugin's entry points (verl.plugins, mtp_hooks)
# exist only where it is installed, not where the checkout is merely on PYTHONPATH
"$PY" -m pip wheel -q --no-deps -w "$W" "$REPO" "$REPO/plugins/mtp-hooks-verl"
tar -cf "$OUT/verl.tar" -C "$W" .
rm -rf "$OUT/parts" && mkdir -p "$OUT/parts"
split -b 45M -d "$OUT/verl.tar" "$OUT/parts/p"
sha256sum "$OUT/verl.tar" | cut -d' ' -f1 > "$OUT/parts/SHA256"
ls -l "$OUT/parts"
