"""The matrix's two tests. A test module that imports them gets them collected and
parametrized by the plugin (matrix/plugin/hooks.py): this project's cases/test_cells.py and
cases/test_explore.py do, and so does a downstream project's:

    from matrix.plugin.cases import test_cell  # noqa: F401  (collected here, one test per cell)

test_cell: a failure that the known-failure catalogue explains is an xfail ("known"); a cell
the catalogue says fails but that passes is an XPASS ("fixed"); any other failure fails, its
message starting with its signature and the command that re-runs the cell.

test_explore (with --explore): for each selected target cell, hypothesis searches the variants
the grid does not cover (matrix/explore/strategies.py) for one that passes in fp32 but not in the
target's precision, and shrinks it (matrix/explore/exploration.py). A target fails when it finds a failure
the catalogue does not explain; known findings are recorded and pass.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from matrix.run import options


class KnownFailure(Exception):
    """A cell failed exactly as a catalogue entry in force says it does."""


def test_cell(cell, tmp_path, request, isolated_torch_state, established_kind):
    from matrix.execute.cell_run import run_and_record, tidy_workdir
    from matrix.plugin import session
    from matrix.plugin.recorder import rerun_command

    config = request.config
    claims = established_kind.claims
    # an entry that says may_pass expects no outcome: it is known only where the cell fails with it
    expected = [entry for entry in claims if not entry.may_pass]
    if expected:
        request.node.add_marker(
            pytest.mark.xfail(
                reason=", ".join(f"{entry.id} ({entry.link})" for entry in expected),
                raises=KnownFailure,
                strict=config.getoption("matrix_strict_known"),
            )
        )
    rerun = rerun_command(config, request.node.nodeid, cell)
    done = run_and_record(
        cell,
        tmp_path,
        config.stash[session.catalogue_key],
        config.stash[session.installed_key],
        device_index=session.device_index(config),
        run_contradictory=config.getoption("matrix_run_contradictory"),
        rerun=rerun,
        timeout_s=session.option(config, "matrix_cell_timeout"),
        claims=claims,
        blocked=established_kind.blocked,
        after_phase=isolated_torch_state.checkpoint,
    )
    # what the cell left changed is put back now, and is its own finding, never the next cell's
    leaks = isolated_torch_state.close("cleanup")
    record = dataclasses.replace(done.record, leaked_state=[leak.as_dict() for leak in leaks])
    request.node.user_properties.append((session.RESULT_PROPERTY, record.as_dict()))
    tidy_workdir(tmp_path, record.outcome, keep=config.getoption("matrix_keep_cell_files"))
    if done.poison:  # this process's device context is gone: stop here, python -m matrix run resumes in a new one
        config.stash[session.restart_key] = f"{cell.id} failed with '{done.poison}'"
        request.session.shouldstop = f"{config.stash[session.restart_key]}: the rest of the run needs a fresh process"
    signature = done.result.signature
    if done.outcome == "known" and done.entry.may_pass and done.entry not in expected:
        pytest.xfail(f"{done.entry.id} ({done.entry.link}): {signature.id} {signature.text}")
    if done.outcome == "known":
        raise KnownFailure(f"{done.entry.id} ({done.entry.link}): {signature.id} {signature.text}")
    if done.outcome == "failed":
        pytest.fail(
            f"{signature.id} {signature.text}\nre-run: {rerun}\n\n{done.result.message}\n\n{done.result.traceback}",
            pytrace=False,
        )


test_cell.matrix_test = "cell"  # the plugin parametrizes it with the selected cells


def test_explore(explore_target, tmp_path, request, isolated_torch_state):
    from matrix.execute.cell_run import tidy_workdir
    from matrix.explore.exploration import Budget, exploration_record, explore
    from matrix.plugin import session

    config = request.config
    budget = Budget(
        examples=session.option(config, "matrix_explore_examples"),
        seconds=config.stash[session.explore_clock_key].next_share(),
        seed=session.option(config, "matrix_explore_seed"),
        findings=session.option(config, "matrix_explore_findings"),
    )
    catalogue = config.stash[session.catalogue_key]
    exploration = explore(
        explore_target,
        budget,
        tmp_path,
        catalogue,
        config.stash[session.installed_key],
        device_index=session.device_index(config),
        plugins=tuple(options.plugin_arguments(list(config.invocation_params.args))),
    )
    request.node.user_properties.append((session.EXPLORATION_PROPERTY, exploration_record(exploration, catalogue)))
    new = [f for f in exploration.findings if f.status == "new"]
    tidy_workdir(tmp_path, "failed" if new else "passed", keep=config.getoption("matrix_keep_cell_files"))
    if new:
        pytest.fail(
            "\n\n".join(
                f"{f.result.signature.id} {f.result.signature.text}\n"
                f"minimal variant, changed from the base: {json.dumps(f.differs_from_base)}\n"
                f"replay: {f.replay}\n\n{f.result.message}"
                for f in new
            ),
            pytrace=False,
        )


test_explore.matrix_test = "explore"  # the plugin parametrizes it with the explorable cells
