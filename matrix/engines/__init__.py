"""The engine axis: what drives a cell's phases. `torch` is a hand-written loop; the others
run the real library (accelerate, the transformers Trainer, Lightning)."""

from __future__ import annotations

from matrix.engines.accelerate_loop import AccelerateEngine
from matrix.engines.base import Engine
from matrix.engines.hf_trainer import HFTrainerEngine
from matrix.engines.lightning_loop import LightningEngine
from matrix.engines.torch_loop import TorchEngine

ENGINES: dict[str, Engine] = {
    engine.name: engine for engine in (TorchEngine(), AccelerateEngine(), HFTrainerEngine(), LightningEngine())
}

__all__ = ["ENGINES", "Engine"]
