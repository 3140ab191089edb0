#!/usr/bin/env bash
# One entry point for the README's commands. It builds what it needs, then runs it:
#   scripts/run.sh demo [args]   the demo on tiny real megatron-core models (CPU)
#   scripts/run.sh test [args]   the test suite on megatron-core 0.19.2 (Python 3.12), then the
#                                core, adapter and plugin tests on megatron-core 0.16.1
#                                (Python 3.11), then the core tests alone on Python 3.10
#   scripts/run.sh lint          ruff check, ruff format --check and mypy (strict)
#   scripts/run.sh env           only build the environments
# Environments: .venv (Python 3.12, torch 2.14.1, megatron-core 0.19.2) and .venv-mcore016
# (Python 3.11, torch 2.13.0, megatron-core 0.16.1). They are rebuilt when their inputs change.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

find_python() {  # $1 = minor version, e.g. 3.12
    local want=$1 exe
    for exe in "python$want" "$HOME/.pyenv/versions/$want"*/bin/python; do
        if command -v "$exe" >/dev/null 2>&1 && "$exe" -c 'import sys; sys.exit(0)' 2>/dev/null; then
            command -v "$exe"; return 0
        fi
    done
    if command -v pyenv >/dev/null 2>&1; then
        local v; v=$(pyenv versions --bare 2>/dev/null | grep -E "^${want//./\\.}(\.|$)" | tail -1 || true)
        if [ -n "$v" ]; then echo "$(pyenv root)/versions/$v/bin/python"; return 0; fi
    fi
    echo "error: Python $want not found. Install it (e.g. 'pyenv install $want' or your OS package" \
         "python$want) so that 'python$want' is on PATH, then re-run." >&2
    return 1
}

plugins() { for p in "$ROOT"/plugins/*/; do [ -f "$p/pyproject.toml" ] && echo "$p"; done; }

# The frameworks the plugins are tested against, installed for real where they run on a CPU:
# veRL without its heavy extras (import verl needs ray, tensordict, transformers, codetiming)
# and ModelOpt (0.47.0 imports requests and huggingface_hub without declaring them).
FRAMEWORKS_NO_DEPS=(verl==0.9.1)
FRAMEWORKS=(ray==2.60.0 tensordict==0.10.0 transformers==5.10.4 codetiming==1.4.0
            nvidia-modelopt==0.47.0 requests huggingface_hub)

build_env() {  # $1 venv dir, $2 python minor, $3 torch spec, $4 megatron-core spec, [$5 frameworks]
    local venv=$1 py=$2 torch_spec=$3 mcore_spec=$4 frameworks=${5:-} stamp
    stamp=$( { cat pyproject.toml scripts/run.sh; find plugins -path '*/build' -prune -o -type f \( -name '*.py' -o -name '*.toml' \) -print | sort | xargs cat; } | sha256sum | cut -c1-16)
    if [ -f "$venv/.stamp" ] && [ "$(cat "$venv/.stamp")" = "$stamp" ]; then return 0; fi
    echo ">> building $venv (Python $py, $torch_spec, $mcore_spec); the first build takes a few minutes" >&2
    rm -rf "$venv"
    "$(find_python "$py")" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q "$torch_spec" "$mcore_spec" numpy
    "$venv/bin/python" -m pip install -q -e ".[test,bench]" omegaconf ruff==0.17.6 mypy==1.19.1
    # shellcheck disable=SC2046
    "$venv/bin/python" -m pip install -q $(plugins)
    if [ -n "$frameworks" ]; then
        "$venv/bin/python" -m pip install -q --no-deps "${FRAMEWORKS_NO_DEPS[@]}"
        "$venv/bin/python" -m pip install -q "${FRAMEWORKS[@]}"
    fi
    echo "$stamp" > "$venv/.stamp"
}

env_core() {  # the core alone (no torch) on the oldest supported Python and the lowest pluggy
    local venv=.venv-core310 stamp
    stamp=$(cat pyproject.toml scripts/run.sh | sha256sum | cut -c1-16)
    if [ -f "$venv/.stamp" ] && [ "$(cat "$venv/.stamp")" = "$stamp" ]; then return 0; fi
    echo ">> building $venv (Python 3.10, core only)" >&2
    rm -rf "$venv"
    "$(find_python 3.10)" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    # pluggy's floor from pyproject.toml; pytest 8.0 is the last that runs on it
    "$venv/bin/python" -m pip install -q -e ".[test]" "pluggy==1.3.0" "pytest==8.0.2"
    echo "$stamp" > "$venv/.stamp"
}

env_main() { build_env .venv 3.12 torch==2.14.1 megatron-core==0.19.2 frameworks; }
env_legacy() { build_env .venv-mcore016 3.11 torch==2.13.0 megatron-core==0.16.1; }

pytest_in() {  # $1 venv, rest: pytest args. "No tests collected" (exit 5) is a failure here.
    local venv=$1; shift
    local rc=0
    "$venv/bin/python" -m pytest "$@" || rc=$?
    if [ "$rc" -eq 5 ]; then echo "error: pytest collected no tests in $venv" >&2; return 1; fi
    return "$rc"
}

cmd=${1:-}; shift || true
case "$cmd" in
    demo)
        env_main
        exec .venv/bin/mtp-hooks demo "$@" ;;
    test)
        env_main
        env_legacy
        echo ">> the examples in mtp_hooks' docstrings (doctests)"
        pytest_in .venv --doctest-modules mtp_hooks
        echo ">> tests on megatron-core 0.19.2 (Python 3.12)"
        pytest_in .venv "$@"
        echo ">> tests on megatron-core 0.16.1 (Python 3.11): core, adapters, plugins, zero_edit"
        pytest_in .venv-mcore016 tests/core tests/adapters tests/plugins tests/zero_edit "$@"
        env_core
        echo ">> core tests without torch or megatron-core (Python 3.10, pluggy 1.3.0)"
        pytest_in .venv-core310 tests/core "$@" ;;
    lint)
        env_main
        .venv/bin/ruff check mtp_hooks plugins tests benchmarks conftest.py
        .venv/bin/ruff format --check mtp_hooks plugins tests benchmarks conftest.py
        .venv/bin/mypy ;;  # strict, for the mtp_hooks package ([tool.mypy] in pyproject.toml)
    env)
        env_main; env_legacy; env_core ;;
    *)
        echo "usage: scripts/run.sh demo|test|lint|env [args]" >&2; exit 2 ;;
esac
