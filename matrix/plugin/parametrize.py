"""Which cells a session runs and how pytest sees them: the axis selection's cells, this --shard's
share (matrix/shards/plan.py), in --order-seed's order, each with its skip reason as a mark (the
missing capability named), and which items of a session are the matrix's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from matrix.grid.cell import Cell, SelectionError
from matrix.plugin.session import (
    activate,
    option,
    selection_key,
    shard_costs_key,
    shard_key,
    shard_plan_key,
)
from matrix.results.run_directory import reports_root
from matrix.shards.plan import Costs, ShardPlan, plan


def explorable(cell: Cell) -> bool:
    """fp32 is the reference every variant is compared with; a precision that fails its own
    policy check fails in 'configure' whatever the variant."""
    from matrix.models import MODELS
    from matrix.precisions.policies import PRECISIONS

    return (
        cell.precision != "fp32" and not PRECISIONS[cell.precision].contradictions() and MODELS[cell.model].explorable
    )


def skip_reason(cell: Cell, index: int) -> str | None:
    from matrix.devices import DEVICES
    from matrix.engines import ENGINES
    from matrix.models import MODELS
    from matrix.precisions.policies import PRECISIONS

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
    from matrix.selection.cells import enumerate_cells

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
    from matrix.selection.cells import enumerate_cells

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


def resumed_done(config) -> set[str]:
    """With --matrix-resume: the cells and targets the run's journal already has."""
    if not config.getoption("matrix_resume"):
        return set()
    from matrix.results import journal

    root = reports_root(config.getoption("matrix_report_dir"), config.invocation_params.dir)
    state = journal.read(root / (config.getoption("matrix_run_id") or ""))
    return set(state.records) | {e["target"] for e in state.explorations}
