"""Model kinds that take their process down, loaded with `-p fault_models` (tests only).

Each fails only where its weights are bfloat16 (bf16-true cells) and trains, evaluates and
saves normally in every other precision, so a run shows the fault and what survives it:

fault-segfault  reads address 0 through ctypes: SIGSEGV
fault-abort     os.abort(): SIGABRT
fault-sleep     sleeps for an hour in Python: pytest-timeout interrupts it (--cell-timeout)
fault-hang      blocks SIGALRM, then sleeps: nothing inside the process can stop it; only
                python -m matrix run's watchdog can
fault-rank-segfault  SIGSEGV in rank 1 of a process group (the distributed engines) only
fault-cuda-assert  raises the error a CUDA device-side assert raises, after which a real
                process's CUDA context is unusable
"""

import ctypes
import os
import signal
import time

import torch
from torch import nn

from matrix.grid.variants import Variant
from matrix.models import base, register
from matrix.models.tiny_transformer import NUM_CLASSES, TinyTransformer


class PlainClassifier(nn.Module):
    """Mean-pooled embeddings and one Linear: nothing in it is precision-sensitive."""

    def __init__(self) -> None:
        super().__init__()
        hidden = Variant().hidden_size
        self.embed = nn.Embedding(base.VOCAB_SIZE, hidden)
        self.head = nn.Linear(hidden, NUM_CLASSES)

    @property
    def weight(self):
        return self.head.weight

    def forward(self, input_ids, padding_mask):
        keep = (~padding_mask).unsqueeze(-1).to(self.head.weight.dtype)
        pooled = (self.embed(input_ids) * keep).sum(1) / keep.sum(1)
        return self.head(pooled)


def segfault():
    ctypes.string_at(0)


def abort():
    os.abort()


def sleep():
    time.sleep(3600)


def hang():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(3600)


def rank_segfault():
    """SIGSEGV in rank 1 of a process group only: the other ranks are left waiting."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() == 1:
        segfault()


def cuda_assert():
    raise RuntimeError(
        "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported at some "
        "other API call, so the stacktrace below might be incorrect."
    )


class FaultyClassifier(PlainClassifier):
    fault = staticmethod(segfault)

    def forward(self, input_ids, padding_mask):
        if self.weight.dtype == torch.bfloat16:
            self.fault()
        return super().forward(input_ids, padding_mask)


def fault_kind(name: str, fault) -> TinyTransformer:
    classifier = type(f"Faulty_{fault.__name__}", (FaultyClassifier,), {"fault": staticmethod(fault)})
    attributes = {"name": name, "description": f"{fault.__name__} with bf16 weights (test only)"}
    kind = type(f"Fault_{fault.__name__}", (TinyTransformer,), {**attributes, "create": lambda self: classifier()})
    return kind()


for name, fault in (
    ("fault-segfault", segfault),
    ("fault-abort", abort),
    ("fault-sleep", sleep),
    ("fault-hang", hang),
    ("fault-cuda-assert", cuda_assert),
    ("fault-rank-segfault", rank_segfault),
):
    register(fault_kind(name, fault))
