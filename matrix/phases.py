"""What every cell runs, phase by phase, whatever the engine, and the result it hands to the
report.

train: train_steps -> mid_training_eval -> checkpoint_save -> checkpoint_reload -> resumed_step
eval:  evaluate -> checkpoint_save -> checkpoint_reload

An engine (matrix/engines/) supplies one function per phase name. The first phase that raises
ends the cell; its exception becomes the signature. Where a library runs several phases in
one call (Trainer.train() steps, evaluates and saves), the engine tags the exception with the
phase the library was in (`matrix_phase`), and the phases before it count as passed.
Phases after the failing one are recorded as not run. Nothing is caught that is not recorded.
"""

from __future__ import annotations

import copy
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from matrix import checks
from matrix.cells import Cell
from matrix.devices import torch_device
from matrix.models import MODELS, ModelKind
from matrix.precisions import PRECISIONS, Precision, dtype_name
from matrix.signatures import Signature, signature_of
from matrix.tolerances import CHECKPOINT_ROUND_TRIP, eval_loss_tolerance

PHASE_NAMES: dict[str, tuple[str, ...]] = {
    "train": ("train_steps", "mid_training_eval", "checkpoint_save", "checkpoint_reload", "resumed_step"),
    "eval": ("evaluate", "checkpoint_save", "checkpoint_reload"),
}
TRAIN_STEPS = 3  # optimizer steps actually applied
LEARNING_RATE = 1e-2


@dataclass
class CellResult:
    cell: Cell
    outcome: str  # passed | failed
    phase: str | None = None  # the phase that failed
    signature: Signature | None = None
    message: str | None = None  # the exception's own message, unnormalized
    traceback: str | None = None
    duration_s: float = 0.0
    phases: dict[str, str] = field(default_factory=dict)  # phase -> passed | failed | not run
    metrics: dict = field(default_factory=dict)


@dataclass
class CellState:
    """What the phases of one cell hand to each other."""

    cell: Cell
    kind: ModelKind
    precision: Precision
    device: torch.device
    workdir: Path
    metrics: dict
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scaler: torch.amp.GradScaler | None = None
    batch: dict | None = None
    outputs_before_save: torch.Tensor | None = None
    engine_state: dict = field(default_factory=dict)  # what an engine keeps between its phases

    @property
    def device_type(self) -> str:
        return self.device.type

    def build(self) -> None:
        self.model = self.kind.build(self.precision, self.device, self.workdir)
        self.batch = self.kind.batch(self.device)
        self.metrics["effective"] = effective_settings(self)
        watch_first_forward(self, self.model)
        checks.check_dtypes(self.kind.precision_weights(self.model), self.precision.weights_dtype, "after build")

    def new_optimizer(self, model) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)


def effective_settings(state: CellState) -> dict:
    """What is actually in force, not only what the precision's name promises."""
    dtypes: dict[str, int] = {}
    trainable: dict[str, int] = {}
    for p in state.model.parameters():
        dtypes[dtype_name(p.dtype)] = dtypes.get(dtype_name(p.dtype), 0) + p.numel()
        if p.requires_grad:
            trainable[dtype_name(p.dtype)] = trainable.get(dtype_name(p.dtype), 0) + p.numel()
    with state.precision.autocast(state.device_type):
        autocast_on = torch.is_autocast_enabled(state.device_type)
        autocast_dtype = torch.get_autocast_dtype(state.device_type) if autocast_on else None
    scaler = state.precision.make_grad_scaler(state.device_type)
    return {
        "parameter_dtypes": dtypes,
        "trainable_parameter_dtypes": trainable,
        "autocast_dtype": dtype_name(autocast_dtype) if autocast_dtype else None,
        "grad_scaler": scaler is not None and scaler.is_enabled(),
        "device": str(state.device),
    }


def watch_first_forward(state: CellState, model) -> None:
    """Record the autocast state in force inside the model's first forward.

    The hook sits on the first Linear, inside whatever wrapper an engine puts around the
    model's forward, so it sees what the engine really does (accelerate does not autocast to
    fp16 on a CPU; Lightning turns 16-mixed into bf16 there), not what was asked for.
    """
    first_linear = next((m for m in model.modules() if isinstance(m, torch.nn.Linear)), None)
    if first_linear is None:
        return

    def observe(module, args):
        enabled = torch.is_autocast_enabled(state.device_type)
        dtype = torch.get_autocast_dtype(state.device_type) if enabled else None
        state.metrics["effective"]["autocast_dtype_in_forward"] = dtype_name(dtype) if dtype else None
        state.metrics["effective"]["first_linear_input_dtype"] = next(
            (dtype_name(a.dtype) for a in args if isinstance(a, torch.Tensor)), None
        )
        handle.remove()

    handle = first_linear.register_forward_pre_hook(observe)


# ---------------------------------------------------------------- shared checks


def evaluate_in_precision(state: CellState, model):
    """Evaluation as the precision defines it: eval mode, no_grad, the precision's autocast."""
    model.eval()
    with torch.no_grad(), state.precision.autocast(state.device_type):
        return state.kind.evaluate(model, state.batch)


def check_against_fp32(state: CellState, result, label: str) -> None:
    """Evaluation loss vs an fp32 copy of the same weights on the same batch, no autocast."""
    reference_model = copy.deepcopy(state.model).to(torch.float32)
    reference_model.eval()
    with torch.no_grad():
        reference = state.kind.evaluate(reference_model, state.batch)
    value = checks.check_finite_loss(result.loss, f"{label} loss")
    ref_value = checks.check_finite_loss(reference.loss, f"fp32 reference {label} loss")
    tolerance = eval_loss_tolerance(state.cell.model, state.precision.compute_dtype)
    state.metrics.update(
        {
            "eval_loss": value,
            "fp32_reference_loss": ref_value,
            "fp32_deviation_abs": abs(value - ref_value),
            "fp32_deviation_rel": abs(value - ref_value) / abs(ref_value) if ref_value else None,
            "fp32_tolerance": tolerance.as_dict(),
            "eval_logits_dtype": dtype_name(result.logits.dtype),
            **({"eval_" + k: v for k, v in result.extras.items()}),
        }
    )
    if result.generated is not None:
        state.metrics["generated_tokens"] = result.generated.shape[-1] - state.batch["input_ids"].shape[-1]
        state.metrics["generation_matches_fp32"] = reference.generated is not None and torch.equal(
            result.generated, reference.generated
        )
    checks.check_within_tolerance(f"{label} loss", value, ref_value, tolerance)


def snapshot_trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def check_training_contract(state: CellState, model, trainable_before, dtypes_before) -> None:
    """After training: parameters changed, stayed finite, kept their dtypes and the precision's."""
    checks.check_finite_parameters(list(model.named_parameters()), "after training")
    checks.check_parameters_changed(trainable_before, model)
    checks.check_same_dtypes(dtypes_before, model, "after training")
    checks.check_dtypes(state.kind.precision_weights(model), state.precision.weights_dtype, "after training")


def check_reload(state: CellState, reloaded) -> None:
    """A fresh model from the checkpoint reproduces the dtypes and the outputs, bit for bit."""
    checks.check_same_dtypes(checks.tensor_dtypes(state.model), reloaded, "after reload")
    outputs = evaluate_in_precision(state, reloaded).logits
    state.metrics["reload_max_abs_difference"] = checks.check_outputs_equal(
        "eval logits", state.outputs_before_save, outputs, CHECKPOINT_ROUND_TRIP
    )


# ---------------------------------------------------------------- running a cell


def run_cell(cell: Cell, workdir: Path, cuda_index: int = 0) -> CellResult:
    from matrix.engines import ENGINES

    precision = PRECISIONS[cell.precision]
    state = CellState(
        cell=cell,
        kind=MODELS[cell.model],
        precision=precision,
        device=torch_device(cell.device, cuda_index),
        workdir=workdir,
        metrics={"declared": precision.settings()},
    )
    engine = ENGINES[cell.engine]
    state.metrics["engine_settings"] = engine.settings(precision)
    phases = engine.phases(cell.mode)
    names = PHASE_NAMES[cell.mode]
    result = CellResult(cell=cell, outcome="passed", metrics=state.metrics)
    result.phases = {name: "not run" for name in names}
    start = time.perf_counter()
    try:
        for name in names:
            try:
                phases[name](state)
            except Exception as exc:  # recorded below: signature, message and full traceback
                failed = getattr(exc, "matrix_phase", None) or name
                for earlier in names[names.index(name) : names.index(failed)]:
                    result.phases[earlier] = "passed"
                result.outcome, result.phase = "failed", failed
                result.signature = signature_of(failed, exc)
                result.message = f"{type(exc).__name__}: {exc}"
                if getattr(exc, "details", None):
                    result.message += f" ({exc.details})"
                result.traceback = "".join(traceback.format_exception(exc))
                result.phases[failed] = "failed"
                break
            result.phases[name] = "passed"
    finally:
        engine.cleanup(state)
    result.duration_s = round(time.perf_counter() - start, 4)
    return result
