"""tiny-transformer: a torch nn.TransformerEncoder classifier fed a padded batch with a key
padding mask, as real encoders are fed. In eval mode torch may take the encoder's fused
fast path (nested tensors from the padding mask)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from matrix.models import base

NUM_CLASSES = 4
# No dropout: a training forward must give the same loss in every engine, whose random
# number streams differ (HF configs default to no attention dropout too).
DROPOUT = 0.0
WEIGHTS_FILE = "model.safetensors"


class EncoderClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(base.VOCAB_SIZE, base.HIDDEN_SIZE, padding_idx=base.PAD_TOKEN_ID)
        layer = nn.TransformerEncoderLayer(
            d_model=base.HIDDEN_SIZE,
            nhead=base.NUM_HEADS,
            dim_feedforward=base.INTERMEDIATE_SIZE,
            dropout=DROPOUT,
            batch_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=base.NUM_LAYERS)
        self.head = nn.Linear(base.HIDDEN_SIZE, NUM_CLASSES)

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor, labels: torch.Tensor | None = None):
        """Logits; with labels, a {"loss", "logits"} dict as the transformers Trainer expects."""
        hidden = self.encoder(self.embed(input_ids), src_key_padding_mask=padding_mask)
        keep = (~padding_mask).unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * keep).sum(dim=1) / keep.sum(dim=1)
        logits = self.head(pooled)
        if labels is None:
            return logits
        return {"loss": F.cross_entropy(logits.float(), labels), "logits": logits}


class TinyTransformer(base.ModelKind):
    name = "tiny-transformer"
    description = "torch nn.TransformerEncoder classifier, key padding mask"

    def create(self) -> nn.Module:
        return EncoderClassifier()

    def batch(self, device):
        ids, mask = base.seeded_tokens(base.SEQUENCE_LENGTHS, pad_left=False)
        labels = torch.arange(len(base.SEQUENCE_LENGTHS)) % NUM_CLASSES
        return {
            "input_ids": ids.to(device),
            "padding_mask": (mask == 0).to(device),  # True marks padding, as torch expects
            "labels": labels.to(device),
        }

    def _logits(self, model, batch):
        return model(batch["input_ids"], batch["padding_mask"])

    def loss(self, model, batch):
        return F.cross_entropy(self._logits(model, batch).float(), batch["labels"])

    def evaluate(self, model, batch):
        logits = self._logits(model, batch)
        return base.EvalOutput(loss=F.cross_entropy(logits.float(), batch["labels"]), logits=logits)

    def save(self, model, directory: Path) -> None:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, directory / WEIGHTS_FILE)

    def load_weights(self, directory: Path, dtype, device):
        model = self.create().to(device=device, dtype=dtype)
        model.load_state_dict(load_file(directory / WEIGHTS_FILE, device=str(device)))
        return model
