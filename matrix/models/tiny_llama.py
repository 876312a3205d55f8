"""tiny-llama: transformers LlamaForCausalLM from a tiny config (GQA, RoPE, RMSNorm)."""

from transformers import LlamaConfig, LlamaForCausalLM

from matrix.models.causal_lm import TINY_DECODER_CONFIG, CausalLMKind


class TinyLlama(CausalLMKind):
    name = "tiny-llama"
    description = "transformers LlamaForCausalLM, tiny config"
    model_class = LlamaForCausalLM

    def config(self):
        return LlamaConfig(**TINY_DECODER_CONFIG)
