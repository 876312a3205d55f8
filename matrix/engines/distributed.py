"""What the distributed engines (ddp.py, fsdp2.py) share: the driver side, which sends each of a
cell's phases to the run's group of ranks (matrix/rank_pool.py), and the rank side, which runs
them on a real process group with the cell's batch split across the ranks.

Driver side: a DistributedEngine's phase is one call to every rank; the ranks' metrics come
back, rank 0's become the cell's, and a rank's exception becomes the cell's failure with that
exception's own signature. Rank side: each rank builds the cell (same seed, same weights),
trains on its rows of the batch, and runs the same checks as the single-process engines on
the whole batch, with the weights gathered where they are sharded.

The loss a rank backpropagates is weighted by its share of the items the loss averages over
(ModelKind.loss_items): with the ranks' gradients averaged, the step is the full batch's, and
the loss reported for a step is the full batch's mean, as the torch engine computes it.
"""

from __future__ import annotations

import abc
import os
import time

from matrix.engines.base import Engine, Unsupported
from matrix.phases import PHASE_NAMES, CellState
from matrix.precisions import Precision
from matrix.results.metrics import UNSET, CellMetrics, Distributed, given

WORLD_SIZE = 2  # --world-size; the plugin sets it
RANK_STATE_KEY = "cell"


def world_size() -> int:
    return WORLD_SIZE


class DistributedEngine(Engine):
    """An engine whose phases run on every rank of a process group. Subclasses implement the
    rank side: rank_train_steps(state, context) ... one per phase, run in each rank."""

    fixed_variant_fields = ("grad_accumulation",)
    distributed = True

    def device_skip_reason(self, device) -> str | None:
        if device.indexed:
            import torch

            visible = torch.cuda.device_count() if device.name == "cuda" else 0
            if visible < world_size():
                return f"Requires: [{world_size()} {device.name} devices, one per rank] ({visible} visible)"
        return None

    def derive_or_refuse(self, precision: Precision) -> dict | Unsupported:
        if precision.grad_dtype is not None or precision.grad_accumulation > 1:
            return Unsupported(
                f"Requires: [micro-batch accumulation and a gradient dtype wired into the {self.name} engine]"
            )
        return super().derive_or_refuse(precision)

    def phases(self, mode: str) -> dict:
        return {name: (lambda state, name=name: self._run_phase(state, name)) for name in PHASE_NAMES[mode]}

    def _run_phase(self, state: CellState, phase: str) -> None:
        from matrix import rank_pool
        from matrix.models import MODELS

        group = rank_pool.pool(state.cell.device, world_size())
        timeout = None if state.deadline is None else max(1.0, state.deadline - time.monotonic())
        if "begun" not in state.engine_state:
            # What the harness establishes about the kind is established here, once, and handed
            # to the ranks: observing it in a rank would save and load a checkpoint while the
            # other rank waits in a collective (transformers saves on rank 0 only once a group
            # is up), and every rank would calibrate the same learning rate again.
            from matrix.observation import observe
            from matrix.phases import kind_learning_rate

            training = state.cell.mode == "train"
            known = {"observed": observe(state.kind), "rate": kind_learning_rate(state.kind) if training else None}
            began = time.perf_counter()
            started_before = group.starts
            group.call(
                "matrix.engines.distributed:rank_begin_cell",
                state.cell,
                MODELS.registered_in(state.cell.model),  # a plugin's kind: its import registers it in the ranks
                state.kind.variant,
                state.precision,
                str(state.workdir),
                known,
                timeout_s=timeout,
            )
            state.engine_state["begun"] = True
            state.metrics.distributed = Distributed(
                world_size=group.world_size,
                backend="nccl" if state.cell.device == "cuda" else "gloo",
                group_started_for_this_cell=group.starts != started_before,
                group_start_s=round(group.started_s or 0.0, 3),
                begin_cell_s=round(time.perf_counter() - began, 3),
            )
        # each rank's CellMetrics, pickled back: rank 0's become the cell's, the group's record kept;
        # a rank that raised sends what it had measured with its error: the first such rank's are kept
        try:
            ranks = group.call("matrix.engines.distributed:rank_phase", self.name, phase, timeout_s=timeout)
        except rank_pool.RankFailure as failure:
            if isinstance(failure.payload, CellMetrics):
                self._take_metrics(state, failure.payload)
            raise
        self._take_metrics(state, ranks[0])
        state.metrics.distributed.rank_first_step_losses = [given(m.rank_first_step_loss) for m in ranks]

    @staticmethod
    def _take_metrics(state: CellState, metrics: CellMetrics) -> None:
        distributed = state.metrics.distributed
        state.metrics.update(metrics)
        if metrics.distributed is not UNSET:
            distributed.update(metrics.distributed)
        state.metrics.distributed = distributed

    def cleanup(self, state: CellState) -> None:
        from matrix import rank_pool

        group = rank_pool.pool(state.cell.device, world_size())
        if state.engine_state.get("begun") and group.alive:
            group.call("matrix.engines.distributed:rank_end_cell", timeout_s=60.0)

    def rank_cleanup(self, state: CellState) -> None:
        """Rank side: reset the library's process-wide state after a cell (in each rank)."""
        return None

    @abc.abstractmethod
    def derive_settings(self, precision: Precision) -> dict: ...


# ---------------------------------------------------------------- rank side


def rank_begin_cell(context, cell, kind_module: str, variant, precision, workdir: str, known: dict) -> None:
    import dataclasses
    import importlib
    from pathlib import Path

    from matrix import learning_rate, observation
    from matrix.devices import DEVICES
    from matrix.engines import ENGINES
    from matrix.models import MODELS
    from matrix.phases import fresh_model

    importlib.import_module(kind_module)
    kind = MODELS[cell.model]
    if variant != kind.variant:
        kind = kind.with_variant(variant)
    observation.remember(kind, known["observed"])
    if known["rate"] is not None:  # a training cell's (an evaluation neither trains nor needs it)
        learning_rate.remember(kind, known["rate"])

    device = DEVICES[cell.device]
    directory = Path(workdir) / f"rank{context.rank}"
    directory.mkdir(parents=True, exist_ok=True)
    state = CellState(
        cell=cell,
        kind=kind,
        precision=precision,
        device=device.torch_device(context.rank if device.indexed else 0),
        workdir=directory,
        metrics=CellMetrics(declared=precision.settings()),
    )
    state.metrics.engine_settings = ENGINES[cell.engine].settings(precision)
    shared = state.engine_state["shared_dir"] = Path(workdir) / "shared"
    context.values[RANK_STATE_KEY] = state
    if precision.weights_from == "load":
        # One pretrained checkpoint on disk that every rank loads, as a distributed job has. It
        # is written once, by rank 0: transformers' save_pretrained writes on rank 0 only once a
        # process group is up (PreTrainedModel.should_save_on_this_rank, transformers 5.x).
        if context.rank == 0:
            shared.mkdir(parents=True, exist_ok=True)
            fresh_model(dataclasses.replace(state, workdir=shared))
        barrier()
        (directory / "pretrained-fp32").symlink_to(shared / "pretrained-fp32", target_is_directory=True)


def rank_phase(context, engine: str, phase: str) -> CellMetrics:
    from matrix.engines import ENGINES

    state = context.values[RANK_STATE_KEY]
    try:
        getattr(ENGINES[engine], "rank_" + phase)(state, context)
    except Exception as exc:
        if getattr(exc, "matrix_phase", None) is None:
            exc.matrix_phase = phase
        exc.matrix_payload = state.metrics  # what this rank measured before it raised
        raise
    return state.metrics


def rank_end_cell(context) -> None:
    from matrix.engines import ENGINES

    state = context.values.pop(RANK_STATE_KEY, None)
    if state is not None:
        ENGINES[state.cell.engine].rank_cleanup(state)
        restore_environment(state)
        for hook in ("first_forward_watch", "first_training_forward_seed"):
            watch = state.engine_state.pop(hook, None)
            if watch is not None:
                watch.remove()


# ---------------------------------------------------------------- rank-side helpers

# What torchrun sets for each rank, which accelerate and DeepSpeed read
LAUNCHER_ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")


def set_launcher_environment(state: CellState, context, also_restored: tuple[str, ...] = (), **extra: str) -> None:
    """Set this rank's launcher variables (and `extra`), as torchrun would, with one intra-op
    thread count per rank as the group runs; rank_end_cell puts the old values back, and those
    of `also_restored` (variables a library sets itself)."""
    import torch

    saved = state.engine_state.setdefault("environ", {})
    for key in (*LAUNCHER_ENVIRONMENT, *also_restored, *extra):
        saved.setdefault(key, os.environ.get(key))
    os.environ.update(
        RANK=str(context.rank),
        WORLD_SIZE=str(context.world_size),
        LOCAL_RANK=str(context.rank),
        LOCAL_WORLD_SIZE=str(context.world_size),
        OMP_NUM_THREADS=str(torch.get_num_threads()),
        **extra,
    )


def restore_environment(state: CellState) -> None:
    for key, value in state.engine_state.pop("environ", {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def shard_rows(batch: dict, rank: int, world: int) -> dict:
    """This rank's rows of the batch (contiguous; the first ranks take one more where the rows
    do not divide evenly)."""
    import torch

    return {key: torch.tensor_split(value, world)[rank] for key, value in batch.items()}


def loss_weight(state: CellState, shard: dict, world: int) -> float:
    """What a rank's shard loss is multiplied by before backward, so that the ranks' gradients,
    averaged, are the gradient of the whole batch's mean loss."""
    return state.kind.loss_items(shard) * world / state.kind.loss_items(state.batch)


def global_mean(value: float, items: int) -> float:
    """The whole batch's mean from each rank's shard mean and item count."""
    import torch
    import torch.distributed as dist

    pair = torch.tensor([value * items, float(items)], dtype=torch.float64)
    dist.all_reduce(pair)
    return (pair[0] / pair[1]).item()


def any_rank(flag: bool) -> bool:
    import torch
    import torch.distributed as dist

    value = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def sharded_step(state: CellState, context, model, optimizer, scaler) -> tuple[float, bool]:
    """One optimizer step of `model` (the wrapped one) on this rank's rows: the loss weighted by
    the rank's share, the scaler's skip decided alike on every rank. Returns the whole batch's
    mean loss and whether the step was applied."""
    from matrix import checks

    shard = shard_rows(state.batch, context.rank, context.world_size)
    optimizer.zero_grad(set_to_none=True)
    with state.precision.autocast(state.device_type):
        loss = state.kind.loss(model, shard)
    value = checks.check_finite_loss(loss, "training loss")
    if state.metrics.rank_first_step_loss is UNSET:
        state.metrics.rank_first_step_loss = value
    weighted = loss * loss_weight(state, shard, context.world_size)
    (weighted if scaler is None else scaler.scale(weighted)).backward()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if scaler is None:
        checks.check_finite_gradients(named)
        optimizer.step()
        applied = True
    else:
        scaler.unscale_(optimizer)
        overflow = any_rank(bool(checks.nonfinite_gradients(named)))
        scaler.step(optimizer)
        scaler.update()
        applied = not overflow
    checks.check_finite_parameters(named, "after the optimizer step")
    return global_mean(value, state.kind.loss_items(shard)), applied


def sharded_dropout_off_loss(state: CellState, context, model, autocast: bool = True) -> float | None:
    """For a kind whose training forward draws random numbers (dropout, as observed): the whole
    batch's training loss of `model` (wrapped, before its first step) with dropout off, each rank
    on its rows. The cross-engine check compares it instead of the first step's loss, whose
    dropout masks on a rank's rows are not the ones the whole batch draws in one process. None
    for a forward without random numbers: the first step's loss compares exactly."""
    from matrix.phases import dropout_off_loss, stochastic_training_forward

    if not stochastic_training_forward(state):
        return None
    shard = shard_rows(state.batch, context.rank, context.world_size)
    return global_mean(dropout_off_loss(state, model, shard, autocast), state.kind.loss_items(shard))


def check_first_step(state: CellState, losses: list[float], dropout_off: float | None) -> None:
    """The cross-engine check of training: the first step's loss, or with dropout the
    dropout-off loss before it (sharded_dropout_off_loss); the record says which."""
    from matrix.phases import DROPOUT_OFF, check_agrees_with_torch_engine

    if dropout_off is None:
        check_agrees_with_torch_engine(state, losses[0], "train")
    else:
        check_agrees_with_torch_engine(state, dropout_off, DROPOUT_OFF)


def sharded_evaluate(state: CellState, context, model, autocast: bool = True):
    """Evaluation as the precision defines it, each rank on its rows, gathered: the whole batch's
    mean loss, and the logits (and generated tokens) of every row in order. `autocast=False`:
    the model's forward brings its own (a model accelerate prepared)."""
    import contextlib

    import torch
    import torch.distributed as dist

    from matrix.models.base import EvalOutput

    shard = shard_rows(state.batch, context.rank, context.world_size)
    model.eval()
    around = state.precision.autocast(state.device_type) if autocast else contextlib.nullcontext()
    with state.eval_grad_context(), around:
        result = state.kind.evaluate(model, shard)
    mine = {
        "loss": result.loss.detach().float().item(),
        "items": state.kind.loss_items(shard),
        "logits": result.logits.detach().cpu(),
        "generated": None if result.generated is None else result.generated.cpu(),
        "extras": result.extras,
    }
    every: list = [None] * context.world_size
    dist.all_gather_object(every, mine)
    total = sum(part["items"] for part in every)
    loss = sum(part["loss"] * part["items"] for part in every) / total
    generated = None if mine["generated"] is None else torch.cat([p["generated"] for p in every]).to(state.device)
    return EvalOutput(
        loss=torch.tensor(loss),
        logits=torch.cat([p["logits"] for p in every]).to(state.device),
        generated=generated,
        extras=mine["extras"],
    )


def full_state_dict(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def gathered_copy(state: CellState, model, reuse: bool = False):
    """For an engine whose parameters are sharded (FSDP2): a plain model of the kind holding
    the sharded model's full weights, in the dtypes the shards have (assigned, not copied into
    the plain model's own dtypes). `reuse`: the copy made last, where no step has run since
    (mid-training eval and the save follow training)."""
    if reuse and state.engine_state.get("gathered") is not None:
        return state.engine_state["gathered"]
    full = full_state_dict(model)
    plain = state.kind.build(state.precision, state.device, state.workdir)
    plain.load_state_dict({k: v.to(state.device) for k, v in full.items()}, assign=True)
    state.engine_state["gathered"] = plain
    return plain


def resume_one_sharded_step(state: CellState, resumed, uninterrupted, scaler_state=None) -> None:
    """Step k+1 from the reloaded sharded checkpoint against the interrupted run's own (matrix/
    resume.py); it must also move the (gathered) weights."""
    from matrix import checks, resume
    from matrix.phases import snapshot_trainable

    state.model.train()
    before = snapshot_trainable(gathered_copy(state, state.model), state.kind)
    resume.check_resume(state, resumed, uninterrupted, state.optimizer, scaler_state)
    checks.check_parameters_changed(before, gathered_copy(state, state.model))


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()
