#!/usr/bin/env python3
"""accelerate's FSDP auto-wrap refuses a model whose _no_split_modules names a class it does not hold.

A decoder-only class of an encoder-decoder family (MBartForCausalLM, PLBartForCausalLM) inherits the
family's `_no_split_modules`, which names the encoder's layer class; the causal LM holds no encoder.
FullyShardedDataParallelPlugin.set_auto_wrap_policy (TRANSFORMER_BASED_WRAP, the wrap accelerate's
FSDP2 guides use, with no class list given) takes the list as it is and raises for the first class
it cannot find, before anything is sharded. No process group, no GPU and no weights download needed.

    pip install torch==2.13.0 transformers==5.24.0 accelerate==1.15.0
    python auto_wrap_absent_no_split_class.py

Exit 1 and the error when the refusal is present, 0 when every model gets a wrap policy.
"""

import sys

from accelerate.utils import FullyShardedDataParallelPlugin
from transformers import MBartConfig, MBartForCausalLM, PLBartConfig, PLBartForCausalLM

TINY = {
    "vocab_size": 99,
    "d_model": 16,
    "decoder_layers": 1,
    "encoder_layers": 1,
    "decoder_attention_heads": 2,
    "encoder_attention_heads": 2,
    "decoder_ffn_dim": 32,
    "encoder_ffn_dim": 32,
    "max_position_embeddings": 32,
}


def main() -> int:
    failed = 0
    for config_class, model_class in ((MBartConfig, MBartForCausalLM), (PLBartConfig, PLBartForCausalLM)):
        model = model_class(config_class(**TINY))
        held = {type(module).__name__ for module in model.modules()}
        absent = sorted(set(model._no_split_modules) - held)
        print(f"{model_class.__name__}: _no_split_modules {model._no_split_modules}, not in the model: {absent}")
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
        try:
            plugin.set_auto_wrap_policy(model)
        except ValueError as error:
            print(f"  REFUSED: ValueError: {error}")
            failed = 1
        else:
            print("  a wrap policy was set")
    return failed


if __name__ == "__main__":
    sys.exit(main())
