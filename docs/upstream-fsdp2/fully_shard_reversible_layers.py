#!/usr/bin/env python3
"""FSDP2, sharding each layer, cannot train Reformer: its reversible layers run without autograd in
the forward and are recomputed in the backward, where their parameters are still sharded.

ReformerModel's encoder runs its layers inside _ReversibleFunction: the forward under no_grad (no
activations kept), the backward calling each layer's attention and feed_forward again to rebuild
them. fully_shard gathers a layer's parameters for the backward from a hook on the layer's forward
outputs; outputs made without autograd carry none, so the recomputation meets the layer's sharded
DTensor parameters: "got mixed torch.Tensor and DTensor". With the root sharded alone, the parameters
stay gathered from the forward to the end of the backward, and the same step runs (the control).
One gloo rank on a CPU.

    pip install torch==2.13.0 transformers==5.24.0
    python fully_shard_reversible_layers.py

Exit 1 when the layer-sharded step raises the DTensor error and the root-sharded one runs, 0 when
both run, 2 otherwise.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import ReformerConfig, ReformerModelWithLMHead

TINY = {"vocab_size": 99, "hidden_size": 32, "attention_head_size": 8, "num_attention_heads": 4,
        "feed_forward_size": 64, "num_hidden_layers": 2, "attn_layers": ["local", "lsh"], "is_decoder": True,
        "axial_pos_embds": False, "max_position_embeddings": 64, "local_attn_chunk_length": 4,
        "lsh_attn_chunk_length": 4, "num_buckets": 4, "hidden_dropout_prob": 0.0,
        "local_attention_probs_dropout_prob": 0.0, "lsh_attention_probs_dropout_prob": 0.0}  # fmt: skip


def train_step(shard_layers: bool) -> str | None:
    """One training step with each layer and the root sharded (or the root alone): None when it runs,
    else the error."""
    torch.manual_seed(0)
    model = ReformerModelWithLMHead(ReformerConfig(**TINY)).train()
    if shard_layers:
        for layer in model.reformer.encoder.layers:
            fully_shard(layer)
    fully_shard(model)
    ids = torch.randint(3, 99, (2, 8))
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return None


def main() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        layers, root = train_step(shard_layers=True), train_step(shard_layers=False)
    finally:
        dist.destroy_process_group()
    print(f"each layer and the root sharded: {'RAISED: ' + layers if layers else 'the step ran'}")
    print(f"the root sharded alone:          {'RAISED: ' + root if root else 'the step ran'}")
    if layers and "got mixed torch.Tensor and DTensor" in layers and root is None:
        return 1
    return 0 if layers is None and root is None else 2


if __name__ == "__main__":
    sys.exit(main())
