"""Saved initial weights: a run whose models start from weights on disk instead of from the kind's
seeded initialisation (--initial-weights DIR).

Golden loss curves (matrix/results/curves.py, `nox -s curves`) are compared across releases, and a
release may change how a model is initialised (a new default init, another draw order): a curve
that starts from a seed would move for that alone. Saved weights, and the batch the curves train
on, hold the start still, as a seed checkpoint does in torchtitan's loss comparisons.

DIR holds, per model kind, `<kind>.safetensors`: the kind's fp32 model's tensors as built, and
its batch under the `batch.` prefix. Every model of the kind a cell builds (the engine's, the
references', the fp32 copies) is built as usual, then given these tensors in its own dtypes; a
float8 precision converts it afterwards. A quantized base cannot take them (its weights are
quantized as they load): such a cell fails in build, saying so.

The directory travels to a distributed engine's ranks in MATRIX_INITIAL_WEIGHTS, set by the run.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from matrix.checks.assertions import CheckFailure
from matrix.grid.schedule import INITIAL_WEIGHTS_VARIABLE as VARIABLE

BATCH_PREFIX = "batch."


class InitialWeightsError(CheckFailure):
    """The saved initial weights do not fit the model (names or shapes), or cannot be applied."""


def current() -> str | None:
    """The run's directory of initial weights, or None: the kinds' own seeded initialisation."""
    return os.environ.get(VARIABLE) or None


def path_of(kind_name: str, directory: str | Path | None = None) -> Path:
    return Path(directory or current()) / f"{kind_name}.safetensors"


def save(kind, directory: Path, workdir: Path) -> Path:
    """The kind's fp32 model as built on the CPU, and its batch, to DIR/<kind>.safetensors."""
    from safetensors.torch import save_file

    from matrix.precisions.policies import PRECISIONS

    model = kind.build(PRECISIONS["fp32"], torch.device("cpu"), workdir)
    tensors = {name: p.detach().clone().contiguous() for name, p in model.named_parameters()}
    for name, value in kind.batch(torch.device("cpu")).items():
        if isinstance(value, torch.Tensor):
            tensors[BATCH_PREFIX + name] = value.detach().clone().contiguous()
    path = path_of(kind.name, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"kind": kind.name, "torch": torch.__version__})
    return path


def _read(kind_name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = path_of(kind_name)
    if not path.is_file():
        raise InitialWeightsError(f"initial weights: none saved for the kind {kind_name!r}", details=str(path))
    return load_file(str(path))


def apply(kind, model: torch.nn.Module, precision) -> torch.nn.Module:
    """`model` (as the kind built it in `precision`) holding the saved weights, each in the dtype
    the model holds it in; unchanged where the run has none."""
    if current() is None:
        return model
    if precision.quantization is not None:
        raise InitialWeightsError("initial weights: a quantized base cannot start from saved weights")
    saved = {name: t for name, t in _read(kind.name).items() if not name.startswith(BATCH_PREFIX)}
    held = dict(model.named_parameters())
    if set(saved) != set(held):
        missing, extra = sorted(set(held) - set(saved)), sorted(set(saved) - set(held))
        raise InitialWeightsError(
            "initial weights: the saved tensors do not match the model's parameters",
            details=f"{len(missing)} not saved (first {missing[:1]}), {len(extra)} not built (first {extra[:1]})",
        )
    with torch.no_grad():
        for name, parameter in held.items():
            value = saved[name]
            if value.shape != parameter.shape:
                raise InitialWeightsError(
                    "initial weights: a saved tensor's shape is not the model's",
                    details=f"{name}: {tuple(value.shape)} saved, {tuple(parameter.shape)} built",
                )
            parameter.copy_(value.to(device=parameter.device, dtype=parameter.dtype))
    return model


def batch(kind, device: torch.device) -> dict:
    """The kind's batch: the saved one where the run has initial weights, else the kind's own."""
    own = kind.batch(device)
    if current() is None:
        return own
    saved = {name[len(BATCH_PREFIX) :]: t for name, t in _read(kind.name).items() if name.startswith(BATCH_PREFIX)}
    return {name: saved[name].to(device) if name in saved else value for name, value in own.items()}
