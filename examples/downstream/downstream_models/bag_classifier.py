"""bag-classifier: a bag-of-tokens classifier, the downstream example's own model kind.

Only the real tokens go through the network: they are gathered out of the padded batch, run
through a per-token MLP, and summed back per sequence with index_add, the way ragged
("packed") batches are pooled. Then a linear head classifies the mean.

It keeps one bug on purpose, the example's known failure (known_failures.toml): the per-row
sums are allocated in the weights' dtype instead of the activations' dtype. Without autocast
the two are the same; under autocast the MLP's output is half precision while the weights
are fp32, and index_add refuses to add half values into fp32 sums.
"""

from __future__ import annotations

from pathlib import Path

import torch
from matrix.variants import Variant
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from matrix.models import ModelKind, base, register

NUM_CLASSES = 4
WEIGHTS_FILE = "model.safetensors"  # the name the transformers Trainer's save_model() writes too


class TokenBagClassifier(nn.Module):
    def __init__(self, variant: Variant) -> None:
        super().__init__()
        self.embed = nn.Embedding(base.VOCAB_SIZE, variant.hidden_size)
        self.token_mlp = nn.Sequential(
            nn.Linear(variant.hidden_size, variant.intermediate_size),
            nn.GELU(),
            nn.Linear(variant.intermediate_size, variant.hidden_size),
        )
        self.head = nn.Linear(variant.hidden_size, NUM_CLASSES)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels=None):
        """Logits; with labels, a {"loss", "logits"} dict as the transformers Trainer expects."""
        real = attention_mask.bool()
        row_of_token = real.nonzero()[:, 0]
        tokens = self.token_mlp(self.embed(input_ids[real]))
        # THE KNOWN BUG: dtype=self.head.weight.dtype should be dtype=tokens.dtype (see the docstring)
        sums = torch.zeros(len(input_ids), tokens.shape[-1], dtype=self.head.weight.dtype, device=tokens.device)
        sums = sums.index_add(0, row_of_token, tokens)
        logits = self.head(sums / real.sum(dim=1, keepdim=True).to(sums.dtype))
        if labels is None:
            return logits
        return {"loss": F.cross_entropy(logits.float(), labels), "logits": logits}


class BagClassifier(ModelKind):
    name = "bag-classifier"
    description = "downstream example: bag-of-tokens MLP classifier pooled with index_add"
    grid_variant = Variant(padding="right")
    variant_fields = (*ModelKind.variant_fields, "hidden_size", "intermediate_size")

    def create(self) -> nn.Module:
        return TokenBagClassifier(self.variant)

    def batch(self, device):
        ids, mask = base.variant_tokens(self.variant)
        labels = torch.arange(self.variant.batch_size) % NUM_CLASSES
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}

    def loss(self, model, batch):
        return self.evaluate(model, batch).loss

    def evaluate(self, model, batch):
        logits = model(batch["input_ids"], batch["attention_mask"])
        # the loss in fp32 whatever the logits' dtype, as the built-in kinds compute it
        return base.EvalOutput(loss=F.cross_entropy(logits.float(), batch["labels"]), logits=logits)

    def save(self, model, directory: Path) -> None:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, directory / WEIGHTS_FILE)

    def load_weights(self, directory: Path, dtype, device):
        model = self.create().to(device=device, dtype=dtype)
        model.load_state_dict(load_file(directory / WEIGHTS_FILE, device=str(device)))
        return model


register(BagClassifier())
