"""A cell's pipeline, owned by the harness: every phase of every mode, and every check at its
step, for every engine (built-in, distributed, a loop a library owns, or a user's). The engine
supplies what its library does (matrix/engines/base.py); this module decides what is done with
it and what is asserted. A cross-cutting check is one edit here.

train: train_steps -> mid_training_eval -> checkpoint_save -> checkpoint_reload -> resumed_step
eval:  evaluate -> checkpoint_save -> checkpoint_reload

- train_steps: build the model (its dtypes checked as built), the engine starts it (the dtypes
  its library declares checked after prepare), k optimizer steps (schedule.TRAIN_STEPS), then
  the training contract (placement, train mode, finite and changed parameters, kept and declared
  dtypes, the loss's fall judged against fp32) and the first step against the torch engine's.
- mid_training_eval / evaluate: the engine's evaluation against an fp32 copy of the same weights
  (within the precision's tolerance row), and in an evaluation cell against the torch engine's.
- checkpoint_save: what the run held (optimizer and scaler state) is kept, the engine writes its
  own checkpoint and exports the weights for the kind's own loader.
- checkpoint_reload: the kind's plain load of the export gives back the dtypes and the outputs
  bit for bit (and, over a quantized base, its two other saves); the engine's own resume path
  gives back a run that evaluates bit for bit as the saved one did.
- resumed_step: the restored run holds the optimizer and scaler state the save held, and its
  step k+1 equals the uninterrupted run's (matrix/harness/resume.py); it moves the weights.

In a process group every rank runs the same phase on its rows of the batch (matrix/harness/group.py);
what is written once is written by rank 0 and every rank agrees on whether it worked.
"""

from __future__ import annotations

import torch

from matrix.checks import assertions as checks
from matrix.checks.tolerances import (
    CHECKPOINT_ROUND_TRIP,
    LOSS_FALL_VS_FP32,
    LossDecrease,
    loss_decrease_bound,
    relative_fall,
)
from matrix.grid import schedule
from matrix.grid.schedule import RESUME_SEED, RESUMED_STEPS, TRAIN_STEPS
from matrix.harness import resume
from matrix.harness.against_references import (
    check_against_fp32,
    check_agrees_with_torch_engine,
    is_fp32_twin,
    record_curve,
)
from matrix.harness.cell_state import CellState, Saved
from matrix.harness.compiled_checks import check_against_eager, check_float8_converted, record_compiled
from matrix.harness.consensus import agreed
from matrix.harness.kind_traits import fp32_twin_fall, kind_learning_rate, kind_record
from matrix.harness.measurements import (
    DROPOUT_OFF,
    effective_settings,
    generators_kept,
    loss_before_training,
    seed_first_training_forward,
    seeded_training_loss,
    snapshot_trainable,
    stochastic_training_forward,
    watch_first_forward,
)
from matrix.harness.round_trips import check_reload, evaluate_as_run
from matrix.models import initial_weights
from matrix.models.observation import observe
from matrix.results.metrics import Compiled, LearningRate, Quantized, given
from matrix.results.metrics import LossDecrease as LossDecreaseRecord

CHECKPOINT_DIR = "checkpoint"  # the engine's own checkpoint, under the cell's shared directory
EXPORT_DIR = "export"  # the weights as a plain model of the kind


def run_phase(state: CellState, name: str) -> None:
    """One phase of the cell in this process (or rank); then the run it worked on must still be
    on the cell's device. A compiled twin records what Dynamo compiled in the phase, failed or not."""
    try:
        PHASE_BY_NAME[name](state)
    finally:
        if state.compile_watch is not None:
            state.compile_watch.phase_ended(name)
            record_compiled(state)
    if not state.group.distributed:
        for run in (state.run, state.restored):
            if run is not None:
                checks.check_placement(state.engine.weights(state, run), state.device, f"after {name}")


# ---------------------------------------------------------------- build


def build(state: CellState) -> torch.nn.Module:
    """The cell's model as the precision says it is obtained, its batch, what is in force, the
    first-forward hooks, and the checks of the model as built."""
    kind = state.kind
    state.metrics.kind = kind_record(kind, with_rate=state.training)
    state.rate = lambda: _established_rate(state)
    if state.engine.compiled:
        from matrix.harness.compiling import Watch

        state.compile_watch = Watch.begin()
        state.metrics.compiled = Compiled(how=state.engine.compile_how)
    model = state.converted(state.built(state.precision), state.precision, for_engine=True)
    state.batch = initial_weights.batch(kind, state.device)
    state.metrics.effective = effective_settings(state, model)
    watch_first_forward(state, model)
    seed_first_training_forward(state, model)
    checks.check_dtypes(kind.precision_weights(model), state.expected_dtypes(model), "after build")
    checks.check_frozen_kept(observe(kind).frozen_parameters, model, "after build")
    if state.precision.quantization is not None:
        from matrix.precisions.quantization import check_storage

        storage = check_storage(model, state.precision.quantization, "after build")
        state.metrics.quantized = Quantized(storage=storage)
    return model


def _established_rate(state: CellState) -> float:
    established = kind_learning_rate(state.kind)
    state.metrics.learning_rate = LearningRate.from_dict(established.as_dict())
    return established.value


# ---------------------------------------------------------------- the phases


def train_steps(state: CellState) -> None:
    engine = state.engine
    state.run = run = engine.start(state, build(state), training=True)
    check_float8_converted(state, run)
    engine.check_declared(state, run, "after prepare")
    weights = engine.weights(state, run)
    trainable_before = snapshot_trainable(weights, state.kind)
    masters_before = engine.named_master_weights(state, run)
    dtypes_before = {**checks.tensor_dtypes(weights), **engine.dtype_changes(state, run)}
    dropout_off = None
    if engine.distributed and stochastic_training_forward(state):
        dropout_off = engine.dropout_off_loss(state, run)
    if state.compile_watch is not None:
        state.compile_watch.training_started()
    steps = engine.train(state, run, schedule.train_steps())
    state.hooks.stop_seeding()  # past step k the engine's own random numbers run on
    if given(state.metrics.effective) is not None:  # what the loop did, beside what the precision asks
        state.metrics.effective.grad_scaler_in_run = bool(engine.scaler_state(state, run))  # {}: a disabled one
    if state.compile_watch is not None:
        state.compile_watch.training_ended()
        record_compiled(state)
        state.compile_watch.check_compiled("training")
        state.compile_watch.check_steps()
    record_steps(state, steps, schedule.train_steps())
    state.metrics.train_losses = steps.losses
    if engine.owns_loop:
        state.metrics.optimizer_steps_applied = steps.applied
    diverged = record_curve(state, steps.applied_losses)  # measured before any check raises: the record holds it
    masters_before = masters_before or engine.named_master_weights_at_start(state, run)
    check_training_contract(state, trainable_before, dtypes_before, masters_before)
    if dropout_off is None:
        check_agrees_with_torch_engine(state, steps.losses[0], "train")
    else:
        check_agrees_with_torch_engine(state, dropout_off, DROPOUT_OFF)
    if diverged is not None:
        raise diverged
    scaler = engine.scaler_state(state, run)
    if scaler is not None and "scale" in scaler:
        state.metrics.grad_scale = float(scaler["scale"])


def mid_training_eval(state: CellState) -> None:
    state.evaluation = state.engine.checked_evaluation(state.engine.evaluate(state, state.run))
    check_against_fp32(state, state.evaluation, "mid-training eval", state.engine.weights(state, state.run))
    check_against_eager(state, state.evaluation)


def evaluate(state: CellState) -> None:
    engine = state.engine
    state.run = run = engine.start(state, build(state), training=False)
    check_float8_converted(state, run)
    engine.check_declared(state, run, "after prepare")
    state.evaluation = result = engine.checked_evaluation(engine.evaluate(state, run))
    if state.compile_watch is not None:
        state.compile_watch.check_compiled("the evaluation")
    check_against_fp32(state, result, "eval", engine.weights(state, run))
    check_against_eager(state, result)
    check_agrees_with_torch_engine(state, result.loss.float().item(), "eval")


def checkpoint_save(state: CellState) -> None:
    engine, run = state.engine, state.run
    # the run as it is saved, measured before the save (a library's save may change what it holds)
    # no step since the evaluation
    outputs = (state.evaluation or engine.checked_evaluation(engine.evaluate(state, run))).logits
    if state.training:
        state.point = resume.point_of(engine.optimizer_state(state, run), engine.scaler_state(state, run))
    exported = engine.exported(state, run)
    exported_logits = evaluate_as_run(state, exported).logits
    checkpoint = state.shared_dir / CHECKPOINT_DIR
    checkpoint.mkdir(parents=True, exist_ok=True)  # the engine's save() writes into it, as a library's does
    agreed(state, lambda: engine.save(state, run, checkpoint))
    state.group.barrier()  # every rank's part of the checkpoint is written
    export = agreed(state, lambda: engine.export(state, run, state.shared_dir / EXPORT_DIR, checkpoint))
    state.group.barrier()  # every rank reads what was written once
    state.saved = Saved(checkpoint, export, exported, exported_logits, outputs)
    if checkpoint.is_dir():
        state.metrics.checkpoint_files = sorted(p.name for p in checkpoint.iterdir())


def checkpoint_reload(state: CellState) -> None:
    engine, saved = state.engine, state.saved
    # the kind's plain load of the export, as any user of the kind reads a saved model
    reloaded = state.load(saved.export)
    check_reload(state, reloaded, saved)
    # the engine's own resume path: a run that evaluates as the saved one did
    state.restored = engine.restore(state, saved.checkpoint, training=state.training)
    restored = engine.evaluate(state, state.restored)
    outputs = engine.checked_evaluation(restored, "evaluate() of the restored run").logits
    state.metrics.resume_reload_max_abs_difference = checks.check_outputs_equal(
        "eval logits of the resumed run", saved.run_logits, outputs, CHECKPOINT_ROUND_TRIP
    )


def resumed_step(state: CellState) -> None:
    """Step k+1 on the restored run and on the uninterrupted one, compared (matrix/harness/resume.py).
    Both sides are measured before either check raises, so the record holds both."""
    engine, restored = state.engine, state.restored
    failure = None
    try:
        resume.check_restored(state, engine.optimizer_state(state, restored), engine.scaler_state(state, restored))
    except checks.CheckpointMismatch as mismatch:  # the step comparison below is recorded too
        failure = mismatch
    before = snapshot_trainable(engine.weights(state, restored), state.kind)
    masters_before = engine.named_master_weights(state, restored)
    record = resume.resume_record(state)
    record.random_numbers = engine.resume_random_numbers or f"seeded with {RESUME_SEED} before step k+1, on both sides"
    uninterrupted_losses, after_uninterrupted = _step_on(state, state.run)
    losses, after_resume = _step_on(state, restored)
    state.metrics.resumed_losses = losses
    try:
        resume.check_same_step(state, losses, after_resume, uninterrupted_losses, after_uninterrupted)
    except checks.ResumeDiverged as diverged:
        failure = failure or diverged
    if failure is not None:
        raise failure
    masters_after = engine.named_master_weights(state, restored)
    checks.check_parameters_changed(before, engine.weights(state, restored), masters_before, masters_after)


# each mode's phases, in the order a cell runs them: the one place the order is written (the repro
# scripts are written with it, matrix/releases/repro/generate.py)
PHASES: dict[str, tuple] = {
    "train": (train_steps, mid_training_eval, checkpoint_save, checkpoint_reload, resumed_step),
    "eval": (evaluate, checkpoint_save, checkpoint_reload),
}
PHASE_NAMES: dict[str, tuple[str, ...]] = {mode: tuple(p.__name__ for p in phases) for mode, phases in PHASES.items()}
PHASE_BY_NAME = {phase.__name__: phase for phases in PHASES.values() for phase in phases}


# ---------------------------------------------------------------- steps


def record_steps(state: CellState, steps, asked: int) -> None:
    """Every step's loss is finite; a library that owns its loop ran the steps it was asked for;
    the steps a grad scaler skipped are counted."""
    for loss in steps.losses:
        checks.check_finite_loss(torch.tensor(loss), "training loss")
    if state.engine.owns_loop and len(steps.losses) != asked:
        raise checks.CheckFailure(
            "the library's loop did not run the steps it was asked for",
            details=f"{len(steps.losses)} steps ran, {asked} asked for",
        )
    skipped = len(steps.losses) - steps.applied
    state.metrics.steps_skipped_by_grad_scaler = given(state.metrics.steps_skipped_by_grad_scaler, 0) + skipped


def _step_on(state: CellState, run) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Step k+1 on a run (a hand-written loop's from RESUME_SEED; a library's from its own random
    state), and the tensors it is compared by after it."""
    engine = state.engine
    if engine.resume_random_numbers is None:
        with generators_kept(state):
            torch.manual_seed(RESUME_SEED)
            steps = engine.train(state, run, RESUMED_STEPS)
    else:
        steps = engine.train(state, run, RESUMED_STEPS)
    if engine.owns_loop and len(steps.losses) != RESUMED_STEPS:
        raise checks.CheckFailure(
            "resuming from the checkpoint did not run exactly the one remaining step",
            details=f"{len(steps.losses)} training steps ran",
        )
    record_steps(state, steps, RESUMED_STEPS)
    return steps.losses, step_tensors(state, run)


def step_tensors(state: CellState, run) -> dict[str, torch.Tensor]:
    """What step k+1 is compared by: every trainable parameter (whole), the master weights and
    the optimizer's state tensors (this process's shards)."""
    engine = state.engine
    found = {
        f"parameter {n}": p.detach().clone()
        for n, p in engine.weights(state, run).named_parameters()
        if p.requires_grad
    }
    found.update({f"master {k}": v.detach().clone() for k, v in engine.master_weights(state, run).items()})
    found.update({f"optimizer {k}": v for k, v in engine.optimizer_state(state, run).items()})
    return found


# ---------------------------------------------------------------- written once in a group


# ---------------------------------------------------------------- the training contract


def check_training_contract(state: CellState, trainable_before, dtypes_before, masters_before=None) -> None:
    """After training: still on the cell's device; parameters changed (their master weights,
    where the optimizer steps such a copy), stayed finite, kept their dtypes and those the library
    declares; the loss fell (matrix/checks/tolerances.py TRAINING_LOSS_DECREASE) between the same
    seeded measurement before and after training."""
    engine, run = state.engine, state.run
    model = engine.weights(state, run)
    checks.check_placement(model, state.device, "after training")
    checks.check_trained_in_train_mode(given(state.metrics.effective.model_training_in_first_forward))
    checks.check_finite_parameters(list(model.named_parameters()), "after training")
    checks.check_parameters_changed(trainable_before, model, masters_before, engine.named_master_weights(state, run))
    checks.check_same_dtypes(dtypes_before, model, "after training")
    engine.check_declared(state, run, "after training")
    # the fall is measured by the harness, the same way before and after training: a library's
    # own losses are taken before each of its steps, so the last applied step never shows in
    # them, and a grad scaler that skipped the first steps leaves none to see (Trainer, Lightning)
    before, after = loss_before_training(state), seeded_training_loss(state, model)
    measured = {"loss_before_training": before, "loss_after_training": after, "relative": relative_fall(before, after)}
    if state.kind.variant != state.kind.grid_variant:
        # the bound was established on the grid's settings only: a variant (exploration) records
        # its fall unchecked (a drawn LoRA with rank 1 and hidden size 8 falls less in fp32)
        unchecked = LossDecreaseRecord(**measured, bound_relative=None, judged_by="unchecked: a variant")
        state.metrics.loss_decrease = unchecked
        return
    bound, judged_by = loss_fall_bound(state)
    state.metrics.loss_decrease = LossDecreaseRecord(
        **measured, bound_relative=None if bound is None else bound.min_relative, judged_by=judged_by
    )
    if bound is None:
        return
    if is_fp32_twin(state.precision):
        checks.check_fp32_learns(before, after, bound, state.learning_rate)
    else:
        checks.check_loss_decreased(before, after, bound)


def loss_fall_bound(state: CellState) -> tuple[LossDecrease | None, str]:
    """How far the cell's training loss must fall, and why: fp32 by the kind's bound (does the
    kind learn at its rate at all?); any other precision by LOSS_FALL_VS_FP32 of its fp32 twin's
    fall, unchecked where the twin itself does not learn (the fp32 cells carry that finding)."""
    absolute = loss_decrease_bound(state.cell.model)
    if is_fp32_twin(state.precision):
        return absolute, f"fp32: the kind's bound {absolute.min_relative:.2%}"
    established = kind_learning_rate(state.kind)
    if established.fp32_fall.relative < absolute.min_relative:
        return None, (
            f"unchecked: the fp32 twin does not learn at learning rate {established.value:g} "
            f"({established.source}); the fp32 cells fail for it"
        )
    twin, over = established.fp32_fall.relative, ""
    applied = given(state.metrics.optimizer_steps_applied, schedule.train_steps())
    if 0 < applied != TRAIN_STEPS:
        # a library's fixed steps, some of them skipped by its grad scaler (fp16 on a GPU), or a
        # run's longer curve: the twin is judged over as many applied steps
        twin, over = fp32_twin_fall(state.kind, established.value, applied), f" over {applied} applied step(s)"
    return LossDecrease(LOSS_FALL_VS_FP32 * twin), (
        f"{LOSS_FALL_VS_FP32:g} of the fp32 twin's fall {twin:.2%}{over} (torch engine, learning rate "
        f"{established.value:g})"
    )


# ---------------------------------------------------------------- against fp32 and the torch engine


# ---------------------------------------------------------------- the reload
