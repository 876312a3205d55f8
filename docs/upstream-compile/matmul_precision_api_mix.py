"""After Inductor compiled, Lightning's read of the fp32 matmul precision raises: PyTorch refuses
the legacy getter torch.get_float32_matmul_precision() once a process has written the new
per-backend setting (torch.backends.cuda.matmul.fp32_precision), and Lightning's CUDA accelerator
calls that getter at fit() and validate(). Found by the precision matrix on an H200 (torch
2.11.0+cu130, lightning 2.6.6): in a process where a compiled cell had run, Lightning cells
raised; in one without, they passed. Standalone: torch and transformers (a tiny LlamaForCausalLM
from a config, no download).

    python matmul_precision_api_mix.py [cpu|cuda]

Part 1 compiles and trains the model with Inductor, then calls the legacy getter as Lightning
does. Part 2 shows the refusal itself, on any device: it writes one backend's setting through the
new API, then reads the legacy getter. Exit 1 when part 1 raises (the finding on this device).
"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

device = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
print(f"torch {torch.__version__}, {device}")
print(f"before compiling: torch.get_float32_matmul_precision() = {torch.get_float32_matmul_precision()!r}")

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
model = torch.compile(LlamaForCausalLM(config).to(device))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 256, (4, 16), device=device)
for _ in range(2):
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

found = False
try:
    print(f"part 1, after compiling: torch.get_float32_matmul_precision() = {torch.get_float32_matmul_precision()!r}")
except RuntimeError as exc:
    found = True
    print(f"part 1, after compiling: RuntimeError: {str(exc)[:160]}")

# part 2: the refusal itself, on any device: one backend's setting written through the new API
# (CUDA matmuls in TF32), the others left as they were; it runs last, as it changes this process
torch.backends.cuda.matmul.fp32_precision = "tf32"
try:
    print(f"part 2, after writing the new API: {torch.get_float32_matmul_precision()!r}")
except RuntimeError as exc:
    print(f"part 2, after writing the new API: RuntimeError: {str(exc)[:160]}")

print(
    "BUG: the legacy getter Lightning calls raises after Inductor compiled"
    if found
    else "OK here: compiling left the legacy getter answering"
)
sys.exit(1 if found else 0)
