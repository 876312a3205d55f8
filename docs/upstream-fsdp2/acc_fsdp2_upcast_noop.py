"""Repro: accelerate FSDP2 + mixed_precision="bf16" must keep fp32 master weights.

Upstream: huggingface/accelerate issue #3979
  "[Bug] FSDP2 mixed-precision upcast to fp32 is a silent no-op since v1.13.0"
  fixed by PR #3985 (upcast moved before fully_shard).

What is checked: a tiny bf16 model is prepared by accelerate's FSDP2 path
(Accelerator.prepare -> _prepare_fsdp2 -> fsdp2_prepare_model) with
mixed_precision="bf16" on 2 CPU ranks (gloo).  accelerate documents that it
upcasts trainable low-precision params to fp32 in this case.  If any sharded
trainable parameter is still bf16 after prepare -> REPRODUCED.

Accelerate only selects FSDP for GPU-like distributed types, so on CPU we
build a MULTI_CPU Accelerator and then switch its state to FSDP (fsdp_version=2)
before calling prepare(); everything after that is accelerate's own code.
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
        model = model.to(torch.bfloat16)  # e.g. a checkpoint loaded with torch_dtype=bfloat16
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        assert acc.is_fsdp2, "accelerate state left FSDP2 during prepare"

        dtypes = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
        # one training step to show the prepared model is usable
        x = torch.randn(4, 8)
        loss = model(x).float().pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        after_step = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}

        bad = {n: str(d) for n, d in after_step.items() if d != torch.float32}
        if rank == 0:
            print(f"accelerate={accelerate.__version__} torch={torch.__version__}", flush=True)
            print(f"param dtypes after prepare: { {n: str(d) for n, d in dtypes.items()} }", flush=True)
            print(f"param dtypes after 1 step:  { {n: str(d) for n, d in after_step.items()} }", flush=True)
        verdict = "REPRODUCED" if bad else "NOT REPRODUCED"
        if rank == 0 and bad:
            print(f"trainable params not upcast to fp32: {bad}", flush=True)
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
