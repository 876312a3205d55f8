"""The torch engine: a hand-written loop with torch.autocast and torch.amp.GradScaler, the way the
precisions are defined (matrix/precisions/policies.py), and the checkpoint most such loops write: the
model in its kind's own format, the optimizer's and grad scaler's state beside it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from matrix.engines.base import EngineSettings, Loop, LoopRun, register_with_compiled_twin
from matrix.harness.compiling import compile_module, plain
from matrix.precisions.policies import Precision, dtype_name

TRAINER_STATE_FILE = "trainer_state.pt"


@dataclass(frozen=True)
class TorchSettings(EngineSettings):
    autocast: str | None = None
    grad_scaler: bool | None = None
    grad_dtype: str | None = None
    grad_accumulation: int | None = None


def save_checkpoint(state, run: LoopRun, directory) -> None:
    """The model in its kind's own format, and the optimizer's and grad scaler's state beside it."""
    directory.mkdir(parents=True, exist_ok=True)
    state.kind.save(plain(run.model), directory)  # a kind saves the module, never torch.compile's wrapper
    if run.optimizer is not None:
        trainer_state = {"optimizer": run.optimizer.state_dict()}
        if run.scaler is not None:
            trainer_state["grad_scaler"] = run.scaler.state_dict()
        torch.save(trainer_state, directory / TRAINER_STATE_FILE)


def load_checkpoint(state, directory, training: bool) -> LoopRun:
    """A fresh model from save_checkpoint()'s directory, its optimizer and grad scaler restored."""
    model = state.load(directory)  # the kind's own load
    if not training:
        return LoopRun(model)
    # Trainer state holds only tensors and plain containers: no arbitrary unpickling.
    trainer_state = torch.load(directory / TRAINER_STATE_FILE, weights_only=True, map_location=state.device)
    optimizer = state.new_optimizer(model)
    optimizer.load_state_dict(trainer_state["optimizer"])
    scaler = state.new_grad_scaler()
    if scaler is not None:
        scaler.load_state_dict(trainer_state["grad_scaler"])
    return LoopRun(model, optimizer, scaler)


class TorchEngine(Loop):
    name = "torch"
    compiled_traits = frozenset({"compiles-under-autocast"})  # the loop's autocast is around the compiled model
    description = "hand-written loop: torch.autocast, torch.amp.GradScaler, AdamW"
    axis_position = 0
    fixed_variant_fields = ()  # its step accumulates the precision's (or variant's) micro-batches
    compile_how = "model = torch.compile(model) before the loop, and after loading a checkpoint"

    def derive_settings(self, precision: Precision) -> TorchSettings:
        return TorchSettings(
            autocast=dtype_name(precision.autocast_dtype) if precision.autocast_dtype is not None else None,
            grad_scaler=True if precision.grad_scaler else None,
            grad_dtype=dtype_name(precision.grad_dtype) if precision.grad_dtype is not None else None,
            grad_accumulation=precision.grad_accumulation if precision.grad_accumulation > 1 else None,
        )

    def start(self, state, model, training: bool) -> LoopRun:
        if not training:
            return LoopRun(self.compiled_if_asked(model))
        model.train()
        return LoopRun(self.compiled_if_asked(model), state.new_optimizer(model), state.new_grad_scaler())

    def compiled_if_asked(self, model):
        return compile_module(model) if self.compiled else model

    def save(self, state, run: LoopRun, directory) -> None:
        save_checkpoint(state, run, directory)

    def export(self, state, run: LoopRun, directory, checkpoint):
        return checkpoint  # the model in its kind's own format is already there

    def restore(self, state, directory, training: bool) -> LoopRun:
        run = load_checkpoint(state, directory, training)
        run.model = self.compiled_if_asked(run.model)
        return run


register_with_compiled_twin(TorchEngine())
