"""bitsandbytes: an 8-bit (LLM.int8) layer on a CPU without AVX-512 computes its int8 product in
fp16 under torch.autocast, and the product overflows.

Standalone reproduction (torch, transformers, bitsandbytes only; nothing is downloaded: the
model is built from a tiny config in code and saved to a temporary directory).

The int8 product of MatMul8bitLt is the op `bitsandbytes::int8_linear_matmul` (int8 x int8 ->
int32). On a CPU, bitsandbytes >= 0.50.0 registers `torch._int_mm` for it only where
`torch.backends.cpu.get_cpu_capability() == "AVX512"` (bitsandbytes/backends/cpu/ops.py). Elsewhere
(an AVX2 x86 CPU, aarch64) the op falls to the portable kernel in bitsandbytes/backends/default/
ops.py, which computes `torch.matmul(A.float(), B.float().t()).to(torch.int32)`. That is exact in
fp32, but it runs inside the caller's autocast region: under torch.autocast("cpu", float16) the
matmul is autocast to fp16, so every int32 product is rounded to 11 significant bits, and a
product above 65504 becomes inf, which .to(torch.int32) turns into -2**31. Under bfloat16
autocast it is rounded to 8 significant bits.

Cases run (each compares the op as this machine dispatches it with the exact integer product):
  1. the op on random int8 matrices (24 x 64 by 128 x 64, every value in [-127, 127]): outside
     autocast, under float16 autocast and under bfloat16 autocast; beside it, for reference, the
     two kernels bitsandbytes chooses between, called directly (torch._int_mm, the AVX512 path,
     and the portable kernel, the path without AVX-512);
  2. a tiny LlamaForCausalLM (hidden_size=64) saved in fp16 and loaded with
     BitsAndBytesConfig(load_in_8bit=True) (LLM.int8, outlier threshold 6.0): its eval loss and
     logits on a fixed batch under float16 autocast with the op as dispatched here, with the
     op replaced by torch._int_mm (the AVX512 path), and with the op replaced by the exact integer
     product (the reference); and the same model with no autocast.

Prints REPRODUCED and exits 1 when the op as dispatched here is off the exact product under
float16 autocast, or the model's loss with it is off the reference by more than the AVX512
path's loss is; prints NOT REPRODUCED and exits 0 otherwise. To take the path without AVX-512 on
a CPU that has it, run with ATEN_CPU_CAPABILITY=avx2 in the environment (bitsandbytes reads
torch's capability when it is imported).

Run: python cpu_int8_matmul_under_autocast.py
     ATEN_CPU_CAPABILITY=avx2 python cpu_int8_matmul_under_autocast.py
"""

import contextlib
import platform
import sys
import tempfile
import warnings

import bitsandbytes as bnb
import torch
import transformers
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

transformers.utils.logging.disable_progress_bar()
# replacing the op's CPU kernel below is deliberate; torch warns once that it overrides one
warnings.filterwarnings("ignore", message="Warning only once for all operators")

INT32_MIN = -(2**31)
OP = "bitsandbytes::int8_linear_matmul"


def cpu_flag(flag):
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return flag in line.split()
    except OSError:
        pass
    return None


def dispatched_path():
    """Which kernel bitsandbytes registered for the op on the CPU, as its cpu backend decides
    (bitsandbytes/backends/cpu/ops.py): from 0.50.0 (bitsandbytes#1968) torch._int_mm only where
    torch dispatches at AVX512; before, torch._int_mm on every CPU (with torch >= 2.6)."""
    release = tuple(int(part) for part in bnb.__version__.split(".")[:2])
    if release < (0, 50):
        return "torch._int_mm (before 0.50.0 bitsandbytes registers it on every CPU)"
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        return "torch._int_mm (the AVX512 path)"
    return "the portable kernel, torch.matmul(A.float(), B.float().t()) (the path without AVX-512)"


def print_versions():
    print(f"python        {platform.python_version()} ({platform.machine()})")
    print(f"torch         {torch.__version__}")
    print(f"transformers  {transformers.__version__}")
    print(f"bitsandbytes  {bnb.__version__}")
    print(f"torch.backends.cpu.get_cpu_capability(): {torch.backends.cpu.get_cpu_capability()}")
    print(f"/proc/cpuinfo avx512f flag: {cpu_flag('avx512f')}, avx2 flag: {cpu_flag('avx2')}")
    print(f"bitsandbytes' CPU int8 product here: {dispatched_path()}")
    print()


def exact_product(A, B):
    return (A.long() @ B.long().t()).to(torch.int32)


def int_mm_product(A, B):
    return torch._int_mm(A.reshape(-1, A.shape[-1]), B.t()).reshape(*A.shape[:-1], B.shape[0])


def portable_product(A, B):
    from bitsandbytes.backends.default.ops import _int8_linear_matmul_impl

    return _int8_linear_matmul_impl(A, B)


def dispatched_product(A, B):
    return torch.ops.bitsandbytes.int8_linear_matmul.default(A, B)


def autocast(dtype):
    return contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)


def product_errors(kernel, A, B, exact, dtype):
    with autocast(dtype):
        got = kernel(A, B)
    wrong = got.long() != exact.long()
    finite = wrong & (got.long() != INT32_MIN)
    largest = (got.long() - exact.long())[finite].abs().max().item() if finite.any() else 0
    return int(wrong.sum()), int((got.long() == INT32_MIN).sum()), largest


def case_product():
    print("case 1: the int8 product, 24 x 64 by 128 x 64, values in [-127, 127], against the exact one")
    generator = torch.Generator().manual_seed(0)
    A = torch.randint(-127, 128, (24, 64), dtype=torch.int8, generator=generator)
    B = torch.randint(-127, 128, (128, 64), dtype=torch.int8, generator=generator)
    exact = exact_product(A, B)
    print(
        f"  exact products: largest |value| {exact.abs().max().item()}, {int((exact.abs() > 65504).sum())} "
        f"of {exact.numel()} above 65504 (fp16's largest finite)"
    )
    kernels = [
        ("as dispatched here", dispatched_product),
        ("torch._int_mm (AVX512 path)", int_mm_product),
        ("portable kernel (no AVX-512)", portable_product),
    ]
    contexts = (("no autocast", None), ("fp16 autocast", torch.float16), ("bf16 autocast", torch.bfloat16))
    results = {}
    for name, kernel in kernels:
        for label, dtype in contexts:
            wrong, overflowed, largest = product_errors(kernel, A, B, exact, dtype)
            results[(name, label)] = wrong
            print(
                f"  {name:30s} {label:14s}: {wrong:5d} wrong, {overflowed:5d} = -2**31 (overflowed), "
                f"largest error of the rest {largest}"
            )
    print()
    return results[("as dispatched here", "fp16 autocast")]


def tiny_llama_8bit(directory):
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(directory)
    quantized = LlamaForCausalLM.from_pretrained(
        directory, quantization_config=BitsAndBytesConfig(load_in_8bit=True), dtype=torch.float16
    )
    unquantized = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return config, quantized.eval(), unquantized.eval()


def evaluate(model, ids, dtype):
    with torch.no_grad(), autocast(dtype):
        out = model(input_ids=ids, labels=ids)
    return out.loss.float().item(), out.logits.float()


def case_model():
    print("case 2: a tiny Llama (hidden 64, 2 layers) loaded with load_in_8bit, eval loss on a fixed batch")
    with tempfile.TemporaryDirectory() as directory:
        config, model, unquantized = tiny_llama_8bit(directory)
    q = model.model.layers[0].self_attn.q_proj
    print(f"  q_proj: {type(q).__module__}.{type(q).__name__}, weight {q.weight.dtype}, threshold {q.state.threshold}")
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    fp32_loss, _ = evaluate(unquantized, ids, None)

    measured = {}
    measured["as dispatched here, fp16 autocast"] = evaluate(model, ids, torch.float16)
    measured["as dispatched here, no autocast"] = evaluate(model, ids, None)
    torch.library.register_kernel(OP, "cpu")(int_mm_product)
    measured["torch._int_mm (AVX512 path), fp16 autocast"] = evaluate(model, ids, torch.float16)
    torch.library.register_kernel(OP, "cpu")(exact_product)  # the reference, from here on
    reference_loss, reference_logits = evaluate(model, ids, torch.float16)

    print(f"  unquantized fp32 model: loss {fp32_loss:.6f}")
    print(f"  reference (exact integer product), fp16 autocast: loss {reference_loss:.6f}")
    errors = {}
    for name, (loss, logits) in measured.items():
        errors[name] = abs(loss - reference_loss)
        print(
            f"  {name:44s}: loss {loss:.6f}, |loss - reference| {errors[name]:.3g}, "
            f"max |logits - reference| {(logits - reference_logits).abs().max().item():.3g}"
        )
    print()
    return errors["as dispatched here, fp16 autocast"], errors["torch._int_mm (AVX512 path), fp16 autocast"]


def main():
    print_versions()
    wrong_products = case_product()
    dispatched_error, avx512_error = case_model()
    if wrong_products or dispatched_error > avx512_error:
        print(
            f"REPRODUCED: under float16 autocast the CPU int8 product as dispatched here ({dispatched_path()}) "
            f"is wrong in {wrong_products} of 3072 entries, and the 8-bit model's loss is {dispatched_error:.3g} "
            f"off the exact product's (the AVX512 path: {avx512_error:.3g})"
        )
        return 1
    print(
        f"NOT REPRODUCED: the CPU int8 product as dispatched here ({dispatched_path()}) is exact under float16 "
        f"autocast, and the 8-bit model's loss is {dispatched_error:.3g} off the exact product's"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
