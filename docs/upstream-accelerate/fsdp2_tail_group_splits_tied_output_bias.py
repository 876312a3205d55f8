#!/usr/bin/env python3
"""accelerate's FSDP2 preparation puts a model's output embeddings in their own group without the
parameter their bias is tied to (BERT-style heads); torch >= 2.13 then refuses the first forward.

fsdp2_prepare_model (accelerate 1.15.0) carves a "tail" group of the final norm and the output
embeddings (and the input embeddings when the weights are tied: accelerate#4171), then shards the
root. RoCBert's (and BERT's) head ties cls.predictions.decoder.bias to cls.predictions.bias: the
decoder goes to the tail group, cls.predictions stays with the root, and FSDP2's check that a
shared parameter lives in one group (pytorch#179532) raises at lazy init. One gloo rank on a CPU;
accelerate selects FSDP on accelerator devices only, so the script selects it as it would there.

    pip install torch==2.13.0 transformers==5.24.0 accelerate==1.15.0
    python fsdp2_tail_group_splits_tied_output_bias.py

Exit 1 when the forward is refused, 0 when it runs.
"""

import os
import socket
import sys

with socket.socket() as free:
    free.bind(("127.0.0.1", 0))
    PORT = free.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(PORT), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                  LOCAL_WORLD_SIZE="1", ACCELERATE_USE_FSDP="true")  # fmt: skip

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from transformers import RoCBertConfig, RoCBertForCausalLM

TINY = {"vocab_size": 99, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 32, "is_decoder": True, "max_position_embeddings": 32, "shape_vocab_size": 8,
        "pronunciation_vocab_size": 8, "shape_embed_dim": 8, "pronunciation_embed_dim": 8}  # fmt: skip


def main() -> int:
    torch.manual_seed(0)
    model = RoCBertForCausalLM(RoCBertConfig(**TINY))
    bias = model.get_output_embeddings().bias
    print(
        "the output embeddings' bias is:", [n for n, p in model.named_parameters(remove_duplicate=False) if p is bias]
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    if accelerator.distributed_type != DistributedType.FSDP:  # a CPU: select FSDP as accelerate does on a GPU
        accelerator.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    prepared, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(3, 99, (2, 8))
    try:
        prepared(input_ids=ids, labels=ids)
    except ValueError as error:
        print(f"REFUSED: ValueError: {error}")
        return 1
    print("the forward ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
