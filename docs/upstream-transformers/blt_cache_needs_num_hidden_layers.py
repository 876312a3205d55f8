"""BltForCausalLM cannot use a cache: forward(use_cache=True) and generate() fail.

BltModel.forward (transformers 5.24.0, models/blt/modeling_blt.py:1190) makes its cache with
DynamicCache(config=self.config), given the top-level BltConfig. DynamicCache asks
config.get_text_config(decoder=True) (cache_utils.py:2062), which looks for a sub-config named
decoder, generator or text_config (configuration_utils.py:1539); BLT's are named
decoder_config, global_config, ..., so it gets BltConfig back. get_layer_types_and_kwargs then
walks config.per_layer_config (cache_utils.py:1971), whose length is config.num_hidden_layers
(integrations/heterogeneity/configuration_utils.py:216), and BltConfig has none: only its
sub-configs do. The user sees, in any eval forward with use_cache=True (the default) and in
generate():
  AttributeError: 'BltConfig' object has no attribute 'num_hidden_layers'
Training (use_cache=False) works. It happens in fp32 and with any config: not a precision bug,
and not a matter of the tiny sizes. 5.8.0 fails the same way; 4.57.6 already fails in
generate() (its DynamicCache(config=...) reads config.num_hidden_layers), not yet in forward.

Torch and transformers only, CPU, a tiny config, no download. Exit status 1 with the bug, 0
without it.
"""

import sys

import torch
import transformers
from transformers import BltConfig, BltForCausalLM

sizes = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    intermediate_size=64,
    max_position_embeddings=64,
)
config = BltConfig(
    vocab_size=99,
    max_position_embeddings=64,
    patch_in_forward=True,
    patch_size=4,
    patching_mode="entropy",
    patching_threshold=1.335442066192627,
    patching_batch_size=1,
    local_attention_window_len=4,
    cross_attn_k=2,
    encoder_hash_byte_group_vocab=99,
    patcher_config=dict(vocab_size=99, sliding_window=4, head_dim=8, **sizes),
    encoder_config=dict(vocab_size=99, hidden_size_global=32, cross_attn_k=2, sliding_window=4, **sizes),
    decoder_config=dict(vocab_size=99, hidden_size_global=32, cross_attn_k=2, head_dim=8, **sizes),
    global_config=dict(head_dim=8, encoder_cross_output_size=64, **sizes),
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
torch.manual_seed(0)
model = BltForCausalLM(config).eval()
ids = torch.randint(3, 99, (2, 8))
print(f"transformers {transformers.__version__}, torch {torch.__version__}")
with torch.no_grad():
    model(input_ids=ids, use_cache=False)
    print("fp32 forward, use_cache=False: ok")
    calls = {
        "forward(use_cache=True)": lambda: model(input_ids=ids, use_cache=True),
        "generate()": lambda: model.generate(input_ids=ids, max_new_tokens=3, do_sample=False),
    }
    failed = False
    for name, call in calls.items():
        try:
            call()
            print(f"fp32 {name}: ok")
        except AttributeError as error:
            if "num_hidden_layers" not in str(error):
                raise
            print(f"fp32 {name}: AttributeError: {error}")
            failed = True
if failed:
    print("BUG: the cache is built from the top-level BltConfig, which has no layer count")
    sys.exit(1)
print("ok: BLT runs with its cache")
