"""A run's directory, reports/<run-id>/: claimed exclusively when the run starts, written at
once, and `reports/latest` pointing at the newest. A report directory is never overwritten."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path

from matrix.grid.cell import Cell
from matrix.results import journal
from matrix.results.compatibility import compatibility_markdown
from matrix.results.document import results_document
from matrix.results.html import html_report
from matrix.results.journal import json_safe
from matrix.results.junit import junit_xml
from matrix.results.markdown import summary_markdown
from matrix.results.records import crash_record


def reports_root(option: str | Path | None, start: Path | None = None) -> Path:
    """Where runs go: --report-dir if given, else reports/ in the directory the run was
    started from (`start`, default the current one). Every command computes it here."""
    return Path(option) if option else (Path(start) if start else Path.cwd()) / "reports"


def create_run_directory(reports_root: Path, run_id: str) -> Path:
    """reports/<run-id>/, created exclusively: a run never writes into another's directory."""
    reports_root.mkdir(parents=True, exist_ok=True)
    directory = reports_root / run_id
    directory.mkdir()  # FileExistsError rather than overwrite
    return directory


def point_latest(reports_root: Path, directory: Path) -> None:
    link = reports_root / "latest"
    temporary = reports_root / f".latest-{secrets.token_hex(4)}"
    try:
        temporary.symlink_to(directory.name, target_is_directory=True)
        os.replace(temporary, link)  # atomic: readers see the old or the new run, never neither
    except OSError:  # no symlinks here (some Windows setups): leave a pointer file instead
        temporary.unlink(missing_ok=True)
        (reports_root / "LATEST").write_text(directory.name + "\n")


def write_documents(directory: Path, document: dict) -> None:
    """results.json, summary.md, junit.xml and index.html of one run, into `directory`."""
    (directory / "results.json").write_text(json.dumps(json_safe(document), indent=2, allow_nan=False) + "\n")
    (directory / "summary.md").write_text(summary_markdown(document))
    table = compatibility_markdown(document)
    if table is not None:  # a run with hf: cells (an architecture sweep): its table beside the summary
        (directory / "compatibility.md").write_text(table, encoding="utf-8")
    (directory / "junit.xml").write_bytes(junit_xml(document))
    (directory / "index.html").write_text(html_report(json_safe(document)), encoding="utf-8")


def write_report(reports_root: Path, document: dict) -> Path:
    """A new reports_root/<run id>/ holding `document` (results_document()), and `latest` at it."""
    directory = create_run_directory(reports_root, document["run"]["id"])
    write_documents(directory, document)
    point_latest(reports_root, directory)
    return directory


def fold_journal(directory: Path, incomplete: bool = True) -> dict:
    """results.json and the rest from a run directory's journal (its controller was killed)."""
    state = journal.read(directory)
    if state.run is None:
        raise ValueError(f"{directory / journal.JOURNAL}: no run header: not a run's journal")
    run = {**state.run, "incomplete": incomplete or bool(state.in_flight())}
    run.setdefault("finished_at", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    records = list(state.records.values())
    for cell_id, (_, axes) in state.in_flight().items():
        died = "found running when the run's process died"
        records.append(crash_record(Cell(**axes), died, "", 0.0, rerun=state.reruns.get(cell_id)).as_dict())
    run.setdefault("duration_s", 0.0)
    run.setdefault("pytest_exit_status", None)
    document = results_document(
        run, state.environment, records, state.explorations, state.precisions, kind_setups=state.kind_setups
    )
    write_documents(directory, document)
    point_latest(directory.parent, directory)
    return document


def write_new_directory(target: Path, document: dict) -> None:
    """All of a run's files appear at `target` at once, or none do (built beside it, renamed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.parent / f".{target.name}.partial-{secrets.token_hex(4)}"
    scratch.mkdir()
    try:
        write_documents(scratch, document)
        if target.exists():  # appeared meanwhile: rename would replace an empty directory
            raise FileExistsError(f"{target} exists")
        scratch.rename(target)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch)
