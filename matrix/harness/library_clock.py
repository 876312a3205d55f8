"""The time a cell spends inside its engine's library calls: its floor.

A cell's `duration_s` holds the harness's work too (the references it compares with, the checks,
the copies it reads the run through). What the library itself costs is the time inside the
engine's protocol calls that do what a user's run does: start (wrap, shard, prepare), train,
evaluate, save, export, restore and close. `LibraryClock` stands in front of the engine and
adds the time of each outermost such call to the cell's `metrics.library_seconds`; a call made
from inside another (a Trainer callback that evaluates during train()) is counted once, in the
outer one. BENCHMARKS.md sets each engine's cell time beside this floor (matrix/tools/bench.py).
"""

from __future__ import annotations

import functools
from time import perf_counter

LIBRARY_CALLS = frozenset({"start", "train", "evaluate", "save", "export", "restore", "close"})


class LibraryClock:
    """The engine, with its library calls timed into `metrics.library_seconds`. Every other
    attribute is the engine's own."""

    def __init__(self, engine, metrics):
        self._engine = engine
        self._metrics = metrics
        self._depth = 0

    def __getattr__(self, name):
        found = getattr(self._engine, name)
        if name not in LIBRARY_CALLS or not callable(found):
            return found

        @functools.wraps(found)
        def timed(*args, **kwargs):
            self._depth += 1
            began = perf_counter()
            try:
                return found(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    spent = perf_counter() - began
                    before = self._metrics.library_seconds
                    self._metrics.library_seconds = spent + (before if isinstance(before, float) else 0.0)

        return timed

    @property
    def timed_engine(self):
        """The engine this clock stands in front of."""
        return self._engine

    def __repr__(self) -> str:
        return f"LibraryClock({self._engine!r})"
