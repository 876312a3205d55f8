"""Two users' kinds that share a process-global setting, as users' models do. Loaded with
`-p user_global_settings`.

user-onednn-bf16: its construction asks oneDNN to run fp32 matmuls in bf16 through the per-backend
API (torch.backends.mkldnn.matmul.fp32_precision = "bf16"), as a user chasing CPU speed writes
it, and never puts it back.

user-precision-aware: its construction picks its attention implementation by
torch.get_float32_matmul_precision(), the legacy getter, as a user's model written before the
per-backend API does. That getter raises once the two APIs disagree: in a process where
user-onednn-bf16 was built before, unless the harness put the setting back.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from matrix.models import ModelKind, register

LENGTH = 8


def config(**extra):
    return GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, **extra)


class TinyGPT2(ModelKind):
    """The five methods every such kind shares; create() is each one's own."""

    def batch(self, device):
        generator = torch.Generator().manual_seed(11)
        input_ids = torch.randint(3, 64, (3, LENGTH), generator=generator)
        return {"input_ids": input_ids.to(device), "labels": input_ids.to(device)}

    def loss(self, model, batch):
        return model(**batch).loss

    def evaluate(self, model, batch):
        from matrix.models.base import EvalOutput

        out = model(**batch)
        return EvalOutput(loss=out.loss, logits=out.logits)

    def save(self, model, directory):
        model.save_pretrained(directory)

    def load_weights(self, directory, dtype, device):
        return GPT2LMHeadModel.from_pretrained(directory, dtype=dtype).to(device)


class OneDnnBf16(TinyGPT2):
    name = "user-onednn-bf16"
    description = "a user's tiny GPT-2 whose construction sets oneDNN's fp32 matmuls to bf16 and leaves it so"

    def create(self):
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        return GPT2LMHeadModel(config())


class PrecisionAware(TinyGPT2):
    name = "user-precision-aware"
    description = "a user's tiny GPT-2 that picks its attention by torch.get_float32_matmul_precision()"

    def create(self):
        attention = "sdpa" if torch.get_float32_matmul_precision() == "highest" else "eager"
        return GPT2LMHeadModel(config(attn_implementation=attention))


register(OneDnnBf16())
register(PrecisionAware())
