"""pytest wiring for the matrix: axis options, cell parametrization, skip reasons, isolation
between cells, and result recording where pytest's reports arrive (the controller, when
pytest-xdist runs workers), so a cell whose worker crashed is still in the report.

With --explore, cases/test_explore.py is collected too: one exploration per selected target
cell (see explorable()), sharing the --explore-seconds budget."""

from __future__ import annotations

import argparse
import calendar
import faulthandler
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

# Nothing is downloaded at run time: every model is built from a config in code. Offline
# mode makes an accidental hub call fail loudly instead.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest
import torch

from matrix.devices import interpret_triton_without_cuda

interpret_triton_without_cuda()  # before anything imports triton (transformers' models do)

import transformers

from matrix import catalogue as known_failures
from matrix import environment, journal
from matrix import report as matrix_report
from matrix.cells import (
    Cell,
    axis_values,
    cell_from_id,
    cell_id_from_nodeid,
    enumerate_cells,
    parse_selection,
    parse_shard,
    shard_cells,
)
from matrix.devices import resolve_cuda_index, skip_reason
from matrix.engines import ENGINES
from matrix.models import MODELS
from matrix.precisions import PRECISIONS
from matrix.results_file import AXES
from matrix.runner import CELL_TIMEOUT_S, COMMAND_VARIABLE

transformers.utils.logging.disable_progress_bar()

AXES_PROPERTY = "matrix_cell"
RESULT_PROPERTY = "matrix_result"
EXPLORATION_PROPERTY = "matrix_exploration"
EXPLORE_TIMEOUT_MARGIN_S = 600
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
EXPLORE_FILE = Path(__file__).resolve().parent / "cases" / "test_explore.py"
selection_key = pytest.StashKey[dict]()
catalogue_key = pytest.StashKey[known_failures.Catalogue]()
installed_key = pytest.StashKey[dict]()
recorder_key = pytest.StashKey["Recorder"]()
explore_clock_key = pytest.StashKey["ExploreClock"]()
cuda_index_key = pytest.StashKey[int]()
shard_key = pytest.StashKey["tuple[int, int] | None"]()
restart_key = pytest.StashKey[str]()  # why this process must stop and the run resume in a new one


def pytest_addoption(parser):
    group = parser.getgroup("matrix", "mixed-precision matrix")
    for axis in AXES:
        group.addoption(
            f"--{axis}",
            dest=f"matrix_{axis}",
            default=None,
            metavar="A,B",
            help=f"{axis} values to run, comma-separated (default: all; see README)",
        )
    group.addoption(
        "--cuda-device",
        dest="matrix_cuda_device",
        default="0",
        metavar="N|per-worker",
        help="index of the GPU the cuda cells run on (default 0), or per-worker: pytest-xdist worker gwK "
        "uses GPU K mod the number visible (one worker per GPU with -n <GPUs>); recorded per cell",
    )
    group.addoption(
        "--shard",
        dest="matrix_shard",
        default=None,
        metavar="K/N",
        help="run shard K of N of the selected cells (dealt round-robin); merge the shards' reports with "
        "python -m matrix merge",
    )
    group.addoption(
        "--run-id",
        dest="matrix_run_id",
        default=None,
        metavar="ID",
        help="name of this run's report directory (default: UTC time + random suffix); it must not exist",
    )
    group.addoption(
        "--cell-timeout",
        dest="matrix_cell_timeout",
        type=float,
        default=CELL_TIMEOUT_S,
        metavar="S",
        help=f"a cell running longer fails with a timeout signature (default {CELL_TIMEOUT_S:g}; "
        "python -m matrix run also kills a process stuck past it)",
    )
    group.addoption("--matrix-resume", dest="matrix_resume", action="store_true", help=argparse.SUPPRESS)
    group.addoption(
        "--report-dir",
        dest="matrix_report_dir",
        default=None,
        metavar="DIR",
        help="where run reports go (default: reports/ beside this conftest)",
    )
    group.addoption("--no-report", dest="matrix_no_report", action="store_true", help="write no report directory")
    group.addoption(
        "--catalogue",
        dest="matrix_catalogue",
        default=None,
        metavar="FILE",
        help="known-failure catalogue (default: matrix/known_failures.toml)",
    )
    group.addoption(
        "--run-contradictory",
        dest="matrix_run_contradictory",
        action="store_true",
        help="run precision policies that contradict themselves instead of failing them in 'configure'",
    )
    group.addoption(
        "--explore",
        dest="matrix_explore",
        action="store_true",
        help="also run the hypothesis explorations (cases/test_explore.py) of the selected cells",
    )
    group.addoption(
        "--explore-examples",
        dest="matrix_explore_examples",
        type=int,
        default=50,
        metavar="N",
        help="variants tried per explored target, at most (default 50)",
    )
    group.addoption(
        "--explore-seconds",
        dest="matrix_explore_seconds",
        type=float,
        default=300.0,
        metavar="S",
        help="wall-time budget of all explorations together, shared out among targets (default 300)",
    )
    group.addoption(
        "--explore-seed", dest="matrix_explore_seed", type=int, default=0, metavar="K", help="search seed (default 0)"
    )
    group.addoption(
        "--explore-findings",
        dest="matrix_explore_findings",
        type=int,
        default=3,
        metavar="M",
        help="distinct failures to find per target before moving on (default 3)",
    )
    group.addoption(
        "--strict-known",
        dest="matrix_strict_known",
        action="store_true",
        help="a cell the catalogue says fails but that passes (fixed) fails the run",
    )


def is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def cuda_index(config) -> int:
    return config.stash[cuda_index_key]


def pytest_configure(config):
    config.addinivalue_line("markers", "cell: a matrix cell (model x precision x mode x device)")
    if is_worker(config):
        # N xdist workers share the cores: torch's default of one thread per core in each
        # of them oversubscribes the machine (measured 2.4x slower with 2 workers on 2 cores).
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    try:
        config.stash[selection_key] = {axis: parse_selection(axis, config.getoption(f"matrix_{axis}")) for axis in AXES}
        config.stash[shard_key] = parse_shard(config.getoption("matrix_shard"))
        worker_id = config.workerinput["workerid"] if is_worker(config) else None
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        config.stash[cuda_index_key] = resolve_cuda_index(config.getoption("matrix_cuda_device"), worker_id, visible)
    except ValueError as error:  # SelectionError, or a bad --cuda-device
        raise pytest.UsageError(str(error)) from None
    catalogue_path = Path(config.getoption("matrix_catalogue") or known_failures.CATALOGUE_FILE)
    try:
        config.stash[catalogue_key] = known_failures.load(catalogue_path)
    except (OSError, known_failures.CatalogueError) as error:
        raise pytest.UsageError(f"--catalogue: {error}") from None
    config.stash[installed_key] = environment.package_versions()
    if not is_worker(config) and not config.getoption("matrix_no_report"):
        root = config.getoption("matrix_report_dir") or Path(__file__).parent / "reports"
        config.stash[recorder_key] = Recorder(config, Path(root), config.getoption("matrix_run_id"))
        config.pluginmanager.register(config.stash[recorder_key], "matrix-recorder")


def pytest_ignore_collect(collection_path, config):
    if collection_path == EXPLORE_FILE and not config.getoption("matrix_explore"):
        return True  # explorations run only when asked for: they never slow the matrix down
    return None


def explorable(cell: Cell) -> bool:
    """fp32 is the reference every variant is compared with; a precision that fails its own
    policy check fails in 'configure' whatever the variant."""
    return (
        cell.precision != "fp32" and not PRECISIONS[cell.precision].contradictions() and MODELS[cell.model].explorable
    )


def cell_marks(cell: Cell, cuda_index: int) -> list:
    precision = PRECISIONS[cell.precision]
    reason = (
        ENGINES[cell.engine].unsupported_reason(precision)
        or skip_reason(cell.device, precision, cuda_index)
        or MODELS[cell.model].skip_reason(cell.device)
    )
    return [pytest.mark.cell] + ([pytest.mark.skip(reason=reason)] if reason else [])


def selected_cells(config) -> list[Cell]:
    """The cells of the axis selection, then of this --shard."""
    return shard_cells(enumerate_cells(config.stash[selection_key]), config.stash[shard_key])


def pytest_generate_tests(metafunc):
    if "explore_target" in metafunc.fixturenames:
        cuda = cuda_index(metafunc.config)
        targets = [c for c in selected_cells(metafunc.config) if explorable(c)]
        metafunc.parametrize("explore_target", [pytest.param(c, id=c.id, marks=cell_marks(c, cuda)) for c in targets])
    if "cell" not in metafunc.fixturenames:
        return
    own = [m for m in metafunc.definition.iter_markers("parametrize") if "cell" in str(m.args[0])]
    if own:  # a test that parametrizes `cell` itself chooses its own cells
        return
    cuda = cuda_index(metafunc.config)
    params = [pytest.param(c, id=c.id, marks=cell_marks(c, cuda)) for c in selected_cells(metafunc.config)]
    metafunc.parametrize("cell", params)


def is_cell_item(item) -> bool:
    return getattr(item, "originalname", None) == "test_cell" and isinstance(
        getattr(getattr(item, "callspec", None), "params", {}).get("cell"), Cell
    )


def matrix_item_id(item) -> str | None:
    """The cell a matrix item runs (cases/: test_cell, test_explore); None for other tests."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if is_cell_item(item):
        return params["cell"].id
    target = params.get("explore_target")
    return target.id if getattr(item, "originalname", None) == "test_explore" and isinstance(target, Cell) else None


def resumed_done(config) -> set[str]:
    """With --matrix-resume: the cells and targets the run's journal already has."""
    if not config.getoption("matrix_resume"):
        return set()
    root = Path(config.getoption("matrix_report_dir") or Path(__file__).parent / "reports")
    state = journal.read(root / (config.getoption("matrix_run_id") or ""))
    return set(state.records) | {e["target"] for e in state.explorations}


def pytest_collection_modifyitems(config, items):
    done = resumed_done(config)  # in each process that collects: the main one, or xdist's workers
    if done:
        config.hook.pytest_deselected(items=[item for item in items if matrix_item_id(item) in done])
        items[:] = [item for item in items if matrix_item_id(item) not in done]
    explorations = 0
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if isinstance(params.get("cell"), Cell):
            item.user_properties.append((AXES_PROPERTY, params["cell"].axes()))
            item.add_marker(pytest.mark.timeout(config.getoption("matrix_cell_timeout")))
        if isinstance(params.get("explore_target"), Cell):
            explorations += not any(m.name == "skip" for m in item.iter_markers())
            # pytest-timeout's per-test limit (pyproject.toml) fits a cell, not a search that
            # may get the whole budget; shrinking and explaining a finding run past it a little
            item.add_marker(pytest.mark.timeout(config.getoption("matrix_explore_seconds") + EXPLORE_TIMEOUT_MARGIN_S))
    config.stash[explore_clock_key] = ExploreClock(config.getoption("matrix_explore_seconds"), explorations)


class ExploreClock:
    """Shares the explorations' wall-time budget out: each target gets what is left divided
    by the targets still to run, so time a quick target leaves goes to the next ones."""

    def __init__(self, total_seconds: float, targets: int) -> None:
        self.total, self.targets, self.started = total_seconds, targets, None

    def next_share(self) -> float:
        if self.started is None:
            self.started = time.monotonic()
        left = max(0.0, self.total - (time.monotonic() - self.started))
        share = left / max(1, self.targets)
        self.targets = max(0, self.targets - 1)
        return share


@pytest.fixture(autouse=True)
def isolated_torch_state():
    """A cell starts clean and leaves nothing behind."""
    saved = (
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        torch.are_deterministic_algorithms_enabled(),
        torch.get_num_threads(),
        dict(os.environ),
    )
    yield
    default_dtype, grad_enabled, deterministic, threads, env = saved
    torch.set_default_dtype(default_dtype)
    torch.set_grad_enabled(grad_enabled)
    torch.use_deterministic_algorithms(deterministic)
    torch.set_num_threads(threads)
    os.environ.clear()
    os.environ.update(env)
    assert not torch.is_autocast_enabled("cpu"), "a cell left CPU autocast enabled"


def rerun_command(config, cell: Cell) -> str:
    command = ["pytest", f"cases/test_cells.py::test_cell[{cell.id}]"]
    if cell.device == "cuda" and cuda_index(config):
        command.append(f"--cuda-device={cuda_index(config)}")
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


def skip_reason_of(report) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


class Recorder:
    """Collects one record per cell from the reports pytest delivers and writes the run.

    The run's directory is created when the first cells are collected; from then on every
    cell's start and record go to its journal (matrix/journal.py) as they happen, and
    results.json is folded from them at the end. SIGTERM ends the run like Ctrl-C: the cells
    done so far are written, marked incomplete. With --matrix-resume (python -m matrix run,
    after a crash) the journal's finished cells are kept and not run again.
    """

    def __init__(self, config, reports_root: Path, run_id: str | None = None) -> None:
        self.config = config
        self.reports_root = reports_root
        self.resume = config.getoption("matrix_resume")
        try:
            self.run_id = journal.check_run_id(run_id) if run_id else journal.new_run_id()
        except ValueError as error:
            raise pytest.UsageError(f"--run-id: {error}") from None
        self.directory = reports_root / self.run_id
        if not self.resume:
            try:  # claimed now, exclusively: a second run with this id stops here, before any cell
                matrix_report.create_run_directory(reports_root, self.run_id)
            except FileExistsError:
                raise pytest.UsageError(
                    f"--run-id: {self.directory} exists; a run never writes into another run's directory"
                ) from None
        self.started = time.time()
        self.records: dict[str, dict] = {}
        self.explorations: list[dict] = []
        self.selected: set[str] = set()
        self.cells_by_nodeid: dict[str, Cell] = {}
        self.journal: journal.Journal | None = None
        self.written: Path | None = None
        self.header: dict | None = None
        if self.resume:
            state = journal.read(self.directory)
            if state.run is None:
                raise pytest.UsageError(f"--matrix-resume: {self.directory} has no journal to resume")
            self.header, self.environment = state.run, state.environment
            self.records, self.explorations = dict(state.records), list(state.explorations)

    def pytest_configure(self, config):
        if threading.current_thread() is threading.main_thread():
            self.previous_sigterm = signal.signal(signal.SIGTERM, self.terminate)

    def pytest_unconfigure(self, config):
        if getattr(self, "previous_sigterm", None) is not None:
            signal.signal(signal.SIGTERM, self.previous_sigterm)
        if self.journal is None:  # no cell was selected (pytest tests, --collect-only): leave nothing
            if not self.resume and self.directory.is_dir() and not any(self.directory.iterdir()):
                self.directory.rmdir()
        else:
            self.journal.close()
            faulthandler.disable()
            self.faulthandler_log.close()
            log = Path(self.faulthandler_log.name)
            if log.exists() and log.stat().st_size == 0:
                log.unlink()  # nothing crashed

    def terminate(self, signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")  # pytest then finishes the session

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session, config, items):
        done = set(self.records) | {e["target"] for e in self.explorations}
        self.selected = {matrix_item_id(item) for item in items} - {None} | done
        self.cells_by_nodeid = {item.nodeid: item.callspec.params["cell"] for item in items if is_cell_item(item)}

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        """Under xdist the workers collect: their node ids say what this run selected."""
        if self.journal is None:
            done = set(self.records) | {e["target"] for e in self.explorations}
            matrix_ids = {cell_id_from_nodeid(n) or cell_id_from_nodeid(n, "test_explore") for n in ids}
            self.selected = matrix_ids - {None} | done
            self.open_journal()

    def pytest_collection_finish(self, session):
        if self.selected and self.journal is None:
            self.open_journal()

    def open_journal(self) -> None:
        self.journal = journal.Journal(self.directory)
        if self.header is None:
            self.header = self.run_header()
            self.environment = environment.capture(cuda_index(self.config))
            self.journal.header(self.header, self.environment)
        # a cell that kills the process leaves its Python stack here (python -m matrix run reads it)
        self.faulthandler_log = open(self.directory / f"faulthandler-{os.getpid()}.log", "w")
        faulthandler.enable(file=self.faulthandler_log, all_threads=True)

    def pytest_runtest_logstart(self, nodeid, location):
        if self.journal is None:
            return
        cell = self.cells_by_nodeid.get(nodeid)
        if cell is None and "::test_cell[" in nodeid:  # under xdist the controller has no items
            cell = cell_from_id(cell_id_from_nodeid(nodeid) or "")
        if cell is not None:
            self.journal.started(cell.id, cell.axes())

    def store(self, record: dict) -> None:
        self.records[record["id"]] = record
        if self.journal is not None:
            self.journal.cell(record)

    def run_header(self) -> dict:
        return {
            "id": self.run_id,
            "command": invocation(),
            "started_at": time.strftime(TIME_FORMAT, time.gmtime(self.started)),
            "selection": {axis: list(values) for axis, values in self.config.stash[selection_key].items()},
            "axes": {axis: list(values) for axis, values in axis_values().items()},
            "workers": getattr(self.config.option, "numprocesses", None),
            "shard": "{}/{}".format(*self.config.stash[shard_key]) if self.config.stash[shard_key] else None,
            "cuda_device": self.config.getoption("matrix_cuda_device"),
            # the version stack nox installed (matrix/stacks.toml); None: an environment of your own
            "stack": os.environ.get("MATRIX_STACK"),
            "cell_timeout_s": self.config.getoption("matrix_cell_timeout"),
            **{f"git_{k}": v for k, v in environment.git_state(Path(__file__).parent).items()},
        }

    def pytest_runtest_logreport(self, report):
        properties = dict(report.user_properties)
        if EXPLORATION_PROPERTY in properties:
            if report.when == "call":
                self.explorations.append(properties[EXPLORATION_PROPERTY])
                if self.journal is not None:
                    self.journal.exploration(properties[EXPLORATION_PROPERTY])
            return
        target_id = cell_id_from_nodeid(report.nodeid, "test_explore")
        if target_id is not None:
            cell = cell_from_id(target_id)
            if report.skipped and cell is not None:
                self.explorations.append(matrix_report.skipped_exploration_record(cell, skip_reason_of(report)))
                if self.journal is not None:
                    self.journal.exploration(self.explorations[-1])
            return
        axes = properties.get(AXES_PROPERTY)
        if axes is not None:
            cell = Cell(**axes)
        else:  # a report xdist made for a crashed worker carries only the node id
            cell_id = cell_id_from_nodeid(report.nodeid)
            cell = cell_from_id(cell_id) if cell_id else None
            if cell is None:
                return
        if RESULT_PROPERTY in properties and report.when == "call":
            self.store(properties[RESULT_PROPERTY])
        elif report.skipped and cell.id not in self.records:
            self.store(matrix_report.skipped_record(cell, skip_reason_of(report)))
        elif report.failed and (cell.id not in self.records or self.records[cell.id]["outcome"] == "passed"):
            # Failed outside run_cell: a fixture error, a teardown check, a timeout, or a crashed worker.
            if is_timeout(report):
                record = matrix_report.timeout_record(
                    cell, self.config.getoption("matrix_cell_timeout"), str(report.longrepr)
                )
            else:
                phase = report.when if report.when in ("setup", "call", "teardown") else "crash"
                record = matrix_report.harness_failure_record(
                    cell, phase, str(report.longrepr), getattr(report, "duration", 0.0)
                )
            self.store(record)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        if self.journal is None:
            return
        finished = time.time()
        for record in self.records.values():  # skipped and harness-failed cells: the controller's command
            if record.get("rerun") is None:
                record["rerun"] = rerun_command(self.config, Cell(**{axis: record[axis] for axis in AXES}))
        missing = self.selected - set(self.records) - {e["target"] for e in self.explorations}
        run = {
            **self.header,
            "finished_at": time.strftime(TIME_FORMAT, time.gmtime(finished)),
            # from the first start: a resumed run (python -m matrix run, after a crash) counts it all
            "duration_s": round(finished - calendar.timegm(time.strptime(self.header["started_at"], TIME_FORMAT)), 2),
            "pytest_exit_status": int(exitstatus),
            "incomplete": bool(missing),
        }
        if self.resume:
            run["resumed"] = True
        restart = self.config.stash.get(restart_key, None)
        if restart and missing:
            self.journal.write("restart", reason=restart)  # python -m matrix run resumes the rest
        document = matrix_report.results_document(run, self.environment, list(self.records.values()), self.explorations)
        matrix_report.write_documents(self.directory, document)
        matrix_report.point_latest(self.reports_root, self.directory)
        self.written = self.directory

    def pytest_terminal_summary(self, terminalreporter):
        if self.written:
            counts = matrix_report.outcome_counts(self.records.values())
            terminalreporter.write_sep("=", "precision matrix")
            if self.records:
                terminalreporter.write_line(
                    f"{counts['failed']} new failures, {counts['fixed']} fixed, {counts['known']} known failures, "
                    f"{counts['passed']} passed, {counts['skipped']} skipped cells"
                )
            ran = [e for e in self.explorations if e["skip_reason"] is None]
            if ran:
                findings = [f for e in ran for f in e["findings"]]
                terminalreporter.write_line(
                    f"{len(ran)} explorations, {sum(e['examples_run'] for e in ran)} variants run: "
                    f"{sum(f['status'] == 'new' for f in findings)} new findings, "
                    f"{sum(f['status'] == 'known' for f in findings)} known"
                )
            terminalreporter.write_line(f"report: {self.written / 'summary.md'}")
