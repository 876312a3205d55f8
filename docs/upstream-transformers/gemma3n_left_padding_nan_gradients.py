"""Gemma3nForCausalLM: one training step on a left-padded batch with SDPA (the default
attention) gives NaN gradients in nearly every parameter, in fp32.

The pad token's embedding row is zero (padding_idx, models/gemma3n/modeling_gemma3n.py:1575 and
:1589, transformers 5.24.0). A left pad position's query has no key it may attend to, and SDPA
returns 0 for such a row; every other step of a layer (bias-free projections, RMS norms, the MLP,
LAuReL, AltUp) maps 0 to 0, so the pad positions leave the decoder stack exactly 0. After the
stack, Gemma3nTextModel.forward takes their size with
torch.mean(hidden_states[0] ** 2, ...) ** 0.5 (modeling_gemma3n.py:1718), with no eps. The
derivative of x ** 0.5 at 0 is infinite; the gradient reaching it is 0 (the pads carry no
label), and 0 * inf = NaN, which backward then carries into the weights through the pad
positions. The user sees a finite loss and NaN gradients; an optimizer step writes NaN into
the weights (a GradScaler skips every step instead).
It happens in fp32: not a precision bug. Eager attention (a fully masked row then attends
uniformly, so the pad positions are not 0), right padding, or no padding train fine.
transformers 4.57.6 and 5.8.0 fail the same way.

Torch and transformers only, CPU, a tiny config, no download. Exit status 1 with the bug, 0
without it.
"""

import sys

import torch
import transformers
from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

config = Gemma3nTextConfig(
    vocab_size=99,
    hidden_size=32,
    intermediate_size=[64, 64, 64, 64],
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    vocab_size_per_layer_input=99,
    hidden_size_per_layer_input=8,
    num_kv_shared_layers=2,
    laurel_rank=8,
    activation_sparsity_pattern=[0.95, 0.0, 0.95, 0.0],
)
ids = torch.tensor([[18, 54, 9, 56, 47, 55, 27, 60], [0, 0, 0, 82, 84, 90, 76, 61]])  # row 2 left-padded
mask = (ids != config.pad_token_id).long()
labels = ids.masked_fill(mask == 0, -100)
print(f"transformers {transformers.__version__}, torch {torch.__version__}")
failed = False
for attention in ("eager", "sdpa"):
    torch.manual_seed(0)
    model = Gemma3nForCausalLM(config).train()
    model.set_attn_implementation(attention)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    loss.backward()
    bad = [name for name, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
    print(f"fp32, {attention}: loss {loss.item():.4f}, {len(bad)} parameters with non-finite gradients {bad[:2]}")
    failed |= bool(bad)
if failed:
    print("BUG: the pad positions stay exactly 0 and `** 0.5` of 0 has an infinite derivative")
    sys.exit(1)
print("ok: gradients are finite with left padding")
