"""The accelerate engine: Accelerator(mixed_precision=...), prepare, accelerator.backward,
evaluation through the prepared model, save_state / load_state.

accelerate puts autocast around the prepared model's forward and converts its outputs to
fp32 (convert_outputs_to_fp32): evaluation, generate() included, goes through that wrapper,
as it does under the transformers Trainer.
"""

from __future__ import annotations

import torch

from matrix import checks, resume
from matrix.engines.base import Engine, Unsupported, one_switch_unsupported, register
from matrix.phases import (
    TRAIN_STEPS,
    CellState,
    check_against_fp32,
    check_agrees_with_torch_engine,
    check_reload,
    check_training_contract,
    snapshot_trainable,
    train_until_applied,
)
from matrix.precisions import Precision


def _accelerator(state: CellState):
    from accelerate import Accelerator  # imported when a cell first runs here

    state.device_kind.activate(state.device)
    settings = state.metrics.engine_settings
    accelerator = Accelerator(mixed_precision=settings["mixed_precision"], cpu=state.device.type == "cpu")
    state.metrics.engine_effective = {
        "mixed_precision": accelerator.mixed_precision,
        "native_amp": accelerator.native_amp,
        "grad_scaler": accelerator.scaler is not None,
        "device": str(accelerator.device),
    }
    return accelerator


def reset_accelerate(state: CellState) -> None:
    """The Accelerator's state is a process-wide singleton: forget it."""
    from accelerate.state import AcceleratorState, GradientState

    state.engine_state.pop("accelerator", None)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _prepare(state: CellState, model, with_optimizer: bool):
    accelerator = state.engine_state.get("accelerator") or _accelerator(state)
    state.engine_state["accelerator"] = accelerator
    if not with_optimizer:
        return accelerator.prepare(model), None
    optimizer = state.new_optimizer(model)
    return accelerator.prepare(model, optimizer)


def _step(state: CellState, model, optimizer, accelerator=None) -> tuple[float, bool]:
    accelerator = accelerator or state.engine_state["accelerator"]
    optimizer.zero_grad(set_to_none=True)
    loss = state.kind.loss(model, state.batch)  # autocast comes from the prepared forward
    value = checks.check_finite_loss(loss, "training loss")
    accelerator.backward(loss)
    optimizer.step()
    applied = not accelerator.optimizer_step_was_skipped
    checks.check_finite_parameters(list(model.named_parameters()), "after the optimizer step")
    return value, applied


def _evaluate(state: CellState, model):
    model.eval()
    with state.eval_grad_context():
        return state.kind.evaluate(model, state.batch)


def train_steps(state: CellState) -> None:
    state.build()
    state.model.train()
    trainable, dtypes = snapshot_trainable(state.model, state.kind), checks.tensor_dtypes(state.model)
    state.model, state.optimizer = _prepare(state, state.model, with_optimizer=True)
    losses = train_until_applied(state, lambda: _step(state, state.model, state.optimizer), TRAIN_STEPS)
    state.metrics.train_losses = losses
    check_training_contract(state, state.model, trainable, dtypes)
    check_agrees_with_torch_engine(state, losses[0], "train")


def mid_training_eval(state: CellState) -> None:
    check_against_fp32(state, _evaluate(state, state.model), "mid-training eval")
    state.model.train()


def evaluate(state: CellState) -> None:
    state.build()
    state.model, _ = _prepare(state, state.model, with_optimizer=False)
    result = _evaluate(state, state.model)
    check_against_fp32(state, result, "eval")
    check_agrees_with_torch_engine(state, result.loss.float().item(), "eval")


def checkpoint_save(state: CellState) -> None:
    state.outputs_before_save = _evaluate(state, state.model).logits
    directory = state.workdir / "accelerate-state"
    state.engine_state["accelerator"].save_state(str(directory))
    state.metrics.checkpoint_files = sorted(p.name for p in directory.iterdir())
    if state.optimizer is not None:
        resume.remember_point(state, state.optimizer, _scaler_state(state.engine_state["accelerator"]))


def _scaler_state(accelerator) -> dict | None:
    return resume.scaler_state(accelerator.scaler)


def checkpoint_reload(state: CellState) -> None:
    # the interrupted run goes on beside the resumed one: step k+1 is taken on both
    state.engine_state["uninterrupted"] = (state.model, state.optimizer, state.engine_state["accelerator"])
    # A resumed run starts a new Accelerator, as a new process would.
    reset_accelerate(state)
    fresh = state.kind.build(state.precision, state.device, state.workdir)
    fresh, optimizer = _prepare(state, fresh, with_optimizer=state.optimizer is not None)
    state.engine_state["accelerator"].load_state(str(state.workdir / "accelerate-state"))
    check_reload(state, fresh, evaluate=_evaluate)
    state.model, state.optimizer = fresh, optimizer


def _continuation(state: CellState, model, optimizer, accelerator) -> resume.Continuation:
    return resume.Continuation(
        step=lambda: _step(state, model, optimizer, accelerator),
        tensors=lambda: resume.model_and_optimizer_tensors(model, optimizer),
    )


def resumed_step(state: CellState) -> None:
    model, optimizer, accelerator = state.engine_state["uninterrupted"]
    model.train()
    current = state.engine_state["accelerator"]
    resumed = _continuation(state, state.model, state.optimizer, current)
    resume.resume_one_step(state, resumed, _continuation(state, model, optimizer, accelerator), _scaler_state(current))


class AccelerateEngine(Engine):
    name = "accelerate"
    description = "accelerate.Accelerator: prepare, backward, save_state/load_state"

    axis_position = 1
    train_steps = staticmethod(train_steps)
    mid_training_eval = staticmethod(mid_training_eval)
    checkpoint_save = staticmethod(checkpoint_save)
    checkpoint_reload = staticmethod(checkpoint_reload)
    resumed_step = staticmethod(resumed_step)
    evaluate = staticmethod(evaluate)

    def derive_settings(self, precision: Precision) -> dict | Unsupported:
        unsupported = one_switch_unsupported(self.name, "an accelerate setting", precision)
        if unsupported:
            return unsupported
        return {
            "mixed_precision": {None: "no", torch.float16: "fp16", torch.bfloat16: "bf16"}[precision.autocast_dtype]
        }

    def cleanup(self, state: CellState) -> None:
        reset_accelerate(state)


register(AccelerateEngine())
