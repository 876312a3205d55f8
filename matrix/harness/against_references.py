"""A cell's numbers against its references: an evaluation against the fp32 copy of the same weights
(within the precision's tolerance row), a quantized base's error, the loss curve against the torch
engine's and the fp32 twin's step by step (matrix/results/curves.py), and a cell's loss against the
torch engine's at the same precision. The pipeline's phases call these (matrix/harness/pipeline.py)."""

from __future__ import annotations

import dataclasses

import torch

from matrix.checks import assertions as checks
from matrix.checks.tolerances import (
    QUANTIZED_VS_UNQUANTIZED,
    eval_loss_tolerance,
)
from matrix.grid import schedule
from matrix.grid.schedule import FIRST_FORWARD_SEED
from matrix.harness.cell_state import CellState
from matrix.harness.measurements import (
    DROPOUT_OFF,
    fp32_reference,
    position_deviations,
    stochastic_training_forward,
    torch_engine_loss,
)
from matrix.harness.reference_curves import reference_curve
from matrix.precisions.float8 import sqnr_db
from matrix.precisions.policies import PRECISIONS, Precision, dtype_name
from matrix.results import curves
from matrix.results.metrics import CrossEngine, Curve, CurveComparison, Tolerance, given
from matrix.results.signatures import signature_of


def is_fp32_twin(precision: Precision) -> bool:
    """The precision every other one's loss fall is judged against: fp32 weights and compute."""
    return precision.weights_dtype == torch.float32 and precision.compute_dtype == torch.float32


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
    metrics.fp32_tolerance = Tolerance(**tolerance.as_dict())
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
    trained adapters (the rest as created), within its scheme's row (matrix/checks/tolerances.py)."""
    from matrix.precisions.quantization import copy_float_weights

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
    record.unquantized_tolerance = Tolerance(**tolerance.as_dict())
    checks.check_within_tolerance(f"{label} loss against the unquantized model", value, reference, tolerance)


def real_positions(state: CellState, *logits: torch.Tensor) -> list[torch.Tensor]:
    """Logits at the batch's real positions only, where it has a per-position attention mask: what
    a fully masked (pad) query returns is the kernel's own (docs/gpu-runs/h100-2026-11-22) and feeds no loss."""
    mask = state.batch.get("attention_mask")
    if mask is None or any(t.shape[:2] != mask.shape for t in logits):
        return [t.float() for t in logits]
    return [t.float()[mask != 0] for t in logits]


def record_curve(state: CellState, losses: list[float]) -> checks.CurveDiverged | None:
    """The training losses of the applied steps, step by step, against the torch engine's at the same precision and
    against the fp32 twin's (matrix/results/curves.py), recorded; the first reference the curve leaves
    gives the failure to raise once the cell's other training checks ran."""
    from matrix.checks.tolerances import curve_vs_fp32_twin, curve_vs_torch_engine

    compute = curve_compute_dtype(state)
    family = state.engine.curve_family  # the engines whose measured spread its rows come from
    # a kind the spread was not measured on takes the unmeasured kinds' rows (tolerances.kind_row)
    same_precision = curve_vs_torch_engine(compute, family, state.kind.name)
    steps = schedule.train_steps()
    record = Curve(
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
            setattr(record, field, CurveComparison(reference=name, unchecked=unchecked))
            continue
        reference, error = reference_curve(state, precision)
        if error is not None:
            setattr(record, field, CurveComparison(reference=name, reference_error=error))
            continue
        compared = curves.compare(losses, reference, tolerance, name)
        setattr(record, field, CurveComparison.from_dict(compared.as_dict()))
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
    from matrix.checks.tolerances import curve_row_dtype

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
        state.metrics.cross_engine = CrossEngine(torch_engine_error=signature_of("torch engine", exc).text)
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
    state.metrics.cross_engine = CrossEngine(
        spread_abs=abs(loss - reference),
        tolerance=Tolerance(**tolerance.as_dict()),
        random_numbers=random_numbers,
        **{key: loss, f"torch_engine_{key}": reference},
    )
    checks.check_engine_agreement(key.replace("_", " "), loss, reference, tolerance)
