"""Functions the rank-pool tests send to the ranks (tests/test_distributed.py): each runs in
every rank as function(context, *args), on the real process group."""

import os
import time


def rank_and_sum(context):
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(context.rank)])
    dist.all_reduce(value)
    return {"rank": context.rank, "sum": value.item(), "pid": os.getpid(), "backend": dist.get_backend()}


def raise_on(context, rank, then_collective):
    """`rank` raises; the others answer, or wait in a collective the raising rank never joins."""
    import torch
    import torch.distributed as dist

    if context.rank == rank:
        raise ValueError(f"rank {rank} refuses a float16 weight: expected float32")
    if then_collective:
        dist.all_reduce(torch.zeros(1))
    return context.rank


def die_on(context, rank):
    if context.rank == rank:
        import ctypes

        ctypes.string_at(0)  # SIGSEGV
    return context.rank


def sleep_on(context, rank, seconds):
    if context.rank == rank:
        time.sleep(seconds)
    return context.rank
