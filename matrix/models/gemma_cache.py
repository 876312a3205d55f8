"""gemma-cache: transformers Gemma3 text model with alternating sliding-window and global
layers, KV cache on in evaluation, and generate() as part of evaluating (seed 001's setting)."""

from matrix.grid.variants import InvalidVariant, Variant
from matrix.models.base import register
from matrix.models.causal_lm import DECODER_FIELDS, CausalLMKind


class GemmaCache(CausalLMKind):
    name = "gemma-cache"
    axis_position = 3
    description = "transformers Gemma3ForCausalLM, sliding + global layers, KV cache, generate()"
    model_class_name = "Gemma3ForCausalLM"
    config_class_name = "Gemma3TextConfig"
    # The sliding window (4) is shorter than the longest row (8), so the sliding mask really cuts.
    grid_variant = Variant(padding="left", use_cache_in_eval=True, sliding_window=4)
    variant_fields = (*DECODER_FIELDS, "head_dim", "sliding_window")
    generate_tokens = 4

    def check_variant(self, variant: Variant) -> None:
        super().check_variant(variant)
        if variant.head_dim % 2:
            raise InvalidVariant(f"head_dim {variant.head_dim} is odd (RoPE needs an even head size)")
        if variant.sliding_window < 2:
            # a window of one: each query sees only its own key, softmax of one score is 1, and
            # q_proj/k_proj/q_norm/k_norm of the sliding layers get exactly zero gradient
            raise InvalidVariant("sliding_window must be at least 2")

    def config_kwargs(self) -> dict:
        variant = self.variant
        return {
            **super().config_kwargs(),
            "head_dim": variant.head_dim,
            "sliding_window": variant.sliding_window,
            # sliding, global, sliding, ...; sliding_window_pattern gives the same layout to
            # transformers < 4.53, which has no layer_types
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(variant.num_layers)],
            "sliding_window_pattern": 2,
            "use_cache": True,
        }


register(GemmaCache())
