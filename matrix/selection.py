"""Which cells a run has: every axis's values (from the registries), the selection options
(--model a,b ...), enumeration in a stable order, and --shard K/N."""

from __future__ import annotations

import itertools

from matrix.cell import Cell, SelectionError
from matrix.devices import DEVICES
from matrix.engines import ENGINES
from matrix.models import MODELS
from matrix.models.base import TRAITS
from matrix.modes import MODES
from matrix.precisions import PRECISIONS


def model_traits(model: str, wanted: frozenset[str] | None = None) -> frozenset[str]:
    """The traits of a registered model kind (matrix/models/base.py TRAITS): observed on its
    built model, or declared where the kind declares them (matrix/observation.py); none for a
    model name no kind is registered under (a report from another project, say). `wanted`: the
    traits the caller asks about; the one derived from the learning rate, whose search trains
    the model, is established only when asked for (None: every trait)."""
    if model not in MODELS:
        return frozenset()
    from matrix.phases import RATE_TRAIT, kind_traits  # builds the model once per process: torch

    return kind_traits(MODELS[model], with_rate=wanted is None or RATE_TRAIT in wanted)


def trait_names() -> tuple[str, ...]:
    return tuple(TRAITS)


def axis_values() -> dict[str, tuple[str, ...]]:
    """Every axis' values, from the registries: a user's registered items included."""
    return {
        "model": tuple(MODELS),
        "precision": tuple(PRECISIONS),
        "mode": MODES,
        "device": tuple(DEVICES),
        "engine": tuple(ENGINES),
    }


def parse_selection(axis: str, text: str | None) -> tuple[str, ...]:
    """'a,b' -> ('a', 'b'), in the axis' own order; None or '' -> every value of the axis."""
    valid = axis_values()[axis]
    wanted = [value.strip() for value in (text or "").split(",") if value.strip()]
    if not wanted:
        return valid
    unknown = [value for value in wanted if value not in valid]
    if unknown:
        raise SelectionError(
            f"--{axis}: unknown value{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"valid values: {', '.join(valid)}"
        )
    return tuple(value for value in valid if value in wanted)


def enumerate_cells(selection: dict[str, tuple[str, ...]]) -> list[Cell]:
    """Every combination of the selected values, grouped by device, engine, mode, then model."""
    return [
        Cell(model=model, precision=precision, mode=mode, device=device, engine=engine)
        for device, engine, mode, model, precision in itertools.product(
            selection["device"], selection["engine"], selection["mode"], selection["model"], selection["precision"]
        )
    ]


def cell_from_id(cell_id: str) -> Cell | None:
    """The cell a test id names (for reports that carry only a node id, such as a crash)."""
    every = enumerate_cells(axis_values())
    return next((cell for cell in every if cell.id == cell_id), None)
