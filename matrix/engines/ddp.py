"""The ddp engine: torch DistributedDataParallel on a real process group (gloo on CPU, nccl on
CUDA), each rank training on its rows of the batch, with the precision's torch.autocast and
GradScaler. Where the precision reduces gradients in half precision, DDP's communication
hooks compress them (fp16_compress_hook, bf16_compress_hook). Checkpoints are written by
rank 0 and read back by every rank, as DDP scripts do.
"""

from __future__ import annotations

from matrix import checks, resume
from matrix.engines.base import Unsupported, register
from matrix.engines.distributed import (
    DistributedEngine,
    barrier,
    check_first_step,
    sharded_dropout_off_loss,
    sharded_evaluate,
    sharded_step,
)
from matrix.engines.torch_loop import load_checkpoint, save_checkpoint
from matrix.phases import (
    TRAIN_STEPS,
    CellState,
    check_against_fp32,
    check_agrees_with_torch_engine,
    check_training_contract,
    evaluate_in_precision,
    snapshot_trainable,
    train_until_applied,
)
from matrix.precisions import Precision, dtype_name

COMPRESS_HOOKS = {"float16": "fp16_compress_hook", "bfloat16": "bf16_compress_hook"}


def _wrap(state: CellState, model):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [state.device.index] if state.device.index is not None else None
    wrapped = DistributedDataParallel(model, device_ids=device_ids)
    hook = state.metrics.engine_settings.get("comm_hook")
    if hook is not None:
        wrapped.register_comm_hook(None, getattr(default_hooks, hook))
    state.metrics.engine_effective = {
        "comm_hook": hook,
        "reduce_dtype": state.metrics.engine_settings["reduce_dtype"],
        "bucket_view": wrapped.gradient_as_bucket_view,
    }
    return wrapped


def _step(state: CellState, context, wrapped=None, optimizer=None, scaler=None):
    if wrapped is None:
        wrapped, optimizer, scaler = state.engine_state["wrapped"], state.optimizer, state.scaler
    return lambda: sharded_step(state, context, wrapped, optimizer, scaler)


def rank_train_steps(state: CellState, context) -> None:
    state.build()
    state.model.train()
    trainable = snapshot_trainable(state.model, state.kind)
    dtypes = checks.tensor_dtypes(state.model)
    state.engine_state["wrapped"] = _wrap(state, state.model)
    state.optimizer = state.new_optimizer(state.model)
    state.scaler = state.precision.make_grad_scaler(state.device_type)
    dropout_off = sharded_dropout_off_loss(state, context, state.engine_state["wrapped"])
    losses = train_until_applied(state, _step(state, context), TRAIN_STEPS)
    state.metrics.train_losses = losses
    check_first_step(state, losses, dropout_off)
    check_training_contract(state, state.model, trainable, dtypes)


def rank_mid_training_eval(state: CellState, context) -> None:
    # evaluated through the wrapped module, as DDP scripts do (DDP itself has no generate())
    result = sharded_evaluate(state, context, state.model)
    check_against_fp32(state, result, "mid-training eval")
    state.model.train()


def rank_evaluate(state: CellState, context) -> None:
    state.build()
    state.engine_state["wrapped"] = _wrap(state, state.model)
    result = sharded_evaluate(state, context, state.model)  # the wrapped module, as above
    check_against_fp32(state, result, "eval")
    check_agrees_with_torch_engine(state, result.loss.item(), "eval")


def rank_checkpoint_save(state: CellState, context) -> None:
    state.outputs_before_save = evaluate_in_precision(state, state.model).logits
    directory = state.engine_state["shared_dir"] / "checkpoint"
    if context.rank == 0:
        save_checkpoint(state, directory)  # the torch engine's format, written once
    barrier()  # every rank reads what rank 0 wrote
    state.metrics.checkpoint_files = sorted(p.name for p in directory.iterdir())
    if state.optimizer is not None:
        resume.remember_point(state, state.optimizer, resume.scaler_state(state.scaler))


def rank_checkpoint_reload(state: CellState, context) -> None:
    if state.optimizer is not None:  # the interrupted run goes on beside the resumed one
        kept = (state.model, state.engine_state["wrapped"], state.optimizer, state.scaler)
        state.engine_state["uninterrupted"] = kept
    state.model = load_checkpoint(state, state.engine_state["shared_dir"] / "checkpoint")
    if state.optimizer is not None:
        state.engine_state["wrapped"] = _wrap(state, state.model)


def rank_resumed_step(state: CellState, context) -> None:
    model, wrapped, optimizer, scaler = state.engine_state["uninterrupted"]
    model.train()
    resumed = resume.Continuation(
        _step(state, context), lambda: resume.model_and_optimizer_tensors(state.model, state.optimizer)
    )
    uninterrupted = resume.Continuation(
        _step(state, context, wrapped, optimizer, scaler), lambda: resume.model_and_optimizer_tensors(model, optimizer)
    )
    resume.resume_one_step(state, resumed, uninterrupted, resume.scaler_state(state.scaler))


class DDPEngine(DistributedEngine):
    name = "ddp"
    axis_position = 4
    description = "torch DistributedDataParallel, 2 ranks (gloo/nccl), autocast + GradScaler, compress hooks"

    rank_train_steps = staticmethod(rank_train_steps)
    rank_mid_training_eval = staticmethod(rank_mid_training_eval)
    rank_checkpoint_save = staticmethod(rank_checkpoint_save)
    rank_checkpoint_reload = staticmethod(rank_checkpoint_reload)
    rank_resumed_step = staticmethod(rank_resumed_step)
    rank_evaluate = staticmethod(rank_evaluate)

    def derive_settings(self, precision: Precision) -> dict | Unsupported:
        reduce = precision.reduce_dtype or precision.weights_dtype  # DDP reduces the gradients' own dtype
        settings: dict = {"reduce_dtype": dtype_name(reduce)}
        if precision.autocast_dtype is not None:
            settings["autocast"] = dtype_name(precision.autocast_dtype)
        if precision.grad_scaler:
            settings["grad_scaler"] = True
        if reduce != precision.weights_dtype:
            hook = COMPRESS_HOOKS.get(dtype_name(reduce))
            if hook is None:
                return Unsupported(f"Requires: [a DDP communication hook that reduces in {dtype_name(reduce)}]")
            settings["comm_hook"] = hook
        return settings


register(DDPEngine())
