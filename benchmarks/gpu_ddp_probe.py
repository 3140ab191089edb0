"""Probe what happens under Megatron DDP when mtp-hooks is attached to the bare model.

Attaching the bare model (not the DDP wrapper) can give MTP parameters zero gradients (found
through ``main_grad``) but cannot finish DDP's param all-gathers. This script runs that case
and the DDP-wrapper case for three steps with ``overlap_param_gather=True`` and prints what
happened: at first an ``AssertionError`` a step later, now an up-front
``UnsupportedModelError``.
The outcomes are recorded in docs/distributed.md.

Run on a GPU: ``python benchmarks/gpu_ddp_probe.py``.
"""

from __future__ import annotations

import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "gpu")]
os.environ["MTP_HOOKS_DISABLE_PLUGIN_AUTOLOAD"] = "1"

import test_megatron_ddp as t  # noqa: E402

import mtp_hooks  # noqa: E402
from mtp_hooks.demo import tiny_models  # noqa: E402

tiny_models.init_single_process()
for attach_inner in (False, True):
    mtp_hooks.testing.reset()
    tiny_models.reset_mtp_loss_tracker(device="cuda")
    try:
        losses, _, _ = t.train("skip", attach_inner=attach_inner)
        print(f"attach_inner={attach_inner}: OK, losses={losses}")
    except Exception as exc:  # report, do not hide
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        print(
            f"attach_inner={attach_inner}: {type(exc).__name__}: {exc!s:.200} "
            f"at {os.path.basename(frame.filename)}:{frame.lineno}"
        )
