"""A cell is one point of the matrix: model x precision x mode x device x engine."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

from matrix.devices import DEVICES
from matrix.modes import MODES
from matrix.precisions import PRECISIONS


@dataclass(frozen=True, order=True)
class Cell:
    model: str
    precision: str
    mode: str
    device: str
    engine: str = "torch"

    @property
    def id(self) -> str:
        """Reads like the cell it runs: gemma-cache-bf16-mixed-eval-cpu-hf-trainer."""
        return f"{self.model}-{self.precision}-{self.mode}-{self.device}-{self.engine}"

    def axes(self) -> dict[str, str]:
        return asdict(self)


def model_traits(model: str) -> frozenset[str]:
    """The traits a registered model kind declares (matrix/models/base.py TRAITS); none for a
    model name no kind is registered under (a report from another project, say)."""
    from matrix.models import MODELS

    return MODELS[model].traits if model in MODELS else frozenset()


def trait_names() -> tuple[str, ...]:
    from matrix.models.base import TRAITS

    return tuple(TRAITS)


class SelectionError(ValueError):
    """A selection names a value that no axis has."""


def axis_values() -> dict[str, tuple[str, ...]]:
    from matrix.engines import ENGINES
    from matrix.models import MODELS  # registered kinds, including downstream ones

    return {
        "model": tuple(MODELS),
        "precision": tuple(PRECISIONS),
        "mode": MODES,
        "device": DEVICES,
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


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """'K/N' -> (K, N) with 1 <= K <= N; None or '' -> None (no sharding)."""
    if not text:
        return None
    k, slash, n = text.partition("/")
    if not (slash and k.strip().isdigit() and n.strip().isdigit() and 1 <= int(k) <= int(n)):
        raise SelectionError(f"--shard: {text!r} is not K/N with 1 <= K <= N (for example 1/2)")
    return int(k), int(n)


def shard_cells(cells: list[Cell], shard: tuple[int, int] | None) -> list[Cell]:
    """Shard K of N: the cells at positions K-1, K-1+N, K-1+2N, ... of the selection's order.

    Dealt round-robin rather than cut in blocks, so each shard gets a similar mix of devices,
    engines and models (a block would give one machine every cuda cell). The split depends only
    on the selection, so N machines given the same selection and shards 1/N..N/N run every
    cell exactly once.
    """
    if shard is None:
        return cells
    k, n = shard
    return cells[k - 1 :: n]


def cell_from_id(cell_id: str) -> Cell | None:
    """The cell a test id names (for reports that carry only a node id, such as a crash)."""
    every = enumerate_cells(axis_values())
    return next((cell for cell in every if cell.id == cell_id), None)


def cell_id_from_nodeid(nodeid: str, test: str = "test_cell") -> str | None:
    """The cell id in a node id such as cases/test_cells.py::test_cell[<id>] (or test_explore[<id>])."""
    marker = f"::{test}["
    if marker not in nodeid or not nodeid.endswith("]"):
        return None
    return nodeid.split(marker, 1)[1][:-1]
