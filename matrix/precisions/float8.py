"""float8 training (torchao): what a float8 precision declares (Float8, a field of its row in
matrix/precisions/policies.py), the conversion users run (torchao.float8.convert_to_float8_training with
a module filter), which modules it converted and which it left out and why (the cell's record),
and the signal-to-quantization-noise ratio its outputs are measured by.

A float8 precision trains over bf16 compute: fp32 weights, bf16 autocast, and the converted
Linear layers multiply in float8 (e4m3 forward, and in the backward pass as the recipe says).
torchao emulates the float8 matmul on a CPU; on CUDA it is native from compute capability 8.9.

The modules left out are what users configure (`module_filter_fn`): the rule here is the one
accelerate applies by default (accelerate.utils.ao.filter_linear_layers) and torchtitan's
recipes follow, the first and last Linear layers of the model, and any whose in or out features
are not divisible by 16 (torch._scaled_mm's requirement). Every cell records the result.

torchao is imported only when a float8 cell runs: without it those cells skip, naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# 0.13.0: the first release whose rowwise recipes train under a CPU's autocast (the issue that
# brought float8 in measured it); the stacks (matrix/releases/stacks.toml) run older ones.
TORCHAO_MIN = "0.13.0"
REQUIREMENT = f"torchao >= {TORCHAO_MIN}"
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName values
DIVISOR = 16  # in and out features of a converted Linear: torch._scaled_mm multiplies multiples of 16


@dataclass(frozen=True)
class Float8:
    """Which of torchao's float8 training recipes a precision converts the model's Linear layers with."""

    recipe: str

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"float8 recipe {self.recipe!r}: one of {', '.join(RECIPES)}")

    @property
    def requires(self) -> tuple[str, ...]:
        return (REQUIREMENT,)

    def config(self):
        """torchao's Float8LinearConfig for the recipe, as users get it."""
        from torchao.float8 import Float8LinearConfig

        return Float8LinearConfig.from_recipe_name(self.recipe)

    def settings(self) -> dict:
        return {"recipe": self.recipe, "left_out": left_out_rule()}


def left_out_rule() -> str:
    return f"the first and last Linear layers, and Linear layers whose features are not multiples of {DIVISOR}"


def linear_names(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def left_out(model: torch.nn.Module) -> dict[str, str]:
    """The Linear layers the conversion leaves in high precision, each with its reason."""
    names = linear_names(model)
    ends = {names[0]: "the first Linear layer", names[-1]: "the last Linear layer"} if names else {}
    reasons = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if name in ends:
            reasons[name] = ends[name]
        elif module.in_features % DIVISOR or module.out_features % DIVISOR:
            reasons[name] = f"{module.in_features} x {module.out_features} features, not multiples of {DIVISOR}"
    return reasons


def convert(model: torch.nn.Module, float8: Float8) -> torch.nn.Module:
    """convert_to_float8_training over the model, with the filter above (in place; returned)."""
    from torchao.float8 import convert_to_float8_training

    excluded = left_out(model)
    return convert_to_float8_training(
        model, config=float8.config(), module_filter_fn=lambda module, fqn: fqn not in excluded
    )


def converted_names(model: torch.nn.Module) -> list[str]:
    """The modules that are torchao Float8Linear layers now (observed, not declared)."""
    return [name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"]


def record(model: torch.nn.Module) -> dict:
    """What the cell's model holds: the converted layers, and the Linear layers left out with why.
    A model converted by a library (accelerate's fp8) is observed the same way."""
    converted = converted_names(model)
    reasons = left_out(model)
    high = [name for name in linear_names(model) if name not in converted]
    return {
        "converted": converted,
        "left_out": {name: reasons.get(name, "not converted by the library's filter") for name in high},
    }


def sqnr_db(reference: torch.Tensor, value: torch.Tensor) -> float | None:
    """Signal-to-quantization-noise ratio in dB, torchao's measure: 20 log10(|ref| / |ref - value|);
    None where there is no noise (the same values) or no signal (JSON has no infinity)."""
    reference, value = reference.double(), value.double()
    noise = (reference - value).norm().item()
    signal = reference.norm().item()
    if noise == 0 or signal == 0:
        return None
    return 20 * math.log10(signal / noise)
