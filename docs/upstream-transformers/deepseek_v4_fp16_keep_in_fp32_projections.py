"""DeepseekV4ForCausalLM loaded with from_pretrained(dtype=torch.float16) cannot run a forward.

DeepseekV4PreTrainedModel lists the attention compressor's and indexer's kv_proj, gate_proj
and weights_proj in _keep_in_fp32_modules (transformers 5.24.0,
models/deepseek_v4/modeling_deepseek_v4.py:1258), meant only to keep the FP8 quantizer off
them; its comment says the non-strict list has no dtype effect. It has one in fp16:
PreTrainedModel._get_dtype_plan (modeling_utils.py:3851) loads every module of that list in
fp32 when dtype is float16. Nothing casts the fp16 hidden states on their way in, so the first
of them, DeepseekV4HCACompressor's kv_proj (modeling_deepseek_v4.py:416), gets an fp16 input
and fp32 weights. The user sees, on the first forward (training or eval):
  RuntimeError: expected m1 and m2 to have the same dtype, but got: c10::Half != float
in torch.nn.modules.linear. bf16 loads them in bf16 and works; so do fp32, a model cast with
.to(torch.float16), and fp16 autocast over the loaded model (autocast casts the matmul's
inputs; the Trainer's fp16=True on a CPU does not autocast, so it fails there). Nothing in the
path depends on the device: fp16 loading without autocast fails on CUDA too.
transformers 5.8.0 (DeepSeek-V4's first release) works: it had no _keep_in_fp32_modules list.

Torch and transformers only, CPU, a tiny config, no download. Exit status 1 with the bug, 0
without it.
"""

import sys
import tempfile

import torch
import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

config = DeepseekV4Config(
    vocab_size=99,
    hidden_size=32,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    q_lora_rank=16,
    num_experts_per_tok=2,
    n_routed_experts=4,
    n_shared_experts=1,
    max_position_embeddings=64,
    layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    mlp_layer_types=["hash_moe", "moe"],
    sliding_window=4,
    o_groups=8,
    o_lora_rank=16,
    index_n_heads=4,
    index_head_dim=8,
    index_topk=4,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
torch.manual_seed(0)
ids = torch.randint(3, 99, (2, 8))
print(f"transformers {transformers.__version__}, torch {torch.__version__}")
with tempfile.TemporaryDirectory() as directory:
    DeepseekV4ForCausalLM(config).save_pretrained(directory)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = DeepseekV4ForCausalLM.from_pretrained(directory, dtype=dtype)
        fp32 = [name for name, p in model.named_parameters() if p.dtype == torch.float32 and "proj" in name]
        try:
            loss = model(input_ids=ids, labels=ids).loss
        except RuntimeError as error:
            if "same dtype" not in str(error):
                raise
            print(f"from_pretrained(dtype={dtype}): fp32 projections {fp32}")
            print(f"  RuntimeError: {error}")
            print("BUG: fp16 loading keeps projections in fp32 that receive fp16 inputs")
            sys.exit(1)
        print(f"from_pretrained(dtype={dtype}): ok, loss {loss.item():.4f}")
print("ok: DeepSeek-V4 runs when loaded in fp16")
