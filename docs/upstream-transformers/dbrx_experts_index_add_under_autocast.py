"""DbrxForCausalLM cannot run a forward pass under CPU autocast (bf16 or fp16).

DbrxExperts.forward (transformers 5.24.0, models/dbrx/modeling_dbrx.py:289) makes the output
buffer with torch.zeros_like(hidden_states): the residual stream, which stays fp32 under
autocast. Each expert's output comes out of x.matmul(...), which autocast runs in the half
dtype, and it is scaled by the routing weights; on a CPU those are half too, since CPU
autocast leaves softmax and torch.norm (route_tokens_to_experts, :340-:345) in their input
dtype. index_add_ (:305) then adds a half source into the fp32 buffer, and index_add_ needs
one dtype. The user sees, on the first forward (training or eval):
  RuntimeError: index_add_(): self (Float) and source (BFloat16) must have the same scalar type
fp32 (no autocast) works. On CUDA, autocast runs linalg_vector_norm in fp32, so with the default
moe_normalize_expert_weights=1 the routing weights are fp32, the product is promoted to fp32 and
the add succeeds; with moe_normalize_expert_weights=None the weights stay half and CUDA fails too.
transformers 4.57.6 works: its router ran softmax with dtype=torch.float32. 5.8.0 fails already.

Torch and transformers only, CPU, a tiny config, no download. Exit status 1 with the bug, 0
without it.
"""

import sys

import torch
import transformers
from transformers import DbrxConfig, DbrxForCausalLM

config = DbrxConfig(
    d_model=32,
    n_heads=4,
    n_layers=2,
    max_seq_len=64,
    vocab_size=99,
    attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
    ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
torch.manual_seed(0)
model = DbrxForCausalLM(config).train()
ids = torch.randint(3, 99, (2, 8))
print(f"transformers {transformers.__version__}, torch {torch.__version__}")

model(input_ids=ids, labels=ids).loss.backward()
print("fp32, no autocast: ok")
for dtype in (torch.bfloat16, torch.float16):
    try:
        with torch.autocast("cpu", dtype=dtype):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    except RuntimeError as error:
        if "index_add_" not in str(error):
            raise
        print(f"autocast {dtype}: RuntimeError: {error}")
        print("BUG: the MoE experts add half-precision outputs into an fp32 buffer")
        sys.exit(1)
    print(f"autocast {dtype}: ok")
print("ok: DBRX runs under CPU autocast")
