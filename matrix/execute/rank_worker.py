"""One rank of the pool (matrix/execute/rank_pool.py): joins the process group once, then runs the calls
the driver sends until it is told to stop or its pipe closes.

A call is ("call", "module:function", args): function(context, *args) runs here, where
`context` is this rank's RankContext, kept from call to call (a cell's model lives in it
between phases). Its return value goes back; an exception goes back described (type,
message, origin, traceback, phase), with its signature computed here, where the traceback is.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

from matrix.results.signatures import is_failure, message_of

# A collective that waits longer than this raises in the rank; the driver kills the group on
# the cell's own (shorter) timeout first.
COLLECTIVE_TIMEOUT_S = 600


@dataclass
class RankContext:
    rank: int
    world_size: int
    device: str  # the device axis' name: cpu, cuda
    cell: object | None = None  # the cell this rank runs now (its CellState), kept between its phases
    # the cell's watch over this rank's process-global state (matrix/harness/global_state.py)
    watch: object | None = None
    # work for after a call's answer went back and before the next call is read (what a cell left
    # is collected while the driver records that cell and goes on)
    after_answer: Callable[[], None] | None = None
    settled: bool = False  # what the cells before left is collected already (matrix/execute/ranks.py)


def describe(exc: BaseException) -> dict:
    from matrix.results.signatures import exception_type, origin_of

    return {
        "type": exception_type(exc),
        "message": message_of(exc),
        "details": getattr(exc, "details", None),
        "origin": origin_of(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "phase": getattr(exc, "matrix_phase", None),
        # what the rank had measured when it raised (a phase's metrics), sent back with the error
        "payload": getattr(exc, "matrix_payload", None),
    }


def resolve(reference: str):
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


def join_group(context: RankContext) -> dict:
    import torch
    import torch.distributed as dist

    from matrix.devices import DEVICES

    device = DEVICES[context.device]
    torch.set_num_threads(1)  # the ranks share the machine's cores
    backend = "nccl" if context.device == "cuda" else "gloo"
    if device.indexed:
        device.activate(device.torch_device(context.rank))
    dist.init_process_group(
        backend,
        init_method=f"file://{os.environ['MATRIX_RANK_STORE']}",
        rank=context.rank,
        world_size=context.world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    return {"backend": dist.get_backend(), "pid": os.getpid(), "torch": torch.__version__}


def main() -> None:
    faulthandler.enable()  # a fatal signal leaves the rank's Python stack in its log, for RankDied
    request_fd, reply_fd = (int(fd) for fd in os.environ["MATRIX_RANK_PIPES"].split(","))
    requests, replies = Connection(request_fd, writable=False), Connection(reply_fd, readable=False)
    context = RankContext(
        int(os.environ["MATRIX_RANK"]), int(os.environ["MATRIX_WORLD_SIZE"]), os.environ["MATRIX_RANK_DEVICE"]
    )
    try:
        from matrix.execute import environment_variables as cell_environment

        cell_environment.apply()  # a rank runs nothing but cells; before anything imports triton
        replies.send(("ready", join_group(context)))
    except Exception as exc:  # answered: the driver reports it as the group's start failure
        replies.send(("error", describe(exc)))
        return
    while True:
        try:
            message = requests.recv()
        except EOFError:  # the driver is gone
            break
        if message[0] == "stop":
            break
        _, reference, args = message
        try:
            replies.send(("ok", resolve(reference)(context, *args)))
        except BaseException as exc:  # answered with its description; the driver records it
            if not is_failure(exc):
                raise
            replies.send(("error", describe(exc)))
        if context.after_answer is not None:
            work, context.after_answer = context.after_answer, None
            work()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
