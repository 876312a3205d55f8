"""tiny-llama: transformers LlamaForCausalLM from a tiny config (GQA, RoPE, RMSNorm)."""

from transformers import LlamaConfig, LlamaForCausalLM

from matrix.models import base
from matrix.models.causal_lm import TOKEN_IDS, CausalLMKind


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=base.VOCAB_SIZE,
        hidden_size=base.HIDDEN_SIZE,
        intermediate_size=base.INTERMEDIATE_SIZE,
        num_hidden_layers=base.NUM_LAYERS,
        num_attention_heads=base.NUM_HEADS,
        num_key_value_heads=base.NUM_KV_HEADS,
        max_position_embeddings=base.MAX_POSITIONS,
        **TOKEN_IDS,
    )


class TinyLlama(CausalLMKind):
    name = "tiny-llama"
    description = "transformers LlamaForCausalLM, tiny config"
    model_class = LlamaForCausalLM

    def config(self):
        return llama_config()
