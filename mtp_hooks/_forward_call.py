"""The forward call a vote is asked about: what its caller passed, by the forward's names.

Some frameworks say per call whether MTP should train: veRL passes ``labels`` and a
``loss_mask`` to a forward exactly when its config trains MTP, and its draft for native
``HybridModel`` MTP passes the mask alone. A vote that reads the call can follow them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ForwardCall"]


class ForwardCall:
    """One forward call of an attached model, as :func:`~mtp_hooks.hookspecs.should_run_mtp`
    sees it through its ``call`` argument.

    Reading an argument makes the decision the call's own: the gate asks every plugin again at
    the next forward instead of reusing it, also where every vote is a
    :func:`~mtp_hooks.framework.cacheable_vote`. A vote that does not read the call costs
    nothing extra.

    Attributes:
        read: Whether a vote has read an argument of this call (``False`` until one does).

    Example:
        >>> from mtp_hooks import ForwardCall
        >>> call = ForwardCall(([1, 2],), {"loss_mask": None}, ("input_ids", "labels"))
        >>> call.argument("input_ids"), call.argument("labels"), call.argument("loss_mask")
        ([1, 2], None, None)
        >>> call.read
        True
    """

    __slots__ = ("_args", "_kwargs", "_names", "read")

    def __init__(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...]
    ) -> None:
        """``args`` and ``kwargs``: the call's positional and keyword arguments; ``names``: the
        forward's positional parameter names after ``self``, in order."""
        self._args = args
        self._kwargs = kwargs
        self._names = names
        self.read = False

    def argument(self, name: str, default: Any = None) -> Any:
        """What the call passed for the forward's parameter ``name``, by keyword or by
        position; ``default`` where it passed nothing for it (the forward's own default
        applies then)."""
        self.read = True
        if name in self._kwargs:
            return self._kwargs[name]
        if name in self._names:
            index = self._names.index(name)
            if index < len(self._args):
                return self._args[index]
        return default

    def __repr__(self) -> str:
        keywords = ", ".join(sorted(self._kwargs))
        return f"ForwardCall({len(self._args)} positional, keywords: {keywords or 'none'})"
