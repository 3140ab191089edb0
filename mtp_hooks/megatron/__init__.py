"""Megatron-Core adapters: gate the MTP block of ``GPTModel`` and ``HybridModel`` per forward call.

Importing this subpackage imports neither torch nor megatron-core; they are imported when a
model is attached.
"""

from __future__ import annotations

from ._attach import AttachHandle, attach, detach, freeze_mtp

__all__ = ["AttachHandle", "attach", "detach", "freeze_mtp"]
