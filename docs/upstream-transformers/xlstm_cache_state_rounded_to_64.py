"""xLSTMForCausalLM with a hidden size whose q/k or v width is not a multiple of 64 cannot use
its cache: forward(use_cache=True) and generate() fail.

The layers size their projections exactly: xLSTMLayer makes qk_dim = int(hidden_size *
qk_dim_factor) and v_dim = int(hidden_size * v_dim_factor) (transformers 5.24.0,
models/xlstm/modeling_xlstm.py:1042-1043). xLSTMCache sizes the recurrent state from the
config's qk_head_dim and v_head_dim (modeling_xlstm.py:1358), and those come from
xLSTMConfig.qk_dim / v_dim, which round the same products up to the next multiple of 64
(models/xlstm/configuration_xlstm.py:161-172). When the product is not a multiple of 64, the
cache's matrix memory has another shape than the layer's heads, and the first recurrent step
checks it (modeling_xlstm.py:412). The user sees, in any eval forward with use_cache=True
(the model's default) and in generate():
  ValueError: matC_old has wrong shape, got torch.Size([2, 4, 16, 16])
Training (use_cache=False) works. It happens in fp32 as well: not a precision bug. Released
checkpoints (hidden_size 4096) have multiples of 64 and are not affected; small or custom
configs are. transformers 4.57.6 and 5.8.0 fail the same way.

Torch and transformers only, CPU, a tiny config, no download. Exit status 1 with the bug, 0
without it.
"""

import sys

import torch
import transformers
from transformers import xLSTMConfig, xLSTMForCausalLM

config = xLSTMConfig(
    vocab_size=99,
    hidden_size=32,  # q/k width 16, v width 32; the cache assumes 64 and 64
    embedding_dim=32,
    num_hidden_layers=2,
    num_blocks=2,
    num_heads=4,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
torch.manual_seed(0)
model = xLSTMForCausalLM(config).eval()
ids = torch.randint(3, 99, (2, 8))
print(f"transformers {transformers.__version__}, torch {torch.__version__}")
print(
    f"layer head dims: q/k {config.hidden_size * config.qk_dim_factor / config.num_heads:g}, "
    f"v {config.hidden_size * config.v_dim_factor / config.num_heads:g}; "
    f"cache head dims: q/k {config.qk_head_dim}, v {config.v_head_dim}"
)
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
        except ValueError as error:
            if "wrong shape" not in str(error):
                raise
            print(f"fp32 {name}: ValueError: {error}")
            failed = True
if failed:
    print("BUG: the cache's state is sized from dims rounded up to 64, the layers' are not")
    sys.exit(1)
print("ok: the cache fits the layers")
