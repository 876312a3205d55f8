"""The deepspeed engines: DeepSpeed's own engine (deepspeed.initialize with a config dict), one
engine per ZeRO stage (deepspeed-zero0 ... deepspeed-zero3), on the run's group of ranks (gloo on
CPU, nccl on CUDA), each rank training on its rows of the batch.

The precision maps onto DeepSpeed's config as its users write it:
- half-precision autocast (the *-mixed precisions): DeepSpeed's own mixed precision, `bf16` or
  `fp16` enabled. DeepSpeed casts the module to that dtype and keeps fp32 master weights in its
  optimizer; it does not autocast. fp16 comes with DeepSpeed's dynamic loss scaler, started at
  2**16 as torch's GradScaler is.
- no autocast (fp32, bf16-true, fp16-true): no mixed-precision section; the module trains in the
  dtype it was built in.
- the *-reduce precisions: `communication_data_type`, the dtype gradients are reduced in.
The optimizer is the config's `AdamW` with `torch_adam` (torch.optim.AdamW, as in every other
engine; DeepSpeed's fused CPU/CUDA Adam needs a compiled extension).

Where DeepSpeed's accelerator refuses a precision on the cell's device, the cell skips with
DeepSpeed's own message.

Its own checkpoint is save_checkpoint on every rank, which load_checkpoint reads into a fresh
engine (the resume path). The export is the weights as a plain model of the kind, saved by rank 0
in the kind's format (save_pretrained) and read back by the kind's own loading
(from_pretrained): for ZeRO 1-3 training the consolidated fp32 state dict of the checkpoint
(zero_to_fp32's get_fp32_state_dict_from_zero_checkpoint), otherwise (stage 0 writes no ZeRO
files) the trained weights in memory.

Each stage has a compiled twin (`deepspeed-zero2-compile`): engine.compile() after
deepspeed.initialize, as DeepSpeed documents it (the module compiled in place, so its hooks and
state dict stay as they are), on the resumed engine too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from matrix.checks import assertions as checks
from matrix.engines.base import ALWAYS, EngineSettings, Loop, Unsupported, register_with_compiled_twin
from matrix.engines.distributed import DistributedEngine, set_launcher_environment
from matrix.engines.libraries import deepspeed as ds
from matrix.harness.compiling import BACKEND
from matrix.harness.kind_traits import ADAMW_WEIGHT_DECAY
from matrix.harness.measurements import evaluate_rows, fresh_model
from matrix.harness.torch_step import loss_weight
from matrix.precisions.policies import Precision
from matrix.results.metrics import UNSET

STAGES = (0, 1, 2, 3)
TAG = "step-k"  # the checkpoint written after step k (matrix/grid/schedule.py)
INITIAL_SCALE_POWER = 16  # torch.amp.GradScaler starts at 2**16 too


@dataclass(frozen=True)
class DeepSpeedSettings(EngineSettings):
    zero_stage: int = field(default=0, metadata=ALWAYS)
    bf16: bool | None = None
    fp16: bool | None = None
    communication_data_type: str | None = None


@dataclass
class DeepSpeedRun:
    engine: object  # deepspeed's DeepSpeedEngine around the module
    steps: int = 0
    plain: object | None = None  # the module's weights as a plain model, made once per step
    plain_at: int = -1


def derive_deepspeed(stage: int, precision: Precision) -> DeepSpeedSettings | Unsupported:
    """The precision in DeepSpeed's config terms, at one ZeRO stage."""
    import torch

    bf16 = fp16 = None
    if precision.autocast_dtype == torch.bfloat16:
        bf16 = True
    elif precision.autocast_dtype == torch.float16:
        if not precision.grad_scaler:
            return Unsupported("Requires: [DeepSpeed fp16 without its loss scaler]")
        fp16 = True
    communication = None
    if precision.reduce_dtype is not None:
        communication = {torch.float16: "fp16", torch.bfloat16: "bf16"}[precision.reduce_dtype]
    return DeepSpeedSettings(zero_stage=stage, bf16=bf16, fp16=fp16, communication_data_type=communication)


def deepspeed_precision_refusal(settings, device) -> str | None:
    if ds.installed_version() is None or isinstance(settings, Unsupported):
        return None  # device_skip_reason (the engine requires deepspeed), or the settings, say it
    for dtype in ("bf16", "fp16"):  # what the config enables is what DeepSpeed's sanity check asks for
        refusal = getattr(settings, dtype) and ds.accelerator_refusal(device.name, dtype)
        if refusal:
            return refusal
    return None


class ZeroEngine(DistributedEngine, Loop):
    """DeepSpeed with one ZeRO stage."""

    Run = DeepSpeedRun
    forward_autocasts = True  # DeepSpeed casts the module to its half dtype: no autocast around it
    traits = frozenset({"casts-parameters", "steps-master-weights"})
    requires = ("deepspeed",)
    compile_how = "engine.compile() after deepspeed.initialize (the module compiled in place)"

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.name = f"deepspeed-zero{stage}"
        self.axis_position = 7 + stage
        sharded = {0: "no sharding", 1: "optimizer state sharded", 2: "optimizer state and gradients sharded"}
        what = sharded.get(stage, "optimizer state, gradients and parameters sharded")
        self.description = (
            f"DeepSpeed ZeRO stage {stage} ({what}), bf16/fp16 config, save_checkpoint/load_checkpoint, "
            "consolidated fp32 weights"
        )

    @property
    def max_grad_norm(self) -> float | None:
        """DeepSpeed's own default, whichever release is installed (its config sets no clipping)."""
        from matrix.engines.libraries.deepspeed import default_gradient_clipping

        return default_gradient_clipping()

    def derive_settings(self, precision: Precision) -> DeepSpeedSettings | Unsupported:
        return derive_deepspeed(self.stage, precision)

    def precision_device_skip_reason(self, precision: Precision, device) -> str | None:
        return deepspeed_precision_refusal(self.derive_or_refuse(precision), device)

    def config(self, state) -> dict:
        """The DeepSpeed config the cell runs with. It names an optimizer in evaluation cells too:
        ZeRO 1 and 2 refuse to start without one, and an evaluation under DeepSpeed runs inside a
        job configured to train."""
        settings = state.settings
        rows = state.group.largest_share(state.batch)
        config: dict = {
            "train_micro_batch_size_per_gpu": rows,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": self.stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
        }
        params = {"lr": state.learning_rate, "weight_decay": ADAMW_WEIGHT_DECAY, "torch_adam": True}
        config["optimizer"] = {"type": "AdamW", "params": params}
        if settings.bf16:
            config["bf16"] = {"enabled": True}
        if settings.fp16:
            config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": INITIAL_SCALE_POWER}
        if settings.communication_data_type:
            config["communication_data_type"] = settings.communication_data_type
        return config

    def start(self, state, model, training: bool) -> DeepSpeedRun:
        deepspeed = ds.import_deepspeed(state)
        set_launcher_environment(state, also_restored=("DS_ACCELERATOR",))
        state.device_kind.activate(state.device)
        config = self.config(state)
        model.train(training)
        trainable = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
        if self.compiled:
            engine.compile(backend=BACKEND)
        if state.metrics.engine_effective is UNSET:  # the cell's first engine; the resumed one is set up alike
            state.metrics.engine_effective = {"config": config}
            ds.record_effective(state, engine)
        return DeepSpeedRun(engine)

    def module(self, state, run: DeepSpeedRun):
        return run.engine

    def step(self, state, run: DeepSpeedRun) -> tuple[float, bool]:
        run.steps += 1
        engine, group = run.engine, state.group
        rows = group.rows(state.batch)
        loss = state.kind.loss(engine, rows)  # DeepSpeed's bf16/fp16 cast the module: no autocast
        value = checks.check_finite_loss(loss, "training loss")
        if state.metrics.rank_first_step_loss is UNSET:
            state.metrics.rank_first_step_loss = value
        skipped = engine.skipped_steps
        engine.backward(loss * loss_weight(state, rows))
        engine.step()
        applied = engine.skipped_steps == skipped  # the fp16 loss scaler skips a step that overflowed
        checks.check_finite_parameters(list(ds.master_weights(run.engine).items()), "after the optimizer step")
        return group.mean(value, state.kind.loss_items(rows)), applied

    def evaluate(self, state, run: DeepSpeedRun):
        return evaluate_rows(state, run.engine.module, autocast=False)

    def weights(self, state, run: DeepSpeedRun):
        if run.plain is None or run.plain_at != run.steps:
            run.plain, run.plain_at = ds.plain_copy(state, run.engine, into=run.plain), run.steps
        return run.plain

    def master_weights(self, state, run: DeepSpeedRun) -> dict:
        return ds.master_weights(run.engine)

    def named_master_weights(self, state, run: DeepSpeedRun) -> dict:
        return ds.full_master_weights(run.engine)

    def optimizer_state(self, state, run: DeepSpeedRun) -> dict:
        return ds.optimizer_state(run.engine)

    def scaler_state(self, state, run: DeepSpeedRun) -> dict | None:
        return ds.scaler_state(run.engine)

    def check_declared(self, state, run: DeepSpeedRun, when: str) -> None:
        ds.check_declared(state, run.engine, self.weights(state, run), when)

    def save(self, state, run: DeepSpeedRun, directory) -> None:
        run.engine.save_checkpoint(str(directory), tag=TAG)

    def export(self, state, run: DeepSpeedRun, directory, checkpoint):
        """The model rank 0 saves in the kind's format: for ZeRO 1-3 training, a fresh model of the
        kind loaded (strictly) with the checkpoint's consolidated fp32 state dict; otherwise the
        trained weights in memory (stage 0 writes no ZeRO files: users save the module). Every
        rank makes it: a failure fails all alike."""
        state.metrics.deepspeed_checkpoint_files = sorted(
            str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()
        )
        if self.stage == 0 or not state.training:
            state.metrics.engine_effective["plain_checkpoint_from"] = "the module's trained weights"
            plain = self.exported(state, run)
        else:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            state.metrics.engine_effective["plain_checkpoint_from"] = "get_fp32_state_dict_from_zero_checkpoint"
            consolidated = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=TAG)
            plain = fresh_model(state)
            plain.load_state_dict({k: v.to(state.device) for k, v in consolidated.items()})
        if state.group.writes:
            directory.mkdir(parents=True, exist_ok=True)
            state.kind.save(plain, directory)
        return directory

    def exported(self, state, run: DeepSpeedRun):
        """The trained weights as a user's checkpoint gives them back: a fresh model in the
        precision with every trained parameter taken from DeepSpeed's fp32 master weights (where
        it keeps none: the parameter), in the model's dtypes."""
        return ds.trained_into_fresh(state, ds.full_master_weights(run.engine))

    def restore(self, state, directory, training: bool) -> DeepSpeedRun:
        run = self.start(state, fresh_model(state), training)
        path, _ = run.engine.load_checkpoint(str(directory), tag=TAG)
        if path is None:
            raise checks.CheckFailure("DeepSpeed's load_checkpoint found no checkpoint", details=str(directory))
        return run

    def close(self, state, run: DeepSpeedRun) -> None:
        run.engine.destroy()  # ZeRO-3's hooks and partitions with it


ENGINES_BY_STAGE = {stage: register_with_compiled_twin(ZeroEngine(stage)) for stage in STAGES}
