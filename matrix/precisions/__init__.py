"""The precision axis: what a precision asks of a cell, and the two kinds of weights it may need.

  policies.py      - the precision table: one row per precision (autocast, weights, gradients,
                     scaler, reduction); engines derive their settings from it
  float8.py        - float8 training (torchao): a float8 precision's recipe, the conversion users
                     run, the layers it converts and leaves out, SQNR
  quantization.py  - bitsandbytes quantized bases: schemes, storage checks, the install requirement

A new precision is one row in policies.py (or a user's register() call).
"""

from matrix.results.module_moves import forwarded


def __getattr__(name: str):  # the flat module matrix.precisions's names, for one release (docs/extending.md)
    return forwarded("matrix.precisions", name, __path__)
