"""One table: what each precision is called in each engine's own settings.

The weights dtype is set by the cell itself in every engine (matrix/precisions.py,
weights_from), so the table holds only what the engine is told on top. An engine that cannot
express a precision gets Unsupported(reason): the cell is skipped with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Unsupported:
    reason: str


ENGINE_SETTINGS: dict[str, dict[str, dict | Unsupported]] = {
    "fp32": {
        "torch": {},
        "accelerate": {"mixed_precision": "no"},
        "hf-trainer": {"fp16": False, "bf16": False},
        "lightning": {"precision": "32-true"},
    },
    "fp16-mixed": {
        "torch": {"autocast": "float16", "grad_scaler": True},
        "accelerate": {"mixed_precision": "fp16"},
        "hf-trainer": {"fp16": True, "bf16": False},
        "lightning": {"precision": "16-mixed"},
    },
    "bf16-mixed": {
        "torch": {"autocast": "bfloat16"},
        "accelerate": {"mixed_precision": "bf16"},
        "hf-trainer": {"fp16": False, "bf16": True},
        "lightning": {"precision": "bf16-mixed"},
    },
    "bf16-true": {
        "torch": {},
        "accelerate": {"mixed_precision": "no"},
        "hf-trainer": {"fp16": False, "bf16": False},
        "lightning": {"precision": "bf16-true"},
    },
    "fp16-true": {
        "torch": {},
        "accelerate": {"mixed_precision": "no"},
        "hf-trainer": {"fp16": False, "bf16": False},
        "lightning": {"precision": "16-true"},
    },
    "bf16-loaded-mixed": {
        "torch": {"autocast": "bfloat16"},
        "accelerate": {"mixed_precision": "bf16"},
        "hf-trainer": {"fp16": False, "bf16": True},
        "lightning": {"precision": "bf16-mixed"},
    },
    "fp16-loaded-mixed": {
        "torch": {"autocast": "float16", "grad_scaler": True},
        "accelerate": {"mixed_precision": "fp16"},
        "hf-trainer": {"fp16": True, "bf16": False},
        "lightning": {"precision": "16-mixed"},
    },
    "bf16-loaded-mixed-fp32-grads": {
        "torch": {"autocast": "bfloat16", "grad_dtype": "float32", "grad_accumulation": 2},
        "accelerate": Unsupported("Requires: [an accelerate setting for gradients in another dtype than the weights]"),
        "hf-trainer": Unsupported(
            "Requires: [a TrainingArguments setting for gradients in another dtype than the weights]"
        ),
        "lightning": Unsupported("Requires: [a Lightning precision for gradients in another dtype than the weights]"),
    },
}
