"""tiny-transformer: a torch nn.TransformerEncoder classifier fed a padded batch with a key
padding mask, as real encoders are fed. In eval mode torch may take the encoder's fused
fast path (nested tensors from the padding mask). A variant with padding 'none' passes no
mask at all."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from matrix.grid.variants import InvalidVariant, Variant
from matrix.models import base
from matrix.models.base import register

NUM_CLASSES = 4
WEIGHTS_FILE = "model.safetensors"


class EncoderClassifier(nn.Module):
    def __init__(self, variant: Variant) -> None:
        super().__init__()
        self.embed = nn.Embedding(base.VOCAB_SIZE, variant.hidden_size, padding_idx=base.PAD_TOKEN_ID)
        layer = nn.TransformerEncoderLayer(
            d_model=variant.hidden_size,
            nhead=variant.num_heads,
            dim_feedforward=variant.intermediate_size,
            dropout=variant.dropout,
            batch_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=variant.num_layers)
        self.head = nn.Linear(variant.hidden_size, NUM_CLASSES)

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor | None = None, labels=None):
        """Logits; with labels, a {"loss", "logits"} dict as the transformers Trainer expects."""
        hidden = self.encoder(self.embed(input_ids), src_key_padding_mask=padding_mask)
        if padding_mask is None:
            pooled = hidden.mean(dim=1)
        else:
            keep = (~padding_mask).unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * keep).sum(dim=1) / keep.sum(dim=1)
        logits = self.head(pooled)
        if labels is None:
            return logits
        return {"loss": F.cross_entropy(logits.float(), labels), "logits": logits}


class TinyTransformer(base.ModelKind):
    name = "tiny-transformer"
    axis_position = 0
    description = "torch nn.TransformerEncoder classifier, key padding mask"
    # No dropout (Variant's default): a training forward must give the same loss in every
    # engine, whose random number streams differ.
    grid_variant = Variant(padding="right")
    variant_fields = (
        *base.ModelKind.variant_fields,
        "hidden_size",
        "num_heads",
        "num_layers",
        "intermediate_size",
        "dropout",
        "grad_accumulation",
        "eval_grad_mode",
    )

    def standalone_code(self) -> str:
        from matrix.models.standalone import encoder_code

        if type(self).create is not TinyTransformer.create:  # a subclass with a model of its own
            return super().standalone_code()
        return encoder_code(self.variant, base.VOCAB_SIZE, base.PAD_TOKEN_ID, NUM_CLASSES)

    def check_variant(self, variant: Variant) -> None:
        super().check_variant(variant)
        if variant.hidden_size % variant.num_heads:
            raise InvalidVariant(f"hidden_size {variant.hidden_size} is not a multiple of num_heads")

    def create(self) -> nn.Module:
        return EncoderClassifier(self.variant)

    def batch(self, device):
        ids, mask = base.variant_tokens(self.variant)
        batch = {"input_ids": ids.to(device)}
        if self.variant.padding != "none":
            batch["padding_mask"] = (mask == 0).to(device)  # True marks padding, as torch expects
        batch["labels"] = (torch.arange(self.variant.batch_size) % NUM_CLASSES).to(device)
        return batch

    def _logits(self, model, batch):
        return model(batch["input_ids"], batch.get("padding_mask"))

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


register(TinyTransformer())
