"""A variant: the settings the fixed grid holds constant and exploration (matrix/explore/exploration.py)
varies. The grid runs each model kind's own variant (ModelKind.grid_variant); a variant with
other values changes the batch, the model's sizes, or the loop, never the precision.

Each model kind reads only some fields (ModelKind.variant_fields); reports and replay
commands carry only those.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

PADDINGS = ("none", "right", "left")
EVAL_GRAD_MODES = ("no_grad", "inference_mode")
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_POSITIONS = 64
# Below this, normalisation layers degenerate: a LayerNorm over 2 features maps every input to
# (+1, -1) or (-1, +1), so no gradient passes it, and an fp32 run "trains" only because AdamW
# scales float rounding noise up to full steps. Such a run is no reference for a precision.
MIN_HIDDEN_SIZE = 4


class InvalidVariant(ValueError):
    """A combination of settings that the model cannot be built with or fed: never a finding."""


@dataclass(frozen=True)
class Variant:
    # the batch: one row per entry of pad_counts, each seq_len wide; a row holds
    # seq_len - pad_counts[row] real tokens, padded on the `padding` side
    seq_len: int = 8
    padding: str = "right"  # none (no padding mask at all) | right | left
    pad_counts: tuple[int, ...] = (0, 3, 6)
    # the model's sizes
    hidden_size: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8  # gemma-cache sets it on its own; tiny-llama uses hidden_size // num_heads
    num_layers: int = 2
    intermediate_size: int = 64
    dropout: float = 0.0  # attention/encoder dropout, and LoRA's dropout
    sliding_window: int = 4
    use_cache_in_eval: bool = False  # the eval forward and generate() use the KV cache
    lora_rank: int = 4
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    # the loop; None: the precision's accumulation, the engine's own grad mode in evaluation
    grad_accumulation: int | None = None
    eval_grad_mode: str | None = None

    @property
    def batch_size(self) -> int:
        return len(self.pad_counts)

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(self.seq_len - pad for pad in self.pad_counts)

    def replace(self, **changes) -> Variant:
        return dataclasses.replace(self, **changes)

    def only(self, fields: tuple[str, ...]) -> dict:
        """The given fields as JSON-ready values."""
        return {name: _plain(getattr(self, name)) for name in fields}

    def differences(self, other: Variant, fields: tuple[str, ...]) -> dict:
        """{field: value here} for the fields where this variant and `other` differ."""
        return {name: _plain(getattr(self, name)) for name in fields if getattr(self, name) != getattr(other, name)}


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def from_json(text: str | dict, base: Variant) -> Variant:
    """A variant from its JSON form (fields not given keep `base`'s values)."""
    data = json.loads(text) if isinstance(text, str) else dict(text)
    names = {f.name for f in dataclasses.fields(Variant)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise InvalidVariant(f"unknown variant field {unknown[0]!r}; fields: {', '.join(sorted(names))}")
    return base.replace(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def to_json(variant: Variant, fields: tuple[str, ...]) -> str:
    return json.dumps(variant.only(fields), separators=(",", ":"))


def check_common(variant: Variant) -> None:
    """What every kind requires of the batch and the loop."""
    if variant.padding not in PADDINGS:
        raise InvalidVariant(f"padding {variant.padding!r} is not one of {', '.join(PADDINGS)}")
    if not variant.pad_counts:
        raise InvalidVariant("the batch has no rows")
    if variant.seq_len < 1:
        raise InvalidVariant("seq_len must be at least 1")
    if any(not 0 <= pad < variant.seq_len for pad in variant.pad_counts):
        raise InvalidVariant("every row keeps at least one real token (0 <= pad < seq_len)")
    if min(variant.pad_counts) != 0:
        raise InvalidVariant("a padded batch is as wide as its longest row: one row has no padding")
    if variant.padding == "none" and any(variant.pad_counts):
        raise InvalidVariant("padding 'none' with padded rows")
    if variant.grad_accumulation is not None and variant.grad_accumulation < 1:
        raise InvalidVariant("grad_accumulation must be at least 1")
    if variant.eval_grad_mode not in (None, *EVAL_GRAD_MODES):
        raise InvalidVariant(f"eval_grad_mode {variant.eval_grad_mode!r} is not one of {', '.join(EVAL_GRAD_MODES)}")
    if variant.hidden_size < MIN_HIDDEN_SIZE:
        raise InvalidVariant(f"hidden_size {variant.hidden_size} is below {MIN_HIDDEN_SIZE}: normalisation degenerates")
    if not 0.0 <= variant.dropout < 1.0:
        raise InvalidVariant("dropout must be in [0, 1)")
