"""XLM's feed-forward layers hold transformers' module-level `gelu` (activations.py:
`gelu = get_activation("gelu")`, one GELUActivation instance): every XLM model of a process shares
that one submodule. Under DeepSpeed ZeRO-3 a second engine in the same process (a run restored
from its checkpoint beside the uninterrupted one, a reference model beside a policy) registers the
shared module again and gives it a new ds_id, so the first engine's recorded trace no longer
matches and its next forward raises "IndexError: pop from an empty deque" in the parameter
coordinator. One process, CPU, gloo; no model weights, no data. Run: python this_file.py

    pip install torch==2.13.0 transformers==5.24.0 deepspeed==0.19.8

Exit 1 when the first engine's forward raises IndexError with the module shared, and the same steps
pass with the module unshared; 0 when the shared run passes; 2 on anything else.
"""

import os
import sys

import torch
import torch.distributed as dist

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
dist.init_process_group("gloo", rank=0, world_size=1)

import deepspeed  # noqa: E402  (after the process group, as a launcher sets it up)
from transformers import XLMConfig, XLMWithLMHeadModel  # noqa: E402
from transformers.activations import GELUActivation  # noqa: E402

CONFIG = {"vocab_size": 99, "emb_dim": 16, "n_layers": 2, "n_heads": 2, "max_position_embeddings": 32,
          "dropout": 0.0, "attention_dropout": 0.0}  # fmt: skip
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}
IDS = torch.randint(4, 99, (2, 8), generator=torch.Generator().manual_seed(1))


def built(unshared: bool):
    torch.manual_seed(0)
    model = XLMWithLMHeadModel(XLMConfig(**CONFIG))
    if unshared:  # each feed-forward layer its own activation module, as ACT2FN["gelu"] would give
        for ffn in model.transformer.ffns:
            ffn.act = GELUActivation()
    return model


def engine_of(model):
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG)
    return engine


def step(engine):
    loss = engine(input_ids=IDS, labels=IDS).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def run(unshared: bool) -> str:
    """A step on engine A, a second engine B built in the process, then A's next step."""
    a, b = built(unshared), built(unshared)
    shared = a.transformer.ffns[0].act is b.transformer.ffns[0].act
    first = engine_of(a)
    step(first)  # the first forward starts ZeRO-3's trace recording for the next one
    engine_of(b)
    try:
        step(first)
    except IndexError as error:
        return f"shared activation module: {shared}; engine A's next step raised IndexError: {error}"
    return f"shared activation module: {shared}; engine A's next step ran"


def main() -> int:
    shared, unshared = run(unshared=False), run(unshared=True)
    print("as transformers builds XLM:", shared)
    print("each layer its own activation:", unshared)
    print("deepspeed", deepspeed.__version__, "torch", torch.__version__)
    if "raised IndexError" in shared and "ran" in unshared.rsplit(";", 1)[1]:
        return 1
    return 0 if "ran" in shared.rsplit(";", 1)[1] else 2


if __name__ == "__main__":
    sys.exit(main())
