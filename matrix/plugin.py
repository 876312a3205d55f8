"""The pytest plugin (entry point `pytest11: matrix`): the matrix's options, the parametrization
of its two tests (matrix/pytest_cases.py) with the selected cells and their skip reasons, the
isolation between cells, and the recording of results where pytest's reports arrive (the
controller, when pytest-xdist runs workers), so a cell whose worker crashed is still in the
report. Hooks and fixtures only: running a cell is matrix/execute.py, recording a run
matrix/recording.py, reports matrix/results/.

pytest loads it in every session of an environment that has the package, so it stays out of the
way until the matrix is used: importing it imports pytest, the standard library and the
matrix's torch-free modules only, and a session that selects none of the matrix's tests imports
no torch and sees its environment untouched. The stack comes in when the matrix is first needed
in a process (activate(): a matrix test is parametrized, a matrix option was given, or an xdist
controller hears of cells), and the cells' environment variables (matrix/cell_environment.py)
are set only while the matrix's tests are parametrized and run, then put back.
"""

from __future__ import annotations

import os
import random
import shlex
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from matrix import cell_environment, options
from matrix.cell import AXES, Cell, SelectionError, cell_id_from_nodeid
from matrix.recording import RunInUse, RunRecorder, started_at
from matrix.results.records import (
    CellRecord,
    harness_failure_record,
    skipped_exploration_record,
    skipped_record,
    timeout_record,
)
from matrix.results.run_directory import reports_root
from matrix.runner import COMMAND_VARIABLE
from matrix.shards import Costs, ShardPlan, parse_shard, plan

RESULT_PROPERTY = "matrix_result"
KIND_SETUP_PROPERTY = "matrix_kind_setup"
EXPLORATION_PROPERTY = "matrix_exploration"
AXES_PROPERTY = "matrix_cell"
EXPLORE_TIMEOUT_MARGIN_S = 600

active_key = pytest.StashKey[bool]()  # the matrix's side of the session is set up in this process
selection_key = pytest.StashKey[dict]()
catalogue_key = pytest.StashKey["Catalogue"]()
installed_key = pytest.StashKey[dict]()
recorder_key = pytest.StashKey["Recorder"]()
explore_clock_key = pytest.StashKey["ExploreClock"]()
device_index_key = pytest.StashKey[int]()
shard_key = pytest.StashKey["tuple[int, int] | None"]()
shard_costs_key = pytest.StashKey["Costs | None"]()
shard_plan_key = pytest.StashKey["ShardPlan"]()
values_key = pytest.StashKey[dict]()  # the checked values of options that have a check
restart_key = pytest.StashKey[str]()  # why this process must stop and the run resume in a new one
deferred_error_key = pytest.StashKey[pytest.UsageError]()  # bad input found while collecting


def pytest_addoption(parser):
    group = parser.getgroup("matrix", "mixed-precision matrix")
    options.add_arguments(group.addoption)


def is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def device_index(config) -> int:
    activate(config)
    return config.stash[device_index_key]


def option(config, dest: str):
    """An option's value, checked (matrix/options.py)."""
    return config.stash[values_key][dest] if dest in config.stash[values_key] else config.getoption(dest)


def pytest_configure(config):
    """Only what needs no torch, unless the session was given matrix options: then it is a
    matrix run, and bad input stops it here, before anything runs (in an xdist controller too)."""
    config.addinivalue_line("markers", "cell: a matrix cell (model x precision x mode x device x engine)")
    try:
        config.stash[values_key] = {
            o.dest: options.checked(o.dest, config.getoption(o.dest)) for o in options.OPTIONS if o.check
        }
        config.stash[shard_key] = parse_shard(config.getoption("matrix_shard"))
        config.stash[shard_costs_key] = shard_costs(config)
    except ValueError as error:  # SelectionError, OptionError
        raise pytest.UsageError(str(error)) from None
    export_run_settings(config)
    if options.given(config.getoption):
        activate(config)
    if not is_worker(config) and not config.getoption("matrix_no_report"):
        root = reports_root(config.getoption("matrix_report_dir"), config.invocation_params.dir)
        config.stash[recorder_key] = Recorder(config, root, config.getoption("matrix_run_id"))
        config.pluginmanager.register(config.stash[recorder_key], "matrix-recorder")


def export_run_settings(config) -> None:
    """The run's curve length and initial weights, as environment variables: what every cell of
    the run reads them from, in this process and in the ranks it starts (matrix/schedule.py,
    matrix/initial_weights.py)."""
    from matrix import schedule

    steps = config.stash[values_key].get("matrix_curve_steps")
    if steps is not None:
        os.environ[schedule.CURVE_STEPS_VARIABLE] = str(steps)
    weights = config.getoption("matrix_initial_weights")
    if weights:
        directory = Path(weights).resolve()
        if not directory.is_dir():
            raise pytest.UsageError(f"--initial-weights: {weights} is not a directory")
        os.environ[schedule.INITIAL_WEIGHTS_VARIABLE] = str(directory)


def activate(config) -> None:
    """The matrix's side of the session, set up once per process when it is first needed: the
    registries (torch and the matrix's axes), the axis selection, the GPU index, the catalogue
    and the installed versions. pytest.UsageError for bad input."""
    if config.stash.get(active_key, False):
        return
    with cell_environment.applied():  # the stack comes in here, triton perhaps with it
        from matrix import catalogue, environment
        from matrix.devices import DEVICES, resolve_index
        from matrix.engines import distributed
        from matrix.selection import parse_selection

        share_the_cores(config)
        try:
            selection = {axis: parse_selection(axis, config.getoption(f"matrix_{axis}")) for axis in AXES}
            worker_id = config.workerinput["workerid"] if is_worker(config) else None
            visible = max((d.count() for d in DEVICES.values() if d.indexed), default=0)
            index = resolve_index(config.getoption("matrix_cuda_device"), worker_id, visible)
        except ValueError as error:  # SelectionError, a bad --cuda-device
            raise pytest.UsageError(str(error)) from None
        try:
            known = catalogue.assemble(
                tuple(Path(p) for p in config.getoption("matrix_catalogue")),
                builtin=not config.getoption("matrix_no_builtin_catalogue"),
            )
        except catalogue.CatalogueError as error:
            raise pytest.UsageError(f"--catalogue: {error}") from None
        config.stash[selection_key], config.stash[device_index_key] = selection, index
        config.stash[catalogue_key] = known
        config.stash[installed_key] = environment.package_versions()
        distributed.WORLD_SIZE = option(config, "matrix_world_size")
    config.stash[active_key] = True


def share_the_cores(config) -> None:
    """N xdist workers share the cores: torch's default of one thread per core in each of them
    oversubscribes the machine (measured 2.4x slower with 2 workers on 2 cores). Imports torch:
    called where the matrix is used (and by the harness's own tests, tests/conftest.py)."""
    if is_worker(config):
        import torch

        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def explorable(cell: Cell) -> bool:
    """fp32 is the reference every variant is compared with; a precision that fails its own
    policy check fails in 'configure' whatever the variant."""
    from matrix.models import MODELS
    from matrix.precisions import PRECISIONS

    return (
        cell.precision != "fp32" and not PRECISIONS[cell.precision].contradictions() and MODELS[cell.model].explorable
    )


def skip_reason(cell: Cell, index: int) -> str | None:
    from matrix.devices import DEVICES
    from matrix.engines import ENGINES
    from matrix.models import MODELS
    from matrix.precisions import PRECISIONS

    precision, engine = PRECISIONS[cell.precision], ENGINES[cell.engine]
    return (
        engine.unsupported_reason(precision)
        or DEVICES[cell.device].skip_reason(precision, index)
        or engine.device_skip_reason(DEVICES[cell.device])
        or engine.precision_device_skip_reason(precision, DEVICES[cell.device])
        or MODELS[cell.model].skip_reason(cell.device)
        or MODELS[cell.model].precision_skip_reason(precision)
        or engine.kind_skip_reason(MODELS[cell.model])
    )


def cell_marks(cell: Cell, index: int) -> list:
    reason = skip_reason(cell, index)
    return [pytest.mark.cell] + ([pytest.mark.skip(reason=reason)] if reason else [])


def shard_costs(config) -> Costs | None:
    """--shard-costs, read (standard library only): a bad file stops the run before anything runs."""
    path = config.getoption("matrix_shard_costs")
    if path is None:
        return None
    if config.stash[shard_key] is None:
        raise SelectionError("--shard-costs: balances shards, so it needs --shard K/N")
    return Costs.read(Path(path))


def shard_plan(config) -> ShardPlan | None:
    """This run's --shard plan over the axis selection (the same in every shard): None unsharded."""
    from matrix.selection import enumerate_cells

    if config.stash[shard_key] is None:
        return None
    if shard_plan_key not in config.stash:
        activate(config)
        cells = enumerate_cells(config.stash[selection_key])
        config.stash[shard_plan_key] = plan(cells, config.stash[shard_key][1], config.stash[shard_costs_key])
    return config.stash[shard_plan_key]


def selected_cells(config) -> list[Cell]:
    """The cells of the axis selection, then of this --shard (planned over the selection's order,
    the same in every shard), in the order --order-seed shuffles them to."""
    from matrix.selection import enumerate_cells

    activate(config)
    shards = shard_plan(config)
    cells = shards.of(config.stash[shard_key][0]) if shards else enumerate_cells(config.stash[selection_key])
    return in_seeded_order(cells, option(config, "matrix_order_seed"))


def in_seeded_order(cells: list, seed: int | None) -> list:
    """The cells shuffled by `seed` (the same order in every process given it: xdist's workers
    must collect alike); None: as they are."""
    if seed is None:
        return list(cells)
    shuffled = list(cells)
    random.Random(seed).shuffle(shuffled)
    return shuffled


def pytest_generate_tests(metafunc):
    """Only the matrix's own tests (matrix/pytest_cases.py, wherever a test module imports
    them) get the cells: another test taking a `cell` argument is left alone."""
    role = getattr(metafunc.function, "matrix_test", None)  # set in matrix/pytest_cases.py
    if role not in ("cell", "explore"):
        return
    try:
        activate(metafunc.config)
    except pytest.UsageError as error:  # raised here it would be one module's collection error
        metafunc.config.stash[deferred_error_key] = error
        return
    index = device_index(metafunc.config)
    with cell_environment.applied():  # skip reasons see what the cells will (Triton's interpreter)
        if role == "explore":
            targets = [c for c in selected_cells(metafunc.config) if explorable(c)]
            params = [pytest.param(c, id=c.id, marks=cell_marks(c, index)) for c in targets]
            metafunc.parametrize("explore_target", params)
        else:
            params = [pytest.param(c, id=c.id, marks=cell_marks(c, index)) for c in selected_cells(metafunc.config)]
            metafunc.parametrize("cell", params)


def is_cell_item(item) -> bool:
    return getattr(item, "originalname", None) == "test_cell" and isinstance(
        getattr(getattr(item, "callspec", None), "params", {}).get("cell"), Cell
    )


def is_exploration_item(item) -> bool:
    return getattr(item, "originalname", None) == "test_explore" and isinstance(
        getattr(getattr(item, "callspec", None), "params", {}).get("explore_target"), Cell
    )


def matrix_item_id(item) -> str | None:
    """The cell a matrix item runs (test_cell, test_explore); None for other tests."""
    if is_cell_item(item):
        return item.callspec.params["cell"].id
    return item.callspec.params["explore_target"].id if is_exploration_item(item) else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The cells' environment variables while a matrix test runs (setup to teardown), and
    put back before the next test, which may be a project's own."""
    if matrix_item_id(item) is None:
        return (yield)
    with cell_environment.applied():
        return (yield)


def pytest_collection_modifyitems(config, items):
    if deferred_error_key in config.stash:  # bad input: one line, exit status 4, before anything runs
        raise config.stash[deferred_error_key]
    done = resumed_done(config)  # in each process that collects: the main one, or xdist's workers
    dropped = [
        item
        for item in items
        if matrix_item_id(item) in done
        or (getattr(item, "originalname", None) == "test_explore" and not config.getoption("matrix_explore"))
    ]
    if dropped:  # explorations run only when asked for: they never slow the matrix down
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in set(dropped)]
    explorations = 0
    for item in items:
        if is_cell_item(item):
            item.user_properties.append((AXES_PROPERTY, item.callspec.params["cell"].axes()))
            # the call only: the kind's one-time work in the setup before it has a budget of its own
            item.add_marker(pytest.mark.timeout(option(config, "matrix_cell_timeout"), func_only=True))
        if is_exploration_item(item):
            explorations += not any(m.name == "skip" for m in item.iter_markers())
            # pytest-timeout's per-test limit fits a cell, not a search that may get the whole
            # budget; shrinking and explaining a finding run past it a little
            item.add_marker(pytest.mark.timeout(option(config, "matrix_explore_seconds") + EXPLORE_TIMEOUT_MARGIN_S))
    config.stash[explore_clock_key] = ExploreClock(option(config, "matrix_explore_seconds"), explorations)


def resumed_done(config) -> set[str]:
    """With --matrix-resume: the cells and targets the run's journal already has."""
    if not config.getoption("matrix_resume"):
        return set()
    from matrix.results import journal

    root = reports_root(config.getoption("matrix_report_dir"), config.invocation_params.dir)
    state = journal.read(root / (config.getoption("matrix_run_id") or ""))
    return set(state.records) | {e["target"] for e in state.explorations}


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


@pytest.fixture
def isolated_torch_state():
    """A cell starts from the process-global state the test before it found and leaves nothing
    behind (matrix/global_state.py): the Watch it yields is compared after each of the cell's
    phases, and closed by test_cell, which records what the cell left changed (its
    `leaked_state`) and puts it back. Whatever is still changed at teardown (a test that raised
    before closing it, an exploration, a test of a project's own) is put back here, with a warning
    naming it: never silently."""
    from matrix import global_state

    watch = global_state.Watch()
    yield watch
    leaks = watch.close("teardown")
    if leaks:
        warnings.warn(LeftGlobalStateChanged(describe_leaks(leaks)), stacklevel=1)


class LeftGlobalStateChanged(UserWarning):
    """A test left process-global state changed; the fixture put it back."""


def describe_leaks(leaks) -> str:
    return "left global state changed (put back): " + "; ".join(
        f"{leak.setting} {leak.before} -> {leak.after} in {leak.phase}"
        + ("" if leak.restored else " (could not be put back)")
        for leak in leaks
    )


@dataclass(frozen=True)
class EstablishedKind:
    """What test_cell gets from its setup: the catalogue entries in force for the cell (those
    that select by a trait ask the kind's, established just before), and what stops the cell."""

    claims: list
    blocked: BaseException | None = None


@pytest.fixture
def established_kind(cell, request, isolated_torch_state) -> EstablishedKind:
    """The cell's kind's one-time work (matrix/kind_setup.py), done in this process before its
    first cell: in the test's setup, which the cell's timeout does not cover, under a budget of
    its own (--kind-setup-timeout). Its record goes with the test's reports. A kind whose work
    ran out of its budget in this process stops the cell before it starts."""
    from matrix import kind_setup
    from matrix.models import MODELS

    config = request.config
    kind = MODELS[cell.model]
    setup = kind_setup.establish(kind, cell.mode == "train", option(config, "matrix_kind_setup_timeout"))
    isolated_torch_state.checkpoint("kind_setup")  # what the kind's one-time work changed is this cell's
    if setup is not None:
        request.node.user_properties.append((KIND_SETUP_PROPERTY, setup.as_dict()))
    blocking = kind_setup.blocking(kind)
    if blocking is not None:  # no entry is asked: its traits are what ran out of time
        reason = f"{kind.name}'s one-time work ran past --kind-setup-timeout {blocking.budget_s:g} s: {blocking.error}"
        return EstablishedKind(claims=[], blocked=kind_setup.KindSetupTimedOut(reason))
    # the engine's libraries' one-time work too: the ops they compile on first use (matrix/extension_builds.py)
    from matrix import extension_builds
    from matrix.engines import ENGINES

    engine = ENGINES[cell.engine]
    for built in extension_builds.establish(engine, cell.device, option(config, "matrix_kind_setup_timeout")):
        request.node.user_properties.append((KIND_SETUP_PROPERTY, built.as_dict()))
    isolated_torch_state.checkpoint("extension_builds")  # what building them changed is this cell's too
    stopped = extension_builds.blocking(engine, cell.device)
    if stopped is not None:
        return EstablishedKind(claims=[], blocked=stopped)
    return EstablishedKind(claims=config.stash[catalogue_key].in_force(cell, config.stash[installed_key]))


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


def skip_reason_of(report) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


class Recorder:
    """pytest's side of a run's recording (matrix/recording.py RunRecorder): which cells were
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
        from matrix import environment
        from matrix.precisions import table

        activate(self.config)  # an xdist controller collects nothing: the cells' side starts here
        self.run.start(
            self.selected, self.run_header(), lambda: environment.capture(device_index(self.config)), table()
        )
        shards = shard_plan(self.config)
        if shards is not None:  # every shard's cells, for merge to name those of a shard that never reported
            shards.write(self.run.directory)

    def run_header(self) -> dict:
        from matrix import environment, schedule
        from matrix.selection import axis_values

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
            # the version stack nox installed (matrix/stacks.toml); None: an environment of your own
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
        from matrix.selection import cell_from_id

        return cell_from_id(cell_id)

    def pytest_runtest_logstart(self, nodeid, location):
        cell = self.cell_of(nodeid) if "::test_cell[" in nodeid else None
        if cell is not None:
            self.run.cell_started(cell, rerun_command(self.config, nodeid, cell))

    def pytest_runtest_logreport(self, report):
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
