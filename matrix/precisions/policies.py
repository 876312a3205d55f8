"""The precision axis: one row per precision, and nothing else decides what a precision means.

A new precision is one entry in the table below (or one register() call in a user's plugin):
each engine derives its own settings from the row (matrix/engines/*.py derive_settings()).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from matrix.grid.registry import Registry
from matrix.precisions.float8 import Float8
from matrix.precisions.quantization import Quantization


@dataclass(frozen=True)
class Precision:
    name: str
    weights_dtype: torch.dtype  # dtype the model's parameters are built/loaded in
    autocast_dtype: torch.dtype | None  # dtype of torch.autocast, None = no autocast
    grad_scaler: bool  # torch.amp.GradScaler around backward/step
    summary: str
    # How the weights get their dtype: "cast" = built in fp32, then module.to(dtype), as
    # Lightning's *-true plugins and hand-written loops do; "load" = from_pretrained(...,
    # dtype=...) of an fp32 checkpoint, as LLM fine-tuning scripts do.
    weights_from: str = "cast"
    # Gradients kept in another dtype than the parameters (None: the parameters' dtype), and
    # micro-batches accumulated per optimizer step: SimpleTuner's --gradient_precision.
    grad_dtype: torch.dtype | None = None
    grad_accumulation: int = 1
    # The dtype gradients are reduced in across ranks (DDP's compress hooks, FSDP's
    # reduce_dtype); None: the gradients' own dtype. Only a distributed engine reduces.
    reduce_dtype: torch.dtype | None = None
    # A quantized base (matrix/precisions/quantization.py): from_pretrained(..., quantization_config=...)
    # quantizes the kind's linear layers; weights_dtype is the dtype= it is asked for, which the
    # unquantized weights take. Only kinds that train adapters over a frozen base run it.
    quantization: Quantization | None = None
    # float8 training (matrix/precisions/float8.py): the model's Linear layers converted with one of torchao's
    # recipes, over the bf16 compute the rest of the row declares
    float8: Float8 | None = None

    def contradictions(self) -> list[str]:
        """Settings that cannot hold together, found before any step runs."""
        found = []
        if self.grad_dtype is not None and self.grad_dtype != self.weights_dtype:
            found.append(
                f"gradients kept in {dtype_name(self.grad_dtype)} for {dtype_name(self.weights_dtype)} weights: "
                "torch's optimizers update a parameter with gradients of the parameter's own dtype"
            )
        return found

    @property
    def compute_dtype(self) -> torch.dtype:
        """Lowest precision the matmuls run in: what the fp32 tolerance is chosen by."""
        if self.float8 is not None:
            return FLOAT8_COMPUTE
        quantized = self.quantization.compute_dtype if self.quantization else None
        if quantized in HALF_DTYPES:
            return quantized
        return self.autocast_dtype or self.weights_dtype

    @property
    def requires(self) -> tuple[str, ...]:
        """The packages it needs beyond torch (matrix/grid/packages.py): a quantized base's library,
        float8's."""
        return (
            *(self.quantization.requires if self.quantization else ()),
            *(self.float8.requires if self.float8 else ()),
        )

    @property
    def half_dtypes(self) -> frozenset[torch.dtype]:
        return frozenset(d for d in (self.weights_dtype, self.autocast_dtype) if d in HALF_DTYPES)

    def autocast(self, device_type: str):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)

    def make_grad_scaler(self, device_type: str) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(device_type) if self.grad_scaler else None

    def settings(self) -> dict:
        """The declared settings, as recorded in reports."""
        return {
            "weights_dtype": dtype_name(self.weights_dtype),
            "autocast_dtype": dtype_name(self.autocast_dtype) if self.autocast_dtype else None,
            "grad_scaler": self.grad_scaler,
            "weights_from": self.weights_from,
            "grad_dtype": dtype_name(self.grad_dtype) if self.grad_dtype else None,
            "grad_accumulation": self.grad_accumulation,
            "reduce_dtype": dtype_name(self.reduce_dtype) if self.reduce_dtype else None,
            "quantization": self.quantization.settings() if self.quantization else None,
            "float8": self.float8.settings() if self.float8 else None,
        }


HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})
# what a float8 precision's converted matmuls run in (their forward's e4m3): its tolerance rows' key
FLOAT8_COMPUTE = torch.float8_e4m3fn


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_F32, _F16, _BF16 = torch.float32, torch.float16, torch.bfloat16

PRECISIONS: Registry[Precision] = Registry("precision", Precision)
register = PRECISIONS.register

for _precision in (
    Precision("fp32", _F32, None, False, "fp32 weights, no autocast"),
    Precision("fp16-mixed", _F32, _F16, True, "fp32 master weights, fp16 autocast, GradScaler"),
    Precision("bf16-mixed", _F32, _BF16, False, "fp32 master weights, bf16 autocast"),
    Precision("bf16-true", _BF16, None, False, "bf16 weights, no autocast"),
    Precision("fp16-true", _F16, None, False, "fp16 weights, no autocast, no scaler"),
    # What most LLM fine-tuning runs: weights loaded in half precision
    # (from_pretrained(dtype=...)) with a mixed-precision trainer on top.
    Precision("bf16-loaded-mixed", _BF16, _BF16, False, "bf16 weights loaded, bf16 autocast", "load"),
    Precision("fp16-loaded-mixed", _F16, _F16, True, "fp16 weights loaded, fp16 autocast, GradScaler", "load"),
    # SimpleTuner's MIXED_PRECISION=bf16 with --gradient_precision=fp32 over bf16 weights
    # (seed 004): contradictory on purpose, so the matrix shows how it is caught.
    Precision(
        "bf16-loaded-mixed-fp32-grads",
        _BF16,
        _BF16,
        False,
        "bf16 weights loaded, bf16 autocast, fp32 gradients, 2 accumulation steps",
        "load",
        grad_dtype=_F32,
        grad_accumulation=2,
    ),
    # Data-parallel training that halves its gradient traffic: fp32 master weights and gradients,
    # reduced across ranks in half precision (DDP's fp16/bf16_compress_hook, FSDP's reduce_dtype).
    Precision(
        "fp16-mixed-fp16-reduce",
        _F32,
        _F16,
        True,
        "fp32 master weights, fp16 autocast, GradScaler, gradients reduced across ranks in fp16",
        reduce_dtype=_F16,
    ),
    Precision(
        "bf16-mixed-bf16-reduce",
        _F32,
        _BF16,
        False,
        "fp32 master weights, bf16 autocast, gradients reduced across ranks in bf16",
        reduce_dtype=_BF16,
    ),
    # Quantized bases (bitsandbytes) under LoRA adapters. QLoRA as its paper and most recipes run
    # it: NF4 with double quantization, bf16 compute, the Trainer's bf16 autocast on top.
    Precision(
        "nf4-bf16-mixed",
        _BF16,
        _BF16,
        False,
        "QLoRA: NF4 base (double quantization), bf16 compute, bf16 autocast",
        "load",
        quantization=Quantization("nf4", _BF16, double_quant=True),
    ),
    # the same on a GPU without bf16 (a T4, a V100): fp16 compute, fp16 autocast, GradScaler
    Precision(
        "nf4-fp16-mixed",
        _F16,
        _F16,
        True,
        "QLoRA in fp16: NF4 base (double quantization), fp16 compute, fp16 autocast, GradScaler",
        "load",
        quantization=Quantization("nf4", _F16, double_quant=True),
    ),
    # Seed 000, llama-recipes' PEFT recipe: load_in_8bit with dtype=float16, fp16 autocast, GradScaler
    Precision(
        "int8-fp16-mixed",
        _F16,
        _F16,
        True,
        "LLM.int8 base (load_in_8bit), fp16 weights loaded, fp16 autocast, GradScaler",
        "load",
        quantization=Quantization("int8"),
    ),
    # float8 training with torchao (matrix/precisions/float8.py), as torchtitan and accelerate's fp8 run it:
    # fp32 master weights, bf16 autocast, the Linear layers converted with one of its recipes
    *(
        Precision(
            f"float8-{recipe.replace('_with_gw_hp', '-gw-hp')}",
            _F32,
            _BF16,
            False,
            f"torchao float8 training, {recipe} recipe; fp32 master weights, bf16 autocast",
            float8=Float8(recipe),
        )
        for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp")
    ),
):
    register(_precision)


def table() -> dict[str, dict]:
    """The precisions as results.json records them: name -> declared settings and summary."""
    return {name: {**p.settings(), "summary": p.summary} for name, p in PRECISIONS.items()}


class PolicyContradiction(ValueError):
    """A precision policy whose settings cannot hold together."""


def validate(precision: Precision) -> None:
    problems = precision.contradictions()
    if problems:
        raise PolicyContradiction(f"precision {precision.name!r} contradicts itself: " + "; ".join(problems))
