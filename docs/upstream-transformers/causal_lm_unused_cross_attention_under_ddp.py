#!/usr/bin/env python3
"""MBartForCausalLM (and PLBartForCausalLM) hold cross-attention weights their forward never uses;
DDP, as users wrap a model (find_unused_parameters=False, its default), then fails at the second step.

The decoder layers of these causal LMs are the encoder-decoder family's: each creates an
`encoder_attn` block, called only with encoder states. A decoder-only forward leaves those
parameters without a gradient, and DDP's reducer, waiting for them, raises at the next forward.
With find_unused_parameters=True both steps run. Two gloo ranks on a CPU, started by this script.

    pip install torch==2.13.0 transformers==5.24.0
    python causal_lm_unused_cross_attention_under_ddp.py

Exit 1 when DDP refuses the second step, 0 when both steps run.
"""

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import MBartConfig, MBartForCausalLM

TINY = {
    "vocab_size": 99,
    "d_model": 16,
    "decoder_layers": 2,
    "encoder_layers": 2,
    "decoder_attention_heads": 2,
    "encoder_attention_heads": 2,
    "decoder_ffn_dim": 32,
    "encoder_ffn_dim": 32,
    "max_position_embeddings": 32,
    "dropout": 0.0,
}


def rank_main(rank, world, port, find_unused, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = MBartForCausalLM(MBartConfig(**TINY))
    unused = [n for n, p in model.named_parameters() if "encoder_attn" in n]
    wrapped = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    ids = torch.randint(3, 99, (2, 8), generator=torch.Generator().manual_seed(rank))
    outcome = "both steps ran"
    try:
        for _ in range(2):
            optimizer.zero_grad()
            wrapped(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
    except RuntimeError as error:
        outcome = f"RuntimeError: {str(error).splitlines()[0]}"
    if rank == 0:
        with open(out, "w") as handle:
            handle.write(f"{len(unused)} encoder_attn parameters in the model; {outcome}")
    dist.destroy_process_group()


def main() -> int:
    failed = 0
    for find_unused in (False, True):
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        out = os.path.join(tempfile.mkdtemp(), "rank0.txt")
        torch.multiprocessing.spawn(rank_main, args=(2, port, find_unused, out), nprocs=2)
        with open(out) as handle:
            line = handle.read()
        print(f"DDP(find_unused_parameters={find_unused}): {line}")
        if not find_unused and "RuntimeError" in line:
            failed = 1
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
