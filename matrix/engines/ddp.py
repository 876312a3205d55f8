"""The ddp engine: torch DistributedDataParallel on a real process group (gloo on CPU, nccl on
CUDA), each rank training on its rows of the batch, with the precision's torch.autocast and
GradScaler. Where the precision reduces gradients in half precision, DDP's communication
hooks compress them (fp16_compress_hook, bf16_compress_hook). Checkpoints are the torch loop's
format, written by rank 0 and read back by every rank, as DDP scripts do.

Its compiled twin, `ddp-compile`, trains through the wrapper compiled, torch.compile(DDP(model)),
as DDP's documentation says (Dynamo then splits the graph at DDP's gradient buckets), and
evaluates the module DDP wraps compiled (DDP has no generate(), and the module inside a compiled
DDP is the eager model).
"""

from __future__ import annotations

from dataclasses import dataclass

from matrix.engines.base import EngineSettings, Loop, LoopRun, Unsupported, register_with_compiled_twin
from matrix.engines.distributed import DistributedEngine
from matrix.engines.torch_loop import load_checkpoint, save_checkpoint
from matrix.harness.compiling import compile_module, plain
from matrix.harness.measurements import evaluate_rows
from matrix.precisions.policies import Precision, dtype_name

COMPRESS_HOOKS = {"float16": "fp16_compress_hook", "bfloat16": "bf16_compress_hook"}


@dataclass(frozen=True)
class DDPSettings(EngineSettings):
    reduce_dtype: str = "float32"  # DDP reduces the gradients' own dtype, or a hook's
    autocast: str | None = None
    grad_scaler: bool | None = None
    comm_hook: str | None = None


class DDPEngine(DistributedEngine, Loop):
    name = "ddp"
    compiled_traits = frozenset({"compiles-under-autocast"})  # torch.compile(DDP(model)) called in the loop's autocast
    axis_position = 4
    description = "torch DistributedDataParallel, 2 ranks (gloo/nccl), autocast + GradScaler, compress hooks"
    compile_how = "torch.compile(DDP(model)), as DDP's docs say (Dynamo splits the graph at its buckets)"

    def derive_settings(self, precision: Precision) -> DDPSettings | Unsupported:
        reduce = precision.reduce_dtype or precision.weights_dtype
        hook = None
        if reduce != precision.weights_dtype:
            hook = COMPRESS_HOOKS.get(dtype_name(reduce))
            if hook is None:
                return Unsupported(f"Requires: [a DDP communication hook that reduces in {dtype_name(reduce)}]")
        return DDPSettings(
            reduce_dtype=dtype_name(reduce),
            autocast=dtype_name(precision.autocast_dtype) if precision.autocast_dtype is not None else None,
            grad_scaler=True if precision.grad_scaler else None,
            comm_hook=hook,
        )

    def _wrap(self, state, model):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [state.device.index] if state.device.index is not None else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids)
        if state.settings.comm_hook is not None:
            wrapped.register_comm_hook(None, getattr(default_hooks, state.settings.comm_hook))
        state.metrics.engine_effective = {
            "comm_hook": state.settings.comm_hook,
            "reduce_dtype": state.settings.reduce_dtype,
            "bucket_view": wrapped.gradient_as_bucket_view,
        }
        return compile_module(wrapped) if self.compiled else wrapped

    def start(self, state, model, training: bool) -> LoopRun:
        wrapped = self._wrap(state, model)
        if not training:
            return LoopRun(wrapped)
        model.train()
        return LoopRun(wrapped, state.new_optimizer(model), state.new_grad_scaler())

    def weights(self, state, run: LoopRun):
        return plain(run.model).module  # every rank holds the whole model

    def evaluate(self, state, run: LoopRun):
        # the module DDP wraps, each rank on its rows, as DDP scripts evaluate (DDP has no
        # generate()); in the compiled twin that module compiled, as its training forward is
        module = self.weights(state, run)
        return evaluate_rows(state, compile_module(module) if self.compiled else module)

    def save(self, state, run: LoopRun, directory) -> None:
        if state.group.writes:  # the torch loop's format, written once
            save_checkpoint(state, LoopRun(self.weights(state, run), run.optimizer, run.scaler), directory)

    def export(self, state, run: LoopRun, directory, checkpoint):
        return checkpoint  # the model in its kind's own format is already there

    def restore(self, state, directory, training: bool) -> LoopRun:
        plain = load_checkpoint(state, directory, training)  # every rank reads what rank 0 wrote
        return LoopRun(self._wrap(state, plain.model), plain.optimizer, plain.scaler)


register_with_compiled_twin(DDPEngine())
