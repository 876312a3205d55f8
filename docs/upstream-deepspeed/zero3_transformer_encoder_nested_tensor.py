"""DeepSpeed ZeRO-3 and nn.TransformerEncoder: evaluation with a key padding mask raises
"MultiheadAttention does not support NestedTensor outside of its fast path ... non-self attention
was used". One process, CPU, gloo; no model weights, no data. Run: python this_file.py

The encoder builds a NestedTensor from the padded batch when its fast path's conditions hold; the
attention then takes its own fast path only when query, key and value are the same tensor object.
ZeRO-3's pre-forward hooks give every submodule new tensor objects for its inputs, so the attention
sees three different tensors. Found by the mixed-precision matrix's deepspeed-zero3 engine.
"""

import os

import torch
import torch.distributed as dist

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
dist.init_process_group("gloo", rank=0, world_size=1)

import deepspeed  # noqa: E402  (after the process group, as a launcher sets it up)

torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
x = torch.randn(2, 5, 16)
mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])  # the second row is padded
model.eval()
with torch.no_grad():
    print("without DeepSpeed:", tuple(model(x, src_key_padding_mask=mask).shape))

config = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3},
    "zero_allow_untested_optimizer": True,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
seen = {}


def spy(module, args, kwargs):  # registered after DeepSpeed's hooks: what the attention receives
    seen["query is key"], seen["query is value"] = args[0] is args[1], args[0] is args[2]


engine.module.layers[0].self_attn.register_forward_pre_hook(spy, with_kwargs=True)
engine.module.eval()
try:
    with torch.no_grad():
        print("ZeRO-3:", tuple(engine.module(x, src_key_padding_mask=mask).shape))
except AssertionError as error:
    print("ZeRO-3 raised AssertionError:", error)
print("as the first layer's attention receives its inputs under ZeRO-3:", seen)
print("deepspeed", deepspeed.__version__, "torch", torch.__version__)
