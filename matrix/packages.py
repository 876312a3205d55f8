"""The packages the matrix knows by name, in one table: which a report records, which make up
the stack two runs are compared and merged on, whose frames name a failure's origin, and
which a standalone reproduction pins. Standard library only."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass


@dataclass(frozen=True)
class Package:
    name: str  # the distribution's name, as pip knows it
    modules: tuple[str, ...] = ()  # top-level modules whose frames count as a failure's origin
    stack: bool = False  # part of the stack under test: diff and merge compare runs on it
    pinned_in_repro: bool = False  # a standalone reproduction script pins its version


PACKAGES: tuple[Package, ...] = (
    Package("torch", ("torch",), stack=True, pinned_in_repro=True),
    Package("transformers", ("transformers",), stack=True, pinned_in_repro=True),
    Package("peft", ("peft",), stack=True, pinned_in_repro=True),
    Package("accelerate", ("accelerate",), stack=True, pinned_in_repro=True),
    Package("safetensors", ("safetensors",), stack=True, pinned_in_repro=True),
    Package("lightning", ("lightning", "lightning_fabric", "pytorch_lightning"), stack=True),
    Package("triton", ("triton",), pinned_in_repro=True),  # with liger-kernel: seed 002's stacks only
    Package("liger-kernel", ("liger_kernel",), pinned_in_repro=True),
    Package("bitsandbytes", ("bitsandbytes",), stack=True, pinned_in_repro=True),  # the quantized precisions
    Package("deepspeed", ("deepspeed",), stack=True, pinned_in_repro=True),  # the deepspeed-zero* engines
    Package("numpy"),
    Package("pytest"),
    Package("pytest-xdist"),
    Package("hypothesis"),
)
RECORDED = tuple(p.name for p in PACKAGES)  # every report's environment.packages
STACK = tuple(p.name for p in PACKAGES if p.stack)
ORIGIN_MODULES = frozenset(module for p in PACKAGES for module in p.modules)
PINNED_IN_REPRO = tuple(p.name for p in PACKAGES if p.pinned_in_repro)


def installed_versions(packages=RECORDED) -> dict[str, str | None]:
    """name -> version, None where the package is not installed."""
    found = {}
    for name in packages:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found
