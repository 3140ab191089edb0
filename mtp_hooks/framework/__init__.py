"""What a framework plugin builds with: config readers, vote caching, schedules, acceptance.

Frameworks hand their config over as plain dicts, OmegaConf nodes or dataclasses; the readers
treat them alike and refuse bad values before any policy changes. A plugin that keeps its
settings in a :class:`RoleSettings` can declare its vote :func:`cacheable_vote`. The acceptance
helpers read speculative decoding's acceptance from MTP metrics or megatron's engine, and
:class:`AcceptanceController` is a ready-made plugin that keeps the drafter trained while it
drafts well enough.

Everything is imported from here; the submodules are private.
"""

from __future__ import annotations

from ._acceptance_controller import AcceptanceController
from ._config_reading import MISSING, RoleSettings, as_mapping, read_key
from ._draft_depth import SpeculationAdvice, recommend_num_speculative_tokens
from ._engine_acceptance import acceptance_from_counts, acceptance_from_megatron
from ._schedules import loss_scale_schedule
from ._vote_caching import cacheable_vote, framework_imported, votes_changed

__all__ = [
    "AcceptanceController",
    "MISSING",
    "RoleSettings",
    "SpeculationAdvice",
    "acceptance_from_counts",
    "acceptance_from_megatron",
    "as_mapping",
    "cacheable_vote",
    "framework_imported",
    "loss_scale_schedule",
    "read_key",
    "recommend_num_speculative_tokens",
    "votes_changed",
]
