#!/usr/bin/env python3
"""torch.distributed.checkpoint cannot resume an optimizer that never stepped some parameters: the
saved state has none for them, the fresh optimizer DCP loads into initializes every one.

AdamW creates a parameter's state at its first gradient. A parameter the forward never uses
(MBartForCausalLM's cross-attention in a decoder-only run, an MoE router trained by no loss) has
none when the run is saved with get_state_dict; on resume, get_state_dict of a fresh optimizer
initializes state for every trainable parameter (a zero-gradient step, _init_optim_state) and
dcp.load asks the checkpoint for keys it never held. Two gloo ranks on a CPU, a model of two
Linear layers of which the forward uses one, sharded with fully_shard.

    pip install torch==2.13.0
    python dcp_optimizer_state_of_unused_parameters.py

Exit 1 when the resume fails, 0 when it loads.
"""

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard


class PartlyUsed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)  # never called, as a decoder-only run's cross-attention

    def forward(self, x):
        return self.used(x)


def build():
    torch.manual_seed(0)
    model = PartlyUsed()
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def rank_main(rank, world, port, directory, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, optimizer = build()
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)
    fresh, fresh_optimizer = build()
    model_state, optimizer_state = get_state_dict(fresh, fresh_optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        outcome = "the run resumed"
    except Exception as error:  # DCP gathers every rank's failure into one CheckpointException
        outcome = f"{type(error).__name__}: {str(error).strip().splitlines()[-1]}"
    if rank == 0:
        with open(out, "w") as handle:
            handle.write(outcome)
    dist.destroy_process_group()


def main() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "rank0.txt")
    torch.multiprocessing.spawn(rank_main, args=(2, port, tempfile.mkdtemp(), out), nprocs=2)
    with open(out) as handle:
        outcome = handle.read()
    print(f"resume from dcp.save of an AdamW that never stepped `unused`: {outcome}")
    return 0 if outcome == "the run resumed" else 1


if __name__ == "__main__":
    sys.exit(main())
