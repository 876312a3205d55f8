"""The torch engine: a hand-written loop with torch.autocast and torch.amp.GradScaler, the
way the precisions are defined (matrix/precisions.py)."""

from __future__ import annotations

import torch

from matrix import checks, resume
from matrix.engines.base import Engine, register
from matrix.phases import (
    TRAIN_STEPS,
    CellState,
    check_against_fp32,
    check_reload,
    check_training_contract,
    evaluate_in_precision,
    snapshot_trainable,
    train_step,
    train_until_applied,
)
from matrix.precisions import Precision, dtype_name

TRAINER_STATE_FILE = "trainer_state.pt"


def train_steps(state: CellState) -> None:
    state.build()
    state.model.train()
    state.optimizer = state.new_optimizer(state.model)
    state.scaler = state.precision.make_grad_scaler(state.device_type)
    trainable = snapshot_trainable(state.model, state.kind)
    dtypes = checks.tensor_dtypes(state.model)
    state.metrics.train_losses = train_until_applied(
        state, lambda: train_step(state, state.model, state.optimizer, state.scaler), TRAIN_STEPS
    )
    check_training_contract(state, state.model, trainable, dtypes)
    if state.scaler is not None:
        state.metrics.grad_scale = state.scaler.get_scale()


def mid_training_eval(state: CellState) -> None:
    result = evaluate_in_precision(state, state.model)
    check_against_fp32(state, result, "mid-training eval")
    state.model.train()


def evaluate(state: CellState) -> None:
    state.build()
    result = evaluate_in_precision(state, state.model)
    check_against_fp32(state, result, "eval")


def save_checkpoint(state: CellState, directory) -> None:
    """The model in its kind's own format, and the optimizer's and grad scaler's state beside it."""
    directory.mkdir(parents=True, exist_ok=True)
    state.kind.save(state.model, directory)
    if state.optimizer is not None:
        trainer_state = {"optimizer": state.optimizer.state_dict()}
        if state.scaler is not None:
            trainer_state["grad_scaler"] = state.scaler.state_dict()
        torch.save(trainer_state, directory / TRAINER_STATE_FILE)


def load_checkpoint(state: CellState, directory):
    """A fresh model from save_checkpoint()'s directory, checked against the saved one
    (check_reload); the optimizer and grad scaler restored onto it. Returns the model."""
    reloaded = state.kind.load(directory, state.precision, state.device, state.workdir)
    check_reload(state, reloaded)
    if state.optimizer is not None:
        # Trainer state holds only tensors and plain containers: no arbitrary unpickling.
        trainer_state = torch.load(directory / TRAINER_STATE_FILE, weights_only=True, map_location=state.device)
        optimizer = state.new_optimizer(reloaded)
        optimizer.load_state_dict(trainer_state["optimizer"])
        scaler = state.precision.make_grad_scaler(state.device_type)
        if scaler is not None:
            scaler.load_state_dict(trainer_state["grad_scaler"])
        state.optimizer, state.scaler = optimizer, scaler
    return reloaded


def checkpoint_save(state: CellState) -> None:
    state.outputs_before_save = evaluate_in_precision(state, state.model).logits
    directory = state.workdir / "checkpoint"
    save_checkpoint(state, directory)
    state.metrics.checkpoint_files = sorted(p.name for p in directory.iterdir())
    if state.optimizer is not None:
        resume.remember_point(state, state.optimizer, resume.scaler_state(state.scaler))


def checkpoint_reload(state: CellState) -> None:
    state.engine_state["uninterrupted"] = (state.model, state.optimizer, state.scaler)
    state.model = load_checkpoint(state, state.workdir / "checkpoint")


def continuation(state: CellState, model, optimizer, scaler) -> resume.Continuation:
    """Step k+1 of a hand-written loop, and what it is compared by."""
    return resume.Continuation(
        step=lambda: train_step(state, model, optimizer, scaler),
        tensors=lambda: resume.model_and_optimizer_tensors(model, optimizer),
    )


def resumed_step(state: CellState) -> None:
    model, optimizer, scaler = state.engine_state["uninterrupted"]
    model.train()
    resumed = continuation(state, state.model, state.optimizer, state.scaler)
    resume.resume_one_step(
        state, resumed, continuation(state, model, optimizer, scaler), resume.scaler_state(state.scaler)
    )


class TorchEngine(Engine):
    name = "torch"
    description = "hand-written loop: torch.autocast, torch.amp.GradScaler, AdamW"

    axis_position = 0
    train_steps = staticmethod(train_steps)
    mid_training_eval = staticmethod(mid_training_eval)
    checkpoint_save = staticmethod(checkpoint_save)
    checkpoint_reload = staticmethod(checkpoint_reload)
    resumed_step = staticmethod(resumed_step)
    evaluate = staticmethod(evaluate)

    def derive_settings(self, precision: Precision) -> dict:
        settings: dict = {}
        if precision.autocast_dtype is not None:
            settings["autocast"] = dtype_name(precision.autocast_dtype)
        if precision.grad_scaler:
            settings["grad_scaler"] = True
        if precision.grad_dtype is not None:
            settings["grad_dtype"] = dtype_name(precision.grad_dtype)
        if precision.grad_accumulation > 1:
            settings["grad_accumulation"] = precision.grad_accumulation
        return settings

    fixed_variant_fields = ()  # train_step accumulates the precision's (or variant's) micro-batches


register(TorchEngine())
