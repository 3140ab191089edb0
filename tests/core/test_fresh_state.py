"""Every test starts without any of the environment variables mtp-hooks reads.

The variables are found in the sources of ``mtp_hooks`` and ``plugins/``, so one added later
is checked too. The check runs in a pytest of its own, started with every variable set, with
the repository's root ``conftest.py`` loaded as the suite loads it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SET_BY_THE_FIXTURE = {"MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD": "1"}

INNER = """
import os

def test_no_variable_of_mtp_hooks_is_set():
    names = os.environ["NAMES_TO_CHECK"].split(",")
    left = {{n: os.environ[n] for n in names if os.environ.get(n) != {fixed!r}.get(n)}}
    assert left == {{}}
"""


def variables_read() -> set[str]:
    found: set[str] = set()
    for folder in ("mtp_hooks", "plugins"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in {".py", ".pth"}:
                found |= set(re.findall(r"MTP_HOOKS_[A-Z_]*[A-Z]", path.read_text()))
    return found


def test_the_fresh_state_fixture_clears_every_variable_mtp_hooks_reads(tmp_path):
    names = variables_read()
    assert {"MTP_HOOKS_POLICY", "MTP_HOOKS_AUTO", "MTP_HOOKS_CONFIG_POLL"} <= names
    (tmp_path / "test_inner.py").write_text(INNER.format(fixed=SET_BY_THE_FIXTURE))
    env = {**os.environ, **{name: "0" for name in names}, "NAMES_TO_CHECK": ",".join(names)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest"]
        + [str(tmp_path / "test_inner.py"), "--rootdir", str(tmp_path)],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:]
