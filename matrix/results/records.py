"""One record per cell, typed: what results.json's `cells` hold (matrix/results/results.schema.json).

A record is made once, complete, where its outcome is known: run_cell's result
(matrix/execute/cell_run.py), a skip, a timeout, a crash, or a failure outside run_cell. Nothing edits
it afterwards. `as_dict()` is its JSON form, in the schema's field order; its `metrics` are a
CellMetrics (matrix/results/metrics.py), written as the fields that were measured.

A failed cell's `traceback` is where it failed: the exception's Python traceback (a rank's
appended), a crash's or timeout's stacks, pytest's text for a failure outside run_cell. The
record keeps at most crash_dump.TRACEBACK_LIMIT characters of it (crash_dump.condense: a
traceback's first lines and innermost frames, a faulthandler dump's crashing thread), whoever
made it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from matrix.grid.cell import Cell
from matrix.results import crash_dump
from matrix.results.metrics import CellMetrics
from matrix.results.signatures import Signature, signature_of_crash

TIMEOUT_SIGNATURE_MESSAGE = "the cell did not finish within the per-cell timeout"


@dataclass(frozen=True)
class CellRecord:
    id: str
    model: str
    precision: str
    mode: str
    device: str
    engine: str
    outcome: str  # passed | known | fixed | inapplicable | failed | skipped (files.OUTCOMES)
    phase: str | None = None  # the phase that failed
    phases: dict = field(default_factory=dict)  # phase -> passed | failed | not run
    signature: dict | None = None  # Signature.as_dict()
    message: str | None = None
    traceback: str | None = None  # condensed to crash_dump.TRACEBACK_LIMIT characters
    skip_reason: str | None = None
    known_failure: dict | None = None  # known_failure_record()
    duration_s: float = 0.0
    phase_seconds: dict = field(default_factory=dict)  # phase -> seconds it took (a cell that ran)
    metrics: CellMetrics = field(default_factory=CellMetrics)  # written as CellMetrics.as_dict()
    cuda_index: int | None = None  # the accelerator's index, for a cell on an indexed device
    device_name: str | None = None
    rerun: str | None = None  # the command that re-runs just this cell
    # the process-global settings the cell left changed, put back after it (matrix/harness/global_state.py):
    # {setting, before, after, phase, restored}; a finding of this cell, never of the next one
    leaked_state: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.traceback is not None and len(self.traceback) > crash_dump.TRACEBACK_LIMIT:
            # a frozen record's own field, set once, before anyone reads it; a record read back
            # (the plugin's from a test report) is within the limit already and stays as it is
            object.__setattr__(self, "traceback", crash_dump.condense(self.traceback, crash_dump.TRACEBACK_LIMIT))

    @classmethod
    def of(cls, cell: Cell, outcome: str, **fields) -> CellRecord:
        return cls(id=cell.id, **cell.axes(), outcome=outcome, **fields)

    def as_dict(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**fields, "metrics": self.metrics.as_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> CellRecord:
        """A record as_dict() wrote (the plugin's, from a test report)."""
        return cls(**{**data, "metrics": CellMetrics.from_dict(data.get("metrics") or {})})


def known_failure_record(entry, not_holding: list[str] | None = None) -> dict:
    """A catalogue entry (matrix/catalogue/entries.py Entry) as a cell record names it: with the conditions
    it is in force under (`when`, matrix/catalogue/conditions.py) and, for a cell it does not apply to here
    (inapplicable), the hardware conditions that do not hold on this machine (`not_holding`)."""
    record = {
        "id": entry.id,
        "title": entry.title,
        "kind": entry.kind,
        "upstream": list(entry.upstream),
        "link": entry.link,
    }
    if getattr(entry, "when", ()):
        record["when"] = [str(requirement) for requirement in entry.when]
    if not_holding is not None:
        record["not_holding"] = list(not_holding)
    return record


def skipped_record(cell: Cell, reason: str, **placement) -> CellRecord:
    return CellRecord.of(cell, "skipped", skip_reason=reason, **placement)


def skipped_exploration_record(target: Cell, reason: str) -> dict:
    return {"target": target.id, **target.axes(), "skip_reason": reason, "findings": []}


def harness_failure_record(
    cell: Cell, phase: str, description: str, duration_s: float = 0.0, **placement
) -> CellRecord:
    """A cell that failed outside run_cell: a fixture error, or a worker process that died."""
    signature = signature_of_crash(phase, description.strip().splitlines()[-1] if description.strip() else phase)
    return CellRecord.of(
        cell,
        "failed",
        phase=phase,
        signature=signature.as_dict(),
        message=description[-4000:],
        traceback=description or None,
        duration_s=duration_s,
        **placement,
    )


def timeout_record(cell: Cell, timeout_s: float, stacks: str, **placement) -> CellRecord:
    """A cell stopped after --cell-timeout; `stacks` is where it was (pytest-timeout or faulthandler)."""
    signature = Signature("timeout", "Timeout", TIMEOUT_SIGNATURE_MESSAGE, "<cell timeout>")
    return CellRecord.of(
        cell,
        "failed",
        phase="timeout",
        signature=signature.as_dict(),
        message=f"stopped after {timeout_s:g} s\n{crash_dump.condense(stacks)}",
        traceback=crash_dump.condense(stacks, crash_dump.TRACEBACK_LIMIT) if stacks else None,
        duration_s=float(timeout_s),
        **placement,
    )


def crash_record(cell: Cell, cause: str, stacks: str, duration_s: float, **placement) -> CellRecord:
    """A cell whose process died: `cause` names the signal (SIGSEGV) or the exit status."""
    signature = Signature("crash", "ProcessDied", cause, crash_dump.crash_origin(stacks))
    return CellRecord.of(
        cell,
        "failed",
        phase="crash",
        signature=signature.as_dict(),
        message=f"the process running this cell died: {cause}\n{crash_dump.condense(stacks)}",
        traceback=crash_dump.condense(stacks, crash_dump.TRACEBACK_LIMIT) if stacks else None,
        duration_s=round(duration_s, 4),
        **placement,
    )


def outcome_counts(records) -> Counter:
    return Counter(r["outcome"] for r in records)
