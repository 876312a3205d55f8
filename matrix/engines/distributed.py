"""What the distributed engines (ddp, fsdp2, accelerate-fsdp2, deepspeed-zero0..3,
hf-trainer-zero2/3) share: their base, DistributedEngine, and the two sides of a cell that runs on
the run's group of ranks (matrix/rank_pool.py; --world-size ranks, 2 by default).

DistributedEngine is mixed in before Loop or LibraryLoop. On an indexed device (cuda) a cell
skips where fewer devices are visible than there are ranks; a precision with a gradient dtype or
micro-batch accumulation is refused (neither is wired into these engines).

Driver side (run_phase, end_cell): a phase is one call to every rank. Before the first, what the
harness establishes about the kind (its observation, its learning rate) is established here, once,
and handed to the ranks. The ranks' metrics come back, rank 0's become the cell's, and a rank's
exception becomes the cell's failure with that exception's own signature.

Rank side (rank_begin_cell, rank_phase, rank_end_cell): each rank builds the cell (same seed, same
weights; a *-loaded-* precision's pretrained checkpoint is written once, by rank 0) and runs the
harness's own pipeline (matrix/pipeline.py) on a real process group, on its rows of the batch
(matrix/group.py); the checks are the pipeline's, the same as in one process, on the whole batch
(evaluations gathered, sharded weights gathered). Helpers for the engines: the launcher variables
torchrun would set (RANK, WORLD_SIZE, ...), put back after the cell, and a sharded model's whole
state dict (FSDP2's shards in one all_gather per dtype) with GatheredWeights, a sharded run's
weights view.

Where the harness or the engine takes the steps, the loss a rank backpropagates is weighted by its
share of the items the loss averages over (ModelKind.loss_items; matrix/measurements.py
loss_weight): with the ranks' gradients averaged, the step is the full batch's, and the loss
reported for a step is the full batch's mean, as the torch engine computes it. The Trainer on
DeepSpeed weights it itself (it averages tokens across devices).
"""

from __future__ import annotations

import os
import time

from matrix.engines.base import Engine, Unsupported, reads
from matrix.precisions import Precision
from matrix.results.metrics import UNSET, CellMetrics, Distributed, given
from matrix.signatures import is_failure

WORLD_SIZE = 2  # --world-size; the plugin sets it


def world_size() -> int:
    return WORLD_SIZE


class DistributedEngine(Engine):
    """An engine whose library runs on every rank of a process group: the harness's pipeline runs
    in each rank, with the engine's start/train/evaluate/save/restore there. Mixed in before
    Loop or LibraryLoop: class DDPEngine(DistributedEngine, Loop)."""

    fixed_variant_fields = ("grad_accumulation",)
    distributed = True

    def device_skip_reason(self, device) -> str | None:
        absent = super().device_skip_reason(device)  # a package the engine requires
        if absent:
            return absent
        if device.indexed:
            import torch

            visible = torch.cuda.device_count() if device.name == "cuda" else 0
            if visible < world_size():
                return f"Requires: [{world_size()} {device.name} devices, one per rank] ({visible} visible)"
        return None

    def derive_or_refuse(self, precision: Precision):
        if precision.grad_dtype is not None or precision.grad_accumulation > 1:
            return Unsupported(
                f"Requires: [micro-batch accumulation and a gradient dtype wired into the {self.name} engine]"
            )
        return super().derive_or_refuse(precision)

    def rank_cleanup(self, state) -> None:
        """Rank side: reset the library's process-wide state after a cell (in each rank)."""
        self.cleanup(state)


# ---------------------------------------------------------------- driver side


def run_phase(state, phase: str) -> None:
    """One phase of the cell, run by every rank of the group."""
    from matrix import rank_pool
    from matrix.models import MODELS

    group = rank_pool.pool(state.cell.device, world_size())
    timeout = None if state.deadline is None else max(1.0, state.deadline - time.monotonic())
    if not state.in_ranks:
        # What the harness establishes about the kind is established here, once, and handed
        # to the ranks: observing it in a rank would save and load a checkpoint while the
        # other rank waits in a collective (transformers saves on rank 0 only once a group
        # is up), and every rank would calibrate the same learning rate again.
        from matrix.kind_traits import kind_learning_rate
        from matrix.observation import observe

        known = {"observed": observe(state.kind), "rate": kind_learning_rate(state.kind) if state.training else None}
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
        state.in_ranks = True
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
        ranks = group.call("matrix.engines.distributed:rank_phase", phase, timeout_s=timeout)
    except rank_pool.RankFailure as failure:
        if isinstance(failure.payload, CellMetrics):
            _take_metrics(state, failure.payload)
        raise
    _take_metrics(state, ranks[0])
    state.metrics.distributed.rank_first_step_losses = [given(m.rank_first_step_loss) for m in ranks]


def _take_metrics(state, metrics: CellMetrics) -> None:
    distributed = state.metrics.distributed
    state.metrics.update(metrics)
    if metrics.distributed is not UNSET:
        distributed.update(metrics.distributed)
    state.metrics.distributed = distributed


def end_cell(state) -> None:
    """The ranks forget the cell: its runs released, the library's state reset."""
    from matrix import rank_pool

    group = rank_pool.pool(state.cell.device, world_size())
    if state.in_ranks and group.alive:
        left = group.call("matrix.engines.distributed:rank_end_cell", timeout_s=60.0)
        from matrix import global_state

        for rank, leaks in enumerate(left):  # the ranks are reused by the next cell: theirs are this cell's too
            global_state.left_in_another_process(f"rank {rank}", leaks or [])


# ---------------------------------------------------------------- rank side


def rank_begin_cell(context, cell, kind_module: str, variant, precision, workdir: str, known: dict) -> None:
    import dataclasses
    import importlib
    from pathlib import Path

    from matrix import learning_rate, observation
    from matrix.cell_state import CellState
    from matrix.devices import DEVICES
    from matrix.engines import ENGINES
    from matrix.group import Group
    from matrix.measurements import fresh_model, settle_garbage
    from matrix.models import MODELS

    settle_garbage()
    importlib.import_module(kind_module)
    from matrix import global_state

    context.watch = global_state.Watch()  # this rank's process-global state, put back after the cell
    kind = MODELS[cell.model]
    if variant != kind.variant:
        kind = kind.with_variant(variant)
    observation.remember(kind, known["observed"])
    if known["rate"] is not None:  # a training cell's (an evaluation neither trains nor needs it)
        learning_rate.remember(kind, known["rate"])

    device = DEVICES[cell.device]
    directory = Path(workdir) / f"rank{context.rank}"
    directory.mkdir(parents=True, exist_ok=True)
    shared = Path(workdir) / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    engine = ENGINES[cell.engine]
    state = CellState(
        cell=cell,
        kind=kind,
        precision=precision,
        device=device.torch_device(context.rank if device.indexed else 0),
        workdir=directory,
        metrics=CellMetrics(declared=precision.settings()),
        engine=engine,
        settings=engine.derive_or_refuse(precision),
        group=Group(context.rank, context.world_size, shared),
    )
    state.metrics.engine_settings = engine.settings(precision)
    context.cell = state
    if precision.weights_from == "load":
        # One pretrained checkpoint on disk that every rank loads, as a distributed job has. It
        # is written once, by rank 0: transformers' save_pretrained writes on rank 0 only once a
        # process group is up (PreTrainedModel.should_save_on_this_rank, transformers 5.x).
        if context.rank == 0:
            fresh_model(dataclasses.replace(state, workdir=shared))
        state.group.barrier()
        (directory / "pretrained-fp32").symlink_to(shared / "pretrained-fp32", target_is_directory=True)


def rank_phase(context, phase: str) -> CellMetrics:
    from matrix import pipeline

    state = context.cell
    try:
        pipeline.run_phase(state, phase)
    except BaseException as exc:  # a library's BaseException too (signatures.is_failure)
        if not is_failure(exc):
            raise
        if getattr(exc, "matrix_phase", None) is None:
            exc.matrix_phase = phase
        exc.matrix_payload = state.metrics  # what this rank measured before it raised
        raise
    finally:
        context.watch.checkpoint(phase)
    return state.metrics


def rank_end_cell(context) -> list[dict]:
    """The rank forgets the cell; what the cell left changed in this rank's process-global state
    is put back, and returned (matrix/global_state.py Leak.as_dict())."""
    state, context.cell = context.cell, None
    if state is None:
        return []
    try:
        for run in (state.run, state.restored):
            if run is not None:
                state.engine.close(state, run)
        state.engine.rank_cleanup(state)
    finally:
        restore_environment()
        state.hooks.remove()
        leaks = context.watch.close("cleanup") if context.watch is not None else []
        context.watch = None
    return [leak.as_dict() for leak in leaks]


# ---------------------------------------------------------------- rank-side helpers

# What torchrun sets for each rank, which accelerate and DeepSpeed read
LAUNCHER_ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")
_SAVED_ENVIRONMENT: dict[str, str | None] = {}  # this rank's variables as they were before the cell


def set_launcher_environment(state, also_restored: tuple[str, ...] = (), **extra: str) -> None:
    """Set this rank's launcher variables (and `extra`), as torchrun would, with one intra-op
    thread count per rank as the group runs; rank_end_cell puts the old values back, and those
    of `also_restored` (variables a library sets itself)."""
    import torch

    for key in (*LAUNCHER_ENVIRONMENT, *also_restored, *extra):
        _SAVED_ENVIRONMENT.setdefault(key, os.environ.get(key))
    group = state.group
    os.environ.update(
        RANK=str(group.rank),
        WORLD_SIZE=str(group.world_size),
        LOCAL_RANK=str(group.rank),
        LOCAL_WORLD_SIZE=str(group.world_size),
        OMP_NUM_THREADS=str(torch.get_num_threads()),
        **extra,
    )


def restore_environment() -> None:
    for key, value in _SAVED_ENVIRONMENT.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _SAVED_ENVIRONMENT.clear()


def full_state_dict(model) -> dict:
    """A sharded model's whole state dict, gathered on every rank (a collective). FSDP2's
    parameters (sharded along dim 0 over one mesh) are gathered in one collective per dtype;
    any other layout through torch's get_model_state_dict, which gathers tensor by tensor (a
    fifth of a sharded cell's time when the harness read the weights that way)."""
    state = model.state_dict()
    gathered = _gathered_along_dim0(state)
    if gathered is not None:
        return gathered
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    found = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in found.items()}


def _gathered_along_dim0(state: dict) -> dict | None:
    """`state`'s tensors whole, its DTensors gathered with one all_gather per dtype, where every
    DTensor is sharded along dim 0 over the same one-dimensional mesh (FSDP2's layout); None
    otherwise. The decision reads only the model's structure, the same in every rank, so every
    rank takes the same path."""
    import math

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    sharded = {name: value for name, value in state.items() if isinstance(value, DTensor)}
    meshes = {value.device_mesh for value in sharded.values()}  # equal meshes: the same ranks
    if len(meshes) > 1 or any(
        value.device_mesh.ndim != 1 or tuple(value.placements) != (Shard(0),) for value in sharded.values()
    ):
        return None
    whole = {name: value.detach().clone() for name, value in state.items() if name not in sharded}
    if not sharded:
        return whole
    mesh = next(iter(sharded.values())).device_mesh
    group, world, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    by_dtype: dict = {}
    for name, value in sharded.items():
        by_dtype.setdefault(value.dtype, []).append(name)
    for dtype, names in by_dtype.items():
        # each rank's shard of a tensor is torch.chunk's: ceil(rows / world) rows, the last fewer
        # or none; padded to that size, every rank sends a buffer of the same layout
        layout, pieces = [], []
        for name in names:
            value = sharded[name]
            rows, per_row = value.shape[0], math.prod(value.shape[1:])
            chunk = -(-rows // world)
            local = value.to_local().detach().reshape(-1)
            held = [max(0, min(rows, (r + 1) * chunk) - r * chunk) for r in range(world)]
            if local.numel() != held[me] * per_row:
                raise RuntimeError(
                    f"{name}: a shard of {local.numel()} elements, not torch.chunk's {held[me] * per_row}"
                )
            padded = torch.zeros(chunk * per_row, dtype=dtype, device=local.device)
            padded[: local.numel()] = local
            pieces.append(padded)
            layout.append((name, value.shape, chunk * per_row, held, per_row))
        buffer = torch.cat(pieces)
        every = [torch.empty_like(buffer) for _ in range(world)]
        dist.all_gather(every, buffer, group=group)
        offset = 0
        for name, shape, size, held, per_row in layout:
            parts = [every[r][offset : offset + held[r] * per_row] for r in range(world)]
            whole[name] = torch.cat(parts).reshape(shape)
            offset += size
    return {name: whole[name] for name in state}  # the state dict's own order


def gathered_copy(state, model, into=None):
    """A plain model of the kind holding a sharded model's full weights, in the dtypes the
    shards have (assigned, not copied into the plain model's own dtypes); `into` an earlier
    copy of the same run's, filled again (measurements.model_holding)."""
    from matrix.measurements import model_holding

    return model_holding(state, full_state_dict(model), into=into)


class GatheredWeights:
    """A sharded run's weights view, gathered once per step into one plain model per run: every
    rank gathers alike (the pipeline asks for the weights at the same points in every rank)."""

    @reads("model", "steps", "gathered", "gathered_at")
    def weights(self, state, run):
        if run.gathered is None or run.gathered_at != run.steps:
            from matrix.compiling import plain

            gathered = gathered_copy(state, plain(run.model), into=run.gathered)
            run.gathered, run.gathered_at = gathered, run.steps
        return run.gathered
