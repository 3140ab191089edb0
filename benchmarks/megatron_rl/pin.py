"""The Megatron-LM trees the benchmark runs, pinned by commit and by a digest of every file.

``megatron_lm.json`` names each pinned commit and the digest of the tree it gives (``git
archive COMMIT`` without the folders listed under ``excluded``, which the run never reads). The
launcher refuses a tree whose digest is not pinned: that is the check that Megatron-LM's files
are byte for byte those of the commit::

    python pin.py DIR          # prints DIR's digest
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

PINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_lm.json")
SKIPPED = {"__pycache__"}  # written by Python itself when the tree is imported
SKIPPED_SUFFIXES = (".pyc", ".so", ".o")  # megatron builds its dataset helpers in place


def tree_digest(root: str) -> str:
    """sha256 over every file's path (relative, '/'-separated) and sha256, in sorted order."""
    lines = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED)
        for name in files:
            if name.endswith(SKIPPED_SUFFIXES):
                continue
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            lines.append(f"{os.path.relpath(path, root).replace(os.sep, '/')} {digest}\n")
    return hashlib.sha256("".join(sorted(lines)).encode()).hexdigest()


def pinned() -> list[dict[str, str]]:
    """The pinned trees: ``commit``, ``name`` and ``digest`` each."""
    with open(PINS) as f:
        return list(json.load(f)["trees"])


def check(root: str) -> dict[str, str]:
    """The pin that ``root`` matches; raises ``SystemExit`` naming the digest if none does."""
    digest = tree_digest(root)
    for pin in pinned():
        if pin["digest"] == digest:
            return pin
    raise SystemExit(
        f"{root}: tree digest {digest} is not pinned in {PINS}; this benchmark runs Megatron-LM "
        "unedited: unpack the pinned commit's archive (run.sh shows how) and run it as it is"
    )


if __name__ == "__main__":
    print(tree_digest(sys.argv[1]))
