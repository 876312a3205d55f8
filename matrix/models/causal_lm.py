"""Shared behaviour of the transformers causal LMs (CausalLMKind): tiny-llama and liger-llama,
gemma-cache, lora and qlora, and the hf: architectures."""

from __future__ import annotations

from pathlib import Path

import torch

from matrix.grid.variants import InvalidVariant, Variant
from matrix.models import base
from matrix.models.hf import dtype_argument, transformers_class
from matrix.models.observation import IGNORE_INDEX  # the label transformers' causal LM loss skips

DECODER_FIELDS = (
    *base.ModelKind.variant_fields,
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "num_layers",
    "intermediate_size",
    "dropout",
    "use_cache_in_eval",
    "grad_accumulation",
    "eval_grad_mode",
)


def decoder_config(variant: Variant) -> dict:
    """The config fields every tiny decoder shares, in transformers' names."""
    return {
        "vocab_size": base.VOCAB_SIZE,
        "hidden_size": variant.hidden_size,
        "intermediate_size": variant.intermediate_size,
        "num_hidden_layers": variant.num_layers,
        "num_attention_heads": variant.num_heads,
        "num_key_value_heads": variant.num_kv_heads,
        "attention_dropout": variant.dropout,
        "max_position_embeddings": base.MAX_POSITIONS,
        "pad_token_id": base.PAD_TOKEN_ID,
        "bos_token_id": base.BOS_TOKEN_ID,
        "eos_token_id": base.EOS_TOKEN_ID,
    }


def next_token_targets(mask: torch.Tensor) -> torch.Tensor:
    """Which labels a causal LM batch asks to be predicted: real tokens whose predecessor is
    a real token too.

    The model shifts labels by one: the output at position t is scored against label t+1.
    With left padding, the last pad of a row would predict the row's first real token. A pad
    query attends to nothing (every key before it is a pad), and the output of such a fully
    masked attention row is whatever the kernel makes of it: on CUDA, SDPA's half-precision
    kernels return another value than its fp32 one (pytorch/pytorch#110213), which moved
    the loss by 0.03 with nothing wrong in the precision path (docs/gpu-runs/h100-2026-11-22,
    pad_row_probe.py). So no label is predicted from a pad position; what the pad positions
    output is recorded instead (measurements.position_deviations).
    """
    real = mask.bool()
    previous_real = torch.ones_like(real)
    previous_real[:, 1:] = real[:, :-1]
    return real & previous_real


class CausalLMKind(base.ModelKind):
    # transformers' names for the model and its config, imported when a cell first needs them
    # (a subclass may set model_class and config_class to the classes themselves instead)
    model_class_name: str
    config_class_name: str
    # Left padding: what decoder-only generation needs, and what eval loaders feed.
    grid_variant = Variant(padding="left")
    variant_fields = DECODER_FIELDS
    generate_tokens = 0  # > 0: evaluation also runs generate()
    requires: tuple[str, ...] = ("transformers",)

    @property
    def model_class(self) -> type:
        return transformers_class(self.model_class_name)

    @property
    def config_class(self) -> type:
        return transformers_class(self.config_class_name)

    def standalone_code(self) -> str:
        from matrix.models.standalone import decoder_code

        return decoder_code(self, base.PAD_TOKEN_ID)

    def config_kwargs(self) -> dict:
        return decoder_config(self.variant)

    def config(self):
        return self.config_class(**self.config_kwargs())

    def check_variant(self, variant: Variant) -> None:
        super().check_variant(variant)
        if variant.seq_len + self.generate_tokens > base.MAX_POSITIONS:
            raise InvalidVariant(f"seq_len {variant.seq_len} + generated tokens exceed {base.MAX_POSITIONS} positions")
        if variant.num_heads % variant.num_kv_heads:
            raise InvalidVariant(f"num_heads {variant.num_heads} is not a multiple of num_kv_heads")
        if variant.seq_len < 2:
            raise InvalidVariant("a causal LM loss needs a row of at least two tokens")

    def create(self):
        return self.model_class(self.config())

    def batch(self, device):
        ids, mask = base.variant_tokens(self.variant)
        labels = ids.masked_fill(~next_token_targets(mask), IGNORE_INDEX)
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}

    def loss(self, model, batch):
        return model(**batch, use_cache=False).loss

    def evaluate(self, model, batch):
        use_cache = self.variant.use_cache_in_eval
        out = model(**batch, use_cache=use_cache)
        result = base.EvalOutput(loss=out.loss, logits=out.logits)
        if use_cache:
            # an architecture whose output has no past_key_values (RWKV's state, Reformer's
            # buckets) records None: the cache it keeps is its own business
            cache = getattr(out, "past_key_values", None)
            result.extras["cache_type"] = type(cache).__name__ if cache is not None else None
        if self.generate_tokens:
            result.generated = model.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                max_new_tokens=self.generate_tokens,
                do_sample=False,
                use_cache=use_cache,
                pad_token_id=base.PAD_TOKEN_ID,
            )
        return result

    def save(self, model, directory: Path) -> None:
        model.save_pretrained(directory)  # safetensors is transformers' default

    def load_weights(self, directory: Path, dtype: torch.dtype, device: torch.device):
        directory = base.local_directory(directory)  # never a Hub repository id
        loaded = self.model_class.from_pretrained(directory, local_files_only=True, **{dtype_argument(): dtype})
        return loaded.to(device)

    def load_quantized(self, directory: Path, precision, device: torch.device):
        # as QLoRA scripts load: quantization_config, the dtype of the unquantized weights, and a
        # device map (a bitsandbytes model is quantized where it is placed, not moved after)
        quantization = {"quantization_config": precision.quantization.config()} if precision.quantization else {}
        return self.model_class.from_pretrained(
            base.local_directory(directory),
            **quantization,
            **{dtype_argument(): precision.weights_dtype},
            device_map={"": str(device)},
            local_files_only=True,
        )
