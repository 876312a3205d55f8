"""A user's own decoder LM, written as the README's "A model kind" says and nothing more: a
small GPT-2 built from a config in code (dropout 0.1 in its embeddings, attention and residual
paths), fed a right-padded batch whose pad positions are labelled -100. Only the six methods:
no traits, no learning rate, no loss_items. Loaded with `-p user_gpt2`.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from matrix.models import ModelKind, register

PAD = 0
LENGTHS = [12, 9, 12, 5]  # real tokens per row; the rest is padding


def config():
    return GPT2Config(
        vocab_size=128,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )


class UserGPT2(ModelKind):
    name = "user-gpt2"
    description = "a user's GPT-2 decoder from a config in code, dropout 0.1, right padding"

    def create(self):
        return GPT2LMHeadModel(config())

    def batch(self, device):
        generator = torch.Generator().manual_seed(7)
        width = max(LENGTHS)
        input_ids = torch.full((len(LENGTHS), width), PAD)
        attention_mask = torch.zeros((len(LENGTHS), width), dtype=torch.long)
        for row, length in enumerate(LENGTHS):
            input_ids[row, :length] = torch.randint(3, 128, (length,), generator=generator)
            attention_mask[row, :length] = 1
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        return {key: value.to(device) for key, value in batch.items()}

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


register(UserGPT2())
