"""Repro: accelerate FSDP2 + SHARDED_STATE_DICT (torch.distributed.checkpoint)
+ mixed_precision="bf16": Accelerator.load_state() cannot restore the optimizer
state it just saved with save_state().

Upstream: huggingface/accelerate issue #3971
  "FSDP2 + SHARDED_STATE_DICT: optimizer checkpoint load fails with missing step key.
   (RuntimeError: Missing key in checkpoint state_dict: optimizer.state.0.step.)"
  (also issue #3896), fixed by PR #3904 "bug: fsdp cannot load optimizor state using dcp"
  (load_fsdp_optimizer now builds the DCP target with get_optimizer_state_dict for FSDP2).

2 CPU ranks (gloo), tiny model, AdamW.  Accelerate only selects FSDP for GPU-like
distributed types, so a MULTI_CPU Accelerator is switched to FSDP (fsdp_version=2)
before prepare(); save_state/load_state are accelerate's own code.
Case A: save_state after 1 step, then load_state in the same process.
Case B: fresh model+optimizer (no step yet) load_state from the same checkpoint;
        exp_avg must equal the saved one.
REPRODUCED = case A raises the 'Missing key in checkpoint state_dict' RuntimeError
             or case B does not restore the optimizer state.
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


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _make(acc):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return acc.prepare(model, opt)


def _exp_avg(opt):
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            out.append(_local(st["exp_avg"]).clone() if "exp_avg" in st else None)
    return out


def worker(rank, world, port, ckpt, result_dir):
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
        from torch.distributed.checkpoint.api import CheckpointException

        acc = Accelerator(cpu=True, mixed_precision="bf16")
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
        plugin.set_mixed_precision("bf16")
        acc.state.fsdp_plugin = plugin
        acc.state.distributed_type = DistributedType.FSDP
        # AcceleratorState() re-syncs from PartialState when re-instantiated (e.g. by
        # AcceleratedOptimizer), so the switch must be made in both shared states.
        from accelerate.state import PartialState

        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        assert acc.is_fsdp2, "could not switch accelerate state to FSDP2"
        if rank == 0:
            print(f"accelerate={accelerate.__version__} torch={torch.__version__}", flush=True)

        model, opt = _make(acc)
        assert acc.is_fsdp2, "accelerate state left FSDP2 during prepare"
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
        acc.backward(loss)
        opt.step()
        saved = _exp_avg(opt)
        acc.save_state(ckpt)
        acc.wait_for_everyone()

        # Case A: load into the same (already stepped) optimizer
        case_a = "ok"
        try:
            acc.load_state(ckpt)
        except (RuntimeError, CheckpointException) as e:
            # DCP wraps per-rank errors in CheckpointException (a BaseException)
            missing = "RuntimeError: Missing key in checkpoint state_dict"
            msg = [line for line in str(e).splitlines() if line.startswith(missing)]
            if msg:
                case_a = f"{type(e).__name__} wrapping {msg[0].strip()}"
            else:
                raise
        # Case B: fresh model+optimizer, nothing stepped yet
        acc._models.clear()
        acc._optimizers.clear()
        _model2, opt2 = _make(acc)
        try:
            acc.load_state(ckpt)
            got = _exp_avg(opt2)
            same = all(g is not None and s is not None and torch.equal(g, s) for g, s in zip(got, saved, strict=False))
            case_b = "restored" if same else f"NOT restored (exp_avg present: {[g is not None for g in got]})"
        except (RuntimeError, CheckpointException) as e:
            msg = [line for line in str(e).splitlines() if line.startswith(("RuntimeError", "KeyError", "ValueError"))]
            case_b = f"{type(e).__name__}: {msg[-1].strip() if msg else str(e)[:200]}"
        if rank == 0:
            print(f"case A (load after step, same optimizer): {case_a}", flush=True)
            print(f"case B (fresh optimizer): {case_b}", flush=True)
        verdict = "NOT REPRODUCED" if (case_a == "ok" and case_b == "restored") else "REPRODUCED"
    except Exception as e:
        print(f"[rank{rank}] {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()
    finally:
        with open(os.path.join(result_dir, f"r{rank}"), "w") as f:
            f.write(verdict)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    d = tempfile.mkdtemp()
    mp.spawn(worker, args=(2, _free_port(), os.path.join(d, "ckpt"), d), nprocs=2, join=True)
    verdicts = {open(os.path.join(d, f"r{r}")).read() for r in range(2)}
    v = verdicts.pop() if len(verdicts) == 1 else "ERROR"
    print(v)
    sys.exit({"REPRODUCED": 1, "NOT REPRODUCED": 0}.get(v, 2))
