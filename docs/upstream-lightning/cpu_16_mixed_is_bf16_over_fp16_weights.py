#!/usr/bin/env python3
"""On a CPU, Lightning's precision="16-mixed" runs bf16 autocast; over fp16 weights two ops fail.

Lightning (2.x) warns that 16-mixed is not supported on a CPU and autocasts in bfloat16 instead. A
model loaded in fp16 (from_pretrained(dtype=torch.float16)) then meets bf16 autocast, and:
- LayerNorm with fp16 weights fails in torch's CPU layer_norm;
- an op autocast promotes (torch.cat of an fp16 tensor with another) fails in its type promotion,
  which knows fp32, fp64 and the autocast dtype only (RoCBert's embeddings concatenate so).
The Lightning part is shown by its own precision plugin; the two failures by torch alone.

    pip install torch==2.13.0 lightning==2.6.6
    python cpu_16_mixed_is_bf16_over_fp16_weights.py

Exit 1 when either failure is present, 0 when both ops run.
"""

import sys
import warnings

import torch
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector


def lightning_dtype() -> torch.dtype:
    """The autocast dtype Lightning's own precision plugin picks for precision="16-mixed" here."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plugin = _AcceleratorConnector(accelerator="cpu", devices=1, precision="16-mixed").precision_plugin
    for warning in seen:
        print(f"Lightning warns: {warning.message}")
    print(f"Lightning's 16-mixed on a CPU: {type(plugin).__name__}, precision {plugin.precision!r}")
    return torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16


def main() -> int:
    dtype = lightning_dtype()
    failed = 0
    norm = torch.nn.LayerNorm(8).to(torch.float16)
    x = torch.randn(2, 8, dtype=torch.float16)
    for what, op in (
        # the input as the layers before it give it under autocast: bf16
        ("LayerNorm with fp16 weights on a bf16 input", lambda: norm(x.to(torch.bfloat16))),
        ("torch.cat of an fp16 and a bf16 tensor", lambda: torch.cat([x, x.to(torch.bfloat16)], -1)),
    ):
        with torch.autocast("cpu", dtype=dtype):
            try:
                out = op()
            except RuntimeError as error:
                print(f"{what} under {dtype} autocast: FAILED: RuntimeError: {error}")
                failed = 1
            else:
                print(f"{what} under {dtype} autocast: {out.dtype}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
