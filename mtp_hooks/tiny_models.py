"""Deprecated alias of :mod:`mtp_hooks.demo.tiny_models`, with a warning on import."""

import warnings

from .demo.tiny_models import *  # noqa: F403
from .demo.tiny_models import __all__  # noqa: F401

warnings.warn(
    "mtp_hooks.tiny_models moved to mtp_hooks.demo.tiny_models; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
