"""Evaluating a model converted for float8 training (torchao.float8.convert_to_float8_training)
under torch.inference_mode(), as Lightning's validate() and Trainer(inference_mode=True) do by
default, against torch.no_grad(), as a hand-written evaluation loop does. Found by the precision
matrix on a CPU (torch 2.13.0, torchao 0.18.0): every lightning float8 eval cell failed in
validate() while the same weights evaluated under no_grad. Standalone: torch and torchao.

    python inference_mode_eval.py [cpu|cuda]
"""

import sys

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

device = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
print(f"torch {torch.__version__}, {device}")
failures = 0
for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(device)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    x = torch.randn(2, 8, 64, device=device)  # 3-D, as a language model's hidden states
    model.eval()
    for name, mode in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
        try:
            with mode(), torch.autocast(device, dtype=torch.bfloat16):
                out = model(x)
            print(f"{recipe:20s} {name:15s} ok {out.dtype}")
        except Exception as exc:  # the point: which context raises, and what
            failures += 1
            print(f"{recipe:20s} {name:15s} {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
print("OK" if not failures else f"BUG: {failures} evaluations raised")
sys.exit(1 if failures else 0)
