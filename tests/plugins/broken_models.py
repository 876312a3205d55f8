"""Model kinds defined outside the matrix package, loaded with `-p broken_models`.

broken-matmul: a custom autograd Function that is not autocast-aware (no
torch.amp.custom_fwd/custom_bwd), the pattern of seed 002. Under autocast its forward
produces half activations while its backward, which runs outside autocast, multiplies them
with the fp32 weight.

crash-abort: a model whose forward kills its process, as a segfault or a CUDA device-side
assert would.
"""

import os

import torch
from torch import nn

from matrix.grid.variants import Variant
from matrix.models import base, register
from matrix.models.tiny_transformer import NUM_CLASSES, TinyTransformer


class NotAutocastAwareLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()  # autocast casts here: half output

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        return grad_output @ weight, grad_output.t() @ x  # half @ fp32: no autocast in backward


class BrokenClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        hidden = Variant().hidden_size
        self.embed = nn.Embedding(base.VOCAB_SIZE, hidden)
        self.weight = nn.Parameter(torch.randn(NUM_CLASSES, hidden) * 0.02)

    def forward(self, input_ids, padding_mask):
        keep = (~padding_mask).unsqueeze(-1).to(self.weight.dtype)
        pooled = (self.embed(input_ids) * keep).sum(1) / keep.sum(1)
        return NotAutocastAwareLinear.apply(pooled, self.weight)


class BrokenMatmul(TinyTransformer):
    name = "broken-matmul"
    description = "custom autograd Function without custom_fwd/custom_bwd (test only)"

    def create(self):
        return BrokenClassifier()


class CrashingClassifier(BrokenClassifier):
    def forward(self, input_ids, padding_mask):
        os.abort()


class CrashAbort(TinyTransformer):
    name = "crash-abort"
    description = "forward aborts the process (test only)"

    def create(self):
        return CrashingClassifier()


register(BrokenMatmul())
register(CrashAbort())
