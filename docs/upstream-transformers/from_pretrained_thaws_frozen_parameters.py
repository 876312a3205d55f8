"""from_pretrained() returns trainable a parameter its model class creates frozen.

Ernie4_5_MoeForCausalLM creates its routing correction bias as
nn.Parameter(..., requires_grad=False): it only routes (it is updated by a load-balancing rule,
never by a gradient). A model built from the config has it frozen; the same model saved and
read back with from_pretrained() has it trainable. An optimizer built over the parameters that
require grad now holds it; it never gets a gradient, so it never moves; code that counts or
freezes by requires_grad sees another model than the one it created.

Torch and transformers only, CPU, a tiny config, no download. Exit status 1 with the bug, 0
without it.
"""

import sys
import tempfile

import torch
import transformers
from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

config = Ernie4_5_MoeConfig(
    vocab_size=99,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    moe_num_experts=4,
    moe_k=2,
    moe_layer_start_index=1,
    max_position_embeddings=64,
)
torch.manual_seed(0)
created = Ernie4_5_MoeForCausalLM(config)
frozen = [name for name, p in created.named_parameters() if not p.requires_grad]
print(f"transformers {transformers.__version__}, torch {torch.__version__}")
print(f"created frozen: {frozen}")
with tempfile.TemporaryDirectory() as directory:
    created.save_pretrained(directory)
    for dtype in (torch.float32, torch.bfloat16):
        loaded = Ernie4_5_MoeForCausalLM.from_pretrained(directory, dtype=dtype)
        parameters = dict(loaded.named_parameters())
        thawed = [name for name in frozen if parameters[name].requires_grad]
        print(f"from_pretrained(dtype={dtype}): thawed {thawed}")
        if thawed:
            print("BUG: from_pretrained() made trainable what the model class creates frozen")
            sys.exit(1)
print("ok: the frozen parameters stay frozen")
