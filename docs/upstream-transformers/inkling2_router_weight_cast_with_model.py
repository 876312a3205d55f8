"""Inkling2 (and Inkling2-Loop) cannot run a forward once the model is cast with .to(bf16/fp16).

Inkling2TopKRouter.forward (transformers 5.24.0, models/inkling2/modeling_inkling2.py:809-811;
the copy in models/inkling2_loop/modeling_inkling2_loop.py:1165-1167) routes in fp32: it casts
the hidden states with .float() and multiplies them with self.weight as it is. The weight is
fp32 only when from_pretrained(dtype=...) keeps it so (_keep_in_fp32_modules_strict lists
"mlp.gate.weight", modeling_inkling2.py:1281). A model cast the ordinary way, model.to(dtype)
(pure bf16/fp16 training, Lightning's "bf16-true"), has a half router weight, and
F.linear(fp32 input, half weight) fails. The user sees, on the first forward (training or eval):
  RuntimeError: expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16
from_pretrained(dtype=torch.bfloat16), fp32, and autocast over fp32 weights all work. The
router does not look at the device: CUDA fails the same way (torch words it "mat1 and mat2
must have the same dtype") unless autocast casts the matmul's inputs.

Torch and transformers only, CPU, a tiny config, no download. Exit status 1 with the bug, 0
without it.
"""

import sys
import tempfile

import torch
import transformers
from transformers import Inkling2ForCausalLM, Inkling2LoopForCausalLM, Inkling2LoopTextConfig, Inkling2TextConfig

sizes = dict(
    vocab_size=99,
    unpadded_vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    swa_head_dim=8,
    sliding_window_size=4,
    d_rel=16,
    layer_types=["hybrid_sliding", "hybrid"],
    max_position_embeddings=64,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
ids = torch.randint(3, 99, (2, 8), generator=torch.Generator().manual_seed(0))
print(f"transformers {transformers.__version__}, torch {torch.__version__}")
failed = False
for model_class, config in (
    (Inkling2ForCausalLM, Inkling2TextConfig(**sizes)),
    (Inkling2LoopForCausalLM, Inkling2LoopTextConfig(**sizes, log_scaling_n_floor=8192)),
):
    torch.manual_seed(0)
    model = model_class(config)
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        loaded = model_class.from_pretrained(directory, dtype=torch.bfloat16)
    loaded(input_ids=ids, labels=ids)
    print(f"{model_class.__name__}.from_pretrained(dtype=bfloat16): ok")
    for dtype in (torch.bfloat16, torch.float16):
        try:
            model.to(dtype)(input_ids=ids, labels=ids).loss.backward()
            print(f"{model_class.__name__}.to({dtype}): ok")
        except RuntimeError as error:
            if "same dtype" not in str(error):
                raise
            print(f"{model_class.__name__}.to({dtype}): RuntimeError: {error}")
            failed = True
if failed:
    print("BUG: the router multiplies fp32 hidden states with a weight that model.to() made half")
    sys.exit(1)
print("ok: Inkling2 runs after model.to(half dtype)")
