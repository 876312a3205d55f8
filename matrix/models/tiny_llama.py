"""tiny-llama: transformers LlamaForCausalLM from a tiny config (GQA, RoPE, RMSNorm)."""

from matrix.grid.variants import InvalidVariant
from matrix.models.base import register
from matrix.models.causal_lm import CausalLMKind


class TinyLlama(CausalLMKind):
    name = "tiny-llama"
    axis_position = 1
    description = "transformers LlamaForCausalLM, tiny config"
    model_class_name = "LlamaForCausalLM"
    config_class_name = "LlamaConfig"

    def check_variant(self, variant) -> None:
        super().check_variant(variant)
        if variant.hidden_size % variant.num_heads or (variant.hidden_size // variant.num_heads) % 2:
            raise InvalidVariant(
                f"hidden_size {variant.hidden_size} / num_heads {variant.num_heads} is not an even head size (RoPE)"
            )


register(TinyLlama())
