"""The processes one cell runs in, as the harness sees them: one process (every engine but the
distributed ones), or the ranks of a real process group, each running the same pipeline
(matrix/harness/pipeline.py) on its own rows of the cell's batch.

A Group answers the few questions the pipeline and the engines ask of it: which rows of the
batch are this process's, what the whole batch's mean of a per-rank quantity is, whether any
rank saw something, where the checkpoints every rank reads are written, and who writes them.
With one process every answer is the trivial one, and no process group is touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Group:
    rank: int = 0
    world_size: int = 1
    # where the cell's checkpoints go, for every rank to read: the cell's own directory in one
    # process, a directory the ranks share in a group
    shared_dir: Path | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def writes(self) -> bool:
        """Whether this process writes what is written once for the group (rank 0)."""
        return self.rank == 0

    def barrier(self) -> None:
        """Every rank waits here until all have arrived (what rank 0 wrote is there to read)."""
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def rows(self, batch: dict) -> dict:
        """This process's rows of the batch: contiguous, the first ranks taking one more where
        the rows do not divide evenly. One process: the whole batch, as it is."""
        if not self.distributed:
            return batch
        import torch

        return {key: torch.tensor_split(value, self.world_size)[self.rank] for key, value in batch.items()}

    def largest_share(self, batch: dict) -> int:
        """How many rows the first rank takes (the most any rank takes): the per-device batch size
        a library is configured with on every rank."""
        return len(Group(0, self.world_size).rows(batch)[next(iter(batch))])

    def mean(self, value: float, items: int) -> float:
        """The whole batch's mean from each rank's mean over its `items` items. One process:
        `value` itself, untouched."""
        if not self.distributed:
            return value
        import torch
        import torch.distributed as dist

        pair = torch.tensor([value * items, float(items)], dtype=torch.float64, device=_collective_device())
        dist.all_reduce(pair)
        return (pair[0] / pair[1]).item()

    def total(self, value: float) -> float:
        """The sum over the ranks of a per-rank value."""
        if not self.distributed:
            return value
        import torch
        import torch.distributed as dist

        total = torch.tensor([value], dtype=torch.float64, device=_collective_device())
        dist.all_reduce(total)
        return total.item()

    def any(self, flag: bool) -> bool:
        """Whether any rank says yes (a grad scaler's overflow must skip the step on every rank)."""
        if not self.distributed:
            return flag
        import torch
        import torch.distributed as dist

        value = torch.tensor([1.0 if flag else 0.0], device=_collective_device())
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def gather(self, value) -> list:
        """Every rank's `value` (any picklable object), in rank order."""
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        every: list = [None] * self.world_size
        dist.all_gather_object(every, value)
        return every


SINGLE = Group()


def _collective_device():
    """Where a collective's tensor must live: nccl reduces CUDA tensors only (a CPU tensor raises
    "No backend type associated with device type cpu"), gloo CPU tensors."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
