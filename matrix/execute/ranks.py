"""A cell of a distributed engine run on the run's group of ranks (matrix/execute/rank_pool.py;
--world-size ranks, 2 by default).

Driver side (run_phase, end_cell): a phase is one call to every rank. Before the first, what the
harness establishes about the kind (its observation, its learning rate) is established here, once,
and handed to the ranks. The ranks' metrics come back, rank 0's become the cell's, and a rank's
exception becomes the cell's failure with that exception's own signature.

Rank side (rank_begin_cell, rank_phase, rank_end_cell): each rank builds the cell (same seed, same
weights; a *-loaded-* precision's pretrained checkpoint is written once, by rank 0) and runs the
harness's own pipeline (matrix/harness/pipeline.py) on a real process group, on its rows of the batch
(matrix/harness/group.py); the checks are the pipeline's, the same as in one process, on the whole
batch (evaluations gathered, sharded weights gathered). What the engines themselves share, and the
helpers they call in a rank, are matrix/engines/distributed.py's.
"""

from __future__ import annotations

import time

from matrix.engines.distributed import restore_environment, world_size
from matrix.results.metrics import UNSET, CellMetrics, Distributed, given
from matrix.results.signatures import is_failure

# ---------------------------------------------------------------- driver side


def run_phase(state, phase: str) -> None:
    """One phase of the cell, run by every rank of the group."""
    from matrix.execute import rank_pool
    from matrix.models import MODELS

    group = rank_pool.pool(state.cell.device, world_size())
    timeout = None if state.deadline is None else max(1.0, state.deadline - time.monotonic())
    if not state.in_ranks:
        # What the harness establishes about the kind is established here, once, and handed
        # to the ranks: observing it in a rank would save and load a checkpoint while the
        # other rank waits in a collective (transformers saves on rank 0 only once a group
        # is up), and every rank would calibrate the same learning rate again.
        # So is what it measured of the kind on fresh models (the references every engine's cells
        # compare with, the tensors the rate stalls in bf16), where it has: the ranks take it
        # rather than train and evaluate the same fresh models again, each in its own process.
        from matrix.harness.kind_traits import established_for, kind_learning_rate
        from matrix.harness.reference_curves import measured_for
        from matrix.models.observation import observe

        known = {"observed": observe(state.kind), "rate": kind_learning_rate(state.kind) if state.training else None}
        known.update(established=established_for(state.kind), measured=measured_for(state.kind))
        began = time.perf_counter()
        started_before = group.starts
        group.call(
            "matrix.execute.ranks:rank_begin_cell",
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
        ranks = group.call("matrix.execute.ranks:rank_phase", phase, timeout_s=timeout)
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
    from matrix.execute import rank_pool

    group = rank_pool.pool(state.cell.device, world_size())
    if state.in_ranks and group.alive:
        left = group.call("matrix.execute.ranks:rank_end_cell", timeout_s=60.0)
        from matrix.harness import global_state

        for rank, leaks in enumerate(left):  # the ranks are reused by the next cell: theirs are this cell's too
            global_state.left_in_another_process(f"rank {rank}", leaks or [])


# ---------------------------------------------------------------- rank side


def rank_begin_cell(context, cell, kind_module: str, variant, precision, workdir: str, known: dict) -> None:
    import dataclasses
    import importlib
    from pathlib import Path

    from matrix.devices import DEVICES
    from matrix.engines import ENGINES
    from matrix.harness import kind_traits, learning_rate, reference_curves
    from matrix.harness.cell_state import CellState
    from matrix.harness.garbage import settle_garbage
    from matrix.harness.group import Group
    from matrix.harness.measurements import fresh_model
    from matrix.models import MODELS, ModelKind, observation

    if not context.settled:  # else settled once the last cell's end was answered
        settle_garbage()
    context.settled = False
    importlib.import_module(kind_module)
    from matrix.harness import global_state

    context.watch = global_state.Watch()  # this rank's process-global state, put back after the cell
    kind = MODELS[cell.model]
    if variant != kind.variant:
        kind = kind.with_variant(variant)
    observation.remember(kind, known["observed"])
    if known["rate"] is not None:  # a training cell's (an evaluation neither trains nor needs it)
        learning_rate.remember(kind, known["rate"])
    kind_traits.remember_established(known["established"])
    reference_curves.remember_measured(known["measured"])

    device = DEVICES[cell.device]
    directory = Path(workdir) / f"rank{context.rank}"
    directory.mkdir(parents=True, exist_ok=True)
    shared = Path(workdir) / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    engine = ENGINES[cell.engine]
    state = CellState.begin(
        cell,
        kind,
        precision,
        device.torch_device(context.rank if device.indexed else 0),
        directory,
        engine=engine,
        group=Group(context.rank, context.world_size, shared),
    )
    context.cell = state
    if precision.weights_from == "load":
        # One pretrained checkpoint on disk that every rank loads, as a distributed job has. It
        # is written once, by rank 0: transformers' save_pretrained writes on rank 0 only once a
        # process group is up (PreTrainedModel.should_save_on_this_rank, transformers 5.x).
        if context.rank == 0:
            if type(kind).build is ModelKind.build or type(kind).pretrained is not ModelKind.pretrained:
                kind.pretrained(shared)  # only the checkpoint, not a whole model built and thrown away
            else:  # a kind that builds its own way (a user's): its build writes what its loads read
                fresh_model(dataclasses.replace(state, workdir=shared))
        state.group.barrier()
        (directory / "pretrained-fp32").symlink_to(shared / "pretrained-fp32", target_is_directory=True)


def rank_phase(context, phase: str) -> CellMetrics:
    from matrix.harness import pipeline

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
    is put back, and returned (matrix/harness/global_state.py Leak.as_dict())."""
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
        context.after_answer = lambda: _settle(context)
    return [leak.as_dict() for leak in leaks]


def _settle(context) -> None:
    """What the cell left is collected once its end was answered, outside any cell, as the driver
    settles before its next cell starts (matrix/harness/garbage.py); the next cell in this rank then
    finds it done."""
    from matrix.harness.garbage import settle_garbage

    settle_garbage()
    context.settled = True
