"""Shared behaviour of the transformers causal LMs (tiny-llama, gemma-cache)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from packaging.version import Version

from matrix.models import base

# transformers 4.56 renamed from_pretrained's torch_dtype to dtype; older stacks need the old name.
DTYPE_ARGUMENT = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"

# The config fields every tiny decoder shares (transformers' names for base.py's sizes).
TINY_DECODER_CONFIG = {
    "vocab_size": base.VOCAB_SIZE,
    "hidden_size": base.HIDDEN_SIZE,
    "intermediate_size": base.INTERMEDIATE_SIZE,
    "num_hidden_layers": base.NUM_LAYERS,
    "num_attention_heads": base.NUM_HEADS,
    "num_key_value_heads": base.NUM_KV_HEADS,
    "max_position_embeddings": base.MAX_POSITIONS,
    "pad_token_id": base.PAD_TOKEN_ID,
    "bos_token_id": base.BOS_TOKEN_ID,
    "eos_token_id": base.EOS_TOKEN_ID,
}


class CausalLMKind(base.ModelKind):
    model_class: type
    use_cache_in_eval = False
    generate_tokens = 0  # > 0: evaluation also runs generate() with the KV cache

    def config(self):
        raise NotImplementedError

    def create(self):
        return self.model_class(self.config())

    def batch(self, device):
        # Left padding: what decoder-only generation needs, and what eval loaders feed.
        ids, mask = base.seeded_tokens(base.SEQUENCE_LENGTHS, pad_left=True)
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}

    def loss(self, model, batch):
        return model(**batch, use_cache=False).loss

    def evaluate(self, model, batch):
        out = model(**batch, use_cache=self.use_cache_in_eval)
        result = base.EvalOutput(loss=out.loss, logits=out.logits)
        if self.use_cache_in_eval:
            result.extras["cache_type"] = type(out.past_key_values).__name__
        if self.generate_tokens:
            result.generated = model.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                max_new_tokens=self.generate_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=base.PAD_TOKEN_ID,
            )
        return result

    def save(self, model, directory: Path) -> None:
        model.save_pretrained(directory)  # safetensors is transformers' default

    def load_weights(self, directory: Path, dtype: torch.dtype, device: torch.device):
        return self.model_class.from_pretrained(directory, **{DTYPE_ARGUMENT: dtype}).to(device)
