"""torchao's float8 training under CPU autocast: the rowwise_with_gw_hp recipe's weight gradient
mixes bf16 and fp32, because Float8Linear casts its input to the autocast dtype only where CUDA
autocast is on (torch.is_autocast_enabled() without a device type). Found by the precision matrix
on a CPU (torch 2.13.0, torchao 0.18.0). Standalone: torch, torchao and transformers (a tiny
LlamaForCausalLM from a config, no download), converted as accelerate's fp8 converts a model:
every Linear layer but the first and the last.

    python cpu_autocast_gw_hp.py [cpu|cuda]
"""

import sys

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from transformers import LlamaConfig, LlamaForCausalLM

device = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
print(f"torch {torch.__version__}, {device}")
failures = 0
for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
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
    convert_to_float8_training(
        model,
        config=Float8LinearConfig.from_recipe_name(recipe),
        module_filter_fn=lambda module, fqn, ends=ends: fqn not in ends,
    )
    ids = torch.randint(0, 256, (4, 16), device=device)
    try:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        print(f"{recipe:20s} ok: loss {loss.item():.4f}")
    except RuntimeError as exc:
        failures += 1
        print(f"{recipe:20s} {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
print("OK" if not failures else f"BUG: {failures} recipes failed to train under {device} autocast")
sys.exit(1 if failures else 0)
