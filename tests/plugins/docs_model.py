"""my_model.py: a model kind of one's own (docs/extending.md shows this file whole;
tests/test_docs_journeys.py checks that the two agree and runs it)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from matrix.models import EvalOutput, ModelKind, register


class MyModel(ModelKind):
    name = "my-model"
    description = "a two-layer classifier"

    def create(self):  # a fresh fp32 model on the CPU, called under a fixed seed
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def batch(self, device):  # the one batch every step and every evaluation runs on
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn(8, 16, generator=generator)
        labels = torch.randint(0, 4, (8,), generator=generator)
        return {"inputs": inputs.to(device), "labels": labels.to(device)}

    def logits(self, model, batch):
        weights_dtype = next(model.parameters()).dtype  # bf16-true and fp16-true cast the weights
        return model(batch["inputs"].to(weights_dtype))

    def loss(self, model, batch):  # the training loss, a scalar tensor
        return nn.functional.cross_entropy(self.logits(model, batch).float(), batch["labels"])

    def evaluate(self, model, batch):  # the caller sets eval mode, no_grad and autocast
        logits = self.logits(model, batch)
        return EvalOutput(loss=nn.functional.cross_entropy(logits.float(), batch["labels"]), logits=logits)

    def save(self, model, directory: Path):  # `directory` exists; `model` is never a compiled wrapper
        torch.save(model.state_dict(), directory / "model.pt")

    def load_weights(self, directory: Path, dtype, device):
        model = self.create()
        model.load_state_dict(torch.load(directory / "model.pt", map_location="cpu", weights_only=True))
        return model.to(dtype=dtype, device=device)


register(MyModel())
