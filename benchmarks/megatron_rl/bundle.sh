#!/usr/bin/env bash
# The CPU side of staging: download what the GPU machine lacks, archive the pinned Megatron-LM
# trees, and split it all into parts that each fit one device call (64 MiB with the work tree).
#   bundle.sh MIRROR OUTDIR      MIRROR: a bare clone of NVIDIA/Megatron-LM (search's `fetch`)
# Then, on the GPU machine, each part is copied to /tmp/stage, with SHA256 beside the last, and
# `run.sh stage` joins, checks and installs them. The versions are the ones that installed and
# imported together on the H200 (torch 2.11, CUDA 13, its protobuf 7): openai 3.x wants httpx2,
# wandb 0.31 and fastapi 0.165 want opentelemetry, and wandb 0.21 wants protobuf < 7.
set -euo pipefail
MIRROR="$1"; OUT="$2"
HERE="$(cd "$(dirname "$0")" && pwd)"
DL="$OUT/dl"; mkdir -p "$DL/te" "$DL/fa" "$DL/rl"
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
for n in 17 24 26 27 28 34 35; do P="$P --platform manylinux_2_${n}_x86_64"; done
P="$P --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
# shellcheck disable=SC2086
python3 -m pip download -q $P -d "$DL/te" transformer-engine-cu13==2.20.2 \
    transformer-engine==2.20.2 nvdlfw-inspect==0.2.2 nvidia-cudnn-frontend==1.32.0 \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
# TE's torch extension is an sdist whose download builds metadata: it needs torch, setuptools
# >= 77, wheel and pybind11 importable. TORCH_SITE: a site-packages that has them (the mcore019
# nox environment's, with a pip venv that has setuptools, wheel and pybind11 as PYTHON).
PYTHONPATH="${TORCH_SITE:-}" "${PYTHON:-python3}" -m pip download -q --no-deps \
    --no-build-isolation --no-binary=transformer-engine-torch -d "$DL/te" \
    transformer-engine-torch==2.20.2
# shellcheck disable=SC2086
python3 -m pip download -q $P -d "$DL/fa" flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 \
    nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
    nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 \
    torch-c-dlpack-ext==0.1.5
# shellcheck disable=SC2086
python3 -m pip download -q $P -d "$DL/rl" pyzmq==27.3.0 quart==0.22.0 hypercorn==0.18.0 \
    openai==2.54.0 httpx-aiohttp==0.2.0 fastapi==0.116.1 starlette==0.47.3 uvicorn==0.55.0 \
    wandb==0.21.0 protobuf==6.33.6 blinker==1.9.0 flask==3.1.3 itsdangerous==2.2.0 h2==4.4.1 \
    priority==2.0.0 wsproto==1.3.2 hpack==4.2.0 hyperframe==6.1.0 distro==1.9.0 jiter==0.19.0 \
    sniffio==1.3.1 gitpython==3.2.1 gitdb==4.0.12 smmap==5.0.3 sentry-sdk==2.75.0 \
    platformdirs==4.14.9 setproctitle==1.3.8
python3 - "$HERE/megatron_lm.json" "$MIRROR" "$DL" <<'PY'
import json, subprocess, sys
pins, mirror, dl = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
for tree in pins["trees"]:
    archive = subprocess.run(
        ["git", "-C", mirror, "archive", "--format=tar", "--prefix=mlm/", tree["commit"], "--",
         ".", ":!docs", ":!tests", ":!images", ":!docker", ":!.github", ":!.gitlab"],
        check=True, capture_output=True).stdout
    name = tree["commit"] if tree["name"] == "main" else tree["name"]  # run.sh's naming
    with open(f"{dl}/mlm_{name}.tar.xz", "wb") as f:
        f.write(subprocess.run(["xz", "-6", "-T2"], input=archive, check=True,
                               capture_output=True).stdout)
PY
tar -cf "$OUT/bundle.tar" -C "$DL" .
rm -rf "$OUT/parts" && mkdir -p "$OUT/parts"
# 52 MiB a part leaves 12 MiB of a call for the work tree, which grows with its records.
split -b 52M -d "$OUT/bundle.tar" "$OUT/parts/p"
sha256sum "$OUT/bundle.tar" | cut -d' ' -f1 > "$OUT/parts/SHA256"
ls -l "$OUT/parts"
