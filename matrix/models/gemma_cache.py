"""gemma-cache: transformers Gemma3 text model with one sliding-window and one global layer,
KV cache on in evaluation, and generate() as part of evaluating (seed 001's setting)."""

from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from matrix.models import base
from matrix.models.causal_lm import TINY_DECODER_CONFIG, CausalLMKind

# Shorter than the longest sequence, so the sliding-window mask really cuts.
SLIDING_WINDOW = 4


class GemmaCache(CausalLMKind):
    name = "gemma-cache"
    description = "transformers Gemma3ForCausalLM, sliding + global layers, KV cache, generate()"
    model_class = Gemma3ForCausalLM
    use_cache_in_eval = True
    generate_tokens = 4

    def config(self):
        return Gemma3TextConfig(
            **TINY_DECODER_CONFIG,
            head_dim=base.HEAD_DIM,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window_pattern=2,  # the same layout for transformers < 4.53, which has no layer_types
            use_cache=True,
        )
