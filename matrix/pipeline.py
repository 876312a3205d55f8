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
  step k+1 equals the uninterrupted run's (matrix/resume.py); it moves the weights.

In a process group every rank runs the same phase on its rows of the batch (matrix/group.py);
what is written once is written by rank 0 and every rank agrees on whether it worked.
"""

from __future__ import annotations

import dataclasses

import torch

from matrix import checks, curves, declared_dtypes, initial_weights, resume, schedule
from matrix.cell_state import CellState, Saved
from matrix.engines.base import evaluation_result
from matrix.float8 import sqnr_db
from matrix.kind_traits import fp32_twin_fall, kind_learning_rate, kind_record
from matrix.measurements import (
    DROPOUT_OFF,
    effective_settings,
    evaluate_in_precision,
    fp32_reference,
    generators_kept,
    loss_before_training,
    position_deviations,
    reference_curve,
    seed_first_training_forward,
    seeded_training_loss,
    snapshot_trainable,
    stochastic_training_forward,
    torch_engine_loss,
    watch_first_forward,
)
from matrix.observation import observe
from matrix.precisions import PRECISIONS, Precision, dtype_name
from matrix.results import metrics as typed
from matrix.results.metrics import given
from matrix.schedule import FIRST_FORWARD_SEED, RESUME_SEED, RESUMED_STEPS, TRAIN_STEPS
from matrix.signatures import is_failure, signature_of
from matrix.tolerances import (
    CHECKPOINT_ROUND_TRIP,
    LOSS_FALL_VS_FP32,
    QUANTIZED_VS_UNQUANTIZED,
    LossDecrease,
    eval_loss_tolerance,
    loss_decrease_bound,
    relative_fall,
)

PHASE_NAMES: dict[str, tuple[str, ...]] = {
    "train": ("train_steps", "mid_training_eval", "checkpoint_save", "checkpoint_reload", "resumed_step"),
    "eval": ("evaluate", "checkpoint_save", "checkpoint_reload"),
}
CHECKPOINT_DIR = "checkpoint"  # the engine's own checkpoint, under the cell's shared directory
EXPORT_DIR = "export"  # the weights as a plain model of the kind


class PeerFailed(checks.CheckFailure):
    """Another rank failed in work written once for the group; this rank stops with it."""


def run_phase(state: CellState, name: str) -> None:
    """One phase of the cell in this process (or rank); then the run it worked on must still be
    on the cell's device. A compiled twin records what Dynamo compiled in the phase, failed or not."""
    try:
        PHASES[name](state)
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
        from matrix.compiling import Watch

        state.compile_watch = Watch.begin()
        state.metrics.compiled = typed.Compiled(how=state.engine.compile_how)
    model = state.converted(state.built(state.precision), state.precision, for_engine=True)
    state.batch = initial_weights.batch(kind, state.device)
    state.metrics.effective = effective_settings(state, model)
    watch_first_forward(state, model)
    seed_first_training_forward(state, model)
    checks.check_dtypes(kind.precision_weights(model), state.expected_dtypes(model), "after build")
    checks.check_frozen_kept(observe(kind).frozen_parameters, model, "after build")
    if state.precision.quantization is not None:
        from matrix.quantization import check_storage

        storage = check_storage(model, state.precision.quantization, "after build")
        state.metrics.quantized = typed.Quantized(storage=storage)
    return model


def _established_rate(state: CellState) -> float:
    established = kind_learning_rate(state.kind)
    state.metrics.learning_rate = typed.LearningRate.from_dict(established.as_dict())
    return established.value


# ---------------------------------------------------------------- the phases


def train_steps(state: CellState) -> None:
    engine = state.engine
    state.run = run = engine.start(state, build(state), training=True)
    check_float8_converted(state, run)
    engine.check_declared(state, run, "after prepare")
    weights = engine.weights(state, run)
    trainable_before = snapshot_trainable(weights, state.kind)
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
    check_training_contract(state, trainable_before, dtypes_before)
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
    state.evaluation = evaluation_result(state.engine.evaluate(state, state.run), state.engine.evaluate)
    check_against_fp32(state, state.evaluation, "mid-training eval", state.engine.weights(state, state.run))
    check_against_eager(state, state.evaluation)


def evaluate(state: CellState) -> None:
    engine = state.engine
    state.run = run = engine.start(state, build(state), training=False)
    check_float8_converted(state, run)
    engine.check_declared(state, run, "after prepare")
    state.evaluation = result = evaluation_result(engine.evaluate(state, run), engine.evaluate)
    if state.compile_watch is not None:
        state.compile_watch.check_compiled("the evaluation")
    check_against_fp32(state, result, "eval", engine.weights(state, run))
    check_against_eager(state, result)
    check_agrees_with_torch_engine(state, result.loss.float().item(), "eval")


def checkpoint_save(state: CellState) -> None:
    engine, run = state.engine, state.run
    # the run as it is saved, measured before the save (a library's save may change what it holds)
    # no step since the evaluation
    outputs = (state.evaluation or evaluation_result(engine.evaluate(state, run), engine.evaluate)).logits
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
    outputs = evaluation_result(restored, engine.evaluate, "evaluate() of the restored run").logits
    state.metrics.resume_reload_max_abs_difference = checks.check_outputs_equal(
        "eval logits of the resumed run", saved.run_logits, outputs, CHECKPOINT_ROUND_TRIP
    )


def resumed_step(state: CellState) -> None:
    """Step k+1 on the restored run and on the uninterrupted one, compared (matrix/resume.py).
    Both sides are measured before either check raises, so the record holds both."""
    engine, restored = state.engine, state.restored
    failure = None
    try:
        resume.check_restored(state, engine.optimizer_state(state, restored), engine.scaler_state(state, restored))
    except checks.CheckpointMismatch as mismatch:  # the step comparison below is recorded too
        failure = mismatch
    before = snapshot_trainable(engine.weights(state, restored), state.kind)
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
    checks.check_parameters_changed(before, engine.weights(state, restored))


PHASES = {
    "train_steps": train_steps,
    "mid_training_eval": mid_training_eval,
    "checkpoint_save": checkpoint_save,
    "checkpoint_reload": checkpoint_reload,
    "resumed_step": resumed_step,
    "evaluate": evaluate,
}


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


def agreed(state: CellState, work):
    """`work()` in every process of the cell, then every rank learns whether it worked anywhere:
    a rank that failed (writing for the group, say) raises its own error, the others PeerFailed,
    and none is left waiting in a collective for a rank that never comes."""
    group = state.group
    if not group.distributed:
        return work()
    result, error = None, None
    try:
        result = work()
    except BaseException as exc:  # raised below, after every rank knows (a library's BaseException too)
        if not is_failure(exc):
            raise
        error = exc
    failed = group.gather(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    elsewhere = [(rank, what) for rank, what in enumerate(failed) if what is not None]
    if elsewhere:
        rank, what = elsewhere[0]
        raise PeerFailed(f"rank {rank} failed where every rank works together", details=what)
    return result


# ---------------------------------------------------------------- the training contract


def check_training_contract(state: CellState, trainable_before, dtypes_before) -> None:
    """After training: still on the cell's device; parameters changed, stayed finite, kept
    their dtypes and those the library declares; the loss fell (matrix/tolerances.py
    TRAINING_LOSS_DECREASE) between the same seeded measurement before and after training."""
    engine, run = state.engine, state.run
    model = engine.weights(state, run)
    checks.check_placement(model, state.device, "after training")
    checks.check_trained_in_train_mode(given(state.metrics.effective.model_training_in_first_forward))
    checks.check_finite_parameters(list(model.named_parameters()), "after training")
    checks.check_parameters_changed(trainable_before, model)
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
        unchecked = typed.LossDecrease(**measured, bound_relative=None, judged_by="unchecked: a variant")
        state.metrics.loss_decrease = unchecked
        return
    bound, judged_by = loss_fall_bound(state)
    state.metrics.loss_decrease = typed.LossDecrease(
        **measured, bound_relative=None if bound is None else bound.min_relative, judged_by=judged_by
    )
    if bound is None:
        return
    if is_fp32_twin(state.precision):
        checks.check_fp32_learns(before, after, bound, state.learning_rate)
    else:
        checks.check_loss_decreased(before, after, bound)


def is_fp32_twin(precision: Precision) -> bool:
    """The precision every other one's loss fall is judged against: fp32 weights and compute."""
    return precision.weights_dtype == torch.float32 and precision.compute_dtype == torch.float32


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


def check_against_fp32(state: CellState, result, label: str, model) -> None:
    """Evaluation loss vs an fp32 copy of `model`'s weights on the same batch, no autocast."""
    reference = fp32_reference(state, model)
    value = checks.check_finite_loss(result.loss, f"{label} loss")
    ref_value = checks.check_finite_loss(reference.loss, f"fp32 reference {label} loss")
    tolerance = eval_loss_tolerance(state.cell.model, state.precision.compute_dtype)
    metrics = state.metrics
    metrics.eval_loss = value
    metrics.fp32_reference_loss = ref_value
    metrics.fp32_deviation_abs = abs(value - ref_value)
    metrics.fp32_deviation_rel = abs(value - ref_value) / abs(ref_value) if ref_value else None
    metrics.fp32_tolerance = typed.Tolerance(**tolerance.as_dict())
    metrics.eval_logits_dtype = dtype_name(result.logits.dtype)
    for name, extra in result.extras.items():  # a model's extras have fields: eval_cache_type
        setattr(metrics, "eval_" + name, extra)
    metrics.logits_sqnr_db = sqnr_db(*real_positions(state, reference.logits, result.logits))
    deviations = position_deviations(result.logits, reference.logits, state.batch.get("attention_mask"))
    for name, deviation in deviations.items():
        setattr(metrics, name, deviation)
    if result.generated is not None:
        metrics.generated_tokens = result.generated.shape[-1] - state.batch["input_ids"].shape[-1]
        metrics.generation_matches_fp32 = reference.generated is not None and torch.equal(
            result.generated, reference.generated
        )
    checks.check_within_tolerance(f"{label} loss", value, ref_value, tolerance)
    if state.precision.quantization is not None:
        check_quantization_error(state, model, value, label)


def check_quantization_error(state: CellState, model, value: float, label: str) -> None:
    """The evaluation loss of a quantized cell against the unquantized fp32 model holding the same
    trained adapters (the rest as created), within its scheme's row (matrix/tolerances.py)."""
    from matrix.quantization import copy_float_weights

    twin = state.scratch_model(PRECISIONS["fp32"])
    missing = copy_float_weights(model, twin, trainable_only=True)
    if missing:
        raise checks.CheckFailure(
            "the unquantized model has no place for a trained tensor of the quantized one",
            details=f"{len(missing)} trainable tensors, first {missing[0]}",
        )
    twin.eval()
    with torch.no_grad():
        reference = checks.check_finite_loss(state.kind.evaluate(twin, state.batch).loss, "unquantized fp32 loss")
    tolerance = QUANTIZED_VS_UNQUANTIZED[state.precision.quantization.scheme]
    record = state.metrics.quantized
    record.unquantized_loss = reference
    record.unquantized_deviation_abs = abs(value - reference)
    record.unquantized_tolerance = typed.Tolerance(**tolerance.as_dict())
    checks.check_within_tolerance(f"{label} loss against the unquantized model", value, reference, tolerance)


def real_positions(state: CellState, *logits: torch.Tensor) -> list[torch.Tensor]:
    """Logits at the batch's real positions only, where it has a per-position attention mask: what
    a fully masked (pad) query returns is the kernel's own (docs/gpu-runs/h100-2026-11-22) and feeds no loss."""
    mask = state.batch.get("attention_mask")
    if mask is None or any(t.shape[:2] != mask.shape for t in logits):
        return [t.float() for t in logits]
    return [t.float()[mask != 0] for t in logits]


def check_float8_converted(state: CellState, run) -> None:
    """A float8 cell's model, as the engine's library holds it after prepare, has float8 layers
    (converted by the harness as users do, or by the library): which ones, and which Linear
    layers were left out and why, go to the record. A run holding none is not training in float8."""
    if state.precision.float8 is None:
        return
    from matrix.float8 import record

    held = record(state.engine.weights(state, run))
    by = (
        "the library (its own fp8 setting)"
        if state.engine.converts_float8
        else "the harness, as users convert before the library"
    )
    state.metrics.float8 = typed.Float8Record(**held, converted_by=by)
    if not held["converted"]:
        raise checks.CheckFailure(
            "float8: the run's model holds no float8 layer after prepare",
            details=f"{len(held['left_out'])} Linear layers left in high precision",
        )


def record_compiled(state: CellState) -> None:
    """What Dynamo compiled so far in a compiled twin's cell, in its record."""
    for name, value in state.compile_watch.record().items():
        setattr(state.metrics.compiled, name, value)


def check_against_eager(state: CellState, result) -> None:
    """A compiled twin's evaluation against its eager twin: the same weights evaluated without
    compile, as the run evaluates. The logits' dtype is the same (Inductor's own tests require
    it); the loss is within the compiled-vs-eager row of the precision's compute dtype."""
    if not state.engine.compiled:
        return
    from matrix.compiling import eager as eager_stance
    from matrix.tolerances import compiled_vs_eager_tolerance

    engine = state.engine
    with eager_stance():  # every compiled module runs eagerly, one compiled in place (FSDP2's layers) too
        if engine.owns_loop:  # the library's evaluation was taken after step k: the weights held there
            eager = evaluate_as_run(state, engine.exported(state, state.run))
        else:  # the engine's own evaluation of the run, nothing compiled
            eager = evaluation_result(engine.evaluate(state, state.run), engine.evaluate)
    record = state.metrics.compiled
    tolerance = compiled_vs_eager_tolerance(state.precision.compute_dtype)
    value = checks.check_finite_loss(result.loss, "compiled eval loss")
    reference = checks.check_finite_loss(eager.loss, "eager twin's eval loss")
    record.eager_logits_dtype = dtype_name(eager.logits.dtype)
    record.eager_loss = reference
    record.eager_deviation_abs = abs(value - reference)
    record.eager_logits_max_abs_difference = (result.logits.float() - eager.logits.float()).abs().max().item()
    record.eager_tolerance = typed.Tolerance(**tolerance.as_dict())
    record.comparison = "within the compiled-vs-eager row of its compute dtype (Inductor fuses away roundings)"
    # a loop the library owns evaluates through wrappers the plain model lacks (the Trainer's
    # accelerate returns fp32 logits): there the dtypes are recorded, and compared only in a loop
    # whose evaluation is the harness's own through the run's module
    if not state.engine.owns_loop and result.logits.dtype != eager.logits.dtype:
        raise checks.DtypeContractBroken(
            "compiled eval logits have another dtype than the eager twin's",
            details=f"compiled {dtype_name(result.logits.dtype)}, eager {dtype_name(eager.logits.dtype)}",
        )
    checks.check_within_tolerance("compiled eval loss against the eager twin", value, reference, tolerance)


def record_curve(state: CellState, losses: list[float]) -> checks.CurveDiverged | None:
    """The training losses of the applied steps, step by step, against the torch engine's at the same precision and
    against the fp32 twin's (matrix/curves.py), recorded; the first reference the curve leaves
    gives the failure to raise once the cell's other training checks ran."""
    from matrix.engines.traits import curve_family
    from matrix.tolerances import curve_vs_fp32_twin, curve_vs_torch_engine

    compute = curve_compute_dtype(state)
    family = curve_family(state.engine.traits)  # the engines whose measured spread its rows come from
    # a kind the spread was not measured on takes the unmeasured kinds' rows (tolerances.kind_row)
    same_precision = curve_vs_torch_engine(compute, family, state.kind.name)
    steps = schedule.train_steps()
    record = typed.Curve(
        steps=steps,
        losses=losses,
        random_numbers=f"forward j of the first {steps} steps seeded with {FIRST_FORWARD_SEED} + j, all sides",
        golden_tolerance=same_precision.as_dict(),
    )
    state.metrics.curve = record
    split = None
    if state.engine.distributed and stochastic_training_forward(state):
        split = (
            "the kind draws dropout masks in training: each rank draws its rows' masks, the torch loop the "
            "whole batch's, so the curves differ by the draws"
        )
    twin_precision = dataclasses.replace(PRECISIONS["fp32"], grad_accumulation=state.precision.grad_accumulation)
    quantization = state.precision.quantization.scheme if state.precision.quantization is not None else None
    references = (
        (
            curves.TORCH_ENGINE,
            "torch_engine",
            state.precision,
            same_precision,
            "the cell is the torch engine: its curve is the reference" if state.cell.engine == "torch" else split,
        ),
        (
            curves.FP32_TWIN,
            "fp32_twin",
            twin_precision,
            curve_vs_fp32_twin(compute, quantization, family, state.kind.name),
            "the cell trains in fp32: it is its own fp32 twin" if is_fp32_twin(state.precision) else split,
        ),
    )
    failure = None
    for name, field, precision, tolerance, unchecked in references:
        if unchecked is not None:
            setattr(record, field, typed.CurveComparison(reference=name, unchecked=unchecked))
            continue
        reference, error = reference_curve(state, precision)
        if error is not None:
            setattr(record, field, typed.CurveComparison(reference=name, reference_error=error))
            continue
        compared = curves.compare(losses, reference, tolerance, name)
        setattr(record, field, typed.CurveComparison.from_dict(compared.as_dict()))
        if failure is None and not compared.held:
            failure = checks.CurveDiverged(
                f"the training loss curve leaves the {name}'s at step {compared.first_step_outside}",
                details=compared.outside(losses) + reference_optimizer(state, name),
            )
    return failure


def curve_compute_dtype(state: CellState) -> torch.dtype:
    """The dtype a training cell's curve is judged by: its precision's compute dtype, or the coarser
    autocast its run was seen computing in (Lightning runs 16-mixed as bf16 on a CPU: a curve
    computed in bf16 is judged by bf16's row, whatever the precision's name says)."""
    from matrix.tolerances import curve_row_dtype

    return curve_row_dtype(
        state.precision.compute_dtype, given(state.metrics.effective.autocast_dtype_in_forward, None)
    )


def reference_optimizer(state: CellState, name: str) -> str:
    """How the torch engine's reference trained, as the engine declared its library trains: what a
    loop whose curve leaves it at step 2 may have left undeclared (matrix/engines/base.py)."""
    engine = state.engine
    clipping = f"clipped to norm {engine.max_grad_norm:g}" if engine.max_grad_norm else "not clipped"
    model = engine.weights(state, state.run)
    decayed = engine.decayed_parameters(model)
    trainable = sum(p.requires_grad for p in model.parameters())
    decay = "all" if decayed is None else f"{len(decayed)} of the {trainable}"
    return (
        f"; the {name} trained AdamW at {state.learning_rate:g}, gradients {clipping}, weight decay on {decay} "
        "trainable parameters, as the engine declares (Engine.max_grad_norm, Engine.decayed_parameters)"
    )


def check_agrees_with_torch_engine(state: CellState, loss: float, mode: str) -> None:
    """The engine's first step (or evaluation) against the torch engine's on a fresh model, from
    the same random numbers."""
    if state.cell.engine == "torch":
        return
    try:
        reference = torch_engine_loss(state, mode)
    except Exception as exc:  # the yardstick itself fails: that is the torch engine cell's finding
        state.metrics.cross_engine = typed.CrossEngine(torch_engine_error=signature_of("torch engine", exc).text)
        return
    tolerance = eval_loss_tolerance(state.cell.model, state.precision.compute_dtype)
    key = {"train": "first_step_loss", "eval": "eval_loss", DROPOUT_OFF: "first_step_loss_dropout_off"}[mode]
    # how both sides got the same random numbers (dropout)
    random_numbers = {
        "train": f"seeded with {FIRST_FORWARD_SEED} before the first forward",
        "eval": None,  # eval mode draws none
        DROPOUT_OFF: (
            "none: dropout off (eval mode) on both sides, since a batch split across ranks draws other "
            "dropout masks than the whole batch in one process"
        ),
    }[mode]
    state.metrics.cross_engine = typed.CrossEngine(
        spread_abs=abs(loss - reference),
        tolerance=typed.Tolerance(**tolerance.as_dict()),
        random_numbers=random_numbers,
        **{key: loss, f"torch_engine_{key}": reference},
    )
    checks.check_engine_agreement(key.replace("_", " "), loss, reference, tolerance)


# ---------------------------------------------------------------- the reload


def evaluate_as_run(state: CellState, model):
    """Evaluation of a plain model under the autocast the engine's run really had in its forward
    (observed by the first-forward hook; it can differ from the precision's: on a CPU, accelerate
    and the Trainer run fp16 mixed precision without autocast, Lightning runs 16-mixed as bf16),
    else the precision's own: the saved weights and their reload are evaluated alike, in the way
    the cell already ran."""
    observed = given(state.metrics.effective.autocast_dtype_in_forward, "not observed")
    if observed == "not observed":
        return evaluate_in_precision(state, model)
    model.eval()
    from contextlib import nullcontext

    context = torch.autocast(state.device_type, dtype=getattr(torch, observed)) if observed else nullcontext()
    with state.eval_grad_context(), context:
        return state.kind.evaluate(model, state.batch)


def check_reload(state: CellState, reloaded, saved: Saved) -> None:
    """The kind's plain load of the export reproduces the dtypes and the outputs, bit for bit,
    of what was saved (saved.exported); over a quantized base, its two other saves too."""
    declared = {}
    if state.kind.loaded_in_dtype(state.precision, reloaded=True):  # from_pretrained applies the declarations
        dtype = state.precision.weights_dtype
        patterns = declared_dtypes.fp32_patterns(reloaded, dtype)
        created = declared_dtypes.created_fp32(reloaded, dtype)
        for kind, tensors in (("parameter", reloaded.named_parameters()), ("buffer", reloaded.named_buffers())):
            for name, _ in tensors:
                if reason := declared_dtypes.fp32_reason(name, patterns, created):
                    declared[f"{kind} {name}"] = reason
    checks.check_same_dtypes(checks.tensor_dtypes(saved.exported), reloaded, "after reload", declared)
    checks.check_frozen_kept(observe(state.kind).frozen_parameters, reloaded, "after reload")
    if state.precision.quantization is None:
        outputs = evaluate_as_run(state, reloaded).logits
        state.metrics.reload_max_abs_difference = checks.check_outputs_equal(
            "eval logits", saved.exported_logits, outputs, CHECKPOINT_ROUND_TRIP
        )
        return
    from matrix.quantization import check_storage

    check_storage(reloaded, state.precision.quantization, "after reload")
    # the adapters as the reloaded model holds them, saved before it is evaluated (an evaluation
    # can change a quantized layer's state on a CPU: bitsandbytes packs its weights there). One
    # rank saves, as transformers does in a group, and checks the other saves; so the ranks'
    # models differ from here on, and they agree on the outcome before going on
    adapters = state.workdir / "quantized-saves" / "adapters"

    def reload_and_saves() -> None:
        if state.group.writes:
            adapters.mkdir(parents=True, exist_ok=True)
            state.kind.save(reloaded, adapters)
        outputs = evaluate_as_run(state, reloaded).logits
        state.metrics.reload_max_abs_difference = checks.check_outputs_equal(
            "eval logits", saved.exported_logits, outputs, CHECKPOINT_ROUND_TRIP
        )
        if state.group.writes:
            check_quantized_saves(state, adapters)

    agreed(state, reload_and_saves)


def check_quantized_saves(state: CellState, adapters) -> None:
    """The two other ways users save a quantized fine-tune, each read back bit for bit: the
    quantized base itself (save_pretrained of the base, as pre-quantized checkpoints are shared)
    with the adapters over it; and the adapters merged into the quantized base, saved and read
    back. Each starts from the adapters `adapters` holds over a base quantized anew, and is
    evaluated before it is saved, as a user evaluates a model before sharing it. Both run; a
    mismatch in the first is raised after the second was measured too."""
    mismatches = []
    for check in (_check_prequantized_save, _check_merged_save):
        try:
            check(state, adapters)
        except checks.CheckpointMismatch as mismatch:  # recorded in the metrics; raised below
            mismatches.append(mismatch)
    if mismatches:
        raise mismatches[0]


def _check_prequantized_save(state: CellState, adapters) -> None:
    from matrix.quantization import check_storage

    kind, precision, record = state.kind, state.precision, state.metrics.quantized
    directory = adapters.parent / "quantized-base"
    model = kind.load(adapters, precision, state.device, state.workdir)
    before = evaluate_as_run(state, model).logits
    kind.save_quantized_base(model, directory)
    record.prequantized_files = sorted(p.name for p in directory.iterdir())
    again = kind.load_over_quantized_base(directory, adapters, precision, state.device, state.workdir)
    check_storage(again, precision.quantization, "after reading the saved quantized base")
    outputs = evaluate_as_run(state, again).logits
    record.prequantized_reload_max_abs_difference = (outputs.float() - before.float()).abs().max().item()
    checks.check_outputs_equal("eval logits over the saved quantized base", before, outputs, CHECKPOINT_ROUND_TRIP)


def _check_merged_save(state: CellState, adapters) -> None:
    from matrix.quantization import check_storage

    kind, precision, record = state.kind, state.precision, state.metrics.quantized
    directory = adapters.parent / "merged"
    as_adapters = evaluate_as_run(state, kind.load(adapters, precision, state.device, state.workdir)).logits
    merged = kind.merge_quantized(kind.load(adapters, precision, state.device, state.workdir))
    merged_outputs = evaluate_as_run(state, merged).logits
    record.merged_deviation_max_abs = (merged_outputs.float() - as_adapters.float()).abs().max().item()
    kind.save_merged(merged, directory)
    reread = kind.load_merged(directory, precision, state.device)
    check_storage(reread, precision.quantization, "after reading the saved merged model")
    outputs = evaluate_as_run(state, reread).logits
    record.merged_reload_max_abs_difference = (outputs.float() - merged_outputs.float()).abs().max().item()
    checks.check_outputs_equal("eval logits of the saved merged model", merged_outputs, outputs, CHECKPOINT_ROUND_TRIP)
