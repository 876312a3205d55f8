"""DeepSpeed as the deepspeed-zero0..3 and hf-trainer-zero2/3 engines see it: whether it is
installed and what its accelerator refuses, its import with the accelerator chosen for the cell,
and views of a DeepSpeed engine in the harness's terms: the module's weights (gathered at
ZeRO-3), the fp32 master weights and optimizer state the ZeRO optimizer keeps (this rank's
partitions), its fp16 loss scaler, and the dtypes it declares for them."""

from __future__ import annotations

import contextlib
import functools
import logging
import os

from matrix.checks import assertions as checks
from matrix.grid import packages
from matrix.harness.measurements import fresh_model, model_holding
from matrix.precisions.policies import dtype_name

INSTALL_HINT = packages.install_hint("deepspeed")


@functools.cache
def installed_version() -> str | None:
    """None where deepspeed cannot be imported here (the engines' cells skip: matrix/grid/packages.py)."""
    return packages.installed_version("deepspeed")


def default_gradient_clipping() -> float | None:
    """The gradient norm DeepSpeed clips to when its config sets no `gradient_clipping` (the
    matrix's configs set none, as its own examples do): 0, none, up to 0.19.2; 1.0 from
    0.19.3 (read in the releases' deepspeed/runtime/constants.py). None where it does not clip."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    return float(GRADIENT_CLIPPING_DEFAULT) or None


@functools.cache
def accelerator_refusal(device_type: str, dtype: str) -> str | None:
    """DeepSpeed's own refusal of `dtype` on a device type (its engine's sanity check), or None.
    The accelerator class is made here, not selected: the driver runs no DeepSpeed."""
    if device_type == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator as Accelerator
    elif device_type == "cuda":
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator as Accelerator
    else:
        return f"Requires: [a DeepSpeed accelerator for {device_type}] (the engines know cpu and cuda)"
    supported = getattr(Accelerator(), f"is_{dtype}_supported")()
    if supported:
        return None
    said = f"Type {dtype} is not supported on your device."  # DeepSpeed's engine raises this ValueError
    return f"Requires: [{dtype} on DeepSpeed's {device_type} accelerator] (DeepSpeed: {said})"


def import_deepspeed(state):
    """deepspeed, imported in the rank with its accelerator chosen for the cell's device (unless
    the user chose one: DS_ACCELERATOR) and its per-step log lines quieted. The ops it builds on
    first use are checked for a build lock a killed build left (matrix/engines/libraries/extension_builds.py): in the
    run's directory it is taken back, elsewhere StaleBuildLock fails the cell before it waits."""
    os.environ.setdefault("DS_ACCELERATOR", state.device.type)
    import deepspeed
    from deepspeed.utils import logger

    from matrix.engines.libraries.extension_builds import clear_stale_lock

    logger.setLevel(logging.WARNING)
    for builder in ops_built_on_first_use(state.device.type):
        clear_stale_lock(op_name(builder))
    return deepspeed


def record_effective(state, engine) -> None:
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
            "basic_optimizer": None if optimizer is None else type(basic_optimizer(optimizer)).__name__,
            "module_parameter_dtypes": sorted({dtype_name(p.dtype) for p in engine.module.parameters()}),
            "accelerator": os.environ["DS_ACCELERATOR"],
            # the probe of catalogue condition optimizer-stepped-at-construction (matrix/catalogue/conditions.py)
            "optimizer_steps_at_construction": None if optimizer is None else steps_taken(basic_optimizer(optimizer)),
        }
    )


def steps_taken(optimizer) -> int | None:
    """The largest step count in a torch optimizer's state: 0 where it never stepped; None where
    DeepSpeed holds no torch optimizer (ZeRO-3's inference engine, DeepSpeedZeRoOffload)."""
    state = getattr(optimizer, "state", None)
    if not isinstance(state, dict):
        return None
    return max((int(s["step"]) for s in state.values() if isinstance(s, dict) and "step" in s), default=0)


def basic_optimizer(optimizer):
    """The torch optimizer under DeepSpeed's wrapper (ZeRO's, bf16's, fp16's), which holds the
    fp32 master weights as its parameters; the optimizer itself where there is none."""
    return getattr(optimizer, "optimizer", optimizer)


def gathered(engine):
    """A context in which the module's parameters are whole on every rank (ZeRO-3 partitions them)."""
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


def module_state(engine) -> dict:
    """The module's whole state dict as the engine holds it (ZeRO-3: gathered on every rank)."""
    with gathered(engine):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def plain_copy(state, engine, into=None):
    """A plain model of the kind holding the engine's module weights in their dtypes (assigned);
    over a quantized base, its floating tensors copied onto a base quantized alike. `into`: an
    earlier copy of the same run's, filled again (measurements.model_holding)."""
    if state.precision.quantization is None:
        return model_holding(state, module_state(engine), into=into)
    from matrix.precisions.quantization import copy_float_weights

    plain = fresh_model(state)
    with gathered(engine):
        copy_float_weights(engine.module, plain, source_dtypes=True)
    return plain


def copy_trained(model, weights: dict) -> None:
    """Copy `weights` into `model`'s trainable parameters of the same names, in the model's dtypes."""
    import torch

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.requires_grad and name in weights:
                parameter.copy_(weights[name])


def trained_into_fresh(state, weights: dict):
    """A fresh model of the kind in the precision (frozen weights and buffers as built) with every
    trained parameter taken from `weights`, in the model's dtypes: the trained weights as a
    user's checkpoint gives them back."""
    model = fresh_model(state)
    copy_trained(model, weights)
    return model


def partitions(engine) -> list:
    """The fp32 tensors the basic optimizer steps (ZeRO: this rank's partitions), in order. ZeRO-3
    hands its flat partitions to the optimizer's param groups only during a step: they are read
    from the ZeRO-3 optimizer itself."""
    flat = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if flat:
        return list(flat)
    return [p for group in basic_optimizer(engine.optimizer).param_groups for p in group["params"]]


def master_weights(engine) -> dict:
    """The fp32 master weights (ZeRO: this rank's partitions) the optimizer steps, by position."""
    return {f"master tensor {i}": p.detach().clone() for i, p in enumerate(partitions(engine))}


def optimizer_state(engine) -> dict:
    """The basic optimizer's state (step counts, moments) of each master tensor, by position:
    checks.optimizer_state, which reads the param groups, sees none of ZeRO-3's between steps."""
    import torch

    state = basic_optimizer(engine.optimizer).state
    return {
        f"master tensor {i}: {key}": value.detach().clone()
        for i, p in enumerate(partitions(engine))
        for key, value in state.get(p, {}).items()
        if isinstance(value, torch.Tensor)
    }


def full_master_weights(engine) -> dict:
    """Every trainable parameter's fp32 master weight, whole (DeepSpeed's safe_get_full_fp32_param,
    a collective; at ZeRO stage 0 its FP16_Optimizer's fp32 groups), by name; the parameter itself
    where DeepSpeed keeps no other (no mixed precision)."""
    from deepspeed.utils import safe_get_full_fp32_param

    grouped = grouped_master_weights(engine)
    found = {}
    for name, parameter in engine.module.named_parameters():
        if parameter.requires_grad:
            full = safe_get_full_fp32_param(parameter)
            full = grouped.get(id(parameter), parameter) if full is None else full
            found[name] = full.detach().clone()
    return found


def grouped_master_weights(engine) -> dict:
    """The fp32 master of each parameter DeepSpeed's FP16_Optimizer keeps (fp16, and bf16 at ZeRO stage
    0): cut from its group's flat fp32 copy (fused) or its own (unfused), by the parameter's id.
    safe_get_full_fp32_param knows only ZeRO's and the BF16 optimizer's mappings."""
    import torch._utils

    optimizer = engine.optimizer
    groups = getattr(optimizer, "fp16_groups", None) or []
    found = {}
    if getattr(optimizer, "fp32_groups_flat", None):
        for params, flat in zip(groups, optimizer.fp32_groups_flat, strict=True):
            found.update(zip(map(id, params), torch._utils._unflatten_dense_tensors(flat, params), strict=True))
    elif getattr(optimizer, "fp32_groups", None):
        for params, masters in zip(groups, optimizer.fp32_groups, strict=True):
            found.update(zip(map(id, params), masters, strict=True))
    return found


def scaler_state(engine) -> dict | None:
    """DeepSpeed's fp16 loss scaler: its scale and counters; None without one."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None or not engine.fp16_enabled():
        return None
    return {k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool))} | {
        "loss_scale": float(scaler.loss_scale)
    }


def applied_steps(engine) -> int:
    """Optimizer steps applied so far, from the basic optimizer's own step counts."""
    state = basic_optimizer(engine.optimizer).state
    return max((int(entry["step"]) for entry in state.values() if "step" in entry), default=0)


def check_declared(state, engine, plain, when: str) -> None:
    """What DeepSpeed declares: with bf16 or fp16 enabled, the module's trained parameters in that
    dtype and fp32 master weights in the optimizer; without, the precision's dtypes, as built
    (`plain`: a plain copy of the module's weights)."""
    import torch

    half = "bfloat16" if engine.bfloat16_enabled() else "float16" if engine.fp16_enabled() else None
    if half is None:
        checks.check_dtypes(state.kind.precision_weights(plain), state.expected_dtypes(plain), when)
        return
    trained = {name: p for name, p in engine.module.named_parameters() if p.requires_grad}  # as DeepSpeed holds them
    checks.check_dtypes(trained, getattr(torch, half), f"{when}, the module's trained parameters ({half} enabled)")
    checks.check_dtypes(master_weights(engine), torch.float32, f"{when}, DeepSpeed's master weights")


# ---------------------------------------------------------------- its ops built on first use


def ops_built_on_first_use(device_type: str) -> tuple[str, ...]:
    """The op builders DeepSpeed runs (torch's JIT extension builder) the first time a rank needs
    them on this device type: on its CPU accelerator, the shared-memory collectives
    (ShareMemCommBuilder, op deepspeed_shm_comm) that deepspeed.comm's TorchBackend loads in
    init_distributed, in every rank of every cell (73 s to build the first time on a 2-core CPU,
    a second to load after). None on CUDA: its cells use no JIT-built op (the config's torch_adam)."""
    if device_type != "cpu":
        return ()
    try:
        from deepspeed.ops.op_builder import cpu
    except ImportError:  # a release without CPU op builders builds none
        return ()
    return tuple(name for name in ("ShareMemCommBuilder",) if hasattr(cpu, name))


def build_variables(device_type: str) -> dict[str, str]:
    """What the build's own process runs with: the accelerator whose builders these are."""
    return {"DS_ACCELERATOR": device_type}


def op_name(builder: str) -> str:
    """The op a builder makes (its directory under TORCH_EXTENSIONS_DIR): deepspeed_shm_comm."""
    from deepspeed.ops.op_builder import cpu

    return getattr(cpu, builder).NAME


def build_op(builder: str) -> bool:
    """Build (or load, where built) one op as DeepSpeed itself does in a rank, in a process whose
    DS_ACCELERATOR is the cell's device type; False where this release or machine does not use it
    (DeepSpeed then goes without, as its build_shm_op does)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    made = get_accelerator().create_op_builder(builder)
    if made is None or not deepspeed.ops.__compatible_ops__.get(made.NAME, False):
        return False
    made.load(verbose=False)
    return True
