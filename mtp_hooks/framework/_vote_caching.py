"""The caching protocol: which plugin votes a gate may reuse, and how to say they changed."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

from .. import _runtime
from .._plugin_checks import mark_cacheable

F = TypeVar("F", bound=Callable[..., Any])


def cacheable_vote(hook: F) -> F:
    """Declare a ``should_run_mtp`` implementation whose vote a gate may reuse.

    By default a gate asks every plugin that votes at every forward, since a vote may follow
    state mtp-hooks cannot see, such as the training step. A vote that depends only on the
    model, the phase, the model's role and state whose every change calls
    :func:`votes_changed` (as :meth:`RoleSettings.set` does) can be reused per model and phase
    instead; a decision is then cached only while every plugin that votes is declared so,
    and only where no vote read the forward call (its ``call`` argument): a vote may read it
    in one phase and be reused in the others.
    Works on functions and on methods, in either order with ``@hookimpl``.

    Example:
        >>> import mtp_hooks
        >>> from mtp_hooks.framework import cacheable_vote
        >>> @mtp_hooks.plugins.hookimpl
        ... @cacheable_vote
        ... def should_run_mtp(model, phase):
        ...     return phase != "eval"
    """
    return mark_cacheable(hook)


def votes_changed() -> None:
    """Tell mtp-hooks that state a :func:`cacheable_vote` depends on has changed: every gate
    asks the plugins again at its next forward."""
    _runtime.advance()


def framework_imported(package: str) -> bool:
    """Whether this process has imported ``package``: the test for a plugin's unconfigured
    defaults.

    A framework's worker processes import the framework before they build a model, and no
    other job does. A plugin that votes without being configured (in a worker, where the
    driver's config is out of reach) therefore votes only where this is true, and abstains
    everywhere else, so that installing it changes no other job. A plugin whose vote is a
    :func:`cacheable_vote` calls :func:`votes_changed` when the framework is imported, if the
    framework offers a hook for that (veRL's ``verl.plugins`` entry points).

    Example:
        >>> from mtp_hooks.framework import framework_imported
        >>> framework_imported("sys"), framework_imported("no_such_framework")
        (True, False)
    """
    return sys.modules.get(package) is not None
