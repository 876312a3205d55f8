"""Where a run's cell time went: each engine's cells and phases, from results.json (a cell's
`duration_s` and `phase_seconds`) and its floor (`metrics.library_seconds`, the time inside the
engine's library calls). summary.md shows the slowest phases, BENCHMARKS.md each engine's cost
per cell beside its floor. Standard library only."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    """Seconds spent by `cells` cells (of one engine, and one mode or one phase)."""

    engine: str
    part: str  # a mode (train, eval) or a phase name
    cells: int
    total_s: float
    median_s: float
    max_s: float


def _cost(engine: str, part: str, seconds: list[float]) -> Cost:
    return Cost(engine, part, len(seconds), sum(seconds), statistics.median(seconds), max(seconds))


def ran(cells: list[dict]) -> list[dict]:
    """The cells that ran (not skipped)."""
    return [c for c in cells if c["outcome"] != "skipped"]


def phase_costs(cells: list[dict]) -> list[Cost]:
    """Each engine's phases over the cells that ran them, the slowest in all first. Cells of runs
    before phase times were recorded (issue 35) have none and count in no phase."""
    found: dict[tuple[str, str], list[float]] = {}
    for cell in ran(cells):
        for phase, seconds in (cell.get("phase_seconds") or {}).items():
            found.setdefault((cell["engine"], phase), []).append(seconds)
    costs = [_cost(engine, phase, seconds) for (engine, phase), seconds in found.items()]
    return sorted(costs, key=lambda c: (-c.total_s, c.engine, c.part))


def engine_costs(cells: list[dict]) -> list[Cost]:
    """Each engine's cells per mode: how many ran, their time in all, the median cell's."""
    found: dict[tuple[str, str], list[float]] = {}
    for cell in ran(cells):
        found.setdefault((cell["engine"], cell["mode"]), []).append(cell["duration_s"])
    return [_cost(engine, mode, seconds) for (engine, mode), seconds in found.items()]


def floor_costs(cells: list[dict]) -> list[Cost]:
    """Each engine's floor per mode: the seconds its cells spent inside the engine's library calls
    (metrics.library_seconds, matrix/harness/library_clock.py), over the cells that ran. A cell
    that never reached the engine (a precision refused in `configure`) spent none: 0 s. A run from
    before the floor was recorded (no cell has it) has no floors."""
    if not any(isinstance((c.get("metrics") or {}).get("library_seconds"), (int, float)) for c in cells):
        return []
    found: dict[tuple[str, str], list[float]] = {}
    for cell in ran(cells):
        seconds = (cell.get("metrics") or {}).get("library_seconds")
        value = float(seconds) if isinstance(seconds, (int, float)) else 0.0
        found.setdefault((cell["engine"], cell["mode"]), []).append(value)
    return [_cost(engine, mode, seconds) for (engine, mode), seconds in found.items()]


def slowest_phases_markdown(cells: list[dict], limit: int = 10) -> list[str]:
    """summary.md's section: the run's cell time, and its `limit` slowest engine phases."""
    costs = phase_costs(cells)
    if not costs:
        return []
    total = sum(c["duration_s"] for c in ran(cells))
    lines = [
        "",
        "## Slowest phases",
        "",
        f"{total:.1f} s in {len(ran(cells))} cells that ran; the phases that took most of it "
        "(results.json: each cell's `phase_seconds`):",
        "",
        "| engine | phase | cells | total | median | slowest |",
        "|---|---|---|---|---|---|",
    ]
    for cost in costs[:limit]:
        lines.append(
            f"| {cost.engine} | {cost.part} | {cost.cells} | {cost.total_s:.1f} s | {cost.median_s:.3f} s "
            f"| {cost.max_s:.2f} s |"
        )
    return lines
