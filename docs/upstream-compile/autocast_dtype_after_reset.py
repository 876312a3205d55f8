"""Does a compiled model called under fp16 autocast return fp16, after the same model was compiled
under bf16 autocast? Found by the precision matrix's probe on CUDA (torch 2.11.0+cu130): a
compiled LlamaForCausalLM returned bf16 logits under fp16 autocast, after torch._dynamo.reset(),
once the bf16 graph had been compiled in the same process. Standalone: torch only.

    python autocast_dtype_after_reset.py [cpu|cuda] [llama] [no_grad]

`llama`: a tiny transformers LlamaForCausalLM (built from a config, no download) instead of an MLP.
"""

import sys

import torch

device = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
if "llama" in sys.argv[2:]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.llama = LlamaForCausalLM(config)

        def forward(self, x):
            return self.llama(input_ids=x).logits

    model = Logits().to(device)
    x = torch.randint(0, 256, (4, 16), device=device)
else:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).to(device)
    x = torch.randn(8, 64, device=device)
results = {}
for label, reset in (("reset between", True), ("no reset", False)):
    torch._dynamo.reset()
    compiled = torch.compile(model)
    for dtype in (torch.bfloat16, torch.float16):
        if reset:
            torch._dynamo.reset()
        grad = torch.no_grad() if "no_grad" in sys.argv[2:] else torch.enable_grad()
        with grad, torch.autocast(device, dtype=dtype):
            eager = model(x)
            out = compiled(x)
        results[(label, str(dtype))] = (str(eager.dtype), str(out.dtype))
print(f"torch {torch.__version__}, {device}, {' '.join(sys.argv[2:])}")
ok = True
for (label, asked), (eager, got) in results.items():
    print(f"{label:14s} autocast {asked:15s} eager {eager:15s} compiled {got}")
    ok &= eager == got
print("OK: compiled dtypes match eager" if ok else "BUG: a compiled output has another dtype than eager")
sys.exit(0 if ok else 1)
