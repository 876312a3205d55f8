"""transformers, imported when a cell first builds a model rather than when the package loads.

Importing transformers' model classes costs about two seconds of CPU (they pull in
torch.distributed.tensor and sympy). A process that only collects, validates or refuses its
input, or that runs only kinds of its own, never pays it.
"""

from __future__ import annotations

import functools
import importlib
from importlib.metadata import version

from packaging.version import Version

from matrix.grid import packages


@functools.cache
def transformers():
    packages.require(["transformers"], "a transformers model kind")  # not a ModuleNotFoundError from deep inside
    module = importlib.import_module("transformers")
    module.utils.logging.disable_progress_bar()  # "Loading weights" bars in every cell's log
    return module


def transformers_class(name: str) -> type:
    """A class transformers exports at its top level, by name (LlamaForCausalLM, ...)."""
    return getattr(transformers(), name)


@functools.cache
def dtype_argument() -> str:
    """from_pretrained's dtype keyword: transformers 4.56 renamed torch_dtype to dtype, and the
    pinned older stacks need the old name. Read from the installed version, without importing."""
    return "dtype" if Version(version("transformers")) >= Version("4.56") else "torch_dtype"
