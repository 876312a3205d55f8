"""Quantized bases (bitsandbytes 4-bit and 8-bit weights, as QLoRA and LLM.int8 fine-tuning load
them): what a quantized precision declares (Quantization, a field of its row in
matrix/precisions/policies.py), the BitsAndBytesConfig users write for it, whether this environment can
run it, and the checks that mean something for a quantized base: the storage, the adapters,
and the evaluation of the same weights with fp32 compute or unquantized.

bitsandbytes is imported only when a quantized cell runs: without it those cells skip.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from packaging.version import Version

from matrix.grid import packages

# 0.46.0 is the first release whose 4-bit and 8-bit layers run on a CPU (its multi-backend
# refactor; 0.45.5 raises "Device type not supported for FP4 quantization: cpu"), and 0.46.1 the
# first that transformers' quantized loading accepts (5.x checks it in from_pretrained).
BITSANDBYTES_CPU = "0.46.0"
BITSANDBYTES_MIN = "0.46.1"
SCHEMES = {"nf4": 4, "fp4": 4, "int8": 8}
REQUIREMENT = f"bitsandbytes >= {BITSANDBYTES_MIN}"


@dataclass(frozen=True)
class Quantization:
    """How a precision's base weights are quantized, in BitsAndBytesConfig's terms."""

    scheme: str  # nf4 | fp4 (4-bit, bnb_4bit_quant_type) | int8 (LLM.int8, load_in_8bit)
    # bnb_4bit_compute_dtype: what a 4-bit layer dequantizes to and multiplies in. None for
    # int8, whose matmul takes its own path (LLM.int8: int8 product, fp16 outliers).
    compute_dtype: torch.dtype | None = None
    double_quant: bool = False  # bnb_4bit_use_double_quant: the block scales quantized again
    # peft's prepare_model_for_kbit_training before the adapters, as QLoRA and llama-recipes do:
    # it casts every unquantized weight to fp32 and turns on gradient checkpointing
    prepare_for_kbit_training: bool = True

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"quantization scheme {self.scheme!r}: one of {', '.join(SCHEMES)}")
        if (self.scheme == "int8") != (self.compute_dtype is None):
            raise ValueError("a 4-bit scheme declares its compute dtype; int8 has none")

    @property
    def bits(self) -> int:
        return SCHEMES[self.scheme]

    @property
    def requires(self) -> tuple[str, ...]:
        """The packages a quantized base needs (matrix/grid/packages.py)."""
        return (REQUIREMENT,)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype a quantized weight is stored in: two 4-bit codes per uint8, or int8."""
        return torch.uint8 if self.bits == 4 else torch.int8

    def config(self):
        """The BitsAndBytesConfig a user writes for it."""
        packages.require(self.requires, f"the {self.scheme} quantized base")
        from transformers import BitsAndBytesConfig

        if self.bits == 8:
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.scheme,
            bnb_4bit_use_double_quant=self.double_quant,
            bnb_4bit_compute_dtype=self.compute_dtype,
        )

    def settings(self) -> dict:
        """As reports record it (no torch types)."""
        return {
            "scheme": self.scheme,
            "bits": self.bits,
            "compute_dtype": str(self.compute_dtype).removeprefix("torch.") if self.compute_dtype else None,
            "double_quant": self.double_quant,
            "prepare_for_kbit_training": self.prepare_for_kbit_training,
            "library": "bitsandbytes",
        }


def installed_bitsandbytes() -> str | None:
    return packages.installed_version("bitsandbytes")


def skip_reason() -> str | None:
    """Why quantized cells cannot run in this environment ("Requires: [...]"), or None."""
    found = installed_bitsandbytes()
    if found is None:
        return packages.not_installed_reason([REQUIREMENT])
    if found == packages.UNKNOWN_VERSION:  # importable, without metadata to say which release: let it run
        return None
    if Version(found) < Version(BITSANDBYTES_CPU):
        return (
            f"Requires: [bitsandbytes >= {BITSANDBYTES_MIN}] ({found} installed: its 4-bit and 8-bit layers "
            "run on CUDA only)"
        )
    if Version(found) < Version(BITSANDBYTES_MIN):
        return (
            f"Requires: [bitsandbytes >= {BITSANDBYTES_MIN}] ({found} installed: transformers' quantized "
            "loading refuses it)"
        )
    return None


def prepare_for_training(model, quantization: Quantization):
    """What a QLoRA script does between loading the quantized base and adding adapters."""
    if not quantization.prepare_for_kbit_training:
        return model
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model)


def quantized_layers(model) -> dict[str, torch.nn.Module]:
    """name -> every bitsandbytes 4-bit or 8-bit linear layer of `model` (peft's LoRA layers wrap
    them: the wrapped one counts)."""
    import bitsandbytes as bnb

    return {n: m for n, m in model.named_modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}


def storage_expectations(model, weights: dict, quantization: Quantization, weights_dtype: torch.dtype) -> dict:
    """name -> (dtype, why) for the kind's precision weights of a quantized model: a quantized
    layer's weight in the storage dtype; every other weight in fp32 where peft's
    prepare_model_for_kbit_training ran (it casts them), else in the dtype from_pretrained
    was asked for."""
    quantized = {f"{name}.weight" for name in quantized_layers(model)}
    rest = torch.float32 if quantization.prepare_for_kbit_training else weights_dtype
    why_rest = (
        "prepare_model_for_kbit_training casts the unquantized weights to fp32" if rest == torch.float32 else None
    )
    why = f"bitsandbytes {quantization.scheme} storage"
    return {n: (quantization.storage_dtype, why) if n in quantized else (rest, why_rest) for n in weights}


def check_storage(model, quantization: Quantization, when: str) -> dict:
    """Every linear layer but the output projection (which transformers keeps unquantized) is a
    bitsandbytes layer of the declared scheme: its weight in the storage dtype, its quant
    state (4-bit: quant type, double quantization, compute dtype) as declared. Returns what a
    report records of it."""
    from matrix.checks.assertions import DtypeContractBroken

    layers = quantized_layers(model)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inside = {id(sub) for layer in layers.values() for sub in layer.modules()}
    adapters = {n for n, _ in model.named_modules() if "lora_" in n}
    plain = [
        n
        for n, m in model.named_modules()
        if type(m) is torch.nn.Linear and m is not output and id(m) not in inside and not n.startswith(tuple(adapters))
    ]
    if not layers or plain:
        raise DtypeContractBroken(
            f"{when}: linear layers left unquantized in a {quantization.scheme} base",
            details=f"{len(plain)} plain nn.Linear, first {plain[0] if plain else None}; {len(layers)} quantized",
        )
    wrong = []
    for name, layer in layers.items():
        weight = layer.weight
        found = {"dtype": weight.dtype}
        want = {"dtype": quantization.storage_dtype}
        if quantization.bits == 4:
            state = weight.quant_state
            found.update(quant_type=state.quant_type, compute_dtype=layer.compute_dtype)
            want.update(quant_type=quantization.scheme, compute_dtype=quantization.compute_dtype)
            if not getattr(state, "packing_format_for_cpu", False):  # the CPU's inference packing drops the nesting
                found["double_quant"], want["double_quant"] = bool(state.nested), quantization.double_quant
        else:
            found["scales"], want["scales"] = getattr(weight, "SCB", None) is not None, True
        if found != want:
            wrong.append((name, {k: (found[k], want[k]) for k in want if found[k] != want[k]}))
    if wrong:
        name, differences = wrong[0]
        field_name, (found_value, wanted) = next(iter(differences.items()))
        raise DtypeContractBroken(
            f"{when}: a {quantization.scheme} layer's {field_name} is {found_value}, not {wanted}",
            details=f"{len(wrong)} of {len(layers)} quantized layers, first {name}",
        )
    return {
        "quantized_layers": len(layers),
        "storage_dtype": str(quantization.storage_dtype).removeprefix("torch."),
        "kept_unquantized": [n for n, m in model.named_modules() if m is output and output is not None],
    }


@contextlib.contextmanager
def fp32_compute(model):
    """The same quantized weights, multiplied in fp32: every 4-bit layer's compute dtype set to
    fp32 for the duration (an int8 layer has none to set: LLM.int8 computes as it does)."""
    import bitsandbytes as bnb

    changed = [(m, m.compute_dtype) for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for module, _ in changed:
        module.compute_dtype = torch.float32
    try:
        yield
    finally:
        for module, dtype in changed:
            module.compute_dtype = dtype


def float_tensors(model) -> dict[str, torch.Tensor]:
    """name -> every floating-point parameter and buffer. Not through state_dict(): a bitsandbytes
    4-bit layer's state_dict() rewrites the layer's weight and quant state when a CPU inference
    had packed them (the packing is undone with its scales rounded to bf16), and a check must not
    change the model it checks."""
    found = dict(model.named_parameters())
    found.update(model.named_buffers())
    return {name: tensor for name, tensor in found.items() if tensor.is_floating_point()}


def copy_float_weights(source, target, trainable_only: bool = False, source_dtypes: bool = False) -> list[str]:
    """Copy every floating-point parameter and buffer of `source` that `target` has under the same
    name and shape (the adapters, norms, embeddings; `trainable_only`: the trainable parameters
    alone) into `target`; the quantized weights and their quant state stay as `target` has them.
    In `target`'s dtypes, or with `source_dtypes` in `source`'s (a tensor of another dtype
    replaces the target's data: a view of what a library holds, which may have cast it).
    Returns the names of `source`'s trainable parameters that found no place in `target` (none,
    if the copy is complete)."""
    theirs = float_tensors(target)
    trainable = {n for n, p in source.named_parameters() if p.requires_grad}
    copied = []
    with torch.no_grad():
        for name, tensor in float_tensors(source).items():
            if name in theirs and tensor.shape == theirs[name].shape and (name in trainable or not trainable_only):
                if source_dtypes and tensor.dtype != theirs[name].dtype:
                    theirs[name].data = tensor.detach().to(theirs[name].device, copy=True)
                else:
                    theirs[name].copy_(tensor)
                copied.append(name)
    return sorted(trainable - set(copied))
