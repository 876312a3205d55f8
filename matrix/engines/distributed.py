"""What the distributed engines (ddp, fsdp2, accelerate-fsdp2, deepspeed-zero0..3,
hf-trainer-zero2/3) share: their base, DistributedEngine, and the helpers an engine calls in a
rank. A cell of theirs runs on the run's group of ranks: matrix/execute/ranks.py drives it.

DistributedEngine is mixed in before Loop or LibraryLoop. On an indexed device (cuda) a cell
skips where fewer devices are visible than there are ranks; a precision with a gradient dtype or
micro-batch accumulation is refused (neither is wired into these engines).

Helpers for the engines: the launcher variables torchrun would set (RANK, WORLD_SIZE, ...), put
back after the cell, and a sharded model's whole state dict (FSDP2's shards in one all_gather per
dtype) with GatheredWeights, a sharded run's weights view.

Where the harness or the engine takes the steps, the loss a rank backpropagates is weighted by its
share of the items the loss averages over (ModelKind.loss_items; matrix/harness/measurements.py
loss_weight): with the ranks' gradients averaged, the step is the full batch's, and the loss
reported for a step is the full batch's mean, as the torch engine computes it. The Trainer on
DeepSpeed weights it itself (it averages tokens across devices).
"""

from __future__ import annotations

import os

from matrix.engines.base import Engine, Unsupported, reads
from matrix.precisions.policies import Precision

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
    from matrix.harness.measurements import model_holding

    return model_holding(state, full_state_dict(model), into=into)


class GatheredWeights:
    """A sharded run's weights view, gathered once per step into one plain model per run: every
    rank gathers alike (the pipeline asks for the weights at the same points in every rank)."""

    @reads("model", "steps", "gathered", "gathered_at")
    def weights(self, state, run):
        if run.gathered is None or run.gathered_at != run.steps:
            from matrix.harness.compiling import plain

            gathered = gathered_copy(state, plain(run.model), into=run.gathered)
            run.gathered, run.gathered_at = gathered, run.steps
        return run.gathered
