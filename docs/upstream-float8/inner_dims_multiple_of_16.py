"""float8 training needs each float8 matmul's inner dimension to be a multiple of 16 on CUDA
(torch._scaled_mm), and the weight gradient contracts over the batch's tokens: a batch of 24
tokens fails in the backward, whatever the layer's sizes. Found by the precision matrix on an
H200 (torch 2.11.0+cu130, torchao 0.17.0: its batches hold 24 tokens). The CPU's emulation has no
such limit. Float8LinearConfig(pad_inner_dim=True) pads the inner dimension and trains.
Standalone: torch, torchao and transformers (a tiny LlamaForCausalLM from a config, no download),
converted as accelerate's fp8 converts a model: every Linear layer but the first and the last.

    python inner_dims_multiple_of_16.py [cpu|cuda]

Exit 1 when a run fails on the inner-dimension limit (the finding on this device).
"""

import dataclasses
import sys

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from transformers import LlamaConfig, LlamaForCausalLM

device = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
print(f"torch {torch.__version__}, {device}")


def train_step(recipe: str, tokens: tuple[int, int], pad: bool) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).to(device)
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    ends = {linears[0], linears[-1]}
    float8 = Float8LinearConfig.from_recipe_name(recipe)
    if pad:
        float8 = dataclasses.replace(float8, pad_inner_dim=True)
    convert_to_float8_training(model, config=float8, module_filter_fn=lambda m, fqn, ends=ends: fqn not in ends)
    ids = torch.randint(0, 256, tokens, device=device)
    try:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return f"ok: loss {loss.item():.4f}"
    except RuntimeError as exc:
        return f"RuntimeError: {str(exc).splitlines()[0][:110]}"


failures = 0
for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
    for tokens, pad in (((4, 8), False), ((3, 8), False), ((3, 8), True)):
        outcome = train_step(recipe, tokens, pad)
        # only this limit counts (on a CPU, rowwise_with_gw_hp fails for another reason: the
        # torchao-float8-ignores-cpu-autocast entry, cpu_autocast_gw_hp.py)
        failures += "divisible by" in outcome
        label = f"{recipe}, {tokens[0] * tokens[1]} tokens{', pad_inner_dim' if pad else ''}"
        print(f"{label:40s} {outcome}")
if failures:
    print(f"FOUND: {failures} runs hit the inner-dimension limit on {device}")
else:
    print("OK: no inner-dimension limit here")
sys.exit(1 if failures else 0)
