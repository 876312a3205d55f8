"""One registry shape for every axis that takes new values: register() adds an item under its
name, refusing a name another item already has; the registry reads like a mapping, in the axis'
order (each item's axis_position).

Each such axis has one (matrix/models, precisions.py, engines, devices); the modes are a fixed
tuple (modes.py), and the catalogue keeps its own list of files (catalogue.py register()).
Built-in items live in their own files and register themselves when their package loads
them (load_modules); a user's items register from a pytest plugin or its conftest. A registry
may also make items on demand from a name's prefix (provide(): hf:<model_type> model kinds).
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

    def __init__(self, what: str, kind: type, check=None) -> None:
        self.what, self.kind = what, kind
        # check(item): raises a RegistrationError for an item that is of the right type but that
        # the harness could not use (an engine whose runs it cannot see into)
        self._check = check
        self._items: dict[str, T] = {}
        self._registered_in: dict[str, str] = {}
        # prefix -> factory(name) -> item: names made on demand (the model axis' hf:<model_type>)
        self._providers: dict[str, object] = {}
        self._provided: dict[str, T] = {}
        self._every: dict[str, object] = {}

    def register(self, item: T, registered_in: str | None = None) -> T:
        if not isinstance(item, self.kind):
            raise RegistrationError(f"{self.what}: {item!r} is not a {self.kind.__name__}")
        name = getattr(item, "name", None)
        if not isinstance(name, str) or not name:
            raise RegistrationError(f"{self.what}: {type(item).__name__} has no name")
        if self._check is not None:
            self._check(item)
        taken = self._items.get(name)
        if taken is not None and taken is not item:
            raise RegistrationError(
                f"{self.what} {name!r} is already registered (by {type(taken).__module__}.{type(taken).__name__})"
            )
        self._items[name] = item
        # the module whose code called register(): importing it registers the item in another
        # process (the distributed engines' ranks)
        self._registered_in[name] = registered_in or sys._getframe(1).f_globals.get("__name__", "")
        return item

    def provide(self, prefix: str, factory, every=None) -> None:
        """Items named `prefix...` are made on demand by factory(name), the first time a name is
        looked up (a selection, a replayed record, a rank): `--model hf:qwen2` needs no register().
        The factory raises KeyError for a name it cannot make (its message: why); it is not a
        value of the axis until asked for by name, so the default grid never grows by itself.
        `every()`: all the names the factory makes here, for a pattern such as hf:* or hf:qwen*."""
        self._providers[prefix] = factory
        self._every[prefix] = every

    def matching(self, pattern: str) -> tuple[str, ...] | None:
        """The names a factory makes that match the shell-style `pattern` (hf:*, hf:qwen*), or
        None when no factory with a list of its names claims the pattern's prefix."""
        import fnmatch

        for prefix, every in self._every.items():
            if every is not None and pattern.startswith(prefix):
                return tuple(name for name in every() if fnmatch.fnmatchcase(name, pattern))
        return None

    def claims(self, name: str) -> bool:
        """Whether `name` is registered or has the prefix of a factory (without making it: a
        catalogue entry may name hf:xlstm in a process that never builds it)."""
        return name in self._items or name in self._provided or any(name.startswith(p) for p in self._providers)

    def provided(self) -> tuple[str, ...]:
        """The names made on demand so far, in the order first asked for."""
        return tuple(self._provided)

    def registered_in(self, name: str) -> str:
        """The module that registered `name` (its import registers it again elsewhere); for a
        name made on demand, the module of its factory (importing it installs the provider)."""
        if name in self._provided:
            return self._registered_in_provider(name)
        return self._registered_in[name]

    def _registered_in_provider(self, name: str) -> str:
        prefix = next(p for p in self._providers if name.startswith(p))
        return self._providers[prefix].__module__

    def unregister(self, name: str) -> None:
        """For tests that register an item of their own and must leave the registry as it was."""
        self._items.pop(name, None)
        self._provided.pop(name, None)

    def __getitem__(self, name: str) -> T:
        if name in self._items:
            return self._items[name]
        if name in self._provided:
            return self._provided[name]
        prefix = next((p for p in self._providers if isinstance(name, str) and name.startswith(p)), None)
        if prefix is None:
            raise KeyError(name)
        item = self._providers[prefix](name)  # KeyError: not a name it can make, and why
        if not isinstance(item, self.kind) or getattr(item, "name", None) != name:
            raise RegistrationError(f"{self.what}: the factory for {prefix!r} made {item!r} for {name!r}")
        self._provided[name] = item
        return item

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
