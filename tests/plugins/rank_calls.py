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


def mismatched_gather(context):
    """An all-gather whose ranks disagree on its size, waited on as ZeRO-3 waits on its parameter
    gathers: gloo's transport thread throws, and the C++ runtime aborts the rank."""
    import torch
    import torch.distributed as dist

    mine = torch.ones(2 + 6 * context.rank)
    gathered = torch.empty(mine.numel() * dist.get_world_size())
    dist.all_gather_into_tensor(gathered, mine, async_op=True).wait()
    return context.rank


def sleep_on(context, rank, seconds):
    if context.rank == rank:
        time.sleep(seconds)
    return context.rank


def gathered_like_torch(context, rows):
    """FSDP2 shards of a model with `rows` rows in its layers, gathered by the harness's one
    collective per dtype (engines/distributed.full_state_dict) and by torch's
    get_model_state_dict: whether every tensor came back bit for bit, in the same names."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from matrix.engines.distributed import _gathered_along_dim0, full_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, rows), torch.nn.LayerNorm(rows), torch.nn.Linear(rows, 1, bias=False)
    )
    model[1].to(torch.bfloat16)  # a second dtype: a second collective
    model.register_buffer("scale", torch.arange(rows, dtype=torch.float32))
    fully_shard(model[0])
    fully_shard(model)
    ours = full_state_dict(model)
    one_collective_per_dtype = _gathered_along_dim0(model.state_dict()) is not None
    theirs = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {
        "one_collective_per_dtype": one_collective_per_dtype,
        "names": list(ours) == list(theirs),
        "equal": all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype for k in theirs),
        "shapes": {k: list(v.shape) for k, v in ours.items()},
    }


def settled(context):
    """Whether the rank collected what the cells before left, and nothing of a cell is held."""
    return {"settled": context.settled, "cell": context.cell, "pending": context.after_answer is not None}
