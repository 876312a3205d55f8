"""The fsdp2 engine: torch.distributed.fsdp.fully_shard on every layer and on the root, on a real
process group (gloo on CPU, nccl on CUDA), each rank training on its rows of the batch.

The precision maps onto MixedPrecisionPolicy: a precision that computes in a half dtype over
fp32 weights gets param_dtype = that dtype (FSDP's own mixed precision: fp32 shards, half
unsharded parameters), with its autocast as well; reduce_dtype is the precision's reduce
dtype, else the gradients' (fp32 for fp32 master weights); output_dtype is left to FSDP.

Checkpoints both ways users write them: a sharded one through torch.distributed.checkpoint
(DCP), which the resumed step starts from, and a full state dict gathered from the shards,
saved by rank 0 in the kind's own format (save_pretrained), which a plain model reads back.
"""

from __future__ import annotations

from matrix import checks, resume
from matrix.engines.base import register
from matrix.engines.distributed import (
    DistributedEngine,
    barrier,
    check_first_step,
    gathered_copy,
    resume_one_sharded_step,
    sharded_dropout_off_loss,
    sharded_evaluate,
    sharded_step,
)
from matrix.phases import (
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
from matrix.tolerances import CHECKPOINT_ROUND_TRIP

SCALER_FILE = "grad_scaler.pt"


def _dtype(name: str | None):
    import torch

    return None if name is None else getattr(torch, name)


def _shard(state: CellState, model):
    """fully_shard every layer (the members of the model's ModuleLists), then the root."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    settings = state.metrics.engine_settings
    policy = MixedPrecisionPolicy(
        param_dtype=_dtype(settings.get("param_dtype")),
        reduce_dtype=_dtype(settings.get("reduce_dtype")),
        output_dtype=_dtype(settings.get("output_dtype")),
    )
    layers = [layer for module in model.modules() if isinstance(module, torch.nn.ModuleList) for layer in module]
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    state.metrics.engine_effective = {
        "mp_policy": {k: dtype_name(v) if v is not None else None for k, v in vars(policy).items()},
        "sharded_layers": len(layers),
        "sharded_parameter_dtypes": sorted({dtype_name(p.dtype) for p in model.parameters()}),
    }
    return model


def _step(state: CellState, context, model=None, optimizer=None, scaler=None):
    if model is None:
        model, optimizer, scaler = state.model, state.optimizer, state.scaler
    return lambda: sharded_step(state, context, model, optimizer, scaler)


def rank_train_steps(state: CellState, context) -> None:
    state.build()
    state.model.train()
    trainable = snapshot_trainable(state.model, state.kind)
    dtypes = checks.tensor_dtypes(state.model)
    _shard(state, state.model)
    state.optimizer = state.new_optimizer(state.model)
    state.scaler = state.precision.make_grad_scaler(state.device_type)
    dropout_off = sharded_dropout_off_loss(state, context, state.model)
    losses = train_until_applied(state, _step(state, context), TRAIN_STEPS)
    state.metrics.train_losses = losses
    check_first_step(state, losses, dropout_off)
    check_training_contract(state, gathered_copy(state, state.model), trainable, dtypes)


def rank_mid_training_eval(state: CellState, context) -> None:
    result = sharded_evaluate(state, context, state.model)
    check_against_fp32(state, result, "mid-training eval", model=gathered_copy(state, state.model, reuse=True))
    state.model.train()


def rank_evaluate(state: CellState, context) -> None:
    state.build()
    _shard(state, state.model)
    result = sharded_evaluate(state, context, state.model)
    check_against_fp32(state, result, "eval", model=gathered_copy(state, state.model))
    check_agrees_with_torch_engine(state, result.loss.item(), "eval")


def rank_checkpoint_save(state: CellState, context) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    shared = state.engine_state["shared_dir"]
    # the sharded checkpoint (DCP), and what the sharded model computes before it is written
    state.engine_state["sharded_outputs_before_save"] = sharded_evaluate(state, context, state.model).logits
    if state.optimizer is not None:
        resume.remember_point(state, state.optimizer, resume.scaler_state(state.scaler))
        model_state, optimizer_state = get_state_dict(state.model, state.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=shared / "dcp")
    else:
        dcp.save({"model": _sharded_model_state(state.model)}, checkpoint_id=shared / "dcp")
    # the full state dict, gathered, saved by rank 0 as a plain model of the kind
    plain = gathered_copy(state, state.model, reuse=True)
    state.outputs_before_save = evaluate_in_precision(state, plain).logits
    directory = shared / "checkpoint"
    if context.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        state.kind.save(plain, directory)
        if state.scaler is not None:
            torch.save(state.scaler.state_dict(), shared / SCALER_FILE)
    barrier()
    state.metrics.checkpoint_files = sorted(p.name for p in directory.iterdir())
    state.metrics.dcp_files = len(list((shared / "dcp").iterdir()))


def _sharded_model_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def rank_checkpoint_reload(state: CellState, context) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    shared = state.engine_state["shared_dir"]
    # the full checkpoint, read by a plain model as any user of the kind reads it
    reloaded = state.kind.load(shared / "checkpoint", state.precision, state.device, state.workdir)
    check_reload(state, reloaded)
    # the sharded checkpoint into a fresh sharded model (and optimizer): the resume path
    resumed = _shard(state, fresh_model(state))
    if state.optimizer is not None:
        optimizer = state.new_optimizer(resumed)
        model_state, optimizer_state = get_state_dict(resumed, optimizer)
        dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=shared / "dcp")
        set_state_dict(resumed, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
        scaler = state.precision.make_grad_scaler(state.device_type)
        if scaler is not None:
            scaler.load_state_dict(torch.load(shared / SCALER_FILE, weights_only=True))
        # the interrupted run goes on beside the resumed one: step k+1 is taken on both
        state.engine_state["uninterrupted"] = (state.model, state.optimizer, state.scaler)
        state.optimizer, state.scaler = optimizer, scaler
    else:
        model_state = _sharded_model_state(resumed)
        dcp.load({"model": model_state}, checkpoint_id=shared / "dcp")
        set_state_dict(resumed, (), model_state_dict=model_state, optim_state_dict={})
    outputs = sharded_evaluate(state, context, resumed).logits
    state.metrics.dcp_reload_max_abs_difference = checks.check_outputs_equal(
        "eval logits after the DCP reload",
        state.engine_state["sharded_outputs_before_save"],
        outputs,
        CHECKPOINT_ROUND_TRIP,
    )
    state.model = resumed


def rank_resumed_step(state: CellState, context) -> None:
    model, optimizer, scaler = state.engine_state["uninterrupted"]
    model.train()
    resumed = resume.Continuation(
        _step(state, context), lambda: resume.model_and_optimizer_tensors(state.model, state.optimizer)
    )
    uninterrupted = resume.Continuation(
        _step(state, context, model, optimizer, scaler), lambda: resume.model_and_optimizer_tensors(model, optimizer)
    )
    resume_one_sharded_step(state, resumed, uninterrupted, resume.scaler_state(state.scaler))


class FSDP2Engine(DistributedEngine):
    name = "fsdp2"
    axis_position = 5
    description = "torch fully_shard (FSDP2) per layer, MixedPrecisionPolicy, DCP and full-state-dict checkpoints"

    rank_train_steps = staticmethod(rank_train_steps)
    rank_mid_training_eval = staticmethod(rank_mid_training_eval)
    rank_checkpoint_save = staticmethod(rank_checkpoint_save)
    rank_checkpoint_reload = staticmethod(rank_checkpoint_reload)
    rank_resumed_step = staticmethod(rank_resumed_step)
    rank_evaluate = staticmethod(rank_evaluate)

    def derive_settings(self, precision: Precision) -> dict:
        weights, compute = precision.weights_dtype, precision.autocast_dtype
        param = compute if compute is not None and compute != weights else None
        reduce = precision.reduce_dtype or (weights if param is not None else None)
        settings: dict = {
            "param_dtype": dtype_name(param) if param else None,
            "reduce_dtype": dtype_name(reduce) if reduce else None,
            "output_dtype": None,
        }
        if compute is not None:
            settings["autocast"] = dtype_name(compute)
        if precision.grad_scaler:
            settings["grad_scaler"] = True
        return settings


register(FSDP2Engine())
