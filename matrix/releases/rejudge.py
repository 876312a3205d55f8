"""A run's cells judged again against a catalogue as it is now, without running a cell:
`python -m matrix rejudge RUN` says what a catalogue change does to a run already made.

Each cell that ran keeps what it did (it failed with its signature, or it passed) and is
classified again as the run classifies it (matrix/catalogue/entries.py classify): the entries in
force for its axes, the run's package versions and the run's machine (the hardware facts and the
curve length its results.json recorded, not this machine's), its recorded metrics for the
entries' cell conditions. What can differ from the run is only what the catalogue says, and the
model traits the entries select by, which are observed here, on this machine's stack.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

RAN = {"passed": "passed", "fixed": "passed", "inapplicable": "passed", "known": "failed", "failed": "failed"}
OUTCOME_NAMES = {"failed": "new"}  # as the reports name an unexplained failure


@dataclass(frozen=True)
class Rejudged:
    """One cell: its outcome and entry in the run, and judged again."""

    id: str
    before: str
    before_entry: str | None
    after: str
    after_entry: str | None

    @property
    def changed(self) -> bool:
        return (self.before, self.before_entry) != (self.after, self.after_entry)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def run_context(document: dict):
    """What the entries' hardware and run conditions read, as the run recorded it."""
    from matrix.catalogue.conditions import Context

    environment, run = document.get("environment", {}), document.get("run", {})
    settings = {"train_steps": run["curve_steps"]} if run.get("curve_steps") else {}
    return Context(hardware=environment.get("hardware", {}), run=settings)


def make_models(cells: list[dict]) -> None:
    """Make the kinds made on demand (hf:<model_type>, hf:<path>) that the run's cells name;
    a user's kind must have been registered (-p) before. SelectionError names one that is not."""
    from matrix.models import MODELS
    from matrix.selection.cells import parse_selection

    for model in dict.fromkeys(cell["model"] for cell in cells):
        if model not in MODELS:
            parse_selection("model", model)


def rejudge(document: dict, catalogue) -> list[Rejudged]:
    """Every cell of the run that ran, classified again against `catalogue`."""
    from matrix.catalogue.entries import classify
    from matrix.grid.cell import AXES, Cell

    cells = [cell for cell in document["cells"] if cell["outcome"] in RAN]
    make_models(cells)
    installed = document.get("environment", {}).get("packages", {})
    context = run_context(document)
    judged = []
    for record in cells:
        cell = Cell(**{axis: record[axis] for axis in AXES})
        ran = RAN[record["outcome"]]
        signature = (record.get("signature") or {}).get("text")
        claims = catalogue.in_force(cell, installed, context)
        inapplicable = catalogue.inapplicable(cell, installed, context) if ran == "passed" else []
        outcome, entry = classify(ran, signature, claims, record.get("metrics"), inapplicable)
        before_entry = (record.get("known_failure") or {}).get("id")
        judged.append(Rejudged(record["id"], record["outcome"], before_entry, outcome, entry.id if entry else None))
    return judged


def counts(judged: list[Rejudged], when: str) -> Counter:
    return Counter(getattr(cell, when) for cell in judged)


def summary_lines(judged: list[Rejudged], listed: int = 50) -> list[str]:
    """What re-judging changed: the counts before and after, each kind of change, and the cells."""

    def line(counted: Counter) -> str:
        order = ("passed", "known", "failed", "fixed", "inapplicable")
        return ", ".join(f"{counted[name]} {OUTCOME_NAMES.get(name, name)}" for name in order if counted[name])

    changed = [cell for cell in judged if cell.changed]
    lines = [
        f"{len(judged)} cells that ran",
        f"  in the run:     {line(counts(judged, 'before'))}",
        f"  judged again:   {line(counts(judged, 'after'))}",
        f"  changed: {len(changed)}",
    ]
    kinds = Counter(
        (OUTCOME_NAMES.get(c.before, c.before), c.before_entry, OUTCOME_NAMES.get(c.after, c.after), c.after_entry)
        for c in changed
    )
    for (before, before_entry, after, after_entry), number in kinds.most_common():
        was = f"{before} ({before_entry})" if before_entry else before
        now = f"{after} ({after_entry})" if after_entry else after
        lines.append(f"    {number:5d}  {was} -> {now}")
    if changed:
        lines.append(f"  cells{' (the first ' + str(listed) + ')' if len(changed) > listed else ''}:")
        lines += [
            f"    {c.id}: {OUTCOME_NAMES.get(c.before, c.before)} -> {OUTCOME_NAMES.get(c.after, c.after)}"
            for c in changed[:listed]
        ]
    return lines
