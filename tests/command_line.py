"""``mtp-hooks`` run as a user runs it: a subprocess of this Python, with none of the caller's
``MTP_HOOKS_*`` variables unless a test sets them."""

from __future__ import annotations

import os
import subprocess
import sys


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m mtp_hooks ARGS`` with ``env`` added to a copy of the environment."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MTP_HOOKS_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "mtp_hooks", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
    )
