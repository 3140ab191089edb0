"""The ``verl.plugins`` entry point: ``import verl`` turns on mtp-hooks' auto-attach.

veRL loads every ``verl.plugins`` entry point when it is imported, in the driver and in each Ray
worker, and logs a plugin's import error at debug level only. This module therefore reports its
own failure loudly (a warning on stderr and in the log) and never raises into veRL.
``MTP_HOOKS_AUTO=0`` leaves auto-attach off.

It also tells mtp-hooks that ``verl`` is now imported: the plugin's worker defaults apply from
here on, so a decision a gate cached while the plugin abstained must be taken again.
"""

from __future__ import annotations

import logging
import os
import sys

_OFF = {"0", "false", "no", "off"}


def _start() -> None:
    try:
        import mtp_hooks.framework

        mtp_hooks.framework.votes_changed()
        if os.environ.get("MTP_HOOKS_AUTO", "").strip().lower() in _OFF:
            return
        mtp_hooks.auto_attach()
    except Exception as exc:  # veRL would swallow it at debug level
        message = (
            f"mtp-hooks-verl: auto-attach could not start ({type(exc).__name__}: {exc}); "
            "veRL models run without MTP policies"
        )
        print(f"warning: {message}", file=sys.stderr)
        logging.getLogger("mtp_hooks").warning(message)


_start()
