#!/usr/bin/env bash
# The CPU side of staging a Nemotron-3-shaped model (Mamba-2 + attention + MoE) on a GPU
# machine without a network: download and build what it lacks, then split it all into parts
# that each fit one device call (64 MiB with the work tree).
#   bundle.sh OUTDIR
# Needs Python 3.12 with pip, and CUDA's nvcc (13.x, as on the GPU machine) for causal-conv1d.
# On the GPU machine each part is copied to /tmp/stage, with SHA256 beside the last, and
# `run.sh stage` joins, checks and installs them.
#
# What and why:
#   Transformer Engine 2.20.2 (cu13): megatron's TE hybrid spec; its torch extension is built
#     on the GPU machine from the sdist (about 90 s).
#   FlashAttention 4 and its CUTLASS DSL: megatron's inference engine takes it for the paged
#     KV cache of the attention layers.
#   megatron-core 0.19.2.
#   mamba-ssm 2.3.2.post1 as a pure-Python wheel: megatron's Mamba-2 layer calls only its
#     Triton kernels (the SSD scan, the gated RMSNorm), which compile on first use.
#   causal-conv1d 1.7.0 built here for sm_90 only: its setup.py lists nine GPU targets (about
#     17 minutes with 6 jobs on the GPU machine); sm_90 alone builds in minutes. Training takes
#     megatron's memory-efficient Mamba path with it; the engine's prefill needs it.
set -euo pipefail
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
DL="$OUT/dl"; WORK="$OUT/work"; mkdir -p "$DL/te" "$DL/fa" "$DL/mc" "$DL/mamba" "$WORK"
PY="${PYTHON:-python3.12}"
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
for n in 17 24 26 27 28 34 35; do P="$P --platform manylinux_2_${n}_x86_64"; done
P="$P --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
# A build environment with the GPU machine's torch (2.11, CUDA 13): the extension must match it.
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q torch==2.11.0 "setuptools>=77" wheel packaging ninja pybind11 numpy
# shellcheck disable=SC2086
"$VPY" -m pip download -q $P -d "$DL/te" transformer-engine-cu13==2.20.2 \
    transformer-engine==2.20.2 nvdlfw-inspect==0.2.2 nvidia-cudnn-frontend==1.32.0 \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
"$VPY" -m pip download -q --no-deps --no-build-isolation \
    --no-binary=transformer-engine-torch -d "$DL/te" transformer-engine-torch==2.20.2
# shellcheck disable=SC2086
"$VPY" -m pip download -q $P -d "$DL/fa" flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 \
    nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
    nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 \
    torch-c-dlpack-ext==0.1.5
# shellcheck disable=SC2086
"$VPY" -m pip download -q $P -d "$DL/mc" megatron-core==0.19.2
MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE "$VPY" -m pip wheel -q --no-deps \
    --no-build-isolation -w "$DL/mamba" mamba-ssm==2.3.2.post1
"$VPY" -m pip download -q --no-deps --no-build-isolation --no-binary=:all: -d "$WORK" \
    causal-conv1d==1.7.0
(cd "$WORK" && rm -rf causal_conv1d-1.7.0 && tar -xzf causal_conv1d-1.7.0.tar.gz)
"$VPY" - "$WORK/causal_conv1d-1.7.0/setup.py" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
# keep the one target the H200 runs (sm_90): the block of -gencode pairs becomes one pair
first = text.index('        cc_flag.append("-gencode")')
last = text.index("    # HACK: The compiler flag")
one = '        cc_flag.append("-gencode")\n        cc_flag.append("arch=compute_90,code=sm_90")\n\n'
open(path, "w").write(text[:first] + one + text[last:])
PY
(cd "$WORK/causal_conv1d-1.7.0" && PATH="$WORK/venv/bin:$PATH" CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" \
    CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-2}" \
    "$VPY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$DL/mamba" .)
# NO_FLASH_ATTENTION=1 leaves FlashAttention out (two parts fewer; the engine tests skip), and
# the parts are as large as one call carries beside a work tree of about 10 MiB.
if [ -n "${NO_FLASH_ATTENTION:-}" ]; then
    tar -cf "$OUT/bundle.tar" -C "$DL" ./te ./mc ./mamba
else
    tar -cf "$OUT/bundle.tar" -C "$DL" .
fi
rm -rf "$OUT/parts" && mkdir -p "$OUT/parts"
# 44 MiB a part leaves 20 MiB of a call for the work tree, which grows with records.
split -b 44M -d "$OUT/bundle.tar" "$OUT/parts/p"
sha256sum "$OUT/bundle.tar" | cut -d' ' -f1 > "$OUT/parts/SHA256"
ls -l "$OUT/parts"
