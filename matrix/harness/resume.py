"""A resume must equal the run it interrupted: the checks of every engine's resumed step.

Users resume from a checkpoint and expect the run to go on as if it had never stopped. So a
training cell saves after step k (schedule.TRAIN_STEPS), restores a fresh run from the engine's
own checkpoint, takes step k+1 on it, and compares it with step k+1 of the same run uninterrupted
(matrix/harness/pipeline.py):

- the optimizer's state (step counts, moments) and the grad scaler's come back exactly: every
  tensor the optimizer held when the checkpoint was written is there after the restore, bit for
  bit (a silent loss of optimizer state, accelerate#3971's class, fails here in every engine);
- step k+1's loss (every attempt, where a grad scaler skips) and, after it, the parameters, the
  master weights and the optimizer's state agree with the uninterrupted run's: bit for bit where
  the device runs a step deterministically (Device.deterministic_steps), else within the
  precision's row of tolerances.RESUME_VS_UNINTERRUPTED. The record says which.

Both sides of step k+1 draw the same random numbers: a hand-written loop's step is taken from
schedule.RESUME_SEED on both sides; a library that runs its own loop (the Trainer, Lightning)
restores its random state from its checkpoint itself, and its uninterrupted run is the one run
that went on past the checkpoint.
"""

from __future__ import annotations

import torch

from matrix.checks import assertions as checks
from matrix.harness.cell_state import CellState, ResumePoint
from matrix.results.metrics import UNSET, Resume, Tolerance


def plain_scaler_state(state: dict | None) -> dict | None:
    """A loss scaler's state with its one-element tensors as numbers, comparable with ==."""
    if state is None:
        return None
    return {k: v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for k, v in state.items()}


def point_of(optimizer_state: dict[str, torch.Tensor], scaler_state: dict | None) -> ResumePoint:
    return ResumePoint(optimizer_state, plain_scaler_state(scaler_state))


def check_restored(state: CellState, optimizer_state: dict[str, torch.Tensor], scaler_state: dict | None) -> None:
    """The restored run's optimizer state and grad scaler state (as the engine reads them right
    after its restore) are what the interrupted run held at the save. Recorded in metrics.resume;
    a difference raises CheckpointMismatch."""
    point = state.point
    record = resume_record(state)
    record.optimizer_state_tensors = len(point.optimizer_state)
    try:
        checks.check_optimizer_state_restored(point.optimizer_state, optimizer_state)
        record.optimizer_state_restored = True
    except checks.CheckpointMismatch:
        record.optimizer_state_restored = False
        raise
    if point.scaler_state is not None:
        restored = plain_scaler_state(scaler_state)
        record.scaler_state_restored = restored == point.scaler_state
        if not record.scaler_state_restored:
            raise checks.CheckpointMismatch(
                "grad scaler state differs after reload", details=f"{point.scaler_state} before, {restored} after"
            )


def check_same_step(
    state: CellState,
    losses: list[float],
    after_resume: dict[str, torch.Tensor],
    uninterrupted_losses: list[float],
    after_uninterrupted: dict[str, torch.Tensor],
) -> None:
    """Step k+1 of the resumed run against the uninterrupted run's: its losses, then every
    named tensor after it. Bit for bit on a device that steps deterministically, else within
    the precision's tolerance row; recorded in metrics.resume, ResumeDiverged if not."""
    from matrix.checks.tolerances import resume_tolerance

    record = resume_record(state)
    deterministic = state.device_kind.deterministic_steps
    tolerance = None if deterministic else resume_tolerance(state.precision.compute_dtype)
    record.judged = (
        f"bit for bit ({state.device_kind.name} steps are deterministic)"
        if deterministic
        else f"within tolerance ({state.device_kind.name} kernels are not deterministic)"
    )
    record.tolerance = None if tolerance is None else Tolerance(**tolerance.loss.as_dict())
    record.tensor_tolerance = None if tolerance is None else Tolerance(**tolerance.tensors.as_dict())
    record.step_losses = losses
    record.uninterrupted_step_losses = uninterrupted_losses
    record.tensors_compared = len(after_uninterrupted)
    missing = sorted(set(after_uninterrupted) ^ set(after_resume))
    differing, worst, unlike = [], 0.0, {}
    for name, expected in after_uninterrupted.items():
        if name not in after_resume:
            continue
        got = after_resume[name].to(expected.device)
        if got.shape != expected.shape or got.dtype != expected.dtype:
            differing.append(name)
            unlike[name] = (
                f"{got.dtype} {tuple(got.shape)} resumed, {expected.dtype} {tuple(expected.shape)} uninterrupted"
            )
            continue
        if torch.equal(got, expected):  # bit for bit (no NaN): nothing differs, and the worst stays
            continue
        difference = (got.double() - expected.double()).abs()
        worst = max(worst, difference.max().item() if difference.numel() else 0.0)
        if tolerance is None:  # bit for bit, and not equal
            differing.append(name)
            continue
        allowed = tolerance.tensors.atol + tolerance.tensors.rtol * expected.double().abs()
        if not bool((difference <= allowed).all()):
            differing.append(name)
    record.tensors_max_abs_difference = worst
    record.tensors_differing = len(differing)
    if len(losses) != len(uninterrupted_losses):
        raise checks.ResumeDiverged(
            "the resumed step took another number of attempts than the uninterrupted run's",
            details=f"{len(losses)} vs {len(uninterrupted_losses)} (a grad scaler skipped other steps)",
        )
    pairs = list(zip(losses, uninterrupted_losses, strict=True))
    if tolerance is None:
        loss_differs = any(a != b for a, b in pairs)
    else:
        loss_differs = not all(tolerance.loss.allows(a, b) for a, b in pairs)
    record.loss_difference_abs = max((abs(a - b) for a, b in pairs), default=0.0)
    if loss_differs:
        raise checks.ResumeDiverged(
            "the resumed step's loss differs from the uninterrupted run's",
            details=f"{losses} vs {uninterrupted_losses}",
        )
    if missing:
        raise checks.ResumeDiverged(
            "the resumed run holds other tensors than the uninterrupted one",
            details=f"{len(missing)} differ in name, first {missing[0]}",
        )
    if unlike:  # another failure than a value that differs: the resumed run holds other tensors
        first = next(iter(unlike))
        raise checks.ResumeDiverged(
            "parameters or optimizer state after the resumed step differ in dtype or shape "
            "from the uninterrupted run's",
            details=f"{len(unlike)} of {len(after_uninterrupted)} tensors, first {first} ({unlike[first]}); "
            f"{len(differing) - len(unlike)} others differ in value, by at most {worst:.3g}",
        )
    if differing:
        raise checks.ResumeDiverged(
            "parameters or optimizer state after the resumed step differ from the uninterrupted run's",
            details=f"{len(differing)} of {len(after_uninterrupted)} tensors, first {differing[0]}, "
            f"max abs difference {worst:.3g}",
        )


def resume_record(state: CellState) -> Resume:
    if state.metrics.resume is UNSET:
        state.metrics.resume = Resume()
    return state.metrics.resume
