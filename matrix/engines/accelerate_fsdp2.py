"""The accelerate-fsdp2 engine: accelerate's own FSDP2 path on a real process group, each rank
training on its rows of the batch. Accelerator(mixed_precision=..., fsdp_plugin=
FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")),
prepare(model, optimizer) (accelerate's fsdp2_prepare_model: fully_shard per transformer
layer, its MixedPrecisionPolicy, its fp32 upcast of trained parameters), accelerator.backward,
save_state / load_state (DCP), and get_state_dict for the full checkpoint a plain model reads.

What accelerate declares, and this engine checks: under mixed precision it keeps the trained
parameters as fp32 master weights, whatever dtype they were loaded in (fsdp2_prepare_model
upcasts them and warns "FSDP upcast of low precision parameters to fp32"); without mixed
precision, prepare leaves every dtype as it was. save_state then load_state brings back the
model and the optimizer's state exactly.

Selecting FSDP on a CPU. accelerate's AcceleratorState turns a distributed run into FSDP only on
accelerator devices (state.py: MULTI_GPU, MULTI_XPU, ...); on a CPU group it stays MULTI_CPU
and ignores the plugin. Here the engine then makes the selection AcceleratorState makes on a
GPU (distributed_type FSDP in both shared states, the plugin's mixed precision set, the plugin
attached) and records that it did (engine_effective "fsdp_selected_by"). Everything after that
is accelerate's own code, run on gloo: the CPU half of the matrix reaches the FSDP2 code that
users run on GPUs. On CUDA accelerate selects FSDP itself.
"""

from __future__ import annotations

from matrix import checks, resume
from matrix.engines.accelerate_loop import reset_accelerate
from matrix.engines.base import Unsupported, one_switch_unsupported, register
from matrix.engines.distributed import (
    DistributedEngine,
    barrier,
    check_first_step,
    gathered_copy,
    global_mean,
    loss_weight,
    resume_one_sharded_step,
    set_launcher_environment,
    shard_rows,
    sharded_dropout_off_loss,
    sharded_evaluate,
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
from matrix.results.metrics import UNSET
from matrix.tolerances import CHECKPOINT_ROUND_TRIP

MIXED_PRECISION = {None: "no", "float16": "fp16", "bfloat16": "bf16"}
STATE_DIR = "accelerate-state"


def _plugin(state: CellState, model):
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin

    settings = state.metrics.engine_settings
    options: dict = {"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"}
    if settings["mixed_precision_policy"] is not None:
        options["mixed_precision_policy"] = {
            k: getattr(torch, v) for k, v in settings["mixed_precision_policy"].items()
        }
    layers = getattr(model, "_no_split_modules", None)
    if layers:  # a transformers model names its layers: one FSDP unit each, as users configure it
        options["auto_wrap_policy"] = "transformer_based_wrap"
        options["transformer_cls_names_to_wrap"] = list(layers)
    return FullyShardedDataParallelPlugin(**options)


def _accelerator(state: CellState, context, model):
    """A new Accelerator on FSDP2 for this rank (accelerate's state is process-wide)."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    set_launcher_environment(state, context, also_restored=("ACCELERATE_USE_FSDP",))
    state.device_kind.activate(state.device)
    settings = state.metrics.engine_settings
    plugin = _plugin(state, model)
    accelerator = Accelerator(
        mixed_precision=settings["mixed_precision"], cpu=state.device.type == "cpu", fsdp_plugin=plugin
    )
    selected_by = "accelerate"
    if accelerator.distributed_type != DistributedType.FSDP:
        # accelerate selects FSDP on accelerator devices only: make the selection it makes there
        selected_by = f"the matrix (accelerate leaves a {accelerator.device.type} group {accelerator.distributed_type})"
        accelerator.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        if settings["mixed_precision"] != "no":
            plugin.set_mixed_precision(settings["mixed_precision"])
        accelerator.state.fsdp_plugin = plugin
    if not accelerator.is_fsdp2:
        raise RuntimeError(f"accelerate did not take the FSDP2 path (distributed_type {accelerator.distributed_type})")
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
    state.engine_state["accelerator"] = accelerator
    return accelerator


def _name(value):
    import torch

    return dtype_name(value) if isinstance(value, torch.dtype) else value


def _prepare(state: CellState, context, model):
    """prepare(model, optimizer): accelerate's FSDP2 path takes both together, in eval too."""
    accelerator = _accelerator(state, context, model)
    dtypes = checks.tensor_dtypes(model)
    prepared, optimizer = accelerator.prepare(model, state.new_optimizer(model))
    state.metrics.engine_effective["trained_parameter_dtypes_after_prepare"] = sorted(
        {dtype_name(p.dtype) for p in prepared.parameters() if p.requires_grad}
    )
    check_declared_dtypes(state, prepared, dtypes, "after prepare")
    return prepared, optimizer


def check_declared_dtypes(state: CellState, model, dtypes_before: dict, when: str) -> None:
    """What accelerate declares for FSDP2: with mixed precision, the trained parameters are fp32
    master weights; without it, prepare leaves every dtype as it was."""
    import torch

    if state.metrics.engine_settings["mixed_precision"] == "no":
        checks.check_same_dtypes(dtypes_before, model, when)
        return
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    checks.check_dtypes(trained, torch.float32, f"{when}, the trained parameters (fp32 master weights under FSDP2)")


def _step(state: CellState, context, model, optimizer, accelerator=None) -> tuple[float, bool]:
    accelerator = accelerator or state.engine_state["accelerator"]
    shard = shard_rows(state.batch, context.rank, context.world_size)
    optimizer.zero_grad(set_to_none=True)
    loss = state.kind.loss(model, shard)  # autocast comes from the prepared forward
    value = checks.check_finite_loss(loss, "training loss")
    if state.metrics.rank_first_step_loss is UNSET:
        state.metrics.rank_first_step_loss = value
    accelerator.backward(loss * loss_weight(state, shard, context.world_size))
    optimizer.step()
    applied = not accelerator.optimizer_step_was_skipped
    checks.check_finite_parameters(list(model.named_parameters()), "after the optimizer step")
    return global_mean(value, state.kind.loss_items(shard)), applied


def _evaluate(state: CellState, context, model):
    return sharded_evaluate(state, context, model, autocast=False)


def rank_train_steps(state: CellState, context) -> None:
    state.build()
    state.model.train()
    state.model, state.optimizer = _prepare(state, context, state.model)
    gathered = gathered_copy(state, state.model)
    trainable, dtypes = snapshot_trainable(gathered, state.kind), checks.tensor_dtypes(gathered)
    # the prepared forward brings accelerate's autocast
    dropout_off = sharded_dropout_off_loss(state, context, state.model, autocast=False)
    losses = train_until_applied(state, lambda: _step(state, context, state.model, state.optimizer), TRAIN_STEPS)
    state.metrics.train_losses = losses
    check_first_step(state, losses, dropout_off)
    check_training_contract(
        state,
        gathered_copy(state, state.model),
        trainable,
        dtypes,
        weights_check=lambda model, when: check_declared_dtypes(state, model, dtypes, when),
    )


def rank_mid_training_eval(state: CellState, context) -> None:
    result = _evaluate(state, context, state.model)
    check_against_fp32(state, result, "mid-training eval", model=gathered_copy(state, state.model, reuse=True))
    state.model.train()


def rank_evaluate(state: CellState, context) -> None:
    state.build()
    state.model, state.optimizer = _prepare(state, context, state.model)
    result = _evaluate(state, context, state.model)
    check_against_fp32(state, result, "eval", model=gathered_copy(state, state.model))
    check_agrees_with_torch_engine(state, result.loss.item(), "eval")


def rank_checkpoint_save(state: CellState, context) -> None:
    accelerator = state.engine_state["accelerator"]
    shared = state.engine_state["shared_dir"]
    state.engine_state["sharded_outputs_before_save"] = _evaluate(state, context, state.model).logits
    resume.remember_point(state, state.optimizer, resume.scaler_state(accelerator.scaler))
    accelerator.save_state(str(shared / STATE_DIR))
    # the full checkpoint: accelerate gathers it to rank 0, which saves it in the kind's format.
    # Read back in the cell's precision it must give the trained weights read in that precision
    # (fp32 master weights rounded to the precision's dtype, as from_pretrained(dtype=) rounds).
    full = accelerator.get_state_dict(state.model)
    in_precision = state.kind.build(state.precision, state.device, state.workdir)
    in_precision.load_state_dict(gathered_copy(state, state.model, reuse=True).state_dict())
    state.engine_state["saved_in_precision"] = in_precision
    state.outputs_before_save = evaluate_in_precision(state, in_precision).logits
    directory = shared / "checkpoint"
    if context.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        saved = state.kind.build(state.precision, state.device, state.workdir)
        saved.load_state_dict({k: v.to(state.device) for k, v in full.items()}, assign=True)
        state.kind.save(saved, directory)
    barrier()
    state.metrics.checkpoint_files = sorted(p.name for p in directory.iterdir())
    state.metrics.accelerate_state_files = sorted(p.name for p in (shared / STATE_DIR).iterdir())


def rank_checkpoint_reload(state: CellState, context) -> None:
    shared = state.engine_state["shared_dir"]
    # the full checkpoint, read by a plain model as any user of the kind reads it
    reloaded = state.kind.load(shared / "checkpoint", state.precision, state.device, state.workdir)
    check_reload(state, reloaded, saved=state.engine_state["saved_in_precision"])
    # the interrupted run goes on beside the resumed one: step k+1 is taken on both
    state.engine_state["uninterrupted"] = (state.model, state.optimizer, state.engine_state["accelerator"])
    # the resume path: a new Accelerator, a fresh model and optimizer, load_state
    reset_accelerate(state)
    resumed, optimizer = _prepare(state, context, fresh_model(state))
    state.engine_state["accelerator"].load_state(str(shared / STATE_DIR))
    outputs = _evaluate(state, context, resumed).logits
    state.metrics.dcp_reload_max_abs_difference = checks.check_outputs_equal(
        "eval logits after load_state",
        state.engine_state["sharded_outputs_before_save"],
        outputs,
        CHECKPOINT_ROUND_TRIP,
    )
    state.model, state.optimizer = resumed, optimizer


def _continuation(state: CellState, context, model, optimizer, accelerator) -> resume.Continuation:
    return resume.Continuation(
        step=lambda: _step(state, context, model, optimizer, accelerator),
        tensors=lambda: resume.model_and_optimizer_tensors(model, optimizer),
    )


def rank_resumed_step(state: CellState, context) -> None:
    model, optimizer, accelerator = state.engine_state["uninterrupted"]
    model.train()
    current = state.engine_state["accelerator"]
    resumed = _continuation(state, context, state.model, state.optimizer, current)
    uninterrupted = _continuation(state, context, model, optimizer, accelerator)
    resume_one_sharded_step(state, resumed, uninterrupted, resume.scaler_state(current.scaler))


class AccelerateFSDP2Engine(DistributedEngine):
    name = "accelerate-fsdp2"
    axis_position = 6
    description = "accelerate's FSDP2 path: prepare (fully_shard per layer, fp32 master weights), save_state/load_state"

    rank_train_steps = staticmethod(rank_train_steps)
    rank_mid_training_eval = staticmethod(rank_mid_training_eval)
    rank_checkpoint_save = staticmethod(rank_checkpoint_save)
    rank_checkpoint_reload = staticmethod(rank_checkpoint_reload)
    rank_resumed_step = staticmethod(rank_resumed_step)
    rank_evaluate = staticmethod(rank_evaluate)

    def derive_settings(self, precision: Precision) -> dict | Unsupported:
        unsupported = one_switch_unsupported(self.name, "an accelerate setting", precision)
        if unsupported:
            return unsupported
        compute = dtype_name(precision.autocast_dtype) if precision.autocast_dtype else None
        mixed = MIXED_PRECISION[compute]
        policy = None
        if compute is not None:
            # param and output dtypes as accelerate sets them for the switch; the reduce dtype the
            # precision's (accelerate's own default reduces in the compute dtype too)
            reduce = dtype_name(precision.reduce_dtype) if precision.reduce_dtype else "float32"
            policy = {"param_dtype": compute, "reduce_dtype": reduce, "output_dtype": compute}
        return {"mixed_precision": mixed, "mixed_precision_policy": policy}

    def rank_cleanup(self, state: CellState) -> None:
        if "accelerator" in state.engine_state:
            reset_accelerate(state)


register(AccelerateFSDP2Engine())
