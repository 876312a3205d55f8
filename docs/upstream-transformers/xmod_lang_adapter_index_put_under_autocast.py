"""X-MOD cannot run a forward pass under autocast: its language adapters write half into fp32.

XmodOutput.lang_adapter (transformers 5.24.0, models/xmod/modeling_xmod.py:438) layer-norms the
hidden states (fp32: autocast keeps layer_norm in fp32), makes new_hidden_states =
torch.zeros_like(hidden_states) in that fp32 dtype (:450), runs each language's adapter (two
nn.Linear, which autocast runs in the half dtype) and writes the result back with a masked
assignment, new_hidden_states[lang_mask] = adapted (:455). Index put needs one dtype on both
sides. The user sees, on the first forward of any Xmod model (training or eval):
  RuntimeError: Index put requires the source and destination dtypes match, got Float for the
  destination and BFloat16 for the source.
fp32 (no autocast) works. Nothing in the path is CPU-specific: CUDA autocast also keeps
layer_norm in fp32 and runs linear in half, so CUDA fails the same way.
transformers 4.57.6 works: it joined the adapters' outputs with torch.cat. 5.8.0 fails already.

Torch and transformers only, CPU, a tiny config, no download. Exit status 1 with the bug, 0
without it.
"""

import sys

import torch
import transformers
from transformers import XmodConfig, XmodForCausalLM

config = XmodConfig(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    is_decoder=True,
    adapter_reduction_factor=2,
    languages=["en_XX"],
    default_language="en_XX",
)
torch.manual_seed(0)
model = XmodForCausalLM(config).train()
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
        if "Index put requires" not in str(error):
            raise
        print(f"autocast {dtype}: RuntimeError: {error}")
        print("BUG: the language adapter writes its half-precision output into an fp32 tensor")
        sys.exit(1)
    print(f"autocast {dtype}: ok")
print("ok: X-MOD runs under autocast")
