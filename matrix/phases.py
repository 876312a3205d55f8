"""What a cell runs, phase by phase, and the result it hands to the report.

train: train_steps -> mid_training_eval -> checkpoint_save -> checkpoint_reload -> resumed_step
eval:  evaluate -> checkpoint_save -> checkpoint_reload

The first phase that raises ends the cell; its exception becomes the signature. Phases after
it are recorded as not run. Nothing is caught that is not recorded.
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

TRAIN_STEPS = 3  # optimizer steps actually applied
# GradScaler starts at 2**16 and halves the scale on every overflow, skipping that step by
# design; on these tiny models the first few fp16 steps overflow. Attempts are capped so
# a scaler that never recovers is a failure, not a hang.
MAX_STEP_ATTEMPTS = 16
LEARNING_RATE = 1e-2
TRAINER_STATE_FILE = "trainer_state.pt"


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

    @property
    def device_type(self) -> str:
        return self.device.type

    def build(self) -> None:
        self.model = self.kind.build(self.precision, self.device, self.workdir)
        self.batch = self.kind.batch(self.device)
        self.metrics["effective"] = effective_settings(self)
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


# ---------------------------------------------------------------- train phases


def _train_step(state: CellState, model, optimizer, scaler) -> tuple[float, bool]:
    """One optimizer step. Returns (loss, whether the step was applied)."""
    optimizer.zero_grad(set_to_none=True)
    with state.precision.autocast(state.device_type):
        loss = state.kind.loss(model, state.batch)
    value = checks.check_finite_loss(loss, "training loss")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if scaler is None:
        loss.backward()
        checks.check_finite_gradients(named)
        optimizer.step()
        applied = True
    else:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # GradScaler refuses fp16 gradients here, by its own rule
        overflow = bool(checks.nonfinite_gradients(named))  # such a step is skipped by design
        scaler.step(optimizer)
        scaler.update()
        applied = not overflow
    checks.check_finite_parameters(named, "after the optimizer step")
    return value, applied


def _train_until_applied(state: CellState, model, optimizer, scaler, steps: int) -> list[float]:
    losses, skipped = [], 0
    while len(losses) - skipped < steps:
        if len(losses) == MAX_STEP_ATTEMPTS:
            raise checks.NonFiniteValue(
                "gradients kept overflowing: the grad scaler skipped every step",
                details=f"{skipped} of {len(losses)} attempts skipped, scale now {scaler.get_scale()}",
            )
        loss, applied = _train_step(state, model, optimizer, scaler)
        losses.append(loss)
        skipped += not applied
    state.metrics["steps_skipped_by_grad_scaler"] = state.metrics.get("steps_skipped_by_grad_scaler", 0) + skipped
    return losses


def train_steps(state: CellState) -> None:
    state.build()
    state.model.train()
    state.optimizer = state.new_optimizer(state.model)
    state.scaler = state.precision.make_grad_scaler(state.device_type)
    trainable = {n: p.detach().clone() for n, p in state.model.named_parameters() if p.requires_grad}
    dtypes = checks.tensor_dtypes(state.model)
    state.metrics["train_losses"] = _train_until_applied(state, state.model, state.optimizer, state.scaler, TRAIN_STEPS)
    checks.check_parameters_changed(trainable, state.model)
    checks.check_same_dtypes(dtypes, state.model, "after training")
    checks.check_dtypes(state.kind.precision_weights(state.model), state.precision.weights_dtype, "after training")
    if state.scaler is not None:
        state.metrics["grad_scale"] = state.scaler.get_scale()


def _evaluate(state: CellState, model):
    model.eval()
    with torch.no_grad(), state.precision.autocast(state.device_type):
        return state.kind.evaluate(model, state.batch)


def _check_against_fp32(state: CellState, result, label: str) -> None:
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


def mid_training_eval(state: CellState) -> None:
    result = _evaluate(state, state.model)
    _check_against_fp32(state, result, "mid-training eval")
    state.model.train()


def evaluate(state: CellState) -> None:
    state.build()
    result = _evaluate(state, state.model)
    _check_against_fp32(state, result, "eval")


def checkpoint_save(state: CellState) -> None:
    state.outputs_before_save = _evaluate(state, state.model).logits
    directory = state.workdir / "checkpoint"
    directory.mkdir(parents=True, exist_ok=True)
    state.kind.save(state.model, directory)
    if state.optimizer is not None:
        trainer_state = {"optimizer": state.optimizer.state_dict()}
        if state.scaler is not None:
            trainer_state["grad_scaler"] = state.scaler.state_dict()
        torch.save(trainer_state, directory / TRAINER_STATE_FILE)
    state.metrics["checkpoint_files"] = sorted(p.name for p in directory.iterdir())


def checkpoint_reload(state: CellState) -> None:
    directory = state.workdir / "checkpoint"
    dtypes = checks.tensor_dtypes(state.model)
    reloaded = state.kind.load(directory, state.precision, state.device, state.workdir)
    checks.check_same_dtypes(dtypes, reloaded, "after reload")
    outputs = _evaluate(state, reloaded).logits
    state.metrics["reload_max_abs_difference"] = checks.check_outputs_equal(
        "eval logits", state.outputs_before_save, outputs, CHECKPOINT_ROUND_TRIP
    )
    if state.optimizer is not None:
        # Trainer state holds only tensors and plain containers: no arbitrary unpickling.
        trainer_state = torch.load(directory / TRAINER_STATE_FILE, weights_only=True, map_location=state.device)
        optimizer = state.new_optimizer(reloaded)
        optimizer.load_state_dict(trainer_state["optimizer"])
        scaler = state.precision.make_grad_scaler(state.device_type)
        if scaler is not None:
            scaler.load_state_dict(trainer_state["grad_scaler"])
        state.optimizer, state.scaler = optimizer, scaler
    state.model = reloaded


def resumed_step(state: CellState) -> None:
    state.model.train()
    before = {n: p.detach().clone() for n, p in state.model.named_parameters() if p.requires_grad}
    state.metrics["resumed_losses"] = _train_until_applied(state, state.model, state.optimizer, state.scaler, 1)
    checks.check_parameters_changed(before, state.model)


PHASES: dict[str, tuple] = {
    "train": (train_steps, mid_training_eval, checkpoint_save, checkpoint_reload, resumed_step),
    "eval": (evaluate, checkpoint_save, checkpoint_reload),
}


def phase_names(mode: str) -> list[str]:
    return [phase.__name__ for phase in PHASES[mode]]


def run_cell(cell: Cell, workdir: Path, cuda_index: int = 0) -> CellResult:
    precision = PRECISIONS[cell.precision]
    state = CellState(
        cell=cell,
        kind=MODELS[cell.model],
        precision=precision,
        device=torch_device(cell.device, cuda_index),
        workdir=workdir,
        metrics={"declared": precision.settings()},
    )
    result = CellResult(cell=cell, outcome="passed", metrics=state.metrics)
    result.phases = {name: "not run" for name in phase_names(cell.mode)}
    start = time.perf_counter()
    for phase in PHASES[cell.mode]:
        try:
            phase(state)
        except Exception as exc:  # recorded below: signature, message and full traceback
            result.outcome, result.phase = "failed", phase.__name__
            result.signature = signature_of(phase.__name__, exc)
            result.message = f"{type(exc).__name__}: {exc}"
            if getattr(exc, "details", None):
                result.message += f" ({exc.details})"
            result.traceback = "".join(traceback.format_exception(exc))
            result.phases[phase.__name__] = "failed"
            break
        result.phases[phase.__name__] = "passed"
    result.duration_s = round(time.perf_counter() - start, 4)
    return result
