"""The fixtures test_cell takes: isolated_torch_state (the process-global state a cell found,
watched and put back: matrix/harness/global_state.py) and established_kind (the kind's and the
engine's libraries' one-time work before the cell, under its own budget, and the catalogue entries
in force for the cell)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest

from matrix.plugin.session import (
    KIND_SETUP_PROPERTY,
    catalogue_key,
    installed_key,
    option,
)


@pytest.fixture
def isolated_torch_state():
    """A cell starts from the process-global state the test before it found and leaves nothing
    behind (matrix/harness/global_state.py): the Watch it yields is compared after each of the cell's
    phases, and closed by test_cell, which records what the cell left changed (its
    `leaked_state`) and puts it back. Whatever is still changed at teardown (a test that raised
    before closing it, an exploration, a test of a project's own) is put back here, with a warning
    naming it: never silently."""
    from matrix.harness import global_state

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
    """The cell's kind's one-time work (matrix/harness/kind_setup.py), done in this process before its
    first cell: in the test's setup, which the cell's timeout does not cover, under a budget of
    its own (--kind-setup-timeout). Its record goes with the test's reports. A kind whose work
    ran out of its budget in this process stops the cell before it starts."""
    from matrix.harness import kind_setup
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
    # the engine's libraries' one-time work too: the ops they compile on first use
    # (matrix/engines/libraries/extension_builds.py)
    from matrix.engines import ENGINES
    from matrix.engines.libraries import extension_builds

    engine = ENGINES[cell.engine]
    for built in extension_builds.establish(engine, cell.device, option(config, "matrix_kind_setup_timeout")):
        request.node.user_properties.append((KIND_SETUP_PROPERTY, built.as_dict()))
    isolated_torch_state.checkpoint("extension_builds")  # what building them changed is this cell's too
    stopped = extension_builds.blocking(engine, cell.device)
    if stopped is not None:
        return EstablishedKind(claims=[], blocked=stopped)
    return EstablishedKind(claims=config.stash[catalogue_key].in_force(cell, config.stash[installed_key]))
