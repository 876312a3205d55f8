"""The accelerate-fsdp2 engine: accelerate's own FSDP2 path on a real process group, each rank
training on its rows of the batch. Accelerator(mixed_precision=..., fsdp_plugin=
FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")),
prepare(model, optimizer) (accelerate's fsdp2_prepare_model: fully_shard per transformer
layer, its MixedPrecisionPolicy, its fp32 upcast of trained parameters), accelerator.backward,
save_state / load_state (DCP), and get_state_dict for the full checkpoint a plain model reads.

What accelerate declares, and this engine checks: under mixed precision it keeps the trained
parameters as fp32 master weights, whatever dtype they were loaded in (fsdp2_prepare_model
upcasts them and warns "FSDP upcast of low precision parameters to fp32"); without mixed
precision, prepare leaves every dtype as it was. The export, read back in the cell's precision,
must give the trained weights read in that precision (fp32 master weights rounded to the
precision's dtype, as from_pretrained(dtype=) rounds).

Selecting FSDP on a CPU. accelerate's AcceleratorState turns a distributed run into FSDP only on
accelerator devices (state.py: MULTI_GPU, MULTI_XPU, ...); on a CPU group it stays MULTI_CPU
and ignores the plugin. Here the engine then makes the selection AcceleratorState makes on a
GPU (distributed_type FSDP in both shared states, the plugin's mixed precision set, the plugin
attached) and records that it did (engine_effective "fsdp_selected_by"). Everything after that
is accelerate's own code, run on gloo: the CPU half of the matrix reaches the FSDP2 code that
users run on GPUs. On CUDA accelerate selects FSDP itself.

Its compiled twin, `accelerate-fsdp2-compile`, adds dynamo_backend="inductor": prepare compiles
the sharded model whole (torch.compile), after fully_shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from matrix.checks import assertions as checks
from matrix.engines.base import (
    ALWAYS,
    EngineSettings,
    Loop,
    Unsupported,
    one_switch_unsupported,
    register_with_compiled_twin,
)
from matrix.engines.distributed import DistributedEngine, GatheredWeights, set_launcher_environment
from matrix.engines.libraries.accelerate import fp8_handlers, reset_accelerate, resume_from_saved_state
from matrix.harness.measurements import fresh_model
from matrix.harness.torch_step import loss_weight
from matrix.precisions.policies import Precision, dtype_name
from matrix.results.metrics import UNSET

MIXED_PRECISION = {None: "no", "float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class AccelerateFSDP2Settings(EngineSettings):
    mixed_precision: str = field(default="no", metadata=ALWAYS)
    mixed_precision_policy: dict | None = field(default=None, metadata=ALWAYS)
    fp8_backend: str | None = None  # fp8: AORecipeKwargs, torchao's recipe (matrix/precisions/float8.py)
    fp8_recipe: str | None = None


@dataclass
class AccelerateFSDP2Run:
    accelerator: object  # accelerate.Accelerator on its FSDP2 path
    model: torch.nn.Module  # as prepared: sharded, its forward autocasting
    optimizer: object | None = None
    steps: int = 0
    gathered: torch.nn.Module | None = None
    gathered_at: int = -1

    @property
    def scaler(self):
        return self.accelerator.scaler


def check_fp32_master_weights(model, when: str) -> None:
    """accelerate's declaration under mixed precision: the trained parameters are fp32 master weights."""
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    checks.check_dtypes(trained, torch.float32, f"{when}, the trained parameters (fp32 master weights under FSDP2)")


def _name(value):
    return dtype_name(value) if isinstance(value, torch.dtype) else value


class AccelerateFSDP2Engine(DistributedEngine, GatheredWeights, Loop):
    name = "accelerate-fsdp2"
    axis_position = 6
    description = "accelerate's FSDP2 path: prepare (fully_shard per layer, fp32 master weights), save_state/load_state"
    Run = AccelerateFSDP2Run
    forward_autocasts = True
    traits = frozenset({"casts-parameters"})  # fsdp2_prepare_model's MixedPrecisionPolicy param_dtype
    requires = ("accelerate",)
    compile_how = "Accelerator(dynamo_backend='inductor'): prepare() compiles the sharded model"
    converts_float8 = True  # mixed_precision='fp8' with AORecipeKwargs: prepare() converts, then shards

    def derive_settings(self, precision: Precision) -> AccelerateFSDP2Settings | Unsupported:
        unsupported = one_switch_unsupported(self.name, "an accelerate setting", precision)
        if unsupported:
            return unsupported
        compute = dtype_name(precision.autocast_dtype) if precision.autocast_dtype else None
        policy = None
        if compute is not None:
            # param and output dtypes as accelerate sets them for the switch; the reduce dtype the
            # precision's (accelerate's own default reduces in the compute dtype too)
            reduce = dtype_name(precision.reduce_dtype) if precision.reduce_dtype else "float32"
            policy = {"param_dtype": compute, "reduce_dtype": reduce, "output_dtype": compute}
        if precision.float8 is not None:  # its FSDP plugin maps fp8 onto bf16 parameters, as bf16
            return AccelerateFSDP2Settings(
                mixed_precision="fp8",
                mixed_precision_policy=policy,
                fp8_backend="ao",
                fp8_recipe=precision.float8.recipe,
            )
        return AccelerateFSDP2Settings(mixed_precision=MIXED_PRECISION[compute], mixed_precision_policy=policy)

    def _plugin(self, state, model):
        from accelerate.utils import FullyShardedDataParallelPlugin

        options: dict = {"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"}
        if state.settings.mixed_precision_policy is not None:
            policy = state.settings.mixed_precision_policy
            options["mixed_precision_policy"] = {k: getattr(torch, v) for k, v in policy.items()}
        layers = getattr(model, "_no_split_modules", None)
        if layers:  # a transformers model names its layers: one FSDP unit each, as users configure it
            options["auto_wrap_policy"] = "transformer_based_wrap"
            options["transformer_cls_names_to_wrap"] = list(layers)
        return FullyShardedDataParallelPlugin(**options)

    def _accelerator(self, state, model):
        """A new Accelerator on FSDP2 for this rank (accelerate's state is process-wide)."""
        from accelerate import Accelerator
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType

        set_launcher_environment(state, also_restored=("ACCELERATE_USE_FSDP",))
        state.device_kind.activate(state.device)
        mixed = state.settings.mixed_precision
        plugin = self._plugin(state, model)
        options: dict = {"dynamo_backend": "inductor"} if self.compiled else {}
        if state.settings.fp8_backend == "ao":
            options["kwargs_handlers"] = fp8_handlers(state)
        accelerator = Accelerator(mixed_precision=mixed, cpu=state.device.type == "cpu", fsdp_plugin=plugin, **options)
        selected_by = "accelerate"
        if accelerator.distributed_type != DistributedType.FSDP:
            # accelerate selects FSDP on accelerator devices only: make the selection it makes there
            selected_by = (
                f"the matrix (accelerate leaves a {accelerator.device.type} group {accelerator.distributed_type})"
            )
            accelerator.state.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            if mixed != "no":
                plugin.set_mixed_precision(mixed)
            accelerator.state.fsdp_plugin = plugin
        if not accelerator.is_fsdp2:
            raise RuntimeError(
                f"accelerate did not take the FSDP2 path (distributed_type {accelerator.distributed_type})"
            )
        policy = accelerator.state.fsdp_plugin.mixed_precision_policy
        state.metrics.engine_effective = {
            "fsdp_selected_by": selected_by,
            "mixed_precision": accelerator.mixed_precision,
            "native_amp": accelerator.native_amp,
            "grad_scaler": accelerator.scaler is not None,
            "mp_policy": None if policy is None else {k: _name(v) for k, v in vars(policy).items()},
            "auto_wrap_policy": plugin.auto_wrap_policy.__name__ if callable(plugin.auto_wrap_policy) else None,
            "device": str(accelerator.device),
        }
        return accelerator

    def start(self, state, model, training: bool) -> AccelerateFSDP2Run:
        """prepare(model, optimizer): accelerate's FSDP2 path takes both together, in eval too."""
        accelerator = self._accelerator(state, model)
        model.train(training)
        prepared, optimizer = accelerator.prepare(model, state.new_optimizer(model))
        state.metrics.engine_effective["trained_parameter_dtypes_after_prepare"] = sorted(
            {dtype_name(p.dtype) for p in prepared.parameters() if p.requires_grad}
        )
        return AccelerateFSDP2Run(accelerator, prepared, optimizer)

    def check_declared(self, state, run: AccelerateFSDP2Run, when: str) -> None:
        """What accelerate declares for FSDP2: with mixed precision, the trained parameters are
        fp32 master weights; without it, prepare leaves every dtype as built (the precision's)."""
        if state.settings.mixed_precision == "no":
            super().check_declared(state, run, when)
            return
        check_fp32_master_weights(self.weights(state, run), when)

    def step(self, state, run: AccelerateFSDP2Run) -> tuple[float, bool]:
        run.steps += 1
        group = state.group
        rows = group.rows(state.batch)
        run.optimizer.zero_grad(set_to_none=True)
        loss = state.kind.loss(run.model, rows)  # autocast comes from the prepared forward
        value = checks.check_finite_loss(loss, "training loss")
        if state.metrics.rank_first_step_loss is UNSET:
            state.metrics.rank_first_step_loss = value
        run.accelerator.backward(loss * loss_weight(state, rows))
        run.optimizer.step()
        applied = not run.accelerator.optimizer_step_was_skipped
        checks.check_finite_parameters(list(run.model.named_parameters()), "after the optimizer step")
        return group.mean(value, state.kind.loss_items(rows)), applied

    def scaler_state(self, state, run: AccelerateFSDP2Run) -> dict | None:
        return None if run.scaler is None else run.scaler.state_dict()

    def save(self, state, run: AccelerateFSDP2Run, directory) -> None:
        run.accelerator.save_state(str(directory))
        state.metrics.accelerate_state_files = sorted(p.name for p in directory.iterdir())

    def export(self, state, run: AccelerateFSDP2Run, directory, checkpoint):
        """The full checkpoint: accelerate gathers it (every rank), rank 0 saves it in the kind's format."""
        full = run.accelerator.get_state_dict(run.model)
        if state.group.writes:
            saved = fresh_model(state)
            saved.load_state_dict({k: v.to(state.device) for k, v in full.items()}, assign=True)
            directory.mkdir(parents=True, exist_ok=True)
            state.kind.save(saved, directory)
        return directory

    def exported(self, state, run: AccelerateFSDP2Run):
        """The trained weights read in the cell's precision: the gathered weights (fp32 master
        weights under mixed precision) copied into a model in the precision's dtypes."""
        in_precision = state.scratch_model()  # compared, never saved
        in_precision.load_state_dict(self.weights(state, run).state_dict())
        return in_precision

    def restore(self, state, directory, training: bool) -> AccelerateFSDP2Run:
        return resume_from_saved_state(self, state, directory, training)

    def cleanup(self, state) -> None:
        reset_accelerate()


register_with_compiled_twin(AccelerateFSDP2Engine())
