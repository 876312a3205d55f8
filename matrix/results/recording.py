"""A run's recording, without pytest: the run directory claimed when the run starts, every
cell's start and record journaled as they happen (matrix/results/journal.py), and the report
folded from them at the end. The pytest plugin (matrix/plugin/hooks.py) feeds it from pytest's
reports; a resumed run (python -m matrix run, after a crash) picks its journal up again.
"""

from __future__ import annotations

import calendar
import faulthandler
import json
import os
import time
from pathlib import Path

from matrix.grid.cell import Cell
from matrix.results import journal
from matrix.results.document import results_document
from matrix.results.records import CellRecord, outcome_counts
from matrix.results.run_directory import create_run_directory, point_latest, write_documents
from matrix.results.signatures import Signature, normalize_message

TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def recordable_entry(entry: dict) -> dict:
    """A cell's record as results.json can hold it. A record holding what JSON cannot (an engine's
    settings or a step's loss as an object) never ends the run: the cell fails in phase `record`,
    its signature naming what could not be written, its own traceback and message kept, and the
    value written as its repr."""
    try:
        json.dumps(journal.json_safe(entry), allow_nan=False)
        return entry
    except (TypeError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    unwritable: list[str] = []

    def written(value):
        unwritable.append(type(value).__name__)
        return f"<not recordable: {type(value).__name__}: {value!r}>"[:300]

    safe = json.loads(json.dumps(journal.json_safe(entry), allow_nan=False, default=written))
    signature = Signature("record", "RecordUnwritable", normalize_message(error), "<recording>")
    types = ", ".join(sorted(set(unwritable)))
    cause = f"the cell's record holds what results.json cannot: {error} (values of type {types})"
    before = safe.get("outcome")
    if safe.get("phase"):
        before += f" in phase {safe['phase']}: {safe.get('message') or ''}".rstrip()
    safe.update(
        outcome="failed",
        phase="record",
        signature=signature.as_dict(),
        message=f"{cause}\nthe cell had {before}",
        traceback="\n\n".join(t for t in (safe.get("traceback"), cause) if t),
        known_failure=None,
    )
    return safe


class RunInUse(ValueError):
    """The run's directory exists (another run's) or, resuming, has no journal."""


class RunRecorder:
    def __init__(self, reports_root: Path, run_id: str | None, resume: bool = False) -> None:
        self.reports_root = Path(reports_root)
        self.run_id = journal.check_run_id(run_id) if run_id else journal.new_run_id()  # ValueError
        self.directory = self.reports_root / self.run_id
        self.resume = resume
        self.started = time.time()
        self.records: dict[str, dict] = {}
        self.explorations: list[dict] = []
        self.kind_setups: list[dict] = []  # matrix/harness/kind_setup.py's records, one per kind and process
        self.selected: set[str] = set()
        self.journal: journal.Journal | None = None
        self.header: dict | None = None
        self.environment: dict | None = None
        self.precisions: dict = {}
        self.written: Path | None = None
        self.faulthandler_log = None
        if resume:
            state = journal.read(self.directory)
            if state.run is None:
                raise RunInUse(f"--matrix-resume: {self.directory} has no journal to resume")
            self.header, self.environment, self.precisions = state.run, state.environment, state.precisions
            self.records, self.explorations = dict(state.records), list(state.explorations)
            self.kind_setups = list(state.kind_setups)
        else:
            try:  # claimed now, exclusively: a second run with this id stops here, before any cell
                create_run_directory(self.reports_root, self.run_id)
            except FileExistsError:
                raise RunInUse(
                    f"--run-id: {self.directory} exists; a run never writes into another run's directory"
                ) from None
            except OSError as error:  # a report directory the file system refuses: before any cell
                raise journal.ReportNotWritten(self.directory, error) from error

    def done(self) -> set[str]:
        """Cells and exploration targets already recorded (a resumed run skips them)."""
        return set(self.records) | {e["target"] for e in self.explorations}

    @property
    def open(self) -> bool:
        return self.journal is not None

    def start(self, selected: set[str], header: dict, environment, precisions: dict) -> None:
        """The cells are known: open the journal (writing the header once) and catch crashes'
        stacks. `environment` is called only for a new run (capturing it costs a probe)."""
        self.selected = set(selected) | self.done()
        self.journal = journal.Journal(self.directory)
        if self.header is None:
            self.header, self.environment, self.precisions = header, environment(), precisions
            self.journal.header(self.header, self.environment, self.precisions)
        # a cell that kills the process leaves its Python stack here (python -m matrix run reads it)
        log = self.directory / f"faulthandler-{os.getpid()}.log"
        try:
            self.faulthandler_log = open(log, "w")
        except OSError as error:
            raise journal.ReportNotWritten(log, error, self.directory) from error
        faulthandler.enable(file=self.faulthandler_log, all_threads=True)

    def cell_started(self, cell: Cell, rerun: str | None) -> None:
        if self.journal is not None:
            self.journal.started(cell.id, cell.axes(), rerun)

    def cell_set_up(self, cell_id: str | None, kind_setup: dict | None) -> None:
        """The cell's setup is done (its kind's one-time work with it, if this was the kind's
        first cell here): from now its own timeout runs."""
        if kind_setup is not None:
            self.kind_setups.append(kind_setup)
        if self.journal is not None and cell_id is not None:
            self.journal.set_up(cell_id, kind_setup)

    def store(self, record: CellRecord) -> None:
        self.records[record.id] = recordable_entry(record.as_dict())
        if self.journal is not None:
            self.journal.cell(self.records[record.id])

    def store_exploration(self, record: dict) -> None:
        self.explorations.append(record)
        if self.journal is not None:
            self.journal.exploration(record)

    def missing(self) -> set[str]:
        return self.selected - self.done()

    def finish(self, exit_status: int, restart_reason: str | None = None) -> Path | None:
        """Write results.json and the rest from everything recorded; point `latest` at it. Nothing,
        after a journal write the file system refused (the run stopped on it)."""
        if self.journal is None or self.journal.refused is not None:
            return None
        finished = time.time()
        missing = self.missing()
        run = {
            **self.header,
            "finished_at": time.strftime(TIME_FORMAT, time.gmtime(finished)),
            # from the first start: a resumed run (python -m matrix run, after a crash) counts it all
            "duration_s": round(finished - calendar.timegm(time.strptime(self.header["started_at"], TIME_FORMAT)), 2),
            "pytest_exit_status": int(exit_status),
            "incomplete": bool(missing),
        }
        if self.resume:
            run["resumed"] = True
        if restart_reason and missing:
            self.journal.write("restart", reason=restart_reason)  # python -m matrix run resumes the rest
        document = results_document(
            run,
            self.environment,
            list(self.records.values()),
            self.explorations,
            self.precisions,
            kind_setups=self.kind_setups,
            missing=[{"id": cell_id, "shard": self.header.get("shard")} for cell_id in missing],
        )
        try:
            write_documents(self.directory, document)
            point_latest(self.reports_root, self.directory)
        except OSError as error:
            path = Path(error.filename) if error.filename else self.directory
            raise journal.ReportNotWritten(path, error, self.directory) from error
        self.written = self.directory
        return self.directory

    def close(self) -> None:
        """Leave nothing where nothing was selected; else close the journal and the crash log."""
        if self.journal is None:
            if not self.resume and self.directory.is_dir() and not any(self.directory.iterdir()):
                self.directory.rmdir()
            return
        try:
            self.journal.close()
        finally:
            if self.faulthandler_log is not None:
                faulthandler.disable()
                self.faulthandler_log.close()
                log = Path(self.faulthandler_log.name)
                if log.exists() and log.stat().st_size == 0:
                    log.unlink()  # nothing crashed

    def counts(self):
        return outcome_counts(self.records.values())


def started_at(timestamp: float) -> str:
    return time.strftime(TIME_FORMAT, time.gmtime(timestamp))
