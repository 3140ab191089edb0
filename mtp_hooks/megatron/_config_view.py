"""The config a skipped or re-weighted forward runs with: the model's own, with one field changed.

A gated call must not change the config object the model shares with its layers, and copying a
``TransformerConfig`` (some 300 fields) on every call would cost more than everything else a
gate does. So the call gets a *view*: an instance of a subclass of the config's class that shares
the config's attribute dictionary, so every other field is read from (and written to) the real
config exactly as without mtp-hooks, and that answers the one changed field, such as
``mtp_num_layers=None``, from its own slot through a data descriptor (which Python consults
before the instance dictionary).

A view is an ``isinstance`` of the config's class and a dataclass with the same fields, of a
class named for it (``TransformerConfigView``). ``copy``, ``deepcopy``, ``pickle`` and
``dataclasses.replace`` turn it into a plain config object holding the changed value. A config
class whose instances have no ``__dict__``, or that defines ``__copy__``, gets a copy.
"""

from __future__ import annotations

import copy
from typing import Any

_VALUE = "_mtp_hooks_value"  # the view's slot: the changed field's value


class _Changed:
    """The data descriptor a view class puts on the changed field. A write during the forward
    stays in the view, as it would in a copy; :class:`Views` then makes a fresh one."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, view: Any, owner: type | None = None) -> Any:
        return self if view is None else getattr(view, _VALUE)

    def __set__(self, view: Any, value: Any) -> None:
        object.__setattr__(view, _VALUE, value)


def _reduce(view: Any) -> tuple[Any, tuple[Any, ...]]:
    base, name = type(view)._mtp_hooks_base
    return _plain_copy, (base, {**vars(view), name: getattr(view, _VALUE)})


def _plain_copy(cls: type, state: dict[str, Any]) -> Any:
    """A plain ``cls`` object holding ``state`` (no ``__init__``, as ``copy.copy`` does)."""
    new: Any = object.__new__(cls)
    new.__dict__.update(state)
    return new


def _build_base(view_class: type, *args: Any, **kwargs: Any) -> Any:
    """A plain config of the view class's base class, built from ``args`` and ``kwargs``."""
    base: type = view_class._mtp_hooks_base[0]  # type: ignore[attr-defined]
    return base(*args, **kwargs)


_classes: dict[tuple[type, str], type | None] = {}  # (config class, field) -> view class


def _view_class(cls: type, name: str) -> type | None:
    attributes = dir(cls)
    if "__dict__" not in attributes or "__copy__" in attributes:
        return None
    namespace = {
        name: _Changed(name),
        "__slots__": (_VALUE,),
        "__module__": __name__,
        "__qualname__": f"{cls.__qualname__}View",
        "__reduce__": _reduce,
        # Calling the view class (dataclasses.replace does) builds the config's own class.
        # Views themselves are made with object.__new__, and __class__ stays the view class:
        # torch.compile reads fields through type(), and must see the changed one.
        "__new__": _build_base,
        "_mtp_hooks_base": (cls, name),
        "__doc__": f"A {cls.__name__} whose {name} differs for one gated forward.",
    }
    return type(f"{cls.__name__}View", (cls,), namespace)


def config_view(config: Any, name: str, value: Any) -> Any:
    """``config`` as one forward sees it with field ``name`` set to ``value``.

    Example:
        >>> import dataclasses
        >>> @dataclasses.dataclass
        ... class Config:
        ...     mtp_num_layers: int | None = 1
        ...     hidden_size: int = 8
        >>> shared = Config()
        >>> view = config_view(shared, "mtp_num_layers", None)
        >>> view.mtp_num_layers, view.hidden_size, isinstance(view, Config)
        (None, 8, True)
        >>> shared.hidden_size = 16
        >>> view.hidden_size, shared.mtp_num_layers
        (16, 1)
    """
    key = (type(config), name)
    try:
        cls = _classes[key]
    except KeyError:
        cls = _classes[key] = _view_class(*key)
    if cls is None:
        new = copy.copy(config)
        setattr(new, name, value)
        return new
    view: Any = object.__new__(cls)
    object.__setattr__(view, "__dict__", config.__dict__)
    object.__setattr__(view, _VALUE, value)
    return view


class Views:
    """The views of one model's config that its gate hands out (under its lock), reused while
    the config object and the value stay the same: a view reads every other field live, so it
    never goes stale."""

    def __init__(self) -> None:
        self.config: Any = None
        self.views: dict[str, Any] = {}

    def get(self, config: Any, name: str, value: Any) -> Any:
        """:func:`config_view` of ``config``, made at most once per (config, name, value)."""
        if config is not self.config:
            self.config, self.views = config, {}
        view = self.views.get(name)
        if view is not None and getattr(view, name) == value:
            return view
        view = config_view(config, name, value)
        if hasattr(type(view), "_mtp_hooks_base"):  # a copy goes stale: never reused
            self.views[name] = view
        return view
