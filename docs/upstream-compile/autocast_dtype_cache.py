"""A compiled model's output dtype under autocast, when Inductor's caches already hold the graph
compiled under another autocast dtype: first in one process (torch._dynamo.reset() between),
then across two processes sharing one TORCHINDUCTOR_CACHE_DIR, as pytest-xdist workers do.
Found by the precision matrix on CUDA (torch 2.11.0+cu130, H200): compiled tiny Llama and
Gemma-3 evaluations under fp16 autocast returned bf16 logits (and under bf16, fp16) in cells run
after another cell had compiled the other dtype. Standalone: torch and transformers only (a tiny
LlamaForCausalLM built from a config, no download).

    python autocast_dtype_cache.py [cpu|cuda]
"""

import os
import subprocess
import sys
import tempfile

import torch


def one(device: str, dtype_name: str, grad: bool) -> str:
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
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    ids = torch.randint(0, 256, (4, 16), device=device)
    compiled = torch.compile(model)
    dtype = getattr(torch, dtype_name)
    context = torch.enable_grad() if grad else torch.no_grad()
    with context, torch.autocast(device, dtype=dtype):
        eager = model(input_ids=ids, labels=ids).logits.dtype
        got = compiled(input_ids=ids, labels=ids).logits.dtype
    return f"{eager}->{got}"


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[2] == "child":
    print(one(sys.argv[1], sys.argv[3], sys.argv[4] == "grad"))
    sys.exit(0)

device = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
print(f"torch {torch.__version__}, {device}")
bad = 0
for grad in (False, True):
    mode = "grad" if grad else "no_grad"
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        seen = []
        for dtype in ("bfloat16", "float16", "bfloat16"):
            torch._dynamo.reset()
            seen.append(one(device, dtype, grad))
        print(f"one process, {mode}: {seen}")
        bad += sum(a.split("->")[0] != a.split("->")[1] for a in seen)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        seen = []
        for dtype in ("bfloat16", "float16"):
            out = (
                subprocess.run(
                    [sys.executable, __file__, device, "child", dtype, mode],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            seen.append(out)
        print(f"two processes, {mode}: {seen}")
        bad += sum(a.split("->")[0] != a.split("->")[1] for a in seen)
print("OK: compiled dtypes match eager" if not bad else f"BUG: {bad} compiled outputs have another dtype than eager")
sys.exit(1 if bad else 0)
