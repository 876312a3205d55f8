"""The model axis: a registry of model kinds.

Downstream projects add their own kind with register(); it then runs through every
precision, mode and device like the built-in ones.
"""

from __future__ import annotations

from matrix.models.base import ModelKind
from matrix.models.gemma_cache import GemmaCache
from matrix.models.liger_llama import LigerLlama
from matrix.models.lora import Lora
from matrix.models.minilm_bert import MiniLMBert
from matrix.models.tiny_llama import TinyLlama
from matrix.models.tiny_transformer import TinyTransformer

MODELS: dict[str, ModelKind] = {}


def register(kind: ModelKind) -> ModelKind:
    if kind.name in MODELS and MODELS[kind.name] is not kind:
        raise ValueError(f"model kind {kind.name!r} is already registered")
    MODELS[kind.name] = kind
    return kind


for _kind in (TinyTransformer(), TinyLlama(), Lora(), GemmaCache(), LigerLlama(), MiniLMBert()):
    register(_kind)

__all__ = ["MODELS", "ModelKind", "register"]
