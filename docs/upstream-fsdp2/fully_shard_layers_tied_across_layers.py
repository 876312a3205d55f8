#!/usr/bin/env python3
"""FSDP2 refuses to shard each decoder layer of a model whose layers hold one parameter between
them: Zamba ties its shared transformer block's weights into every hybrid layer.

ZambaForCausalLM's hybrid layers each hold a `shared_transf` whose parameters transformers ties
to the first hybrid layer's (`_tied_weights_keys`): model.layers.1.shared_transf.*.weight is the
same tensor as model.layers.0.shared_transf.*.weight. fully_shard on each layer, as users shard a
transformers model (each decoder layer, then the root; accelerate's FSDP2 auto-wrap does the
same), puts that tensor in two groups, and the second fully_shard raises "Parameter ... is shared
with a parameter already managed by another FSDP group". One gloo rank on a CPU.

    pip install torch==2.13.0 transformers==5.24.0
    python fully_shard_layers_tied_across_layers.py

Exit 1 when the refusal is raised, 0 when every layer shards and the forward runs.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import ZambaConfig, ZambaForCausalLM

TINY = {"vocab_size": 99, "hidden_size": 32, "attention_hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "attention_head_dim": 16, "num_key_value_heads": 2,
        "n_mamba_heads": 2, "mamba_dt_rank": 2, "max_position_embeddings": 64, "use_mamba_kernels": False,
        "layers_block_type": ["hybrid", "hybrid"]}  # fmt: skip


def main() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = ZambaForCausalLM(ZambaConfig(**TINY))
    first, second = (layer.shared_transf.self_attn.q_proj.weight for layer in model.model.layers)
    print(f"layers 0 and 1 hold one shared_transf q_proj weight: {first is second}")
    try:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        ids = torch.randint(3, 99, (2, 8))
        model(input_ids=ids, labels=ids)
    except ValueError as error:
        print(f"REFUSED: ValueError: {error}")
        return 1
    finally:
        dist.destroy_process_group()
    print("every layer sharded and the forward ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
