"""What a framework plugin builds with: config readers, vote caching, schedules, phase names.

Frameworks hand their config over as plain dicts, OmegaConf nodes or dataclasses; the readers
treat them alike and refuse bad values before any policy changes. A plugin that keeps its
settings in a :class:`RoleSettings` can declare its vote :func:`cacheable_vote`, and
:func:`check_phase` refuses a phase name from a config as the policy would. What speculative
decoding needs beside gating (the ``AcceptanceController``, an engine's acceptance, the draft
depth to use) is in the ``mtp-hooks-drafting`` distribution (``plugins/mtp-hooks-drafting``).

Everything is imported from here; the submodules are private.
"""

from __future__ import annotations

from .._phase_catalogue import normalize as _normalize
from .._phases import Phase
from ._config_reading import MISSING, RoleSettings, as_mapping, read_key
from ._schedules import loss_scale_schedule
from ._vote_caching import cacheable_vote, framework_imported, votes_changed

__all__ = [
    "MISSING",
    "RoleSettings",
    "as_mapping",
    "cacheable_vote",
    "check_phase",
    "framework_imported",
    "loss_scale_schedule",
    "read_key",
    "votes_changed",
]


def check_phase(name: object, where: str = "phase") -> Phase | str:
    """The canonical form of a phase name from a plugin's settings: a built-in :class:`Phase`,
    or a declared phase's name.

    Args:
        name: The name as given (``"eval"``, a :class:`Phase`, a declared phase).
        where: What the error names as the culprit (``"AcceptanceController watch"``).

    Raises:
        PolicyError: The phase is unknown; the error lists the known phases and says how to
            declare one.

    Example:
        >>> import mtp_hooks
        >>> from mtp_hooks.framework import check_phase
        >>> check_phase("eval")
        <Phase.EVAL: 'eval'>
        >>> try:
        ...     check_phase("evla", "my plugin's phase")
        ... except mtp_hooks.PolicyError as error:
        ...     print(str(error).split(";")[0])
        my plugin's phase: unknown phase 'evla' (did you mean 'eval'?)
    """
    return _normalize(name, where)
