"""The matrix's side of a pytest session: what it keeps in pytest's stash, its options read back
checked (matrix/run/options.py), and activate(): the registries, the axis selection, the GPU
index, the catalogue and the installed versions, set up once per process when the matrix is first
needed (no torch before that)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from matrix.execute import environment_variables as cell_environment
from matrix.grid.cell import AXES

RESULT_PROPERTY = "matrix_result"


KIND_SETUP_PROPERTY = "matrix_kind_setup"


EXPLORATION_PROPERTY = "matrix_exploration"


AXES_PROPERTY = "matrix_cell"


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


def is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def device_index(config) -> int:
    activate(config)
    return config.stash[device_index_key]


def option(config, dest: str):
    """An option's value, checked (matrix/run/options.py)."""
    return config.stash[values_key][dest] if dest in config.stash[values_key] else config.getoption(dest)


def export_run_settings(config) -> None:
    """The run's curve length and initial weights, as environment variables: what every cell of
    the run reads them from, in this process and in the ranks it starts (matrix/grid/schedule.py,
    matrix/models/initial_weights.py)."""
    from matrix.grid import schedule

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
        from matrix.catalogue import entries as catalogue
        from matrix.devices import DEVICES, resolve_index
        from matrix.devices import fingerprint as environment
        from matrix.engines import distributed
        from matrix.selection.cells import parse_selection

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
    """A process that runs cells computes on one intra-op thread, as each rank of the distributed
    engines does (matrix/execute/rank_worker.py), whether it is one of N xdist workers or the run's
    only process: a reference measured here (matrix/harness/reference_curves.py) is then the very one
    a rank measures, bit for bit, and a rank can take it from here. The models are tiny: their
    operations gain nothing from torch's threads, while torch's default of one thread per core
    makes every operation wait for the slowest thread's core wherever the cores are busy (other
    workers, the ranks, anything else on the machine). Imports torch: called where the matrix is
    used (and by the harness's own tests, tests/conftest.py)."""
    import torch

    torch.set_num_threads(1)
