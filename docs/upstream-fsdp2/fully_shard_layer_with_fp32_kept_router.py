#!/usr/bin/env python3
"""FSDP2 refuses a layer whose trainable parameters have two dtypes, which from_pretrained gives a
model whose class keeps some of them in fp32 (DeepseekV2's router gate.weight) when loaded in half.

transformers keeps `_keep_in_fp32_modules_strict` modules in fp32 when a model is loaded with
dtype=torch.bfloat16 (or float16); a decoder layer then holds bf16 and fp32 trainable parameters.
fully_shard on that layer, as users shard a transformers model (each decoder layer, then the
root), asserts "FSDP expects uniform original parameter dtype" at its lazy initialization. One
gloo rank on a CPU.

    pip install torch==2.13.0 transformers==5.24.0
    python fully_shard_layer_with_fp32_kept_router.py

Exit 1 when the assertion is raised, 0 when the forward runs.
"""

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

TINY = {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": None,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "max_position_embeddings": 32}  # fmt: skip


def main() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    directory = tempfile.mkdtemp()
    DeepseekV2ForCausalLM(DeepseekV2Config(**TINY)).save_pretrained(directory)
    model = DeepseekV2ForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    kept = sorted({str(p.dtype) for p in model.parameters()})
    print(f"from_pretrained(dtype=torch.bfloat16): parameter dtypes {kept}; _keep_in_fp32_modules_strict "
          f"{model._keep_in_fp32_modules_strict}")  # fmt: skip
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids = torch.randint(3, 99, (2, 8))
    try:
        model(input_ids=ids, labels=ids)
    except AssertionError as error:
        print(f"REFUSED: AssertionError: {error}")
        return 1
    finally:
        dist.destroy_process_group()
    print("the forward ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
