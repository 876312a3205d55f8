#!/usr/bin/env python3
"""accelerate's FSDP2 checkpoint steps the optimizer through the grad scaler: an fp16 run on a GPU
cannot save before its first training step, and a resumed run's scaler is not the saved one.

On FSDP2, accelerate saves and loads the optimizer with torch.distributed.checkpoint's
get_optimizer_state_dict, which initializes an optimizer that holds no state yet by calling its
step() on zero gradients (_init_optim_state). accelerate hands it the AcceleratedOptimizer, whose
step() goes through the GradScaler an fp16 run has on a GPU: scaler.step() then scaler.update().
- An evaluation run (no training step, no scaler.scale() yet) cannot save_state at all:
  "Attempted step but _scale is None".
- A resumed run: load_state loads the scaler first ("before the optimizer for FSDP2"), then the
  fresh optimizer's initialization steps through that scaler, and scaler.update() changes it.
accelerate creates the GradScaler on accelerator devices only; this script gives the CPU run the
same scaler accelerate would make (accelerate.utils.get_fsdp2_grad_scaler) and selects FSDP as
accelerate does on a GPU, so the mechanism runs on one gloo rank. On a GPU nothing needs setting.

    pip install torch==2.13.0 accelerate==1.15.0
    python fsdp2_checkpoint_steps_through_grad_scaler.py

Exit 1 when either shows, 0 when neither does.
"""

import os
import socket
import sys
import tempfile

with socket.socket() as free:
    free.bind(("127.0.0.1", 0))
    PORT = free.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(PORT), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                  LOCAL_WORLD_SIZE="1", ACCELERATE_USE_FSDP="true")  # fmt: skip

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, get_fsdp2_grad_scaler

GPU = torch.cuda.is_available()


def accelerator_with_scaler() -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=not GPU, mixed_precision="fp16" if GPU else "no", fsdp_plugin=plugin)
    if accelerator.distributed_type != DistributedType.FSDP:  # a CPU: as accelerate selects on a GPU
        accelerator.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    if accelerator.scaler is None:  # a CPU: the scaler accelerate makes for fp16 on a GPU
        accelerator.scaler = get_fsdp2_grad_scaler(device=accelerator.device.type)
    return accelerator


def prepared(accelerator):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def main() -> int:
    failed = 0
    # an evaluation run saves before any training step
    accelerator = accelerator_with_scaler()
    model, optimizer = prepared(accelerator)
    try:
        accelerator.save_state(tempfile.mkdtemp())
        print("save_state before any training step: saved")
    except AssertionError as error:  # torch's GradScaler asserts
        print(f"save_state before any training step: FAILED: AssertionError: {str(error).splitlines()[0]}")
        failed = 1
    # a training run saves after one step, and a fresh run resumes from it
    accelerator = accelerator_with_scaler()
    model, optimizer = prepared(accelerator)
    accelerator.backward(model(torch.ones(4, 8)).square().mean())
    optimizer.step()
    saved = {k: float(v) for k, v in accelerator.scaler.state_dict().items()}
    directory = tempfile.mkdtemp()
    accelerator.save_state(directory)
    resumed = accelerator_with_scaler()
    model, optimizer = prepared(resumed)
    resumed.load_state(directory)
    loaded = {k: float(v) for k, v in resumed.scaler.state_dict().items()}
    print(f"grad scaler saved {saved}")
    print(f"grad scaler after load_state {loaded}")
    if loaded != saved:
        print("the resumed run's grad scaler is not the saved one: FAILED")
        failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main())
