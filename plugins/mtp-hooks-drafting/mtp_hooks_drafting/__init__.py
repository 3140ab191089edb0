"""mtp-hooks-drafting: the MTP drafter kept fresh, and the draft depth a rollout engine should use.

What speculative decoding with MTP needs beside gating, built on mtp-hooks' public API and
imported by nothing in mtp-hooks itself:

* :class:`AcceptanceController`, a plugin object that sets the training phase's MTP loss
  weight, or a skip, from the drafter's recent acceptance, reports a drafter that died
  (:class:`DeadDrafterWarning`) and advises how many tokens to draft;
* :func:`acceptance_from_counts` and :func:`acceptance_from_megatron`, a rollout engine's own
  acceptance counters as :class:`mtp_hooks.MTPMetrics`;
* :func:`recommend_num_speculative_tokens`, the number of tokens to draft with the best
  expected tokens/s, given the acceptance and the cost of an engine step.

Installing it changes nothing: it registers no entry point, and a controller acts only once
registered (``mtp_hooks.plugins.register(controller)``).
"""

from __future__ import annotations

from ._death import DeadDrafterWarning
from .controller import AcceptanceController
from .draft_depth import SpeculationAdvice, recommend_num_speculative_tokens
from .engine_acceptance import acceptance_from_counts, acceptance_from_megatron

__all__ = [
    "AcceptanceController",
    "DeadDrafterWarning",
    "SpeculationAdvice",
    "acceptance_from_counts",
    "acceptance_from_megatron",
    "recommend_num_speculative_tokens",
]
