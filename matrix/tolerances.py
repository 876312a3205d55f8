"""Numeric tolerances, as data.

Evaluation loss of a cell vs an fp32 reference computed from the same weights on the same
batch. Rows are keyed by the precision's compute dtype (the lowest dtype its matmuls run
in); a model kind may override a row. A value passes when |x - ref| <= atol + rtol * |ref|.
The deviation is recorded even when it passes; `python -m matrix diff` calls its growth
between two runs drift when it exceeds a fraction of the allowance (matrix/compare.py).

Unit roundoff: fp16 2**-11 ~ 4.9e-4, bf16 2**-8 ~ 3.9e-3. The rows leave room for the
accumulation over two tiny layers, not for a wrong answer: a cross entropy near ln(vocab)
~ 4.6 that is off by more than a few percent is a bug, not rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def allows(self, value: float, reference: float) -> bool:
        return abs(value - reference) <= self.atol + self.rtol * abs(reference)

    def as_dict(self) -> dict[str, float]:
        return {"atol": self.atol, "rtol": self.rtol}


EVAL_LOSS_VS_FP32: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
    torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
}

# (model kind, compute dtype) -> Tolerance, for a kind that needs its own row.
MODEL_OVERRIDES: dict[tuple[str, torch.dtype], Tolerance] = {}

# A checkpoint reloaded into a fresh model must reproduce the outputs bit for bit: the same
# weights in the same dtype run the same kernels on the same batch.
CHECKPOINT_ROUND_TRIP = Tolerance(atol=0.0, rtol=0.0)


def eval_loss_tolerance(model: str, compute_dtype: torch.dtype) -> Tolerance:
    return MODEL_OVERRIDES.get((model, compute_dtype), EVAL_LOSS_VS_FP32[compute_dtype])
