"""One optimizer step as the torch loop takes it (the torch engine's, and the harness's own fp32 and
reference runs): autocast, the grad scaler, clipping, the step and whether it applied; a rank's
loss weighted by its share of the items the loss averages over; a run of steps."""

from __future__ import annotations

import torch

from matrix.checks import assertions as checks
from matrix.grid.schedule import MAX_STEP_ATTEMPTS
from matrix.harness.cell_state import CellState
from matrix.results.metrics import UNSET


def train_step(state: CellState, model, optimizer, scaler, max_grad_norm: float | None = None) -> tuple[float, bool]:
    """One optimizer step over the precision's micro-batches, as the precisions are defined:
    torch.autocast around the forward, the grad scaler around backward and step. In a group,
    each rank on its rows, its loss weighted by its share of the batch's items (the ranks'
    averaged gradients are then the whole batch's) and a scaler's skip decided alike on every
    rank. Returns (the whole batch's mean loss, step applied)."""
    group = state.group
    rows = group.rows(state.batch)
    optimizer.zero_grad(set_to_none=True)
    accumulation = state.precision.grad_accumulation
    losses = []
    for _ in range(accumulation):
        with state.autocast():
            loss = state.kind.loss(model, rows) / accumulation
        losses.append(checks.check_finite_loss(loss, "training loss") * accumulation)
        if group.distributed:
            if state.metrics.rank_first_step_loss is UNSET:
                state.metrics.rank_first_step_loss = losses[-1]
            loss = loss * loss_weight(state, rows)
        (loss if scaler is None else scaler.scale(loss)).backward()
        # read after backward: FSDP2 swaps a module's parameters between sharded and unsharded
        # ones around its forward and backward, and one read before may be gone by the step
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if state.precision.grad_dtype is not None:
            # keep the accumulated gradients in grad_dtype, as SimpleTuner's
            # --gradient_precision does between micro-steps
            for _, p in named:
                if p.grad is not None and p.grad.dtype != state.precision.grad_dtype:
                    p.grad.data = p.grad.data.to(state.precision.grad_dtype)
    value = sum(losses) / len(losses)
    if scaler is None:
        checks.check_finite_gradients(named)
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], max_grad_norm)
        optimizer.step()
        applied = True
    else:
        scaler.unscale_(optimizer)  # GradScaler refuses fp16 gradients here, by its own rule
        if max_grad_norm:  # clipped unscaled, as the libraries clip
            torch.nn.utils.clip_grad_norm_([p for _, p in named], max_grad_norm)
        overflow = group.any(bool(checks.nonfinite_gradients(named)))  # such a step is skipped by design
        scaler.step(optimizer)
        scaler.update()
        applied = not overflow
    checks.check_finite_parameters(named, "after the optimizer step")
    return group.mean(value, state.kind.loss_items(rows)), applied


def loss_weight(state: CellState, rows: dict) -> float:
    """What a rank's loss on its rows is multiplied by before backward, so that the ranks'
    gradients, averaged, are the gradient of the whole batch's mean loss."""
    return state.kind.loss_items(rows) * state.group.world_size / state.kind.loss_items(state.batch)


def take_steps(step, steps: int) -> tuple[list[float], list[int]]:
    """Call step() -> (loss, applied) until `steps` optimizer steps were applied: every attempt's
    loss, and the attempts (0-based) the grad scaler skipped."""
    losses, skipped = [], []
    while len(losses) - len(skipped) < steps:
        if len(losses) == MAX_STEP_ATTEMPTS:
            raise checks.NonFiniteValue(
                "gradients kept overflowing: the grad scaler skipped every step",
                details=f"{len(skipped)} of {len(losses)} attempts skipped",
            )
        loss, applied = step()
        if not applied:
            skipped.append(len(losses))
        losses.append(loss)
    return losses, skipped
