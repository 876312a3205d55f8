"""What an engine provides: one function per phase name (matrix/phases.py PHASE_NAMES), the
settings a precision becomes in the engine's own terms (matrix/engines/settings.py), and the
clean-up of whatever global state the engine's library keeps."""

from __future__ import annotations

import abc
from collections.abc import Callable

from matrix.engines.settings import ENGINE_SETTINGS, Unsupported
from matrix.phases import PHASE_NAMES, CellState
from matrix.precisions import Precision

Phase = Callable[[CellState], None]


def run_tagged(call, tracker):
    """Run a library call that spans several phases (Trainer.train(), Lightning's fit()); an
    exception is tagged with the phase the tracker last saw, so run_cell records that phase."""
    try:
        return call()
    except Exception as exc:
        exc.matrix_phase = tracker.phase
        raise


class Engine(abc.ABC):
    name: str
    description: str
    # one function per phase name, in PHASE_NAMES order (functions named after their phase)
    train_phases: tuple[Phase, ...]
    eval_phases: tuple[Phase, ...]
    # Variant fields (matrix/variants.py) the engine does not implement: exploration keeps
    # them at the grid's value for this engine. Micro-batch accumulation is wired only where
    # an engine says so.
    fixed_variant_fields: tuple[str, ...] = ("grad_accumulation",)

    def phases(self, mode: str) -> dict[str, Phase]:
        """Phase name -> function, for every phase of the mode."""
        functions = self.train_phases if mode == "train" else self.eval_phases
        table = {function.__name__: function for function in functions}
        if tuple(table) != PHASE_NAMES[mode]:
            raise ValueError(f"{self.name}: {mode} phases {tuple(table)} are not {PHASE_NAMES[mode]}")
        return table

    def settings(self, precision: Precision) -> dict:
        entry = ENGINE_SETTINGS[precision.name][self.name]
        return {"unsupported": entry.reason} if isinstance(entry, Unsupported) else dict(entry)

    def unsupported_reason(self, precision: Precision) -> str | None:
        entry = ENGINE_SETTINGS[precision.name][self.name]
        return entry.reason if isinstance(entry, Unsupported) else None

    def cleanup(self, state: CellState) -> None:
        """Reset the library's global state after a cell (the torch engine keeps none)."""
        return None
