"""The model axis: a registry of model kinds (matrix/models/base.py ModelKind), one file each.

A new built-in kind is one file here that defines a ModelKind and calls register(); a
downstream project's kind registers from its plugin or conftest the same way, and then runs
through every precision, mode, device and engine like the built-in ones.
"""

from __future__ import annotations

from matrix.models.base import MODELS, ModelKind, register
from matrix.registry import load_modules

load_modules(__name__, skip=("base", "causal_lm", "hf", "hf_shrink"))

__all__ = ["MODELS", "ModelKind", "register"]
