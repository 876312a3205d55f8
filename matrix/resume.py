"""A resume must equal the run it interrupted: what every engine checks in its resumed_step.

Users resume from a checkpoint and expect the run to go on as if it had never stopped. So a
training cell saves after step k (TRAIN_STEPS), reloads into a fresh model and optimizer, takes
step k+1, and compares it with step k+1 of the same run uninterrupted:

- the optimizer's state (step counts, moments) and the grad scaler's come back exactly: every
  tensor the optimizer held when the checkpoint was written is there after the reload, bit for
  bit (a silent loss of optimizer state, accelerate#3971's class, fails here in every engine);
- step k+1's loss (every attempt, where a grad scaler skips) and, after it, the parameters and
  the optimizer's state agree with the uninterrupted run's: bit for bit where the device runs
  a step deterministically (Device.deterministic_steps), else within the precision's row of
  tolerances.RESUME_VS_UNINTERRUPTED. The record says which.

Both sides of step k+1 draw the same random numbers: a hand-written loop's step is taken from
RESUME_SEED on both sides; a library that runs its own loop (the Trainer, Lightning) restores
its random state from its checkpoint itself, and its uninterrupted run is the same run made again
from the start, without the interruption.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from matrix import checks
from matrix.phases import MAX_STEP_ATTEMPTS, snapshot_trainable
from matrix.results import metrics as typed
from matrix.results.metrics import given

RESUME_SEED = 20261125  # the global generator's seed before step k+1, on both sides
POINT_KEY = "resume_point"  # engine_state: what the run held when it saved


@dataclass
class ResumePoint:
    """What the interrupted run held when its checkpoint was written."""

    optimizer_state: dict[str, torch.Tensor]
    scaler_state: dict | None


@dataclass
class Continuation:
    """One side of step k+1: `step()` takes one optimizer step attempt -> (loss, applied);
    `tensors()` names the tensors compared after it (parameters, master weights, optimizer state)."""

    step: Callable[[], tuple[float, bool]]
    tensors: Callable[[], dict[str, torch.Tensor]]


def remember_point(state, optimizer, scaler_state: dict | None = None) -> None:
    """At the save: the optimizer's state tensors (this process's own shards; `optimizer`: the
    optimizer, or its state as an engine reads it) and the grad scaler's state, to compare with
    what the reload brings back."""
    tensors = optimizer if isinstance(optimizer, dict) else checks.optimizer_state(optimizer)
    state.engine_state[POINT_KEY] = ResumePoint(tensors, _plain(scaler_state))


def scaler_state(scaler) -> dict | None:
    """A torch GradScaler's state, None without one."""
    return None if scaler is None else scaler.state_dict()


def _plain(state: dict | None) -> dict | None:
    if state is None:
        return None
    return {k: v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for k, v in state.items()}


def check_restored(state, optimizer, restored_scaler_state: dict | None = None) -> None:
    """The reloaded optimizer (or its state, as the engine reads it) and grad scaler hold what the
    interrupted run held at the save. Recorded in metrics.resume; a difference raises
    CheckpointMismatch."""
    point: ResumePoint = state.engine_state[POINT_KEY]
    record = _record(state)
    record.optimizer_state_tensors = len(point.optimizer_state)
    try:
        checks.check_optimizer_state_restored(point.optimizer_state, optimizer)
        record.optimizer_state_restored = True
    except checks.CheckpointMismatch:
        record.optimizer_state_restored = False
        raise
    if point.scaler_state is not None:
        restored = _plain(restored_scaler_state)
        record.scaler_state_restored = restored == point.scaler_state
        if not record.scaler_state_restored:
            raise checks.CheckpointMismatch(
                "grad scaler state differs after reload", details=f"{point.scaler_state} before, {restored} after"
            )


@contextlib.contextmanager
def _seeded(state):
    with torch.random.fork_rng(devices=state.device_kind.rng_devices(state.device)):
        torch.manual_seed(RESUME_SEED)
        yield


def take_step(state, continuation: Continuation) -> list[float]:
    """Attempts of step k+1 until one is applied (a grad scaler may skip), from RESUME_SEED."""
    losses: list[float] = []
    with _seeded(state):
        while True:
            if len(losses) == MAX_STEP_ATTEMPTS:
                raise checks.NonFiniteValue(
                    "gradients kept overflowing: the grad scaler skipped every step",
                    details=f"{len(losses)} attempts of the resumed step skipped",
                )
            loss, applied = continuation.step()
            losses.append(loss)
            if applied:
                return losses


def record_random_numbers(state, how: str) -> None:
    _record(state).random_numbers = how


def check_resume(state, resumed: Continuation, uninterrupted: Continuation, optimizer, scaler_state=None) -> None:
    """A hand-written loop's resumed_step: the state restored (check_restored), then step k+1 on
    the reloaded run and on the interrupted one, from the same seed, compared (check_same_step).
    Both are measured before either check raises, so the record holds both."""
    failure = None
    try:
        check_restored(state, optimizer, scaler_state)
    except checks.CheckpointMismatch as mismatch:
        failure = mismatch
    record_random_numbers(state, f"seeded with {RESUME_SEED} before step k+1, on both sides")
    losses = take_step(state, resumed)
    state.metrics.resumed_losses = losses
    skipped = given(state.metrics.steps_skipped_by_grad_scaler, 0)
    state.metrics.steps_skipped_by_grad_scaler = skipped + len(losses) - 1
    after_resume = resumed.tensors()
    reference_losses = take_step(state, uninterrupted)
    try:
        check_same_step(state, losses, after_resume, reference_losses, uninterrupted.tensors())
    except checks.ResumeDiverged as diverged:
        failure = failure or diverged
    if failure is not None:
        raise failure


def check_library_resume(
    state,
    restored: tuple,
    losses: list[float],
    after_resume: dict[str, torch.Tensor],
    run_uninterrupted: Callable[[], tuple[list[float], dict[str, torch.Tensor]]],
    random_numbers: str,
) -> None:
    """The resumed step of a library that owns its loop (the Trainer, Lightning): the state the
    resumed run began with (`restored`: optimizer state and scaler state, as the library loaded
    them) against the save's, then its step k+1 (`losses`, `after_resume`) against the same run
    made again from the start without the interruption (`run_uninterrupted()` -> its step k+1's
    losses and tensors). Both are measured before either check raises."""
    failure = None
    try:
        check_restored(state, *restored)
    except checks.CheckpointMismatch as mismatch:  # the comparison below is recorded too
        failure = mismatch
    uninterrupted_losses, after_uninterrupted = run_uninterrupted()
    record_random_numbers(state, random_numbers)
    try:
        check_same_step(state, losses, after_resume, uninterrupted_losses, after_uninterrupted)
    except checks.ResumeDiverged as diverged:
        failure = failure or diverged
    if failure is not None:
        raise failure


def resume_one_step(state, resumed: Continuation, uninterrupted: Continuation, scaler_state=None) -> None:
    """A hand-written loop's resumed_step: step k+1 from the reloaded model and optimizer against
    the interrupted run's own step k+1 (check_resume); it must also move the weights."""
    state.model.train()
    before = snapshot_trainable(state.model, state.kind)
    check_resume(state, resumed, uninterrupted, state.optimizer, scaler_state)
    checks.check_parameters_changed(before, state.model)


def check_same_step(
    state,
    losses: list[float],
    after_resume: dict[str, torch.Tensor],
    uninterrupted_losses: list[float],
    after_uninterrupted: dict[str, torch.Tensor],
) -> None:
    """Step k+1 of the resumed run against the uninterrupted run's: its losses, then every
    named tensor after it. Bit for bit on a device that steps deterministically, else within
    the precision's tolerance row; recorded in metrics.resume, ResumeDiverged if not."""
    from matrix.tolerances import resume_tolerance

    record = _record(state)
    deterministic = state.device_kind.deterministic_steps
    tolerance = None if deterministic else resume_tolerance(state.precision.compute_dtype)
    record.judged = (
        f"bit for bit ({state.device_kind.name} steps are deterministic)"
        if deterministic
        else f"within tolerance ({state.device_kind.name} kernels are not deterministic)"
    )
    record.tolerance = None if tolerance is None else typed.Tolerance(**tolerance.loss.as_dict())
    record.tensor_tolerance = None if tolerance is None else typed.Tolerance(**tolerance.tensors.as_dict())
    record.step_losses = losses
    record.uninterrupted_step_losses = uninterrupted_losses
    record.tensors_compared = len(after_uninterrupted)
    missing = sorted(set(after_uninterrupted) ^ set(after_resume))
    differing, worst = [], 0.0
    for name, expected in after_uninterrupted.items():
        if name not in after_resume:
            continue
        got = after_resume[name].to(expected.device)
        if got.shape != expected.shape or got.dtype != expected.dtype:
            differing.append(name)
            continue
        difference = (got.double() - expected.double()).abs()
        worst = max(worst, difference.max().item() if difference.numel() else 0.0)
        if tolerance is None:
            same = torch.equal(got, expected)
        else:
            allowed = tolerance.tensors.atol + tolerance.tensors.rtol * expected.double().abs()
            same = bool((difference <= allowed).all())
        if not same:
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
    if differing:
        raise checks.ResumeDiverged(
            "parameters or optimizer state after the resumed step differ from the uninterrupted run's",
            details=f"{len(differing)} of {len(after_uninterrupted)} tensors, first {differing[0]}, "
            f"max abs difference {worst:.3g}",
        )


def model_and_optimizer_tensors(model, optimizer) -> dict[str, torch.Tensor]:
    """What step k+1 is compared by, in a process that holds whole parameters: every trainable
    parameter, and the optimizer's state tensors (this process's own shards)."""
    found = {f"parameter {n}": _local(p) for n, p in model.named_parameters() if p.requires_grad}
    found.update({f"optimizer {k}": v for k, v in checks.optimizer_state(optimizer).items()})
    return found


def _local(tensor: torch.Tensor) -> torch.Tensor:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard
    return local.detach().clone()


def _record(state) -> typed.Resume:
    if state.metrics.resume is typed.UNSET:
        state.metrics.resume = typed.Resume()
    return state.metrics.resume
