"""The curves a training cell's losses are compared with step by step: the torch loop's own at the
same precision, and the fp32 twin's, computed from the same initial weights and batch
(matrix/harness/against_references.py record_curve judges them)."""

from __future__ import annotations

import torch

from matrix.grid.schedule import forward_seed, train_steps
from matrix.harness import measurements
from matrix.harness.cell_state import CellState
from matrix.harness.measurements import generators_kept, harness_forward
from matrix.harness.torch_step import take_steps, train_step
from matrix.results.metrics import CellMetrics

# (kind type, kind name, variant, precision, device, steps, initial weights) -> losses, or the
# reference's own failure (its signature text)
_REFERENCE_CURVES: dict[tuple, tuple[list[float] | None, str | None]] = {}


def reference_curve(state: CellState, precision) -> tuple[list[float] | None, str | None]:
    """The torch engine's training losses at each of the cell's first train_steps() applied steps in
    `precision` (the cell's own, or its fp32 twin): a fresh model on the cell's device, the whole
    batch in one process, AdamW at the cell's learning rate, the precision's autocast and grad
    scaler, each forward seeded as the cell's are (schedule.forward_seed), gradients clipped where the
    engine's library clips them (Engine.max_grad_norm). Once per process for a kind, precision,
    device, length and clipping; the global generators are left as they were.
    Returns (losses, None), or (None, the reference's own failure) where the torch engine itself
    fails to train there: that is the torch engine cell's finding, not this cell's."""
    import dataclasses

    from matrix.harness.cell_state import FirstForwardHooks
    from matrix.harness.group import SINGLE
    from matrix.models.initial_weights import current as initial_weights
    from matrix.results.signatures import signature_of

    steps = train_steps()
    kind = state.kind
    engine = state.engine
    key = (type(kind), kind.name, kind.variant, precision, str(state.device), steps, initial_weights())
    key += (engine.max_grad_norm, engine.decayed_parameters.__func__)  # the library's optimizer, replicated
    if key in _REFERENCE_CURVES:
        return _REFERENCE_CURVES[key]
    reference = dataclasses.replace(
        state,
        cell=dataclasses.replace(state.cell, precision=precision.name, engine="torch"),
        precision=precision,
        group=SINGLE,
        metrics=CellMetrics(),
        hooks=FirstForwardHooks(),
        compile_watch=None,
        steps_ended=0,
        loss_before_training=None,
    )
    applied, micro = 0, 0
    with harness_forward(state), generators_kept(state):
        try:
            model = reference.fresh_model()
            optimizer = reference.new_optimizer(model, state.engine.decayed_parameters(model))
            scaler = reference.new_grad_scaler()
            model.train()

            def seed(module, args):
                nonlocal micro
                torch.manual_seed(forward_seed(applied, micro))
                micro += 1

            model.register_forward_pre_hook(seed)

            def step():
                nonlocal applied, micro
                taken = train_step(reference, model, optimizer, scaler, engine.max_grad_norm)
                applied, micro = applied + taken[1], 0
                return taken

            losses, skipped = take_steps(step, steps)
            found = ([loss for attempt, loss in enumerate(losses) if attempt not in skipped], None)
        except Exception as exc:  # the torch engine's own failure: recorded as the reference's
            found = (None, signature_of("torch engine", exc).text)
    _REFERENCE_CURVES[key] = found
    return found


def _of_kind(cache: dict, kind) -> dict:
    """The entries of a cache keyed (kind type, kind name, variant, ...) that are `kind`'s."""
    return {key: value for key, value in cache.items() if key[:3] == (type(kind), kind.name, kind.variant)}


def measured_for(kind) -> dict:
    """What this process measured of `kind` on fresh models (its fresh measurements and reference
    curves), each under the key it was measured for: a rank takes them from its driver
    (remember_measured) rather than measure the same again."""
    return {"fresh": _of_kind(measurements._FRESH_MEASUREMENTS, kind), "curves": _of_kind(_REFERENCE_CURVES, kind)}


def remember_measured(measured: dict) -> None:
    """Take another process's measured_for() as this one's (a rank's, from its driver): each entry
    is used only where a cell asks for exactly its key."""
    measurements._FRESH_MEASUREMENTS.update(measured["fresh"])
    _REFERENCE_CURVES.update(measured["curves"])
