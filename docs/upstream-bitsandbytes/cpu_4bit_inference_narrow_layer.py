"""bitsandbytes: CPU inference of a 4-bit Linear4bit whose in_features < 64 (the 4-bit blocksize).

Standalone reproduction (torch, transformers, bitsandbytes only; nothing is downloaded: the
model is built from a tiny config in code and saved to a temporary directory).

On a CPU with AVX512-BF16, `Linear4bit.forward` repacks the weight for the CPU kernel
(`bitsandbytes.functional._convert_weight_packed_for_cpu`) the first time it runs in eval mode
without grad. That repacking reshapes absmax to (out_features, in_features // blocksize), which
is (N, 0) when in_features < blocksize, and the forward crashes:

    RuntimeError: shape '[32, 0]' is invalid for input of size 16

Training mode (or an input that requires grad) skips the repacking and works.

Cases run:
  1. bare bnb.nn.Linear4bit(K, 32) for K = 32 (< 64), 96 (not a multiple of 64) and 64 (the
     control), nf4, double quant, bf16 compute: train-mode forward under torch.no_grad(), then
     eval-mode forward under torch.no_grad();
  2. a tiny LlamaForCausalLM (hidden_size=32) saved in fp32 and loaded with
     BitsAndBytesConfig(load_in_4bit=True, nf4, double quant, bf16 compute): train-mode forward
     under no_grad, then eval-mode forward under no_grad.

Prints REPRODUCED and exits 1 when an eval-mode no-grad forward of a layer with K = 32 or 96 (or of
the Llama) raises; prints NOT REPRODUCED and
exits 0 when every forward succeeds.

Run: python cpu_4bit_inference_narrow_layer.py
"""

import os
import platform
import sys
import tempfile
import traceback

import bitsandbytes as bnb
import torch
import transformers
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM


def cpu_flag(flag):
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return flag in line.split()
    except OSError:
        pass
    return None


def print_versions():
    print(f"python        {platform.python_version()} ({platform.machine()})")
    print(f"torch         {torch.__version__}")
    print(f"transformers  {transformers.__version__}")
    print(f"bitsandbytes  {bnb.__version__}")
    print(f"torch.backends.cpu.get_cpu_capability(): {torch.backends.cpu.get_cpu_capability()}")
    has = getattr(bnb.functional, "has_avx512bf16", None)
    if has is None:
        print("bitsandbytes.functional.has_avx512bf16(): absent in this release (no CPU weight packing)")
    else:
        print(
            f"bitsandbytes.functional.has_avx512bf16(): {has()}  "
            "(what Linear4bit.support_avx512bf16_for_cpu is set from)"
        )
    print(f"/proc/cpuinfo avx512_bf16 flag: {cpu_flag('avx512_bf16')}")
    print()


def run(label, fn):
    """Run fn; return None on success, or the exception."""
    try:
        out = fn()
        print(f"  {label}: OK{'' if out is None else ' ' + out}")
        return None
    except Exception as exc:
        tb = traceback.extract_tb(exc.__traceback__)
        where = f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno} in {tb[-1].name}" if tb else "?"
        print(f"  {label}: FAILED {type(exc).__name__}: {exc}")
        print(f"    raised at {where}")
        names = [fr.name for fr in tb]
        if "_convert_weight_packed_for_cpu" in names:
            print("    (inside bitsandbytes.functional._convert_weight_packed_for_cpu)")
        return exc


def bare_layer(in_features):
    print(f"case 1: bare bitsandbytes.nn.Linear4bit({in_features}, 32), nf4, double quant, bf16 compute")
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(
        in_features, 32, bias=False, compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4"
    )
    layer.load_state_dict(torch.nn.Linear(in_features, 32, bias=False).state_dict())
    layer = layer.to("cpu")
    # bitsandbytes quantizes on the first .to(<device>) that is not "meta"; on CPU call _quantize
    # explicitly when .to("cpu") was a no-op.
    if not getattr(layer.weight, "bnb_quantized", True):
        layer.weight = layer.weight._quantize("cpu")
    qs = layer.weight.quant_state
    print(
        f"  weight {tuple(layer.weight.shape)} {layer.weight.dtype}; quant_state.shape={tuple(qs.shape)} "
        f"blocksize={qs.blocksize} nested={qs.nested} absmax {tuple(qs.absmax.shape)} {qs.absmax.dtype}"
    )
    x = torch.randn(2, in_features, dtype=torch.bfloat16)

    def train_fwd():
        layer.train()
        with torch.no_grad():
            y = layer(x)
        return f"out {tuple(y.shape)} {y.dtype}"

    def eval_fwd():
        layer.eval()
        with torch.no_grad():
            y = layer(x)
        return f"out {tuple(y.shape)} {y.dtype}"

    r_train = run("train-mode forward (no_grad)", train_fwd)
    r_eval = run("eval-mode forward (no_grad)", eval_fwd)
    return r_train, r_eval


def llama():
    print("case 2: tiny LlamaForCausalLM (hidden_size=32), loaded with BitsAndBytesConfig(load_in_4bit, nf4)")
    cfg = LlamaConfig(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(d)
        qcfg = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        model = LlamaForCausalLM.from_pretrained(d, quantization_config=qcfg, dtype=torch.bfloat16)
    q = model.model.layers[0].self_attn.q_proj
    print(
        f"  q_proj: {type(q).__module__}.{type(q).__name__} in_features={q.in_features} out_features={q.out_features}"
    )
    ids = torch.randint(0, cfg.vocab_size, (2, 8))

    def train_fwd():
        model.train()
        with torch.no_grad():
            out = model(input_ids=ids)
        return f"logits {tuple(out.logits.shape)}"

    def eval_fwd():
        model.eval()
        with torch.no_grad():
            out = model(input_ids=ids)
        return f"logits {tuple(out.logits.shape)}"

    r_train = run("train-mode forward (no_grad)", train_fwd)
    r_eval = run("eval-mode forward (no_grad)", eval_fwd)
    return r_train, r_eval


def main():
    print_versions()
    results = {}
    for k in (32, 96, 64):  # 32 < 64, 96 not a multiple of 64, 64 the control
        results[f"Linear4bit({k}, 32)"] = bare_layer(k)
        print()
    try:
        results["Llama hidden_size=32"] = llama()
    except ImportError as exc:  # transformers >= 5 refuses bitsandbytes < 0.46.1
        print(f"  Llama case NOT RUN: {type(exc).__name__}: {exc}")
    print()
    control = results["Linear4bit(64, 32)"]
    print("summary (train-mode / eval-mode forward):")
    for name, (tr, ev) in results.items():
        print(f"  {name:24s} train {'OK' if tr is None else 'FAILED'} / eval {'OK' if ev is None else 'FAILED'}")
    narrow_eval_failed = [n for n, (tr, ev) in results.items() if ev is not None and n != "Linear4bit(64, 32)"]
    any_train_failed = any(tr is not None for tr, ev in results.values())
    if narrow_eval_failed:
        print(
            f"REPRODUCED: eval-mode no-grad CPU forward of a 4-bit layer whose in_features is below or not "
            f"a multiple of the blocksize 64 fails: {', '.join(narrow_eval_failed)}"
            + ("" if control[1] is None else "; note: the in_features=64 control failed too")
            + ("" if not any_train_failed else "; note: a train-mode forward failed too")
        )
        return 1
    if any_train_failed or control[1] is not None:
        print("NOT REPRODUCED (but another forward failed: see above)")
        return 0
    print(
        "NOT REPRODUCED: train- and eval-mode CPU forwards of the 4-bit layers all succeeded"
        + ("" if "Llama hidden_size=32" in results else " (the Llama case did not run: see above)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
