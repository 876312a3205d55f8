"""Work written once for a process group: rank 0 writes (a checkpoint, an export), and every rank
agrees on whether it worked, so a failure on rank 0 stops the others in the same phase (PeerFailed)
instead of leaving them waiting in a collective. In one process the work simply runs."""

from __future__ import annotations

from matrix.checks import assertions as checks
from matrix.harness.cell_state import CellState
from matrix.results.signatures import is_failure


class PeerFailed(checks.CheckFailure):
    """Another rank failed in work written once for the group; this rank stops with it."""


def agreed(state: CellState, work):
    """`work()` in every process of the cell, then every rank learns whether it worked anywhere:
    a rank that failed (writing for the group, say) raises its own error, the others PeerFailed,
    and none is left waiting in a collective for a rank that never comes."""
    group = state.group
    if not group.distributed:
        return work()
    result, error = None, None
    try:
        result = work()
    except BaseException as exc:  # raised below, after every rank knows (a library's BaseException too)
        if not is_failure(exc):
            raise
        error = exc
    failed = group.gather(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    elsewhere = [(rank, what) for rank, what in enumerate(failed) if what is not None]
    if elsewhere:
        rank, what = elsewhere[0]
        raise PeerFailed(f"rank {rank} failed where every rank works together", details=what)
    return result
