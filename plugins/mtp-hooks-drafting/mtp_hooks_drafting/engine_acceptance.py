"""A rollout engine's speculative-decoding acceptance, as :class:`mtp_hooks.MTPMetrics`.

A rollout engine that drafts with the model's MTP layers counts, per draft position, how many
drafts it proposed and how many it accepted. :func:`acceptance_from_counts` and
:func:`acceptance_from_megatron` turn those counters into the :class:`mtp_hooks.MTPMetrics` that
:class:`~mtp_hooks_drafting.AcceptanceController` consumes, so the controller can follow the
engine's own acceptance instead of (or beside) teacher-forced figures.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from mtp_hooks import MTPMetrics, PolicyError

from ._checks import count, fraction

__all__ = ["acceptance_from_counts", "acceptance_from_megatron"]


def acceptance_from_counts(
    drafts: int | Sequence[int], accepted_per_position: Sequence[int]
) -> MTPMetrics:
    """The acceptance of a rollout engine's drafts, from its counters, as :class:`MTPMetrics`.

    Engines count acceptance *chained*: a draft at position ``k`` counts as accepted only when
    the drafts at positions ``1..k`` were all accepted (greedy or rejection-sampling
    verification stops at the first miss). megatron-core's ``DynamicInferenceEngine``, vLLM
    (``spec_decode_num_drafts`` and ``spec_decode_num_accepted_tokens_per_pos``) and SGLang
    count this way.

    Args:
        drafts: How many times a draft was proposed at each position: one int for all
            positions (the number of verify steps that drafted, per request), or one per
            position.
        accepted_per_position: Per position ``k`` (index 0 is the first draft), how many of
            those drafts were accepted together with every draft before them.

    Returns:
        ``chain_acceptance[k]`` is ``accepted[k] / drafts[k]``; ``accepted_length`` their sum
        (the mean number of drafted tokens a verify step accepts); ``acceptance[k]`` the
        fraction of drafts at position ``k`` that were right among those checked (the earlier
        ones accepted); ``tokens`` the drafts per position. An engine has no loss, so ``loss``
        is empty, and ``forwards`` is 0.

    Raises:
        PolicyError: A count is not an int >= 0, more drafts are accepted than proposed, or a
            later position accepts more than an earlier one (not chained counts).

    Example:
        >>> from mtp_hooks_drafting import acceptance_from_counts
        >>> m = acceptance_from_counts(200, [150, 90])
        >>> m.chain_acceptance, m.accepted_length, m.acceptance
        ((0.75, 0.45), 1.2, (0.75, 0.6))
    """
    where = "acceptance_from_counts"
    if isinstance(accepted_per_position, (str, bytes)) or not isinstance(
        accepted_per_position, Sequence
    ):
        raise PolicyError(
            f"{where}: accepted_per_position must be a sequence of counts, one per draft "
            f"position, not {type(accepted_per_position).__name__}"
        )
    if not accepted_per_position:
        raise PolicyError(
            f"{where}: no draft positions (accepted_per_position is empty); give one count per "
            "position the engine drafts, or call it only once the engine speculates (k >= 1)"
        )
    accepted = [
        count(a, f"{where}: accepted_per_position[{k}]")
        for k, a in enumerate(accepted_per_position)
    ]
    if isinstance(drafts, (str, bytes)):
        raise PolicyError(f"{where}: drafts must be an int or a sequence of ints, not {drafts!r}")
    if isinstance(drafts, Sequence):
        proposed = [count(d, f"{where}: drafts[{k}]") for k, d in enumerate(drafts)]
        if len(proposed) != len(accepted):
            raise PolicyError(
                f"{where}: {len(proposed)} draft counts for "
                f"{len(accepted)} positions; give one per position, or one int for all"
            )
    else:
        proposed = [count(drafts, f"{where}: drafts")] * len(accepted)
    for k, (a, d) in enumerate(zip(accepted, proposed, strict=True)):
        if a > d:
            raise PolicyError(f"{where}: position {k + 1} accepted {a} of {d} drafts")
        if k and a > accepted[k - 1]:
            raise PolicyError(
                f"{where}: position {k + 1} accepted {a}, more than position "
                f"{k} ({accepted[k - 1]}); give chained counts (a draft counts only when the "
                "drafts before it were accepted too)"
            )
    chain = tuple(a / d if d else 0.0 for a, d in zip(accepted, proposed, strict=True))
    checked = [proposed[0], *accepted[:-1]]  # positions exist: refused above otherwise
    acceptance = tuple(a / c if c else 0.0 for a, c in zip(accepted, checked, strict=True))
    return MTPMetrics(
        loss=(),
        acceptance=acceptance,
        tokens=tuple(proposed),
        forwards=0,
        chain_acceptance=chain,
        accepted_length=sum(chain),
    )


def acceptance_from_megatron(metrics: Mapping[str, Any]) -> MTPMetrics:
    """:func:`acceptance_from_counts` from the metrics dict of megatron's inference engine.

    ``DynamicInferenceEngine`` reports ``spec_decode_acceptance_rate_pos{N}`` (percent, chained,
    ``N`` from 1), ``spec_decode_tokens_proposed`` (summed over positions) and
    ``spec_decode_tokens_accepted``, each under an ``inference/`` prefix in its logged dict;
    both spellings are read. The drafts per position are the proposed total over the number
    of positions (exact unless stop words cut drafts short).

    Raises:
        PolicyError: A key is missing, a rate is outside [0, 100], or the rates do not fall
            with the position.

    Example:
        >>> from mtp_hooks_drafting import acceptance_from_megatron
        >>> m = acceptance_from_megatron({
        ...     "inference/spec_decode_acceptance_rate_pos1": 75.0,
        ...     "inference/spec_decode_acceptance_rate_pos2": 45.0,
        ...     "inference/spec_decode_tokens_proposed": 400,
        ...     "inference/spec_decode_tokens_accepted": 240})
        >>> m.chain_acceptance, m.tokens
        ((0.75, 0.45), (200, 200))
    """

    if not isinstance(metrics, Mapping):
        raise PolicyError(
            f"acceptance_from_megatron: the engine's metrics are a dict, not "
            f"{type(metrics).__name__}; pass the dict DynamicInferenceEngine reports"
        )

    def get(key: str) -> Any:
        for name in (f"inference/{key}", key):
            if name in metrics:
                return metrics[name]
        raise PolicyError(
            f"acceptance_from_megatron: no {key!r} in the engine's metrics; pass the dict of a "
            "DynamicInferenceEngine built with num_speculative_tokens > 0, after it drafted"
        )

    rates: list[float] = []
    while any(
        f"{p}spec_decode_acceptance_rate_pos{len(rates) + 1}" in metrics for p in ("inference/", "")
    ):
        rate = get(f"spec_decode_acceptance_rate_pos{len(rates) + 1}")
        if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
            raise PolicyError(f"acceptance_from_megatron: rate pos{len(rates) + 1} is {rate!r}")
        rates.append(fraction(rate / 100.0, f"acceptance_from_megatron: pos{len(rates) + 1}"))
        if len(rates) > 1 and rates[-1] > rates[-2]:  # checked before rounding to counts
            raise PolicyError(
                f"acceptance_from_megatron: the rate at pos{len(rates)} ({rate!r}%) is above "
                f"pos{len(rates) - 1}'s ({rates[-2] * 100.0!r}%); megatron's rates are chained, "
                "so they fall with the position: pass the engine's own metrics dict"
            )
    if not rates:
        get("spec_decode_acceptance_rate_pos1")  # raises, naming the key
    total = count(get("spec_decode_tokens_proposed"), "spec_decode_tokens_proposed")
    drafts = total // len(rates)
    return acceptance_from_counts(drafts, [round(rate * drafts) for rate in rates])
