"""The nightly names the release: bisect each new failure over the packages that changed.

`python -m matrix diff OLD NEW --bisect-budget SECONDS` calls `bisect_new_failures` when the
diff has new failures and the two runs' package versions differ. Per new signature it takes one
cell (the first, in id order) and, per package whose version changed, bisects that cell between
the old run's and the new run's version (matrix/releases/bisection.py: the releases in between, a scratch
environment for the new run's stack). What it finds:

- `found`: the first release where the cell's state changes. In the nightly direction (the
  package moved up) that is the release that broke it: "first bad";
- `same at both ends`: the cell gives the same result with the old and the new release of
  that package: not this package (or not reproducible outside the run);
- `error`: the bisection could not run (a release that does not install, a version pip's index
  does not list), with its message;
- `nothing ran`: the cell did not run with a release it tried (it skipped, naming what it
  lacks, or no run came back): the bisection decides nothing about this package;
- `not run`: the time budget was spent before it started.

A loss curve that moved (the diff's curve-moved category) is bisected the same way, per moved
cell (in id order, while the budget lasts) and changed package: the state of a release is
whether the cell's curve stays within the row of the old run's (bisect.CurveJudge), and `found`
names the first release where it moved (bisect_moved_curves).

Each found failure also gets a standalone script (`python -m matrix repro`, torch-engine cells)
beside the bisections, so the report links something to paste into an upstream issue.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from packaging.version import InvalidVersion, Version

from matrix.releases.bisection import BisectError, NothingRan


def _direction(old: str, new: str) -> str:
    try:
        return "up" if Version(new) > Version(old) else "down"
    except InvalidVersion:
        return "unknown"


def representatives(new_changes: list[dict]) -> list[tuple[str, str, list[str]]]:
    """(signature id, its text, the cells) per new signature, most cells first; the first cell
    in id order stands for them all."""
    groups: dict[str, tuple[str, list[str]]] = {}
    for change in new_changes:
        brief = change["new"]
        signature = brief.get("signature") or f"phase {brief.get('phase')}"
        groups.setdefault(signature, (brief.get("signature_text") or "", []))[1].append(change["cell"])
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1][1]), item[0]))
    return [(signature, text, sorted(cells)) for signature, (text, cells) in ordered]


def bisect_new_failures(
    new_changes: list[dict],
    packages: dict[str, tuple],
    *,
    stack: str,
    budget_s: float,
    output: Path,
    new_run: Path | None = None,
    bisect_fn=None,
    repro_fn=None,
    clock=time.monotonic,
    log=print,
) -> list[dict]:
    """One record per (new signature, changed package), in the order they were tried."""
    if bisect_fn is None:
        from matrix.releases.bisection import bisect as bisect_fn
    if repro_fn is None:
        repro_fn = _write_repro
    deadline = clock() + budget_s
    output.mkdir(parents=True, exist_ok=True)
    records = []
    for signature, text, cells in representatives(new_changes):
        cell = cells[0]
        for package, (old, new) in sorted(packages.items()):
            record = _record(signature, text, cell, len(cells), package, old, new)
            records.append(record)

            def bisection(deadline, package=package, old=old, new=new, cell=cell):
                return bisect_fn(package, str(old), str(new), cell, stack, output, [], log=log, deadline=deadline)

            if _try(record, bisection, deadline, budget_s, clock):
                record["repro"] = repro_fn(cell, new_run, output)
    (output / "bisections.json").write_text(json.dumps(records, indent=2) + "\n")
    return records


def _record(signature: str, text: str, cell: str, cells: int, package: str, old, new) -> dict:
    """What a bisection record says before it runs."""
    return {
        "signature": signature,
        "signature_text": text,
        "cell": cell,
        "cells": cells,
        "package": package,
        "old": old,
        "new": new,
        "direction": _direction(str(old), str(new)) if old and new else "unknown",
    }


def _try(record: dict, bisection, deadline: float, budget_s: float, clock) -> dict | None:
    """Run one bisection (bisection(deadline) -> bisect.bisect's result) within what is left of the
    budget, its outcome into `record`; the result where it found the release, else None."""
    package, old, new = record["package"], record["old"], record["new"]
    if not old or not new:
        record.update(status="error", detail=f"{package} is absent from one run ({old} -> {new})")
        return None
    left = deadline - clock()
    if left <= 0:
        record.update(status="not run", detail=f"the bisection budget ({budget_s:.0f} s) was spent")
        return None
    start, found = clock(), None
    try:
        found = bisection(start + left)
    except NothingRan as error:  # the cell skipped (or did not run) with a release: no verdict
        record.update(status="nothing ran", detail=str(error))
    except BisectError as error:
        same = "nothing to bisect" in str(error)
        record.update(status="same at both ends" if same else "error", detail=str(error))
    else:
        record.update(
            status="found",
            first_changed=found["first_changed"],
            last_before=found["last_before_change"],
            from_state=found["from_state"],
            to_state=found["to_state"],
            tried=[trial["version"] for trial in found["evidence"]],
        )
    record["seconds"] = round(clock() - start, 1)
    return found


def curve_arguments(run: dict) -> tuple[str, ...]:
    """What a cell runs with to train the curve a run recorded: its length and initial weights."""
    arguments = ("--curve-steps", str(run.get("curve_steps") or 3))
    if run.get("initial_weights"):
        from matrix.results.curves import INITIAL_WEIGHTS_DIR

        directory = Path(run["initial_weights"])
        if not directory.is_absolute():  # golden curves name the directory in the repository
            directory = INITIAL_WEIGHTS_DIR.parent / directory
        arguments += ("--initial-weights", str(directory))
    return arguments


def bisect_moved_curves(
    moved: list[dict],
    packages: dict[str, tuple],
    old_document: dict,
    new_run: dict,
    *,
    stack: str,
    budget_s: float,
    output: Path,
    bisect_fn=None,
    clock=time.monotonic,
    log=print,
) -> list[dict]:
    """One record per (moved cell, changed package), in the order they were tried: the first
    release where the cell's curve leaves the old run's row."""
    from matrix.releases.bisection import CurveJudge
    from matrix.results.curves import curve_of

    if bisect_fn is None:
        from matrix.releases.bisection import bisect as bisect_fn
    old_cells = {cell["id"]: cell for cell in old_document["cells"]}
    deadline = clock() + budget_s
    output.mkdir(parents=True, exist_ok=True)
    records = []
    for change in sorted(moved, key=lambda change: change["cell"]):
        cell = change["cell"]
        losses, row = curve_of(old_cells[cell])
        judge = CurveJudge(tuple(losses), row, curve_arguments(new_run))
        text = f"the curve leaves the old run's row at step {change['step']}"
        for package, (was, now) in sorted(packages.items()):
            record = _record("curve-moved", text, cell, 1, package, was, now)
            records.append(record)

            def bisection(deadline, package=package, was=was, now=now, cell=cell, judge=judge):
                arguments = list(judge.arguments)
                return bisect_fn(
                    package, str(was), str(now), cell, stack, output, arguments, log=log, deadline=deadline, judge=judge
                )

            _try(record, bisection, deadline, budget_s, clock)
    (output / "curve-bisections.json").write_text(json.dumps(records, indent=2) + "\n")
    return records


def _write_repro(cell: str, new_run: Path | None, output: Path) -> str | None:
    """The standalone script of the cell, with the new run's pins; None where repro cannot
    write one (only torch-engine cells are written so far): the reason is in the log."""
    from matrix.releases.repro import ReproError, generate

    try:
        script = generate(cell, new_run, None)
    except ReproError as error:
        print(f"no repro script for {cell}: {error}")
        return None
    path = output / f"repro-{cell}.py"
    path.write_text(script)
    return str(path)
