#!/usr/bin/env bash
# The CPU side of staging: what the GPU machine lacks for Megatron-LM's GRPO loop on a GPT or a
# Nemotron-3-shaped hybrid, and the pinned Megatron-LM trees, split into parts that each fit
# one device call (64 MiB with the work tree).
#   bundle.sh MIRROR OUTDIR [NEMOTRON_DIR]
# MIRROR: a bare clone of NVIDIA/Megatron-LM (search's `fetch`). NEMOTRON_DIR: the output of
# benchmarks/nemotron/bundle.sh, made before; without it that script runs first, into
# OUTDIR/nemotron (about 10 minutes: it builds causal-conv1d).
# One bundle serves both benchmarks: Transformer Engine, FlashAttention 4, mamba-ssm and
# causal-conv1d come from the Nemotron bundle (same pins); this adds the RL loop's packages
# and the trees. On the GPU machine each part is copied to /tmp/stage, with SHA256 beside the
# last, and `run.sh stage` joins, checks and installs them. The RL versions are the ones that
# installed and imported together on the H200 (torch 2.11, CUDA 13, its protobuf 7): openai
# 3.x wants httpx2, wandb 0.31 and fastapi 0.165 want opentelemetry, and wandb 0.21 wants
# protobuf < 7.
set -euo pipefail
MIRROR="$1"; OUT="$(mkdir -p "$2" && cd "$2" && pwd)"
HERE="$(cd "$(dirname "$0")" && pwd)"
NEMOTRON="${3:-$OUT/nemotron}"
[ -d "$NEMOTRON/dl/mamba" ] || bash "$HERE/../nemotron/bundle.sh" "$NEMOTRON"
DL="$OUT/dl"; rm -rf "$DL"; mkdir -p "$DL/rl"
# megatron-core's wheel stays behind: the pinned tree brings its own megatron.core
cp -r "$NEMOTRON/dl/te" "$NEMOTRON/dl/fa" "$NEMOTRON/dl/mamba" "$DL/"
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
for n in 17 24 26 27 28 34 35; do P="$P --platform manylinux_2_${n}_x86_64"; done
P="$P --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
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
# 44 MiB a part leaves 20 MiB of a call for the work tree (11 MiB in December 2026, growing
# with each session's records; 54 MiB parts stopped fitting at 11). run.sh takes up to 100 parts.
split -b 44M -d "$OUT/bundle.tar" "$OUT/parts/p"
sha256sum "$OUT/bundle.tar" | cut -d' ' -f1 > "$OUT/parts/SHA256"
ls -l "$OUT/parts"
