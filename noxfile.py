"""The project's sessions: the demo, the test matrix, the core alone, lint and types.

Run them through ``scripts/nox``, which installs nox and uv on first use::

    scripts/nox -s demo     # the main job: policies on tiny real models, on the CPU
    scripts/nox             # what CI runs: lint, types, docs, every matrix entry of tests, core

Every version pin of the project's environments is in this file. A session's environment is
built on first use and reused afterwards (installs into it are checks that take a moment).
Where a Python of the matrix is missing, nox skips its sessions and says so; under ``CI=true``
a missing Python fails the run instead.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "uv|virtualenv"
# uv installs no bytecode by default, and where PYTHONDONTWRITEBYTECODE is set (CI machines here)
# every import of torch and megatron-core would compile from source: tests ran at half speed.
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")
# A Python the machine lacks is reported as skipped (an error under CI), never downloaded.
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "types", "docs", "wheels", "tests", "core"]
nox.options.error_on_missing_interpreters = bool(os.environ.get("CI"))
nox.needs_version = ">=2025.5.1"

# -- the pins -----------------------------------------------------------------------------------
TORCH = {"3.12": "torch==2.14.1", "3.11": "torch==2.13.0"}
# Which tests run on which megatron-core: every test on the newest; on an older one, those whose
# outcome can differ there (docs/contributing.md, "What runs where", gives each reason).
MATRIX = {  # id: (Python, megatron-core, what runs)
    "mcore019": ("3.12", "megatron-core==0.19.2", ["tests"]),
    "mcore018": (  # the first release with models/hybrid
        "3.12",
        "megatron-core==0.18.2",
        [
            "tests/adapters",
            "tests/plugins",
            "tests/zero_edit",
            "tests/distributed",
            # torch.compile's view of the hooks: torch 2.14.1 and Python 3.12, as mcore019
            "--ignore=tests/adapters/test_compile.py",
        ],
    ),
    "mcore016": (  # torch 2.13.0 and Python 3.11: compile and the stress rounds run here too
        "3.11",
        "megatron-core==0.16.1",
        ["tests/adapters", "tests/plugins", "tests/zero_edit", "tests/stress"],
    ),
}
# The test sessions spread their tests over one worker per core (pytest-xdist; tests/ports.py
# keeps the workers' process groups apart; worksteal, since a few tests take minutes), and list
# the slowest tests at the end.
PARALLEL = ["--numprocesses=auto", "--maxprocesses=8", "--dist=worksteal", "--durations=15"]
# The frameworks the plugin tests run against for real (with megatron-core 0.19.2): veRL without
# its heavy extras (import verl needs ray, tensordict, transformers, codetiming), ModelOpt
# (0.47.0 imports requests and huggingface_hub without declaring them), and Megatron-Bridge's
# files (its package imports Transformer Engine: the tests run its gpt_step functions).
FRAMEWORKS_NO_DEPS = ["verl==0.9.1", "megatron-bridge==0.3.1"]
FRAMEWORKS = [
    "ray==2.60.0",
    "tensordict==0.10.0",
    "transformers==5.10.4",
    "codetiming==1.4.0",
    "nvidia-modelopt==0.47.0",
    "requests",
    "huggingface_hub",
    *[  # what veRL's actor worker imports beyond its declared base dependencies (with pyarrow
        # and pandas, about 200 MB; tests/plugins/test_verl_worker.py runs the worker)
        "hydra-core==1.3.8",
        "peft==0.21.2",
        "datasets==5.2.0",
        "pillow==13.0.0",
        "uvicorn==0.55.0",
        "fastapi==0.165.0",
        "cachetools==8.0.3",
    ],
]
# megatron's Mamba-2 layer calls mamba-ssm's Triton kernels, which the CPU tests run through
# Triton's interpreter (tests/mamba_on_cpu.py); mamba-ssm is an sdist whose build compiles CUDA
# unless told not to, and imports torch, so it builds in the environment, CUDA skipped.
MAMBA = ["mamba-ssm==2.3.2.post1", "einops==0.8.2"]
MAMBA_BUILD = ["setuptools", "wheel", "packaging", "ninja"]
CORE_FLOOR = ["pluggy==1.3.0", "pytest==8.0.2"]  # pyproject's pluggy floor; pytest 8.0 runs on it
# The property tests (tests/core/test_*_properties.py) set a fixed seed and their example counts
# themselves, so every run checks the same examples.
HYPOTHESIS = "hypothesis==6.168.5"
RUFF, MYPY, SPHINX, MYST = "ruff==0.17.6", "mypy==1.19.1", "sphinx==9.1.1", "myst-parser==5.2.0"
PLUGINS = sorted(
    f"plugins/{name}"
    for name in os.listdir("plugins")
    if os.path.exists(f"plugins/{name}/pyproject.toml")
)
# The plugins' own modules, for the doctests; the veRL entry point turns auto-attach on when
# imported, which only a veRL process should do.
PLUGIN_PACKAGES = [f"{path}/{os.path.basename(path).replace('-', '_')}" for path in PLUGINS] + [
    "--ignore=plugins/mtp-hooks-verl/mtp_hooks_verl/verl_entry.py"
]


def _install_project(session: nox.Session, python: str, megatron: str) -> None:
    """torch, megatron-core, this package (editable) and the framework plugins."""
    if os.path.isdir("/opt/wheels"):  # machines that keep torch wheels on disk: use them
        session.env["UV_FIND_LINKS"] = "/opt/wheels"
    session.install(TORCH[python], megatron, "numpy")
    session.install("-e", ".[test,bench]", "omegaconf", HYPOTHESIS, *PLUGINS)
    if python != "3.11":  # megatron-core 0.16 (Python 3.11) builds no Mamba-2 hybrid
        session.install(*MAMBA_BUILD)
        session.install(
            "--no-build-isolation",
            "--no-deps",
            *MAMBA,
            env={"MAMBA_SKIP_CUDA_BUILD": "TRUE", "MAMBA_FORCE_BUILD": "TRUE"},
        )


@nox.session(python="3.12")
def demo(session: nox.Session) -> None:
    """The demo on tiny real megatron-core 0.19.2 models, on the CPU (args go to the demo)."""
    _install_project(session, "3.12", MATRIX["mcore019"][1])
    session.run("mtp-hooks", "demo", *session.posargs)


@nox.session
@nox.parametrize(
    ("python", "entry"),
    [(python, entry) for entry, (python, _, _) in MATRIX.items()],
    ids=list(MATRIX),
)
def tests(session: nox.Session, entry: str) -> None:
    """The test suite on one megatron-core of the matrix (args go to pytest)."""
    python, megatron, paths = MATRIX[entry]
    _install_project(session, python, megatron)
    # One OpenMP thread per process: two workers of two threads each on two cores ran the
    # adapter tests at less than half the speed (152 s against 66 s for the same 456 tests).
    session.env["OMP_NUM_THREADS"] = "1"
    if entry == "mcore019":
        session.install("--no-deps", *FRAMEWORKS_NO_DEPS)
        session.install(*FRAMEWORKS)
        if not session.posargs:
            session.run("pytest", "--doctest-modules", "mtp_hooks", *PLUGIN_PACKAGES)
    session.run("pytest", *PARALLEL, *(session.posargs or paths))


@nox.session(python="3.10")
def core(session: nox.Session) -> None:
    """The core tests, and those of mtp-hooks-drafting, without torch or megatron-core, on the
    oldest Python and pluggy allowed."""
    session.install("-e", ".[test]", HYPOTHESIS, *CORE_FLOOR, "plugins/mtp-hooks-drafting")
    session.run("pytest", *(session.posargs or ["tests/core", "tests/drafting"]))


@nox.session(python="3.12")
def wheels(session: nox.Session) -> None:
    """The sdist and wheel of the library and of each plugin, built as a user would build them;
    each wheel installed into a clean environment of its own, imported, and the plugins listed.

    mtp-hooks is not on the package index, so a wheel's ``mtp-hooks`` requirement is met by the
    wheel built here (given by path), never by whatever the index holds under that name.
    """
    import glob

    tmp = session.create_tmp()
    dist = os.path.join(tmp, "dist")
    session.run("rm", "-rf", dist, external=True)
    for path in [".", *PLUGINS]:
        session.run("uv", "build", "--quiet", "--out-dir", dist, path, external=True)
    built = sorted(os.path.basename(p) for p in glob.glob(f"{dist}/*"))
    session.log(f"built: {', '.join(built)}")
    wheels = sorted(glob.glob(f"{dist}/*.whl"))
    if len(wheels) != 1 + len(PLUGINS) or len(built) != 2 * len(wheels):
        session.error(f"expected an sdist and a wheel of mtp-hooks and each plugin, got {built}")
    (core,) = glob.glob(f"{dist}/mtp_hooks-*.whl")
    for wheel in wheels:
        module = os.path.basename(wheel).split("-")[0]
        env = os.path.join(tmp, f"env-{module}")
        session.run("uv", "venv", "--quiet", "--python", "3.12", env, external=True)
        python = os.path.join(env, "bin", "python")
        pair = [wheel] if wheel == core else [core, wheel]
        session.run("uv", "pip", "install", "--quiet", "--python", python, *pair, external=True)
        session.run(python, "-c", f"import {module}; print({module}.__name__, 'imports')",
                    external=True)  # fmt: skip
        session.run(os.path.join(env, "bin", "mtp-hooks"), "plugins", external=True)


@nox.session(python="3.12")
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install(RUFF)
    paths = ["mtp_hooks", "plugins", "tests", "benchmarks", "examples", "scripts"]
    paths += ["noxfile.py", "conftest.py"]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session(python="3.12")
def types(session: nox.Session) -> None:
    """mypy --strict on mtp_hooks and the plugins ([tool.mypy] in pyproject.toml)."""
    _install_project(session, "3.12", MATRIX["mcore019"][1])
    session.install(MYPY)
    session.run("mypy")


@nox.session(python="3.12")
def docs(session: nox.Session) -> None:
    """The docs site (docs/: MyST pages and the API reference), built with Sphinx; any warning
    fails it."""
    session.install(SPHINX, MYST, "-e", ".", "plugins/mtp-hooks-drafting")
    out = "docs/_build/html"
    session.run("sphinx-build", "-W", "--keep-going", "-q", "-b", "html", "docs", out)
    # Every page's footer names the copyright holder (conf.py reads it from pyproject.toml).
    session.run(
        "python", "-c",
        "import sys, pathlib; page = pathlib.Path(sys.argv[1]).read_text(); "
        "sys.exit(0 if 'mtp-hooks developers' in page and '&#169;.' not in page "
        "else 'the footer names no copyright holder')",
        f"{out}/index.html",
    )  # fmt: skip
    # The API page's text names no private module (mtp_hooks._phases.Phase): Sphinx prints one
    # where it falls back to a signature's raw text, and users import from the public modules.
    session.run(
        "python", "-c",
        "import re, sys, pathlib; page = pathlib.Path(sys.argv[1]).read_text(); "
        "text = re.sub(r'<[^>]+>', '', page); "
        "private = sorted(set(re.findall(r'mtp_hooks\\._\\w+', text))); "
        "sys.exit(f'the API page names private modules: {private}' if private else 0)",
        f"{out}/api.html",
    )  # fmt: skip
    session.log(f"docs site: {out}/index.html")
