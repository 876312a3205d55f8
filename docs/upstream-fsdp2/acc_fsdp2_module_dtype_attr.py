"""Repro: accelerate FSDP2 + mixed_precision="bf16" crashes on a plain torch.nn.Module
(one without a `.dtype` attribute, i.e. not a transformers PreTrainedModel):
  AttributeError: 'FSDPSequential' object has no attribute 'dtype'
raised in fsdp2_prepare_model's fp32-upcast check (`model.dtype != torch.float32`).

Upstream: huggingface/accelerate PR #3528 "[FSDP2] Issues in Wrap Policy and Mixed Precision"
  (uses getattr(model, "dtype", None)).

2 CPU ranks (gloo).  Accelerate only selects FSDP for GPU-like distributed types, so a
MULTI_CPU Accelerator is switched to FSDP (fsdp_version=2) before prepare().
REPRODUCED = that AttributeError is raised by prepare().
"""

import os
import socket
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world, port, result_dir):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    verdict = "ERROR"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        import accelerate
        from accelerate import Accelerator
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        acc = Accelerator(cpu=True, mixed_precision="bf16")
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        plugin.set_mixed_precision("bf16")
        acc.state.fsdp_plugin = plugin
        acc.state.distributed_type = DistributedType.FSDP
        # AcceleratorState() re-syncs from PartialState when re-instantiated (e.g. by
        # AcceleratedOptimizer), so the switch must be made in both shared states.
        from accelerate.state import PartialState

        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        assert acc.is_fsdp2, "could not switch accelerate state to FSDP2"

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if rank == 0:
            print(f"accelerate={accelerate.__version__} torch={torch.__version__}", flush=True)
        try:
            model, opt = acc.prepare(model, opt)
            assert acc.is_fsdp2, "accelerate state left FSDP2 during prepare"
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
            acc.backward(loss)
            opt.step()
            verdict = "NOT REPRODUCED"
            if rank == 0:
                print(
                    "prepared + 1 step ok; param dtypes:",
                    {n: str(p.dtype) for n, p in model.named_parameters()},
                    flush=True,
                )
        except AttributeError as e:
            if "has no attribute 'dtype'" in str(e):
                verdict = "REPRODUCED"
                if rank == 0:
                    print(f"AttributeError: {e}", flush=True)
            else:
                raise
    except Exception as e:  # report, do not hide
        print(f"[rank{rank}] {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()
    finally:
        with open(os.path.join(result_dir, f"r{rank}"), "w") as f:
            f.write(verdict)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    d = tempfile.mkdtemp()
    mp.spawn(worker, args=(2, _free_port(), d), nprocs=2, join=True)
    verdicts = {open(os.path.join(d, f"r{r}")).read() for r in range(2)}
    v = verdicts.pop() if len(verdicts) == 1 else "ERROR"
    print(v)
    sys.exit({"REPRODUCED": 1, "NOT REPRODUCED": 0}.get(v, 2))
