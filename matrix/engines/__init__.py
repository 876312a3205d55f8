"""The engine axis: what one training library does to a cell, one file each (base.py says what an
engine supplies; the harness's pipeline, matrix/pipeline.py, does the rest). `torch` is a
hand-written loop; the others run the real library (accelerate, the transformers Trainer,
Lightning, DDP, FSDP2, accelerate's FSDP2, DeepSpeed ZeRO 0-3 and the Trainer on DeepSpeed).

A new engine is one file here (an Engine subclass and a register() call) plus its library in
pyproject.toml; a user's engine registers from their plugin.
"""

from __future__ import annotations

from matrix.engines.base import (
    ENGINES,
    Engine,
    EngineIncomplete,
    EngineSettings,
    LibraryLoop,
    Loop,
    LoopProgress,
    LoopRun,
    Steps,
    Unsupported,
    register,
)
from matrix.registry import load_modules

load_modules(__name__)

__all__ = [
    "ENGINES",
    "Engine",
    "EngineIncomplete",
    "EngineSettings",
    "LibraryLoop",
    "Loop",
    "LoopProgress",
    "LoopRun",
    "Steps",
    "Unsupported",
    "register",
]
