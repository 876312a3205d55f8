"""The accelerate engine: Accelerator(mixed_precision=...), prepare, accelerator.backward,
evaluation through the prepared model, save_state / load_state.

accelerate puts autocast around the prepared model's forward and converts its outputs to
fp32 (convert_outputs_to_fp32): evaluation, generate() included, goes through that wrapper,
as it does under the transformers Trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from matrix import checks
from matrix.engines.base import EngineSettings, Loop, Unsupported, one_switch_unsupported, register
from matrix.libraries.accelerate import reset_accelerate, resume_from_saved_state
from matrix.measurements import same_weights_copy
from matrix.precisions import Precision


@dataclass(frozen=True)
class AccelerateSettings(EngineSettings):
    mixed_precision: str = "no"  # accelerate's switch: no | fp16 | bf16


@dataclass
class AccelerateRun:
    accelerator: object  # accelerate.Accelerator
    model: torch.nn.Module  # as prepared: its forward autocasts
    optimizer: object | None = None  # accelerate's AcceleratedOptimizer


class AccelerateEngine(Loop):
    name = "accelerate"
    description = "accelerate.Accelerator: prepare, backward, save_state/load_state"
    axis_position = 1
    Run = AccelerateRun
    forward_autocasts = True
    requires = ("accelerate",)

    def derive_settings(self, precision: Precision) -> AccelerateSettings | Unsupported:
        unsupported = one_switch_unsupported(self.name, "an accelerate setting", precision)
        if unsupported:
            return unsupported
        switch = {None: "no", torch.float16: "fp16", torch.bfloat16: "bf16"}[precision.autocast_dtype]
        return AccelerateSettings(mixed_precision=switch)

    def _accelerator(self, state):
        from accelerate import Accelerator  # imported when a cell first runs here

        state.device_kind.activate(state.device)
        accelerator = Accelerator(mixed_precision=state.settings.mixed_precision, cpu=state.device.type == "cpu")
        state.metrics.engine_effective = {
            "mixed_precision": accelerator.mixed_precision,
            "native_amp": accelerator.native_amp,
            "grad_scaler": accelerator.scaler is not None,
            "device": str(accelerator.device),
        }
        return accelerator

    def start(self, state, model, training: bool) -> AccelerateRun:
        accelerator = self._accelerator(state)
        if not training:
            return AccelerateRun(accelerator, accelerator.prepare(model))
        model.train()
        prepared, optimizer = accelerator.prepare(model, state.new_optimizer(model))
        return AccelerateRun(accelerator, prepared, optimizer)

    def step(self, state, run: AccelerateRun) -> tuple[float, bool]:
        run.optimizer.zero_grad(set_to_none=True)
        loss = state.kind.loss(run.model, state.batch)  # autocast comes from the prepared forward
        value = checks.check_finite_loss(loss, "training loss")
        run.accelerator.backward(loss)
        run.optimizer.step()
        applied = not run.accelerator.optimizer_step_was_skipped
        checks.check_finite_parameters(list(run.model.named_parameters()), "after the optimizer step")
        return value, applied

    def scaler_state(self, state, run: AccelerateRun) -> dict | None:
        scaler = run.accelerator.scaler
        return None if scaler is None else scaler.state_dict()

    def exported(self, state, run: AccelerateRun):
        return same_weights_copy(state, run.model)  # without accelerate's forward wrapper

    def save(self, state, run: AccelerateRun, directory) -> None:
        run.accelerator.save_state(str(directory))

    def restore(self, state, directory, training: bool) -> AccelerateRun:
        return resume_from_saved_state(self, state, directory, training)

    def cleanup(self, state) -> None:
        reset_accelerate()


register(AccelerateEngine())
