"""The config a gated forward runs with: the model's own, with a few fields changed.

A gated call must not change the config object the model shares with its layers, and copying a
``TransformerConfig`` (some 300 fields) on every call would cost more than everything else a
gate does. So the call gets a *view*: an instance of a subclass of the config's class that shares
the config's attribute dictionary, so every other field is read from (and written to) the real
config exactly as without mtp-hooks, and that answers the changed fields, such as
``mtp_num_layers=None``, from its own slot through data descriptors (which Python consults
before the instance dictionary).

A view is an ``isinstance`` of the config's class and a dataclass with the same fields, of a
class named for it (``TransformerConfigView``). ``copy``, ``deepcopy``, ``pickle`` and
``dataclasses.replace`` turn it into a plain config object holding the changed values. A config
class whose instances have no ``__dict__``, or that defines ``__copy__``, gets a copy.
"""

from __future__ import annotations

import copy
from typing import Any

_VALUES = "_mtp_hooks_values"  # the view's slot: {changed field: its value}
Changes = tuple[tuple[str, Any], ...]  # (field, value) pairs, hashable: a cache key


class _Changed:
    """The data descriptor a view class puts on the changed field. A write during the forward
    stays in the view, as it would in a copy; :class:`Views` then makes a fresh one."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, view: Any, owner: type | None = None) -> Any:
        return self if view is None else getattr(view, _VALUES)[self.name]

    def __set__(self, view: Any, value: Any) -> None:
        getattr(view, _VALUES)[self.name] = value


def _reduce(view: Any) -> tuple[Any, tuple[Any, ...]]:
    base = type(view)._mtp_hooks_base[0]
    return _plain_copy, (base, {**vars(view), **getattr(view, _VALUES)})


def _plain_copy(cls: type, state: dict[str, Any]) -> Any:
    """A plain ``cls`` object holding ``state`` (no ``__init__``, as ``copy.copy`` does)."""
    new: Any = object.__new__(cls)
    new.__dict__.update(state)
    return new


def _build_base(view_class: type, *args: Any, **kwargs: Any) -> Any:
    """A plain config of the view class's base class, built from ``args`` and ``kwargs``."""
    base: type = view_class._mtp_hooks_base[0]  # type: ignore[attr-defined]
    return base(*args, **kwargs)


_classes: dict[tuple[type, tuple[str, ...]], type | None] = {}  # (class, fields) -> view class


def _view_class(cls: type, names: tuple[str, ...]) -> type | None:
    attributes = dir(cls)
    if "__dict__" not in attributes or "__copy__" in attributes:
        return None
    namespace = {
        **{name: _Changed(name) for name in names},
        "__slots__": (_VALUES,),
        "__module__": __name__,
        "__qualname__": f"{cls.__qualname__}View",
        "__reduce__": _reduce,
        # Calling the view class (dataclasses.replace does) builds the config's own class.
        # Views themselves are made with object.__new__, and __class__ stays the view class:
        # torch.compile reads fields through type(), and must see the changed one.
        "__new__": _build_base,
        "_mtp_hooks_base": (cls, names),
        "__doc__": f"A {cls.__name__} whose {', '.join(names)} differ for one gated forward.",
    }
    return type(f"{cls.__name__}View", (cls,), namespace)


def config_view(config: Any, changes: Changes) -> Any:
    """``config`` as one forward sees it with the ``(field, value)`` pairs of ``changes`` set.

    Example:
        >>> import dataclasses
        >>> @dataclasses.dataclass
        ... class Config:
        ...     mtp_num_layers: int | None = 1
        ...     hidden_size: int = 8
        >>> shared = Config()
        >>> view = config_view(shared, (("mtp_num_layers", None),))
        >>> view.mtp_num_layers, view.hidden_size, isinstance(view, Config)
        (None, 8, True)
        >>> shared.hidden_size = 16
        >>> view.hidden_size, shared.mtp_num_layers
        (16, 1)
    """
    key = (type(config), tuple(name for name, _ in changes))
    try:
        cls = _classes[key]
    except KeyError:
        cls = _classes[key] = _view_class(*key)
    if cls is None:
        new = copy.copy(config)
        for name, value in changes:
            setattr(new, name, value)
        return new
    view: Any = object.__new__(cls)
    object.__setattr__(view, "__dict__", config.__dict__)
    object.__setattr__(view, _VALUES, dict(changes))
    return view


class Views:
    """The views of one model's config that its gate hands out (under its lock), reused while
    the config object and the changed values stay the same: a view reads every other field
    live, so it never goes stale."""

    def __init__(self) -> None:
        self.config: Any = None
        self.views: dict[Changes, tuple[Any, dict[str, Any]]] = {}

    def get(self, config: Any, changes: Changes) -> Any:
        """:func:`config_view` of ``config``, made at most once per (config, changes)."""
        if config is not self.config:
            self.config, self.views = config, {}
        found = self.views.get(changes)
        if found is not None and getattr(found[0], _VALUES) == found[1]:  # not written since
            return found[0]
        view = config_view(config, changes)
        if hasattr(type(view), "_mtp_hooks_base"):  # a copy goes stale: never reused
            self.views[changes] = (view, dict(changes))
        return view
