"""One registry shape for every axis and for the catalogue: register() adds an item under its
name, refusing a name another item already has; the registry reads like a mapping.

Each axis has one (matrix/models, precisions.py, engines, devices; catalogue.py for entries).
Built-in items live in their own files and register themselves when their package loads
them (load_modules); a user's items register from a pytest plugin or its conftest.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

try:  # pytest's usage error: a plugin whose register() fails stops pytest with one line
    from pytest import UsageError
except ImportError:  # the registries work without pytest (python -m matrix replay, repro)

    class UsageError(Exception):
        pass


T = TypeVar("T")
DEFAULT_POSITION = 100  # where a user's item goes in an axis' order: after the built-in ones


class RegistrationError(ValueError, UsageError):
    """register() of a name that another item already has, or of something that is not an item.
    Also pytest's usage error: a plugin module whose register() fails while pytest loads it
    stops pytest with this one line (exit status 4), not an internal error."""


class Registry(Mapping, Generic[T]):
    """name -> item, iterated by position, then in the order registered. An item's position is
    the `axis_position` its own class declares (a subclass of a built-in kind does not inherit
    its place), DEFAULT_POSITION if it declares none."""

    def __init__(self, what: str, kind: type) -> None:
        self.what, self.kind = what, kind
        self._items: dict[str, T] = {}
        self._registered_in: dict[str, str] = {}

    def register(self, item: T) -> T:
        if not isinstance(item, self.kind):
            raise RegistrationError(f"{self.what}: {item!r} is not a {self.kind.__name__}")
        name = getattr(item, "name", None)
        if not isinstance(name, str) or not name:
            raise RegistrationError(f"{self.what}: {type(item).__name__} has no name")
        taken = self._items.get(name)
        if taken is not None and taken is not item:
            raise RegistrationError(
                f"{self.what} {name!r} is already registered (by {type(taken).__module__}.{type(taken).__name__})"
            )
        self._items[name] = item
        # the module whose code called register(): importing it registers the item in another
        # process (the distributed engines' ranks)
        self._registered_in[name] = sys._getframe(1).f_globals.get("__name__", "")
        return item

    def registered_in(self, name: str) -> str:
        """The module that registered `name` (its import registers it again elsewhere)."""
        return self._registered_in[name]

    def unregister(self, name: str) -> None:
        """For tests that register an item of their own and must leave the registry as it was."""
        self._items.pop(name, None)

    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        ordered = sorted(enumerate(self._items.values()), key=lambda p: (position_of(p[1]), p[0]))
        return iter([item.name for _, item in ordered])

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.what}: {', '.join(self)})"


def position_of(item) -> int:
    return vars(type(item)).get("axis_position", DEFAULT_POSITION)


def load_modules(package: str, skip: tuple[str, ...] = ("base",)) -> None:
    """Import every module of `package` (but `skip`): each built-in item's file registers it.
    A new built-in item is one new file."""
    module = importlib.import_module(package)
    for info in sorted(pkgutil.iter_modules(module.__path__), key=lambda i: i.name):
        if info.name not in skip and not info.name.startswith("_"):
            importlib.import_module(f"{package}.{info.name}")
