"""The accelerate engine: Accelerator(mixed_precision=...), prepare, accelerator.backward,
evaluation through the prepared model, save_state / load_state.

accelerate puts autocast around the prepared model's forward and converts its outputs to
fp32 (convert_outputs_to_fp32): evaluation, generate() included, goes through that wrapper,
as it does under the transformers Trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from matrix.checks import assertions as checks
from matrix.engines.base import EngineSettings, Loop, Unsupported, one_switch_unsupported, register_with_compiled_twin
from matrix.engines.libraries.accelerate import fp8_handlers, reset_accelerate, resume_from_saved_state
from matrix.harness.compiling import plain
from matrix.harness.measurements import same_weights_copy
from matrix.precisions.policies import Precision


@dataclass(frozen=True)
class AccelerateSettings(EngineSettings):
    mixed_precision: str = "no"  # accelerate's switch: no | fp16 | bf16 | fp8
    fp8_backend: str | None = None  # fp8: AORecipeKwargs, torchao's recipe (matrix/precisions/float8.py)
    fp8_recipe: str | None = None


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
    compile_how = "Accelerator(dynamo_backend='inductor'): prepare() compiles the model"
    converts_float8 = True  # mixed_precision='fp8' with AORecipeKwargs: prepare() converts the model

    def derive_settings(self, precision: Precision) -> AccelerateSettings | Unsupported:
        unsupported = one_switch_unsupported(self.name, "an accelerate setting", precision)
        if unsupported:
            return unsupported
        if precision.float8 is not None:
            return AccelerateSettings(mixed_precision="fp8", fp8_backend="ao", fp8_recipe=precision.float8.recipe)
        switch = {None: "no", torch.float16: "fp16", torch.bfloat16: "bf16"}[precision.autocast_dtype]
        return AccelerateSettings(mixed_precision=switch)

    def _accelerator(self, state):
        from accelerate import Accelerator  # imported when a cell first runs here

        state.device_kind.activate(state.device)
        options = {"dynamo_backend": "inductor"} if self.compiled else {}
        if state.settings.fp8_backend == "ao":
            options["kwargs_handlers"] = fp8_handlers(state)
        accelerator = Accelerator(
            mixed_precision=state.settings.mixed_precision, cpu=state.device.type == "cpu", **options
        )
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
        return same_weights_copy(state, plain(run.model))  # without accelerate's forward wrapper, or compile's

    def save(self, state, run: AccelerateRun, directory) -> None:
        run.accelerator.save_state(str(directory))

    def restore(self, state, directory, training: bool) -> AccelerateRun:
        return resume_from_saved_state(self, state, directory, training)

    def cleanup(self, state) -> None:
        reset_accelerate()


register_with_compiled_twin(AccelerateEngine())
