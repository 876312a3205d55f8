"""pytest's side of a run's recording (matrix/results/recording.py RunRecorder), a plugin object
registered on the controller: the selected cells, each cell's start and record as pytest reports
them, and the report at the end; with the command that re-runs one cell."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

import pytest

from matrix.grid.cell import Cell, cell_id_from_nodeid
from matrix.plugin.parametrize import (
    is_cell_item,
    matrix_item_id,
    shard_plan,
)
from matrix.plugin.session import (
    AXES_PROPERTY,
    EXPLORATION_PROPERTY,
    KIND_SETUP_PROPERTY,
    RESULT_PROPERTY,
    activate,
    active_key,
    device_index,
    option,
    restart_key,
    selection_key,
    shard_key,
)
from matrix.results.journal import REPORT_NOT_WRITTEN_STATUS, ReportNotWritten
from matrix.results.recording import RunInUse, RunRecorder, started_at
from matrix.results.records import (
    CellRecord,
    harness_failure_record,
    skipped_exploration_record,
    skipped_record,
    timeout_record,
)
from matrix.run import options
from matrix.run.supervisor import COMMAND_VARIABLE


def rerun_command(config, nodeid: str, cell: Cell) -> str:
    """The command that re-runs just this cell: its node id, the run's -p plugins (a plugin's
    model kind exists only with them), and the device index it ran on."""
    from matrix.devices import DEVICES

    command = ["pytest", nodeid, *options.plugin_arguments(list(config.invocation_params.args))]
    if DEVICES[cell.device].indexed and device_index(config):
        command.append(f"--cuda-device={device_index(config)}")
    return shlex.join(command)


def invocation() -> str:
    if os.environ.get(COMMAND_VARIABLE):  # started by python -m matrix run
        return os.environ[COMMAND_VARIABLE]
    program = Path(sys.argv[0]).name
    program = "python -m pytest" if program == "__main__.py" else program
    return " ".join([program, *map(shlex.quote, sys.argv[1:])])


def is_timeout(report) -> bool:
    """pytest-timeout's failure: the cell ran past --cell-timeout."""
    return report.failed and "Timeout (>" in str(report.longrepr) and "pytest-timeout" in str(report.longrepr)


@contextlib.contextmanager
def stopping_if_refused():
    """A write to the report that the file system refuses (matrix/results/journal.py
    ReportNotWritten) stops the session with its one line and REPORT_NOT_WRITTEN_STATUS, where it
    would otherwise surface as an internal error of pytest in the middle of a cell's report."""
    try:
        yield
    except ReportNotWritten as error:
        pytest.exit(str(error), returncode=REPORT_NOT_WRITTEN_STATUS)


def skip_reason_of(report) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


class Recorder:
    """pytest's side of a run's recording (matrix/results/recording.py RunRecorder): which cells were
    selected, each cell's start and record as pytest reports them, the report at the end.
    SIGTERM ends the run like Ctrl-C: the cells done so far are written, marked incomplete."""

    def __init__(self, config, root: Path, run_id: str | None) -> None:
        self.config = config
        # the run's directory is claimed now, before any cell runs; a session that runs no cell
        # leaves neither it nor a reports/ made for it behind (pytest_unconfigure)
        self.root, self.root_existed = root, root.exists()
        try:
            self.run = RunRecorder(root, run_id, resume=config.getoption("matrix_resume"))
        except ValueError as error:  # a bad or taken --run-id, or nothing to resume
            message = str(error) if isinstance(error, RunInUse) else f"--run-id: {error}"
            raise pytest.UsageError(message) from None
        except ReportNotWritten as error:  # --report-dir where the run cannot make its directory
            raise pytest.UsageError(f"--report-dir: {error}") from None
        self.nodeids: dict[str, Cell] = {}
        self.previous_sigterm = None

    def pytest_configure(self, config):
        if threading.current_thread() is threading.main_thread():
            self.previous_sigterm = signal.signal(signal.SIGTERM, self.terminate)

    def pytest_unconfigure(self, config):
        if self.previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self.previous_sigterm)
        self.run.close()
        if not self.root_existed and self.root.is_dir() and not any(self.root.iterdir()):
            self.root.rmdir()

    def terminate(self, signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")  # pytest then finishes the session

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session, config, items):
        self.selected = {matrix_item_id(item) for item in items} - {None} | self.run.done()  # resumed: done too
        self.nodeids = {item.nodeid: item.callspec.params["cell"] for item in items if is_cell_item(item)}

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        """Under xdist the workers collect: their node ids say what this run selected."""
        if not self.run.open:
            matrix_ids = {cell_id_from_nodeid(n) or cell_id_from_nodeid(n, "test_explore") for n in ids}
            self.selected = matrix_ids - {None} | self.run.done()
            if self.selected:  # a run of other tests (the harness's own) writes no report
                self.start()

    def pytest_collection_finish(self, session):
        if getattr(self, "selected", None) and not self.run.open:
            self.start()

    def start(self) -> None:
        from matrix.devices import fingerprint as environment
        from matrix.precisions.policies import table

        activate(self.config)  # an xdist controller collects nothing: the cells' side starts here
        with stopping_if_refused():
            self.run.start(
                self.selected, self.run_header(), lambda: environment.capture(device_index(self.config)), table()
            )
        shards = shard_plan(self.config)
        if shards is not None:  # every shard's cells, for merge to name those of a shard that never reported
            shards.write(self.run.directory)

    def run_header(self) -> dict:
        from matrix.devices import fingerprint as environment
        from matrix.grid import schedule
        from matrix.selection.cells import axis_values

        config = self.config
        return {
            "id": self.run.run_id,
            "command": invocation(),
            "started_at": started_at(self.run.started),
            "selection": {axis: list(values) for axis, values in config.stash[selection_key].items()},
            "axes": {axis: list(values) for axis, values in axis_values().items()},
            "workers": getattr(config.option, "numprocesses", None),
            "shard": "{}/{}".format(*config.stash[shard_key]) if config.stash[shard_key] else None,
            "order_seed": option(config, "matrix_order_seed"),  # None: the selection's order
            "cuda_device": config.getoption("matrix_cuda_device"),
            # the version stack nox installed (matrix/releases/stacks.toml); None: an environment of your own
            "stack": os.environ.get("MATRIX_STACK"),
            "cell_timeout_s": option(config, "matrix_cell_timeout"),
            "curve_steps": schedule.train_steps(),
            "initial_weights": os.environ.get(schedule.INITIAL_WEIGHTS_VARIABLE),
            **{f"git_{k}": v for k, v in environment.git_state(config.rootpath).items()},
        }

    def cell_of(self, nodeid: str) -> Cell | None:
        cell = self.nodeids.get(nodeid)
        if cell is None:  # under xdist the controller has no items
            cell = self.named_cell(cell_id_from_nodeid(nodeid))
        return cell

    def named_cell(self, cell_id: str | None) -> Cell | None:
        """The cell of an id in a node id; None where the matrix is not in use in this session
        (a project's own test that happens to be called test_cell imports no torch)."""
        if cell_id is None or not self.config.stash.get(active_key, False):
            return None
        from matrix.selection.cells import cell_from_id

        return cell_from_id(cell_id)

    def pytest_runtest_logstart(self, nodeid, location):
        cell = self.cell_of(nodeid) if "::test_cell[" in nodeid else None
        if cell is not None:
            with stopping_if_refused():
                self.run.cell_started(cell, rerun_command(self.config, nodeid, cell))

    def pytest_runtest_logreport(self, report):
        with stopping_if_refused():
            self.record(report)

    def record(self, report) -> None:
        """What a test's report says of its cell (or exploration), into the run's recording."""
        properties = dict(report.user_properties)
        if report.when == "setup" and report.passed and "::test_cell[" in report.nodeid:
            # the cell's own clock starts now, after its kind's (and engine's libraries') one-time work
            setups = [value for key, value in report.user_properties if key == KIND_SETUP_PROPERTY]
            for setup in setups or [None]:
                self.run.cell_set_up(cell_id_from_nodeid(report.nodeid), setup)
        if EXPLORATION_PROPERTY in properties:
            if report.when == "call":
                self.run.store_exploration(properties[EXPLORATION_PROPERTY])
            return
        target_id = cell_id_from_nodeid(report.nodeid, "test_explore")
        if target_id is not None:
            cell = self.named_cell(target_id)
            if report.skipped and cell is not None:
                self.run.store_exploration(skipped_exploration_record(cell, skip_reason_of(report)))
            return
        axes = properties.get(AXES_PROPERTY)
        cell = Cell(**axes) if axes is not None else self.cell_of(report.nodeid)
        if cell is None:
            return
        from matrix.devices import DEVICES

        records = self.run.records
        common = {
            "rerun": rerun_command(self.config, report.nodeid, cell),
            **DEVICES[cell.device].placement(device_index(self.config)),
        }
        if RESULT_PROPERTY in properties and report.when == "call":
            self.run.store(CellRecord.from_dict(properties[RESULT_PROPERTY]))
        elif report.skipped and cell.id not in records:
            self.run.store(skipped_record(cell, skip_reason_of(report), **common))
        elif report.failed and (cell.id not in records or records[cell.id]["outcome"] == "passed"):
            # Failed outside run_cell: a fixture error, a teardown check, a timeout, or a crashed worker.
            if is_timeout(report):
                record = timeout_record(
                    cell, option(self.config, "matrix_cell_timeout"), str(report.longrepr), **common
                )
            else:
                phase = report.when if report.when in ("setup", "call", "teardown") else "crash"
                record = harness_failure_record(
                    cell, phase, str(report.longrepr), getattr(report, "duration", 0.0), **common
                )
            self.run.store(record)

    @pytest.hookimpl(wrapper=True)
    def pytest_sessionfinish(self, session, exitstatus):
        """The report is written after every other plugin's sessionfinish, even when one of them
        raises: pytest's own tears down the fixtures, and a Ctrl-C or SIGTERM that came during a
        fixture's setup makes tmp_path's teardown raise KeyError there (pytest 9.2)."""
        try:
            return (yield)
        finally:
            with stopping_if_refused():
                self.run.finish(exitstatus, self.config.stash.get(restart_key, None))

    def pytest_terminal_summary(self, terminalreporter):
        if not self.run.written:
            return
        counts = self.run.counts()
        terminalreporter.write_sep("=", "precision matrix")
        if self.run.records:
            terminalreporter.write_line(
                f"{counts['failed']} failures not in the catalogue, {counts['fixed']} fixed, "
                f"{counts['known']} known failures, {counts['passed']} passed, {counts['skipped']} skipped cells"
                + (f", {counts['inapplicable']} not applicable here" if counts["inapplicable"] else "")
            )
        ran = [e for e in self.run.explorations if e["skip_reason"] is None]
        if ran:
            findings = [f for e in ran for f in e["findings"]]
            terminalreporter.write_line(
                f"{len(ran)} explorations, {sum(e['examples_run'] for e in ran)} variants run: "
                f"{sum(f['status'] == 'new' for f in findings)} new findings, "
                f"{sum(f['status'] == 'known' for f in findings)} known"
            )
        terminalreporter.write_line(f"report: {self.run.written / 'summary.md'}")
