"""What a policy's errors are told with: every error of one source at once, and did-you-mean
hints (the closest allowed spelling to a typo)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from ._errors import PolicyError

__all__ = ["Errors", "did_you_mean"]


def did_you_mean(given: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'skip'?)"`` for ``given="skp"``, or ``""`` when nothing is close.

    Matches case-insensitively (``"Train"`` suggests ``'train'``) and ignores surrounding
    spaces; a choice is close when difflib's ratio is at least 0.6, or, failing that, when one
    of the two begins with the other (``"evaluation"`` suggests ``'eval'``), for words of three
    letters or more.

    >>> did_you_mean("trian", ["train", "eval", "rollout"])
    " (did you mean 'train'?)"
    >>> did_you_mean("evaluation", ["train", "eval", "rollout"])
    " (did you mean 'eval'?)"
    >>> did_you_mean("xyz", ["train", "eval"])
    ''
    """
    options = {c.lower(): c for c in choices}
    word = given.strip().lower()
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    if not close and len(word) >= 3:
        close = [c for c in options if len(c) >= 3 and (c.startswith(word) or word.startswith(c))]
    return f" (did you mean {options[close[0]]!r}?)" if len(close) == 1 else ""


class Errors:
    """The errors of one policy source, gathered so that one ``PolicyError`` names them all:
    each item is checked in a ``with errors:`` block, which keeps its ``PolicyError`` and goes
    on; :meth:`raise_any` raises them together (one error as itself), each kept in
    ``PolicyError.errors`` with its own attributes."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.found: list[PolicyError] = []

    def __enter__(self) -> Errors:
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if isinstance(exc, PolicyError):
            exc.fill(source=self.source)
            self.found.extend(exc.errors or (exc,))  # an item's own errors, one by one
            return True  # go on to the next item
        return False

    def raise_any(self) -> None:
        if len(self.found) == 1:
            raise self.found[0]
        if self.found:
            listed = "\n".join(f"  {error}" for error in self.found)
            error = PolicyError(f"{len(self.found)} errors in this policy:\n{listed}")
            error.fill(source=self.source)
            error.errors = tuple(self.found)
            raise error
