"""The pytest plugin (entry point `pytest11: matrix`): the matrix's options, the parametrization
of its two tests (matrix/plugin/cases.py) with the selected cells and their skip reasons, the
isolation between cells, and the recording of results where pytest's reports arrive (the
controller, when pytest-xdist runs workers), so a cell whose worker crashed is still in the
report. Hooks and fixtures only: running a cell is matrix/execute/cell_run.py, recording a run
matrix/results/recording.py, reports matrix/results/.

pytest loads it in every session of an environment that has the package, so it stays out of the
way until the matrix is used: importing it imports pytest, the standard library and the
matrix's torch-free modules only, and a session that selects none of the matrix's tests imports
no torch and sees its environment untouched. The stack comes in when the matrix is first needed
in a process (activate(): a matrix test is parametrized, a matrix option was given, or an xdist
controller hears of cells), and the cells' environment variables (matrix/execute/environment_variables.py)
are set only while the matrix's tests are parametrized and run, then put back.
"""

from __future__ import annotations

import pytest

from matrix.execute import environment_variables as cell_environment
from matrix.explore.clock import ExploreClock
from matrix.plugin.parametrize import (
    cell_marks,
    explorable,
    is_cell_item,
    is_exploration_item,
    matrix_item_id,
    resumed_done,
    selected_cells,
    shard_costs,
)
from matrix.plugin.recorder import Recorder
from matrix.plugin.session import (
    AXES_PROPERTY,
    activate,
    deferred_error_key,
    device_index,
    explore_clock_key,
    export_run_settings,
    is_worker,
    option,
    recorder_key,
    shard_costs_key,
    shard_key,
    values_key,
)
from matrix.results.run_directory import reports_root
from matrix.run import options
from matrix.shards.plan import parse_shard

EXPLORE_TIMEOUT_MARGIN_S = 600


def pytest_addoption(parser):
    group = parser.getgroup("matrix", "mixed-precision matrix")
    options.add_arguments(group.addoption)


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


def pytest_generate_tests(metafunc):
    """Only the matrix's own tests (matrix/plugin/cases.py, wherever a test module imports
    them) get the cells: another test taking a `cell` argument is left alone."""
    role = getattr(metafunc.function, "matrix_test", None)  # set in matrix/plugin/cases.py
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
