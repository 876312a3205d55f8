"""liger-llama: tiny-llama trained through Liger-Kernel's fused linear cross entropy (seed 002).

The model is tiny-llama's LlamaForCausalLM with Liger's own Llama forward
(`liger_kernel.transformers.model.llama.lce_forward`) bound to the instance, which is what
`apply_liger_kernel_to_llama(fused_linear_cross_entropy=True, model=...)` does in the
releases that patch an instance (older ones replace LlamaForCausalLM.forward for the whole
process, which would leak into the other kinds' cells). In training with labels that forward
never materialises the logits: Liger's LigerFusedLinearCrossEntropyFunction computes the
loss and the lm_head and hidden-state gradients chunk by chunk in its forward. In evaluation
it computes logits and the usual loss.

Liger's kernels are Triton kernels. Without a GPU they run in Triton's interpreter
(TRITON_INTERPRET=1, which the matrix's cells run under, set before triton is imported;
matrix/execute/environment_variables.py): the Python side of Liger's op,
the dtype decisions and the matmuls around the kernels, runs as written. One thing differs
from a GPU and matters for seed 002: Liger up to 0.3.1 chooses its dtype with
torch.is_autocast_enabled(), which asks about CUDA autocast only (docs/SEEDS.md).
"""

from __future__ import annotations

import types

from matrix.devices.cuda import triton_interpreted
from matrix.grid import packages
from matrix.models.base import register
from matrix.models.tiny_llama import TinyLlama

REQUIRED = ("triton", "liger-kernel")  # as pip names them; matrix/grid/packages.py says how to install them


def missing_packages() -> tuple[str, ...]:
    return packages.missing(REQUIRED)


def liger_lce_forward():
    """Liger's own Llama forward (the function its patching API installs)."""
    packages.require(REQUIRED, "the liger-llama model kind")
    from liger_kernel.transformers.model.llama import lce_forward

    return lce_forward


class LigerLlama(TinyLlama):
    name = "liger-llama"
    axis_position = 4
    description = "tiny-llama with Liger-Kernel's fused linear cross entropy forward (Triton; interpreter on CPU)"
    requires = (*TinyLlama.requires, *REQUIRED)

    def standalone_code(self) -> str:
        from matrix.models.standalone import LIGER

        return super().standalone_code() + LIGER

    def skip_reason(self, device: str) -> str | None:
        absent = super().skip_reason(device)
        if absent:
            return absent
        if device == "cpu" and not triton_interpreted():
            return (
                "Requires: [Triton's interpreter for CPU tensors] (TRITON_INTERPRET=1 is not set for this "
                "process; the matrix's cells run under it where no GPU is visible)"
            )
        return None

    def with_liger(self, model):
        model.forward = types.MethodType(liger_lce_forward(), model)
        return model

    def build(self, precision, device, workdir):
        return self.with_liger(super().build(precision, device, workdir))

    def load_weights(self, directory, dtype, device):
        return self.with_liger(super().load_weights(directory, dtype, device))


register(LigerLlama())
