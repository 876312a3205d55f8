"""What a report shows as grids, and what it sums up as "not run here". Standard library only.

A run selects every cell of its axes; many cannot run on the machine: a whole device is absent
(no GPU), an extra is not installed (a whole engine's rows), a kind cannot take a precision (a
whole column). A grid of skips hides what ran, so the reports (summary.md, index.html) leave out
of their grids:

- a device where every cell skipped;
- in each device and mode, a precision column where every cell skipped; a model's block of a
  column (its engines in that precision) where every cell skipped: a precision the kind cannot
  take (the grid shows the block empty); then a model x engine row where every cell skipped;

and list those cells instead, one line per reason, with how many and which. A skip in a row, a
column and a block that otherwise ran stays in its grid: it is a fact about that cell and engine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from matrix.grid.cell import AXES

# how a line names the values of an axis; the axes in the order a line reads them
AXIS_WORDS = {"device": "device", "mode": "mode", "engine": "engine", "model": "model", "precision": "precision"}
SCOPE_ORDER = ("engine", "model", "precision", "device", "mode")
NAMED_IN_REASONS = ("engine", "model")  # a reason naming its cell's own engine or model is one reason for all
# the groups of cells left out of the grids where every cell of one skipped (a cell left out by one
# is skipped, so the order does not matter): a device, a precision column of a device's grid (its
# mode), one model's engines in such a column, a model x engine row of such a grid
LEFT_OUT_WHOLE = (
    ("device",),
    ("device", "mode", "precision"),
    ("device", "mode", "model", "precision"),
    ("device", "mode", "model", "engine"),
)
LISTED_AT_MOST = 4  # more values than this read as a count, or as "every ... but" the few left out


@dataclass(frozen=True)
class NotRun:
    """Cells left out of the grids for one reason."""

    reason: str  # the skip reason; where several differ only in their cell's own engine or model: <engine>, <model>
    cells: tuple[dict, ...]

    def scope(self, everything: dict[str, list[str]]) -> str:
        """Which cells, by axis: '6 engines (deepspeed-zero0, ...); every precision but fp32; cpu'.
        An axis whose every value in the run is covered is left out, unless it is the only one."""
        parts = []
        for axis in SCOPE_ORDER:
            values = [v for v in everything[axis] if any(c[axis] == v for c in self.cells)]
            word = AXIS_WORDS[axis]
            if len(values) == len(everything[axis]):
                continue
            missing = [v for v in everything[axis] if v not in values]
            if len(values) <= LISTED_AT_MOST:
                parts.append(f"{word}{'s' if len(values) > 1 else ''} {', '.join(values)}")
            elif len(missing) <= 2:
                parts.append(f"every {word} but {', '.join(missing)}")
            else:
                parts.append(f"{len(values)} {word}s ({values[0]} ... {values[-1]})")
        return "; ".join(parts) or "every cell of the run"


@dataclass(frozen=True)
class Reach:
    shown: frozenset[str]  # ids of the cells the grids show
    not_run: tuple[NotRun, ...]  # the rest, by reason, the most cells first
    axes: dict[str, list[str]]  # every value of each axis among the run's cells, in the axis' order


def general_reason(cell: dict) -> str:
    """The cell's skip reason, its own engine and model names put as <engine>, <model>: the reason
    six DeepSpeed engines each give in their own words is one line."""
    reason = cell.get("skip_reason") or "skipped"
    for axis in NAMED_IN_REASONS:
        reason = re.sub(rf"(?<![\w.-]){re.escape(cell[axis])}(?![\w-])", f"<{axis}>", reason)
    return reason


def reach(document: dict) -> Reach:
    cells = document["cells"]
    axes_order = document["run"].get("axes") or {}
    everything = {}
    for axis in AXES:
        present = {c[axis] for c in cells}
        listed = [v for v in dict.fromkeys(axes_order.get(axis) or ()) if v in present]
        if axis == "precision":
            listed = [v for v in dict.fromkeys([*(document.get("precisions") or {}), *listed]) if v in present]
        everything[axis] = listed + sorted(present - set(listed))
    out: set[str] = set()
    for axes in LEFT_OUT_WHOLE:
        groups: dict[tuple, list[dict]] = {}
        for cell in cells:
            groups.setdefault(tuple(cell[axis] for axis in axes), []).append(cell)
        for group in groups.values():
            if all(c["outcome"] == "skipped" for c in group):
                out.update(c["id"] for c in group)
    left_out = [cell for cell in cells if cell["id"] in out]
    # a reason put in general terms only where that makes one line of several reasons: "the torch
    # engine runs one process" and "... accelerate ..." are one; "torch 2.13.0+cpu" stays itself
    general: dict[str, set[str]] = {}
    for cell in left_out:
        general.setdefault(general_reason(cell), set()).add(cell.get("skip_reason") or "skipped")
    by_reason: dict[str, list[dict]] = {}
    for cell in left_out:
        reason = general_reason(cell)
        by_reason.setdefault(reason if len(general[reason]) > 1 else cell.get("skip_reason") or "skipped", []).append(
            cell
        )
    not_run = tuple(
        NotRun(reason, tuple(group)) for reason, group in sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    )
    return Reach(frozenset(c["id"] for c in cells) - out, not_run, everything)


def ran_here(document: dict) -> int:
    """How many of the run's cells ran here: every one but the skipped (results.json's counts)."""
    return len(document["cells"]) - document.get("counts", {}).get("skipped", 0)


def nothing_ran_line(document: dict) -> str:
    """The headline of a run where no cell ran: it says so, not a line of zeros."""
    return f"Nothing ran here: 0 of the {len(document['cells'])} cells selected ran, so this run decides nothing"


def not_run_sentence(document: dict, shown: Reach, link) -> str:
    """The sentence after the headline: how many cells did not run here (every skipped one), how
    many of them the "Not run here" section lists (`link(text)` refers to it) and how many stay in
    the grids, of how many selected."""
    total, skipped = len(document["cells"]), document.get("counts", {}).get("skipped", 0)
    if not total:
        return "The run selected no cells."
    if not skipped:
        return f"Every one of the {total} cells selected ran here."
    left_out = sum(len(group.cells) for group in shown.not_run)
    reasons = f"for {len(shown.not_run)} reason{'s' if len(shown.not_run) != 1 else ''} ({link('below')})"
    start = f"Not run here: {skipped} skipped cell{'s' if skipped != 1 else ''} of the {total} selected"
    if left_out == skipped:
        return f"{start}, {reasons}."
    in_grids = f"{skipped - left_out} in the grids beside cells that ran"
    return f"{start}: {left_out} {reasons}, {in_grids}." if left_out else f"{start}, {in_grids}."
