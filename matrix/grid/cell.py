"""A cell is one point of the matrix: model x precision x mode x device x engine.

Standard library only: records and reports name cells without importing the stack. Which
values each axis has is the registries' business (matrix/selection/cells.py axis_values).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

AXES = ("model", "precision", "mode", "device", "engine")  # the order of a cell id's parts


class SelectionError(ValueError):
    """A selection names a value that no axis has, or a shard that does not exist."""


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


def cell_id_from_nodeid(nodeid: str, test: str = "test_cell") -> str | None:
    """The cell id in a node id such as cases/test_cells.py::test_cell[<id>] (or test_explore[<id>])."""
    marker = f"::{test}["
    if marker not in nodeid or not nodeid.endswith("]"):
        return None
    return nodeid.split(marker, 1)[1][:-1]
