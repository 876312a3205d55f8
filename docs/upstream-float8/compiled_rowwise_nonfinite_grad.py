"""Inductor-compiled float8 training with torchao's rowwise recipe gives non-finite weight
gradients where eager gives finite ones: a tiny Gemma3 (its RMSNorms, gelu MLP), bf16 autocast, a
batch of one left-padded row holding 2 real tokens in 8 (what one of two DDP ranks trains on
when the matrix's gemma-cache batch is split). Found by the precision matrix in its ddp-compile
cells on a CPU (torch 2.13.0, torchao 0.18.0). The same model compiled with backend="eager" or
"aot_eager" is finite, so is the tensorwise recipe compiled, and so is the whole three-row batch.
Standalone: torch, torchao and transformers (a model from a config, no download), converted as
accelerate's fp8 converts a model: every Linear layer but the first and the last.

    python compiled_rowwise_nonfinite_grad.py [cpu|cuda]

Exit 1 when Inductor's gradients are non-finite while eager's are finite (the finding here).
"""

import sys

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

device = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
print(f"torch {torch.__version__}, {device}")


def non_finite_gradients(recipe: str, backend: str | None, rows: list[int]) -> list[str]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=64,
    )
    model = Gemma3ForCausalLM(config).to(device)
    linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    ends = {linears[0], linears[-1]}
    convert_to_float8_training(
        model,
        config=Float8LinearConfig.from_recipe_name(recipe),
        module_filter_fn=lambda module, fqn: fqn not in ends,
    )
    run = model if backend is None else torch.compile(model, backend=backend)
    torch.manual_seed(1)
    ids = torch.randint(0, 99, (3, 8), device=device)
    mask = torch.tensor([[1] * 8, [0] * 3 + [1] * 5, [0] * 6 + [1] * 2], device=device)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = run(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows], use_cache=False).loss
    loss.backward()
    return [name for name, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]


found = False
for recipe in ("rowwise", "tensorwise"):
    for rows in ([2], [0, 1, 2]):
        outcomes = {}
        for backend in (None, "aot_eager", "inductor"):
            bad = non_finite_gradients(recipe, backend, rows)
            outcomes[backend or "eager"] = bad
            shown = f"non-finite: {', '.join(bad)}" if bad else "finite"
            print(f"{recipe:10s} rows {rows!s:9s} {backend or 'eager':9s} {shown}")
        found |= bool(outcomes["inductor"]) and not outcomes["eager"]
print("FOUND: Inductor's float8 gradients are non-finite where eager's are finite" if found else "OK")
sys.exit(1 if found else 0)
