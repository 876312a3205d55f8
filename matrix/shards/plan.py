"""--shard K/N: which of the selected cells one machine runs, and the plan every shard shares.
Standard library only (merge reads a shard's plan and report without the stack).

Without costs the cells are dealt round-robin. With --shard-costs (a previous run: the night
before's merged results.json) they are balanced by what they cost then, so the slowest shard
ends near the others rather than at twice the median:

- a cell costs its recorded duration_s; a cell the previous run did not have costs the median
  of the cells it did have that share its engine, precision, mode and device (then its engine,
  mode and device; its engine; any);
- each model kind's one-time work (kind_setups) is paid once per process that runs its cells,
  so a kind's cells stay together where they can: the unit dealt is a kind's cells, split into
  its engines' cells, then single cells, only while a unit is over a quarter of a shard's
  share (which bounds the longest shard near 1.25 times the mean);
- units go, dearest first, to the shard with the least so far (ties: the lower shard), and each
  shard runs its cells in the selection's order.

Every shard computes the same plan from the same selection and costs, and writes it next to its
report (shard-plan.json): merge reads it to name the cells of a shard that never reported.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from matrix.grid.cell import Cell, SelectionError

PLAN_FILE = "shard-plan.json"  # in each shard's run directory
UNKNOWN_COST_S = 1.0  # a cell's cost when the previous run has no cell to compare it with
SPLIT_FRACTION = 0.25  # a unit over this fraction of a shard's share is split further


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """'K/N' -> (K, N) with 1 <= K <= N; None or '' -> None (no sharding)."""
    if not text:
        return None
    k, slash, n = text.partition("/")
    if not (slash and k.strip().isdigit() and n.strip().isdigit() and 1 <= int(k) <= int(n)):
        raise SelectionError(f"--shard: {text!r} is not K/N with 1 <= K <= N (for example 1/2)")
    return int(k), int(n)


@dataclass(frozen=True)
class Costs:
    """What a previous run's cells cost: seconds per cell id, and per model kind its one-time work."""

    cells: dict[str, tuple[dict, float]]  # id -> (axes, seconds)
    kind_setup_s: dict[str, float] = field(default_factory=dict)
    source: str | None = None  # the run they were measured in

    @classmethod
    def of(cls, document: dict) -> Costs:
        cells = {
            c["id"]: (
                {axis: c[axis] for axis in ("model", "precision", "engine", "mode", "device")},
                float(c["duration_s"] or 0),
            )
            for c in document["cells"]
        }
        setups: dict[str, list[float]] = {}
        for setup in document.get("kind_setups") or []:
            setups.setdefault(setup["kind"], []).append(float(setup["seconds"] or 0))
        return cls(cells, {kind: statistics.mean(s) for kind, s in setups.items()}, document["run"]["id"])

    @classmethod
    def read(cls, path: Path) -> Costs:
        """A report directory or its results.json (checked as merge and diff check them)."""
        from matrix.results.files import ResultsError, load

        try:
            document, _ = load(path)
        except ResultsError as error:
            raise SelectionError(f"--shard-costs: {error}") from None
        return cls.of(document)

    def estimator(self):
        """cell -> seconds: recorded, else the median of its like: the cells of other kinds with its
        engine, precision, mode and device (the precision decides whether it runs or skips here:
        a median over both would price a running cell at a skipped one's nothing), then its
        engine, mode and device, then its engine, then any."""

        def keys(axes: dict) -> tuple[tuple, ...]:
            engine, mode, device = axes["engine"], axes["mode"], axes["device"]
            return (
                ("epmd", engine, axes["precision"], mode, device),
                ("emd", engine, mode, device),
                ("e", engine),
                ("*",),
            )

        groups: dict[tuple, list[float]] = {}
        for axes, seconds in self.cells.values():
            for key in keys(axes):
                groups.setdefault(key, []).append(seconds)
        medians = {key: statistics.median(values) for key, values in groups.items()}

        def cost(cell: Cell) -> float:
            if cell.id in self.cells:
                return self.cells[cell.id][1]
            return next((medians[key] for key in keys(cell.axes()) if key in medians), UNKNOWN_COST_S)

        return cost


@dataclass(frozen=True)
class ShardPlan:
    """Which cells each of N shards runs, and what each was predicted to cost (seconds; None when
    dealt round-robin without costs)."""

    shards: tuple[tuple[Cell, ...], ...]
    predicted_s: tuple[float, ...] | None = None
    costs_from: str | None = None

    def of(self, k: int) -> list[Cell]:
        return list(self.shards[k - 1])

    def document(self) -> dict:
        return {
            "shards": len(self.shards),
            "costs_from": self.costs_from,
            "predicted_s": list(self.predicted_s) if self.predicted_s else None,
            "cells": [[cell.id for cell in shard] for shard in self.shards],
        }

    def write(self, directory: Path) -> Path:
        path = Path(directory) / PLAN_FILE
        path.write_text(json.dumps(self.document(), indent=1) + "\n", encoding="utf-8")
        return path


def read_plan(directory: Path) -> dict | None:
    """A shard's run directory -> the plan it ran by (None: no plan there)."""
    path = Path(directory) / PLAN_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def plan(cells: Sequence[Cell], n: int, costs: Costs | None = None) -> ShardPlan:
    """The N shards of `cells` (the selection, in its order)."""
    if costs is None:
        return ShardPlan(tuple(tuple(cells[k::n]) for k in range(n)))
    cost = costs.estimator()
    seconds = {cell: cost(cell) for cell in cells}
    share = (sum(seconds.values()) + sum(costs.kind_setup_s.get(kind, 0) for kind in {c.model for c in cells})) / n
    units = _units(cells, seconds, costs.kind_setup_s, share * SPLIT_FRACTION)
    order = {cell: index for index, cell in enumerate(cells)}
    units.sort(key=lambda unit: (-unit[0], order[unit[1][0]]))
    loads, members = [0.0] * n, [[] for _ in range(n)]
    for unit_cost, unit_cells in units:
        k = min(range(n), key=lambda i: (loads[i], i))
        loads[k] += unit_cost
        members[k] += unit_cells
    shards = tuple(tuple(sorted(shard, key=order.__getitem__)) for shard in members)
    return ShardPlan(shards, tuple(round(load, 3) for load in loads), costs.source)


def _units(cells: Iterable[Cell], seconds: dict, setup_s: dict, largest: float) -> list[tuple[float, list[Cell]]]:
    """A kind's cells as one unit with its setup; split by engine, then into cells, while too dear."""
    by_kind: dict[str, list[Cell]] = {}
    for cell in cells:
        by_kind.setdefault(cell.model, []).append(cell)
    units = []
    for kind, kind_cells in by_kind.items():
        setup = setup_s.get(kind, 0.0)
        whole = setup + sum(seconds[c] for c in kind_cells)
        if whole <= largest:
            units.append((whole, kind_cells))
            continue
        by_engine: dict[str, list[Cell]] = {}
        for cell in kind_cells:
            by_engine.setdefault(cell.engine, []).append(cell)
        for engine_cells in by_engine.values():
            part = setup + sum(seconds[c] for c in engine_cells)
            if part <= largest:
                units.append((part, engine_cells))
            else:  # each cell alone; the kind's setup goes with the first, where it is paid
                units += [(seconds[c] + (setup if i == 0 else 0.0), [c]) for i, c in enumerate(engine_cells)]
    return units


def shard_cells(cells: list[Cell], shard: tuple[int, int] | None, costs: Costs | None = None) -> list[Cell]:
    """Shard K of N of the selection (all of it when not sharded)."""
    if shard is None:
        return cells
    k, n = shard
    return plan(cells, n, costs).of(k)
