"""The engine axis: what drives a cell's phases, one file each. `torch` is a hand-written loop;
the others run the real library (accelerate, the transformers Trainer, Lightning).

A new engine is one file here (an Engine subclass and a register() call) plus its library in
pyproject.toml; a user's engine registers from their plugin.
"""

from __future__ import annotations

from matrix.engines.base import ENGINES, Engine, Unsupported, register
from matrix.registry import load_modules

load_modules(__name__)

__all__ = ["ENGINES", "Engine", "Unsupported", "register"]
