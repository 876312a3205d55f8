"""A run's journal, reports/<run-id>/cells.jsonl: one JSON line per event, written as it happens.

results.json is written once, at the end. The journal is what survives when the end never
comes: the run's header (run and environment) first, then for each cell a `start` line when
it begins and a `cell` line with its record when it ends (a later line for the same cell wins).
A cell with a start and no record was running when its process died. `python -m matrix run`
reads it to record such a cell as crashed and resume the others; `python -m matrix fold DIR`
turns a journal whose controller was killed into results.json, marked incomplete.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

JOURNAL = "cells.jsonl"
# the exit status of a run stopped because its report could not be written (pytest's own are 0-5)
REPORT_NOT_WRITTEN_STATUS = 6


class ReportNotWritten(Exception):
    """The file system refused a write to the run's report: a full disk, a file-size limit, a
    directory made read-only. Nothing a run does after it could be recorded, so the run stops
    (the pytest plugin, with REPORT_NOT_WRITTEN_STATUS); what the journal holds up to the refused
    line is still there for `python -m matrix fold` once the cause is gone."""

    def __init__(self, path: Path, error: OSError, run_directory: Path | None = None) -> None:
        code = errno.errorcode.get(error.errno, "") if error.errno is not None else ""
        kept = (
            f"the cells recorded before are in {run_directory / JOURNAL} (`python -m matrix fold "
            f"{run_directory}` writes their report once the file system takes it)"
            if run_directory is not None
            else "nothing was recorded"
        )
        super().__init__(
            f"ReportNotWritten: {type(error).__name__}: {code} {error.strerror or error}: {path}; "
            f"the run stops here; {kept}"
        )


RUN_ID_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def new_run_id() -> str:
    """UTC time and a random suffix: sorts by time, and two runs started together differ."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def check_run_id(run_id: str) -> str:
    """A run id names a directory: letters, digits, '.', '_', '-' only, not hidden, not 'latest'."""
    if not run_id or not set(run_id) <= RUN_ID_CHARACTERS or run_id.startswith(".") or run_id == "latest":
        raise ValueError(f"{run_id!r} is not a run id (letters, digits, '.', '_', '-'; not 'latest')")
    return run_id


def json_safe(value):
    """Strict JSON: a non-finite float becomes the string "nan", "inf" or "-inf"."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class Journal:
    """Appends events; each line is flushed as written, so a crash loses at most the line."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / JOURNAL
        self.refused: ReportNotWritten | None = None  # the first write the file system refused
        try:
            self.file = open(self.path, "a", encoding="utf-8")
        except OSError as error:
            raise ReportNotWritten(self.path, error, self.path.parent) from error

    def write(self, event: str, **fields) -> None:
        """Appends the event as one line. A write the file system refuses raises ReportNotWritten,
        and so does every write after it: a line after a lost one would read as complete."""
        if self.refused is not None:
            raise self.refused
        line = json.dumps(json_safe({"event": event, "time": time.time(), **fields}), allow_nan=False)
        try:
            self.file.write(line + "\n")
            self.file.flush()
        except OSError as error:
            self.refused = ReportNotWritten(self.path, error, self.path.parent)
            raise self.refused from error

    def header(self, run: dict, environment: dict, precisions: dict) -> None:
        """The run, its machine, and the precision table its cells run with (so that a fold
        needs nothing but this file)."""
        self.write("run", run=run, environment=environment, precisions=precisions, pid=os.getpid())

    def started(self, cell_id: str, axes: dict, rerun: str | None = None) -> None:
        """A cell begins: its axes too, so a reader without its model kind registered can name it,
        and the command that re-runs it, for the record of a cell that never finishes."""
        self.write("start", cell=cell_id, axes=axes, rerun=rerun, pid=os.getpid())

    def set_up(self, cell_id: str, kind_setup: dict | None = None) -> None:
        """The cell's setup is done, its kind's one-time work (matrix/harness/kind_setup.py) with it:
        the cell's own clock starts here."""
        self.write("set_up", cell=cell_id, kind_setup=kind_setup)

    def cell(self, record: dict) -> None:
        self.write("cell", record=record)

    def exploration(self, record: dict) -> None:
        self.write("exploration", record=record)

    def close(self) -> None:
        """Closes the file. After a refused write, the rest of that line may still be buffered and
        refused again on close: that refusal was reported when it happened, and is not raised twice."""
        try:
            self.file.close()
        except OSError as error:
            if self.refused is None:
                raise ReportNotWritten(self.path, error, self.path.parent) from error


@dataclass
class JournalState:
    run: dict | None = None
    environment: dict | None = None
    precisions: dict = field(default_factory=dict)
    records: dict[str, dict] = field(default_factory=dict)
    explorations: list[dict] = field(default_factory=list)
    restarts: list[float] = field(default_factory=list)  # a process stopped for a fresh one to go on
    started: dict[str, tuple[float, dict]] = field(default_factory=dict)  # cell id -> (start time, axes)
    reruns: dict[str, str | None] = field(default_factory=dict)  # cell id -> its re-run command
    set_up: set[str] = field(default_factory=set)  # cells whose setup (their kind's one-time work) is done
    kind_setups: list[dict] = field(default_factory=list)  # matrix/harness/kind_setup.py's records

    def in_flight(self) -> dict[str, tuple[float, dict]]:
        """Cells that started and have no record: running now, or running when the process died."""
        return {cell: start for cell, start in self.started.items() if cell not in self.records}


def read(directory: Path) -> JournalState:
    """What the journal says so far. A torn last line (the writer died mid-line) is ignored."""
    tail = Tail(directory)
    tail.update()
    return tail.state


class Tail:
    """Follows a journal as it grows, parsing only the lines added since the last update (the
    runner polls it several times a second; rereading a journal of large records would not be
    free on a small machine)."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / JOURNAL
        self.state = JournalState()
        self.offset = 0

    def update(self) -> JournalState:
        try:
            with open(self.path, "rb") as file:
                file.seek(self.offset)
                chunk = file.read()
        except (FileNotFoundError, NotADirectoryError):  # not yet there, or can never be (a bad --report-dir)
            return self.state
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for its end
        self.offset += len(complete)
        for line in complete.decode("utf-8").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                raise ValueError(f"{self.path}: a line is not JSON: {line[:80]!r}") from None
            self.apply(event)
        return self.state

    def apply(self, event: dict) -> None:
        state, kind = self.state, event.get("event")
        if kind == "run":
            state.run, state.environment = event["run"], event["environment"]
            state.precisions = event.get("precisions", {})
        elif kind == "start":
            state.started[event["cell"]] = (event["time"], event["axes"])
            state.reruns[event["cell"]] = event.get("rerun")
        elif kind == "set_up":
            if event["cell"] in state.started:  # the cell's own clock starts after its kind's work
                state.started[event["cell"]] = (event["time"], state.started[event["cell"]][1])
            state.set_up.add(event["cell"])
            if event.get("kind_setup"):
                state.kind_setups.append(event["kind_setup"])
        elif kind == "cell":
            state.records[event["record"]["id"]] = event["record"]
        elif kind == "exploration":
            state.explorations.append(event["record"])
        elif kind == "restart":
            state.restarts.append(event["time"])
