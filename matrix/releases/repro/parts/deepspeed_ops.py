"""Where a DeepSpeed engine's script has DeepSpeed build its CPU ops, and the master weights it reads,
written out before the engine's part (engine_deepspeed_zero.py, engine_hf_trainer_deepspeed.py). Not
imported: text of the script."""

import importlib.metadata

# DeepSpeed's CPU accelerator builds its ops on first use into TORCH_EXTENSIONS_DIR, by default one
# directory for every release (~/.cache/torch_extensions), and loads whatever build it finds there: an
# op another DeepSpeed release built can lack what this one calls ('deepspeed_shm_comm' has no
# attribute 'vector_kernel_level'). This script's ops go in a directory of their own per release.
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    os.path.join(
        tempfile.gettempdir(),
        "repro-torch-extensions",
        f"torch-{torch.__version__}-deepspeed-{importlib.metadata.version('deepspeed')}",
    ),
)


def deepspeed_default_clipping():
    """The gradient norm DeepSpeed clips to when its config sets no `gradient_clipping` (this script's
    sets none): 0, none, up to 0.19.2; 1.0 from 0.19.3. Read from the DeepSpeed that runs the
    script, not the one it was written on."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    return float(GRADIENT_CLIPPING_DEFAULT) or None


# the torch loop whose curve DeepSpeed's is held to clips as DeepSpeed does, on whichever release runs
# the script (the header's MAX_GRAD_NORM is what the release it was written on clips to)
MAX_GRAD_NORM = deepspeed_default_clipping()


def full_master_weights(engine):
    """Each trainable parameter's fp32 master weight, whole, by name (at ZeRO stage 0 its FP16_Optimizer's
    fp32 groups; the parameter itself where DeepSpeed keeps none): a parameter changed in training if
    its master did."""
    from deepspeed.utils import safe_get_full_fp32_param

    optimizer, grouped = engine.optimizer, {}
    groups = getattr(optimizer, "fp16_groups", None) or []
    if getattr(optimizer, "fp32_groups_flat", None):  # fused: one flat fp32 copy per group
        for params, flat in zip(groups, optimizer.fp32_groups_flat, strict=True):
            grouped.update(zip(map(id, params), torch._utils._unflatten_dense_tensors(flat, params), strict=True))
    elif getattr(optimizer, "fp32_groups", None):  # unfused: one fp32 copy per parameter
        for params, masters in zip(groups, optimizer.fp32_groups, strict=True):
            grouped.update(zip(map(id, params), masters, strict=True))
    found = {}
    for name, parameter in engine.module.named_parameters():
        if parameter.requires_grad:
            full = safe_get_full_fp32_param(parameter)
            full = grouped.get(id(parameter), parameter) if full is None else full
            found[name] = full.detach().clone()
    return found


def gathered_module(engine):
    """Every parameter of the engine's module whole on every rank (ZeRO-3 partitions them), for reading."""
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


def plain_copy(engine, into=None):
    """A plain model of the kind holding the engine's module weights in their dtypes (ZeRO-3: gathered).
    Over a quantized base, a base quantized alike holding the module's floating tensors, read without
    state_dict(): a 4-bit layer's state_dict() undoes a CPU inference's packing, and a check must not
    change what the save then writes (parts/quantized.py). `into`: an earlier copy, filled again."""
    if CELL["quantization"] is not None:
        plain = build(CELL)
        with gathered_module(engine):
            copy_float_weights(engine.module, plain, source_dtypes=True)
        return plain
    with gathered_module(engine):
        held = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return model_holding(held, into)
