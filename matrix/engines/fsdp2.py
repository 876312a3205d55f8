"""The fsdp2 engine: torch.distributed.fsdp.fully_shard on every layer and on the root, on a real
process group (gloo on CPU, nccl on CUDA), each rank training on its rows of the batch.

The precision maps onto MixedPrecisionPolicy: a precision that computes in a half dtype over
fp32 weights gets param_dtype = that dtype (FSDP's own mixed precision: fp32 shards, half
unsharded parameters), with its autocast as well; reduce_dtype is the precision's reduce
dtype, else the gradients' (fp32 for fp32 master weights); output_dtype is left to FSDP.

Its own checkpoint is a sharded one through torch.distributed.checkpoint (DCP), which the resumed
run starts from; the export is the full state dict gathered from the shards, saved by rank 0 in
the kind's own format (save_pretrained), which a plain model reads back.

Its compiled twin, `fsdp2-compile`, compiles each layer in place (layer.compile()) before
fully_shard, as torchtitan compiles each transformer block: in place, fully_shard's hooks still
run around the compiled forward, and the state dict keeps its keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from matrix.engines.base import ALWAYS, EngineSettings, Loop, register_with_compiled_twin
from matrix.engines.distributed import DistributedEngine, GatheredWeights
from matrix.harness.compiling import compile_in_place
from matrix.harness.measurements import fresh_model
from matrix.harness.torch_step import train_step
from matrix.precisions.policies import Precision, dtype_name

SCALER_FILE = "grad_scaler.pt"


@dataclass(frozen=True)
class FSDP2Settings(EngineSettings):
    param_dtype: str | None = field(default=None, metadata=ALWAYS)
    reduce_dtype: str | None = field(default=None, metadata=ALWAYS)
    output_dtype: str | None = field(default=None, metadata=ALWAYS)
    autocast: str | None = None
    grad_scaler: bool | None = None


@dataclass
class ShardedRun:
    """A sharded model, its optimizer and grad scaler; its weights gathered once per step."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scaler: torch.amp.GradScaler | None = None
    steps: int = 0
    gathered: torch.nn.Module | None = None
    gathered_at: int = -1


def _dtype(name: str | None):
    return None if name is None else getattr(torch, name)


class FSDP2Engine(DistributedEngine, GatheredWeights, Loop):
    name = "fsdp2"
    traits = frozenset({"casts-parameters"})  # MixedPrecisionPolicy(param_dtype=...), autocast besides
    axis_position = 5
    description = "torch fully_shard (FSDP2) per layer, MixedPrecisionPolicy, DCP and full-state-dict checkpoints"
    Run = ShardedRun
    compile_how = "each layer compiled in place (layer.compile()) before fully_shard, as torchtitan compiles its blocks"

    def derive_settings(self, precision: Precision) -> FSDP2Settings:
        weights, compute = precision.weights_dtype, precision.autocast_dtype
        param = compute if compute is not None and compute != weights else None
        reduce = precision.reduce_dtype or (weights if param is not None else None)
        return FSDP2Settings(
            param_dtype=dtype_name(param) if param else None,
            reduce_dtype=dtype_name(reduce) if reduce else None,
            output_dtype=None,
            autocast=dtype_name(compute) if compute is not None else None,
            grad_scaler=True if precision.grad_scaler else None,
        )

    def _shard(self, state, model):
        """fully_shard every layer (the members of the model's ModuleLists), then the root."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        settings = state.settings
        policy = MixedPrecisionPolicy(
            param_dtype=_dtype(settings.param_dtype),
            reduce_dtype=_dtype(settings.reduce_dtype),
            output_dtype=_dtype(settings.output_dtype),
        )
        layers = [layer for module in model.modules() if isinstance(module, torch.nn.ModuleList) for layer in module]
        for layer in layers:
            if self.compiled:
                compile_in_place(layer)
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        state.metrics.engine_effective = {
            "mp_policy": {k: dtype_name(v) if v is not None else None for k, v in vars(policy).items()},
            "sharded_layers": len(layers),
            "sharded_parameter_dtypes": sorted({dtype_name(p.dtype) for p in model.parameters()}),
        }
        return model

    def start(self, state, model, training: bool) -> ShardedRun:
        sharded = self._shard(state, model)
        if not training:
            return ShardedRun(sharded)
        sharded.train()
        return ShardedRun(sharded, state.new_optimizer(sharded), state.new_grad_scaler())

    def step(self, state, run: ShardedRun) -> tuple[float, bool]:
        run.steps += 1
        return train_step(state, run.model, run.optimizer, run.scaler)

    def save(self, state, run: ShardedRun, directory) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if run.optimizer is not None:
            model_state, optimizer_state = get_state_dict(run.model, run.optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)
        else:
            dcp.save({"model": get_model_state_dict(run.model)}, checkpoint_id=directory)
        if run.scaler is not None and state.group.writes:
            torch.save(run.scaler.state_dict(), directory / SCALER_FILE)
        state.metrics.dcp_files = len(list(directory.iterdir()))

    def restore(self, state, directory, training: bool) -> ShardedRun:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

        resumed = self._shard(state, fresh_model(state))
        if not training:
            model_state = get_model_state_dict(resumed)
            dcp.load({"model": model_state}, checkpoint_id=directory)
            set_state_dict(resumed, (), model_state_dict=model_state, optim_state_dict={})
            return ShardedRun(resumed)
        optimizer = state.new_optimizer(resumed)
        model_state, optimizer_state = get_state_dict(resumed, optimizer)
        dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)
        set_state_dict(resumed, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
        scaler = state.new_grad_scaler()
        if scaler is not None:
            scaler.load_state_dict(torch.load(directory / SCALER_FILE, weights_only=True))
        return ShardedRun(resumed.train(), optimizer, scaler)


register_with_compiled_twin(FSDP2Engine())
