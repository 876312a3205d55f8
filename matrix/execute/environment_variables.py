"""The environment variables the matrix's cells run under: the Hub offline (every model is built
from a config in code, so an accidental download fails loudly instead) and without progress
bars; where no GPU is visible, Triton's interpreter for Liger's kernels on CPU tensors
(matrix/devices/cuda.py interpreter_variables); MKL's reproducible mode, without which the CPU's
matrix products may round differently for a tensor at another memory alignment (matrix/devices/cpu.py
REPRODUCIBLE_BLAS); and TORCH_EXTENSIONS_DIR, a directory the run
owns for the ops a library compiles on first use, keyed by the torch and DeepSpeed releases
(matrix/engines/libraries/extension_builds.py), instead of the one per user that every environment shares.

They are the matrix's business only. The pytest plugin is loaded in every pytest session of an
environment that has the package, and a project's own tests may download from the Hub or
compile Triton kernels, so the plugin sets them only while the matrix's tests are parametrized
and run (applied()) and puts back what was there after. A rank process of the distributed
engines (matrix/execute/rank_worker.py) runs nothing but cells: it applies them for its whole life.
An explicit setting is always kept.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def variables() -> dict[str, str]:
    """Every variable a cell runs under, with its value (asks torch whether a GPU is visible)."""
    from matrix.devices.cpu import REPRODUCIBLE_BLAS
    from matrix.devices.cuda import interpreter_variables
    from matrix.engines.libraries import extension_builds

    return {**OFFLINE, **REPRODUCIBLE_BLAS, **interpreter_variables(), **extension_builds.variables()}


def apply() -> dict[str, str]:
    """Set each variable that is not set already; returns those it set."""
    added = {name: value for name, value in variables().items() if name not in os.environ}
    os.environ.update(added)
    return added


@contextlib.contextmanager
def applied() -> Iterator[None]:
    """The variables set for the block, and unset after it where this set them. Triton reads
    TRITON_INTERPRET when it is imported, so the block must be where triton first is (a cell)."""
    added = apply()
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
