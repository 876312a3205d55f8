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

Checkpoints as DeepSpeed users write them: save_checkpoint on every rank, load_checkpoint into a
fresh engine (the resume path); and the weights as a plain model of the kind, saved by rank 0 in
the kind's format (save_pretrained) and read back by the kind's own loading (from_pretrained):
for ZeRO 1-3 the consolidated fp32 state dict of the checkpoint (zero_to_fp32's
get_fp32_state_dict_from_zero_checkpoint), for stage 0, which writes no ZeRO files, the module's
own state dict.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os

from matrix import checks, resume
from matrix.engines.base import Unsupported, register
from matrix.engines.distributed import (
    DistributedEngine,
    barrier,
    check_first_step,
    global_mean,
    loss_weight,
    set_launcher_environment,
    shard_rows,
    sharded_dropout_off_loss,
    sharded_evaluate,
)
from matrix.phases import (
    ADAMW_WEIGHT_DECAY,
    TRAIN_STEPS,
    CellState,
    check_against_fp32,
    check_agrees_with_torch_engine,
    check_reload,
    check_training_contract,
    evaluate_in_precision,
    fresh_model,
    snapshot_trainable,
    train_until_applied,
)
from matrix.precisions import Precision, dtype_name
from matrix.results.metrics import UNSET
from matrix.tolerances import CHECKPOINT_ROUND_TRIP

STAGES = (0, 1, 2, 3)
CHECKPOINT_DIR = "deepspeed"
TAG = f"step{TRAIN_STEPS}"
INITIAL_SCALE_POWER = 16  # torch.amp.GradScaler starts at 2**16 too
INSTALL_HINT = "pip install '.[deepspeed]', or nox -s deepspeed"


@functools.cache
def installed_version() -> str | None:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _accelerator_refusal(device_type: str, dtype: str) -> str | None:
    """DeepSpeed's own refusal of `dtype` on a device type (its engine's sanity check), or None.
    The accelerator class is made here, not selected: the driver runs no DeepSpeed."""
    if device_type == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator as Accelerator
    elif device_type == "cuda":
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as Accelerator
    else:
        return f"Requires: [a DeepSpeed accelerator for {device_type}] (this engine knows cpu and cuda)"
    supported = getattr(Accelerator(), f"is_{dtype}_supported")()
    if supported:
        return None
    said = f"Type {dtype} is not supported on your device."  # DeepSpeed's engine raises this ValueError
    return f"Requires: [{dtype} on DeepSpeed's {device_type} accelerator] (DeepSpeed: {said})"


def _deepspeed(state: CellState):
    """deepspeed, imported in the rank with its accelerator chosen for the cell's device (unless
    the user chose one: DS_ACCELERATOR) and its per-step log lines quieted."""
    os.environ.setdefault("DS_ACCELERATOR", state.device.type)
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    return deepspeed


def ds_config(state: CellState, context) -> dict:
    """The DeepSpeed config the cell runs with (the precision's part is derive_settings'). It
    names an optimizer in evaluation cells too: ZeRO 1 and 2 refuse to start without one, and an
    evaluation under DeepSpeed runs inside a job configured to train."""
    settings = state.metrics.engine_settings
    rows = len(shard_rows(state.batch, 0, context.world_size)["input_ids"])
    config: dict = {
        "train_micro_batch_size_per_gpu": rows,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": settings["zero_stage"]},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    params = {"lr": state.learning_rate, "weight_decay": ADAMW_WEIGHT_DECAY, "torch_adam": True}
    config["optimizer"] = {"type": "AdamW", "params": params}
    if settings.get("bf16"):
        config["bf16"] = {"enabled": True}
    if settings.get("fp16"):
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": INITIAL_SCALE_POWER}
    if settings.get("communication_data_type"):
        config["communication_data_type"] = settings["communication_data_type"]
    return config


def _initialize(state: CellState, context, model):
    deepspeed = _deepspeed(state)
    set_launcher_environment(state, context, also_restored=("DS_ACCELERATOR",))
    state.device_kind.activate(state.device)
    config = ds_config(state, context)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    engines = state.engine_state.setdefault("engines", [])
    engines.append(engine)
    if len(engines) == 1:  # the first engine of the cell; the resumed one is set up alike
        state.metrics.engine_effective = {"config": config}
        record_effective(state, engine)
    return engine


def record_effective(state: CellState, engine) -> None:
    """What DeepSpeed made of the config, in the cell's engine_effective."""
    import deepspeed

    optimizer = engine.optimizer
    state.metrics.engine_effective.update(
        {
            "deepspeed": deepspeed.__version__,
            "zero_stage": engine.zero_optimization_stage(),
            "bf16_enabled": engine.bfloat16_enabled(),
            "fp16_enabled": engine.fp16_enabled(),
            "communication_data_type": dtype_name(engine.communication_data_type),
            "optimizer": None if optimizer is None else type(optimizer).__name__,
            "basic_optimizer": None if optimizer is None else type(_basic(optimizer)).__name__,
            "module_parameter_dtypes": sorted({dtype_name(p.dtype) for p in engine.module.parameters()}),
            "accelerator": os.environ["DS_ACCELERATOR"],
        }
    )


def destroy_engines(state: CellState) -> None:
    """Release the cell's DeepSpeed engines (ZeRO-3's hooks and partitions with them)."""
    for engine in state.engine_state.pop("engines", []):
        engine.destroy()


def _basic(optimizer):
    """The torch optimizer under DeepSpeed's wrapper (ZeRO's, bf16's, fp16's), which holds the
    fp32 master weights as its parameters; the optimizer itself where there is none."""
    return getattr(optimizer, "optimizer", optimizer)


def _gathered(state: CellState, engine):
    """A context in which the module's parameters are whole on every rank (ZeRO-3 partitions them)."""
    import contextlib

    if state.metrics.engine_settings["zero_stage"] == 3:
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


def module_state(state: CellState, engine) -> dict:
    """The module's whole state dict as the engine holds it (ZeRO-3: gathered on every rank)."""
    with _gathered(state, engine):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def plain_copy(state: CellState, engine):
    """A plain model of the kind holding the engine's module weights in their dtypes (assigned);
    over a quantized base, its floating tensors copied onto a base quantized alike."""
    plain = state.kind.build(state.precision, state.device, state.workdir)
    if state.precision.quantization is None:
        plain.load_state_dict({k: v.to(state.device) for k, v in module_state(state, engine).items()}, assign=True)
        return plain
    from matrix.quantization import copy_float_weights

    with _gathered(state, engine):
        copy_float_weights(engine.module, plain)
    return plain


def in_precision_with_masters(state: CellState, engine):
    """The trained weights as a user's checkpoint gives them back: a fresh model of the kind in
    the precision (frozen weights and buffers as built) with every trained parameter taken from
    DeepSpeed's fp32 master weights (where it keeps none: the parameter), in the model's dtypes."""
    model = fresh_model(state)
    copy_trained(model, full_master_weights(engine))
    return model


def copy_trained(model, weights: dict) -> None:
    """Copy `weights` into `model`'s trainable parameters of the same names, in the model's dtypes."""
    import torch

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.requires_grad and name in weights:
                parameter.copy_(weights[name])


def _partitions(engine) -> list:
    """The fp32 tensors the basic optimizer steps (ZeRO: this rank's partitions), in order. ZeRO-3
    hands its flat partitions to the optimizer's param groups only during a step: they are read
    from the ZeRO-3 optimizer itself."""
    flat = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if flat:
        return list(flat)
    return [p for group in _basic(engine.optimizer).param_groups for p in group["params"]]


def master_weights(engine) -> dict:
    """The fp32 master weights (ZeRO: this rank's partitions) the optimizer steps, by position."""
    return {f"master tensor {i}": p.detach().clone() for i, p in enumerate(_partitions(engine))}


def optimizer_state(engine) -> dict:
    """The basic optimizer's state (step counts, moments) of each master tensor, by position:
    checks.optimizer_state, which reads the param groups, sees none of ZeRO-3's between steps."""
    import torch

    state = _basic(engine.optimizer).state
    return {
        f"master tensor {i}: {key}": value.detach().clone()
        for i, p in enumerate(_partitions(engine))
        for key, value in state.get(p, {}).items()
        if isinstance(value, torch.Tensor)
    }


def full_master_weights(engine) -> dict:
    """Every trainable parameter's fp32 master weight, whole (DeepSpeed's safe_get_full_fp32_param,
    a collective), by name; the parameter itself where DeepSpeed keeps no other (no mixed precision)."""
    from deepspeed.utils import safe_get_full_fp32_param

    found = {}
    for name, parameter in engine.module.named_parameters():
        if parameter.requires_grad:
            full = safe_get_full_fp32_param(parameter)
            found[name] = (parameter if full is None else full).detach().clone()
    return found


def _scaler_state(engine) -> dict | None:
    """DeepSpeed's fp16 loss scaler: its scale and counters; None without one."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None or not engine.fp16_enabled():
        return None
    return {k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool))} | {
        "loss_scale": float(scaler.loss_scale)
    }


def _step(state: CellState, context, engine) -> tuple[float, bool]:
    shard = shard_rows(state.batch, context.rank, context.world_size)
    loss = state.kind.loss(engine, shard)  # DeepSpeed's bf16/fp16 cast the module: no autocast
    value = checks.check_finite_loss(loss, "training loss")
    if state.metrics.rank_first_step_loss is UNSET:
        state.metrics.rank_first_step_loss = value
    skipped = engine.skipped_steps
    engine.backward(loss * loss_weight(state, shard, context.world_size))
    engine.step()
    applied = engine.skipped_steps == skipped  # the fp16 loss scaler skips a step that overflowed
    checks.check_finite_parameters(list(master_weights(engine).items()), "after the optimizer step")
    return global_mean(value, state.kind.loss_items(shard)), applied


def check_declared_dtypes(state: CellState, engine, model, when: str) -> None:
    """What DeepSpeed declares: with bf16 or fp16 enabled, the module's trained parameters in that
    dtype and fp32 master weights in the optimizer; without, the precision's dtypes, as built
    (`model`: a plain copy of the module's weights)."""
    import torch

    settings = state.metrics.engine_settings
    half = "bfloat16" if settings.get("bf16") else "float16" if settings.get("fp16") else None
    if half is None:
        checks.check_dtypes(state.kind.precision_weights(model), state.expected_dtypes(model), when)
        return
    trained = {name: p for name, p in engine.module.named_parameters() if p.requires_grad}  # as DeepSpeed holds them
    checks.check_dtypes(trained, getattr(torch, half), f"{when}, the module's trained parameters ({half} enabled)")
    checks.check_dtypes(master_weights(engine), torch.float32, f"{when}, DeepSpeed's master weights")


def rank_train_steps(state: CellState, context) -> None:
    state.build()
    state.model.train()
    trainable = snapshot_trainable(state.model, state.kind)
    engine = _initialize(state, context, state.model)
    state.engine_state["engine"], state.optimizer = engine, engine.optimizer
    dtypes = checks.tensor_dtypes(plain_copy(state, engine))  # as DeepSpeed set them up
    dropout_off = sharded_dropout_off_loss(state, context, engine, autocast=False)
    losses = train_until_applied(state, lambda: _step(state, context, engine), TRAIN_STEPS)
    state.metrics.train_losses = losses
    check_first_step(state, losses, dropout_off)
    check_training_contract(
        state,
        plain_copy(state, engine),
        trainable,
        dtypes,
        weights_check=lambda model, when: check_declared_dtypes(state, engine, model, when),
    )


def _evaluate(state: CellState, context, engine):
    return sharded_evaluate(state, context, engine.module, autocast=False)


def rank_mid_training_eval(state: CellState, context) -> None:
    engine = state.engine_state["engine"]
    result = _evaluate(state, context, engine)
    check_against_fp32(state, result, "mid-training eval", model=plain_copy(state, engine))
    engine.module.train()


def rank_evaluate(state: CellState, context) -> None:
    state.build()
    engine = _initialize(state, context, state.model)
    state.engine_state["engine"] = engine
    check_declared_dtypes(state, engine, plain_copy(state, engine), "after initialize")
    result = _evaluate(state, context, engine)
    check_against_fp32(state, result, "eval", model=plain_copy(state, engine))
    check_agrees_with_torch_engine(state, result.loss.item(), "eval")


def _plain_checkpoint(state: CellState, engine, directory):
    """The model rank 0 saves in the kind's format: for ZeRO 1-3 training, a fresh model of the
    kind loaded (strictly) with the checkpoint's consolidated fp32 state dict; otherwise the
    trained weights in memory (stage 0 writes no ZeRO files: users save the module)."""
    if state.metrics.engine_settings["zero_stage"] == 0 or state.cell.mode != "train":
        state.metrics.engine_effective["plain_checkpoint_from"] = "the module's trained weights"
        return state.engine_state["saved_in_precision"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state.metrics.engine_effective["plain_checkpoint_from"] = "get_fp32_state_dict_from_zero_checkpoint"
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=TAG)
    plain = fresh_model(state)
    plain.load_state_dict({k: v.to(state.device) for k, v in consolidated.items()})
    return plain


def rank_checkpoint_save(state: CellState, context) -> None:
    engine = state.engine_state["engine"]
    shared = state.engine_state["shared_dir"]
    state.engine_state["sharded_outputs_before_save"] = _evaluate(state, context, engine).logits
    if state.cell.mode == "train":
        resume.remember_point(state, optimizer_state(engine), _scaler_state(engine))
    engine.save_checkpoint(str(shared / CHECKPOINT_DIR), tag=TAG)
    # the trained weights in memory, as the plain checkpoint must give them back
    saved = in_precision_with_masters(state, engine)
    state.engine_state["saved_in_precision"] = saved
    state.outputs_before_save = evaluate_in_precision(state, saved).logits
    directory = shared / "checkpoint"
    barrier()  # every rank's part of the DeepSpeed checkpoint is written
    plain = _plain_checkpoint(state, engine, shared / CHECKPOINT_DIR)  # every rank: a failure fails all alike
    if context.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        state.kind.save(plain, directory)
    barrier()
    state.metrics.checkpoint_files = sorted(p.name for p in directory.iterdir())
    state.metrics.deepspeed_checkpoint_files = sorted(
        str(p.relative_to(shared / CHECKPOINT_DIR)) for p in (shared / CHECKPOINT_DIR).rglob("*") if p.is_file()
    )


def rank_checkpoint_reload(state: CellState, context) -> None:
    shared = state.engine_state["shared_dir"]
    # the plain checkpoint, read by a plain model as any user of the kind reads it
    reloaded = state.kind.load(shared / "checkpoint", state.precision, state.device, state.workdir)
    check_reload(state, reloaded, saved=state.engine_state["saved_in_precision"])
    # the resume path: a fresh model and engine, load_checkpoint (module, optimizer, scaler)
    resumed = _initialize(state, context, fresh_model(state))
    path, _ = resumed.load_checkpoint(str(shared / CHECKPOINT_DIR), tag=TAG)
    if path is None:
        raise checks.CheckFailure(
            "DeepSpeed's load_checkpoint found no checkpoint", details=str(shared / CHECKPOINT_DIR)
        )
    outputs = _evaluate(state, context, resumed).logits
    state.metrics.dcp_reload_max_abs_difference = checks.check_outputs_equal(
        "eval logits after load_checkpoint",
        state.engine_state["sharded_outputs_before_save"],
        outputs,
        CHECKPOINT_ROUND_TRIP,
    )
    # the interrupted run goes on beside the resumed one: step k+1 is taken on both
    state.engine_state["uninterrupted"] = state.engine_state["engine"]
    state.engine_state["engine"], state.optimizer = resumed, resumed.optimizer


def _tensors(state: CellState, engine) -> dict:
    """What step k+1 is compared by: the module's trained parameters (gathered), the fp32 master
    weights and the optimizer's state (this rank's partitions)."""
    trained = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    found = {f"parameter {n}": v for n, v in module_state(state, engine).items() if n in trained}
    found.update(master_weights(engine))
    found.update({f"optimizer {k}": v for k, v in optimizer_state(engine).items()})
    return found


def rank_resumed_step(state: CellState, context) -> None:
    engine, interrupted = state.engine_state["engine"], state.engine_state["uninterrupted"]
    engine.module.train()
    interrupted.module.train()
    before = snapshot_trainable(plain_copy(state, engine), state.kind)
    resume.check_resume(
        state,
        resume.Continuation(lambda: _step(state, context, engine), lambda: _tensors(state, engine)),
        resume.Continuation(lambda: _step(state, context, interrupted), lambda: _tensors(state, interrupted)),
        optimizer_state(engine),
        _scaler_state(engine),
    )
    checks.check_parameters_changed(before, plain_copy(state, engine))


class DeepSpeedEngine(DistributedEngine):
    """DeepSpeed with one ZeRO stage."""

    rank_train_steps = staticmethod(rank_train_steps)
    rank_mid_training_eval = staticmethod(rank_mid_training_eval)
    rank_checkpoint_save = staticmethod(rank_checkpoint_save)
    rank_checkpoint_reload = staticmethod(rank_checkpoint_reload)
    rank_resumed_step = staticmethod(rank_resumed_step)
    rank_evaluate = staticmethod(rank_evaluate)

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

    def device_skip_reason(self, device) -> str | None:
        if installed_version() is None:
            return f"Requires: [deepspeed] (not installed: {INSTALL_HINT})"
        return super().device_skip_reason(device)

    def precision_device_skip_reason(self, precision: Precision, device) -> str | None:
        if installed_version() is None:
            return None  # device_skip_reason says it
        settings = self.settings(precision)
        for dtype in ("bf16", "fp16"):  # what the config enables is what DeepSpeed's sanity check asks for
            refusal = settings.get(dtype) and _accelerator_refusal(device.name, dtype)
            if refusal:
                return refusal
        return None

    def derive_settings(self, precision: Precision) -> dict | Unsupported:
        import torch

        settings: dict = {"zero_stage": self.stage}
        if precision.autocast_dtype == torch.bfloat16:
            settings["bf16"] = True
        elif precision.autocast_dtype == torch.float16:
            if not precision.grad_scaler:
                return Unsupported("Requires: [DeepSpeed fp16 without its loss scaler]")
            settings["fp16"] = True
        if precision.reduce_dtype is not None:
            settings["communication_data_type"] = {torch.float16: "fp16", torch.bfloat16: "bf16"}[
                precision.reduce_dtype
            ]
        return settings

    def rank_cleanup(self, state: CellState) -> None:
        destroy_engines(state)


ENGINES_BY_STAGE = {stage: DeepSpeedEngine(stage) for stage in STAGES}
for _engine in ENGINES_BY_STAGE.values():
    register(_engine)
