"""What an engine is: a class with one method per phase (matrix/phases.py PHASE_NAMES), the
settings it derives from a precision in its library's own terms, and the clean-up of
whatever global state that library keeps.

A new engine is one file in matrix/engines/ that subclasses Engine and calls register()
(plus its library in pyproject.toml); a user's engine registers from their plugin.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from matrix.phases import PHASE_NAMES, CellState
from matrix.precisions import Precision, dtype_name
from matrix.registry import Registry


@dataclass(frozen=True)
class Unsupported:
    """An engine cannot express a precision: its cells skip with this reason ("Requires: [...]")."""

    reason: str


def run_tagged(call, tracker):
    """Run a library call that spans several phases (Trainer.train(), Lightning's fit()); an
    exception is tagged with the phase the tracker last saw, so run_cell records that phase."""
    try:
        return call()
    except Exception as exc:
        exc.matrix_phase = tracker.phase
        raise


class Engine(abc.ABC):
    """One value of the engine axis. Subclasses define a method per phase name (train_steps,
    mid_training_eval, checkpoint_save, checkpoint_reload, resumed_step; evaluate), each taking
    the cell's CellState, and derive_settings()."""

    name: str
    axis_position: int  # place in the axis' order (a user's engine: after the built-in ones)
    description: str
    # Variant fields (matrix/variants.py) the engine does not implement: exploration keeps
    # them at the grid's value for this engine. Micro-batch accumulation is wired only where
    # an engine says so.
    fixed_variant_fields: tuple[str, ...] = ("grad_accumulation",)
    distributed = False  # True: the engine runs on several ranks and reduces gradients across them

    def phases(self, mode: str) -> dict:
        """Phase name -> bound method, for every phase of the mode."""
        missing = [name for name in PHASE_NAMES[mode] if not callable(getattr(self, name, None))]
        if missing:
            raise TypeError(f"engine {self.name!r} has no method for the {mode} phase(s) {', '.join(missing)}")
        return {name: getattr(self, name) for name in PHASE_NAMES[mode]}

    @abc.abstractmethod
    def derive_settings(self, precision: Precision) -> dict | Unsupported:
        """What `precision` (its autocast dtype, grad scaler, weights dtype, gradient dtype and
        accumulation) is called in this engine's library, or Unsupported(reason). The weights
        dtype itself is set by the cell in every engine (Precision.weights_from)."""

    def derive_or_refuse(self, precision: Precision) -> dict | Unsupported:
        if precision.reduce_dtype is not None and not self.distributed:
            return Unsupported(
                f"Requires: [gradients reduced across ranks, in {dtype_name(precision.reduce_dtype)}] "
                f"(the {self.name} engine runs one process)"
            )
        return self.derive_settings(precision)

    def settings(self, precision: Precision) -> dict:
        derived = self.derive_or_refuse(precision)
        return {"unsupported": derived.reason} if isinstance(derived, Unsupported) else derived

    def unsupported_reason(self, precision: Precision) -> str | None:
        derived = self.derive_or_refuse(precision)
        return derived.reason if isinstance(derived, Unsupported) else None

    def device_skip_reason(self, device) -> str | None:
        """Why this engine cannot run on a device of the device axis here, or None."""
        return None

    def precision_device_skip_reason(self, precision: Precision, device) -> str | None:
        """Why this engine's library refuses a precision on a device of the axis here, in the
        library's own words, or None (DeepSpeed asks its accelerator)."""
        return None

    def kind_skip_reason(self, kind) -> str | None:
        """Why this engine cannot drive a model kind ("Requires: [...] (...)"), or None."""
        return None

    def cleanup(self, state: CellState) -> None:
        """Reset the library's global state after a cell (the torch engine keeps none)."""
        return None


ENGINES: Registry[Engine] = Registry("engine", Engine)
register = ENGINES.register


def one_switch_unsupported(engine: str, what: str, precision: Precision) -> Unsupported | None:
    """Why an engine whose library takes one mixed-precision switch (accelerate, the Trainer,
    Lightning) cannot be told `precision`, or None. Such a library keeps gradients in the
    weights' dtype, steps once per micro-batch, and ties the grad scaler to fp16 autocast."""
    import torch

    if precision.grad_dtype is not None:
        return Unsupported(f"Requires: [{what} for gradients in another dtype than the weights]")
    if precision.grad_accumulation > 1:
        return Unsupported(f"Requires: [micro-batch accumulation wired into the {engine} engine]")
    if precision.grad_scaler != (precision.autocast_dtype == torch.float16):
        has = "with" if precision.grad_scaler else "without"
        autocast = dtype_name(precision.autocast_dtype) if precision.autocast_dtype else "no"
        return Unsupported(f"Requires: [{what} for {autocast} autocast {has} a grad scaler]")
    return None
