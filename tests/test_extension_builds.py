"""Ops a library compiles on first use (matrix/engines/libraries/extension_builds.py): the directory the run owns,
keyed by the releases, and a build lock a killed build left, told from a live build's by whether a
process holds it, with torch's own FileBaton (what DeepSpeed's builder waits on) in real processes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from matrix.engines.libraries import extension_builds
from matrix.execute import environment_variables as cell_environment

# torch's FileBaton, as torch.utils.cpp_extension's _jit_compile takes it: created, held open while
# the build runs (here: until killed), removed after
HOLD_BATON = """
import sys, time
from torch.utils.file_baton import FileBaton
baton = FileBaton(sys.argv[1])
assert baton.try_acquire()
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def builder(tmp_path):
    """A live builder holding the baton of op `some_op` under tmp_path/extensions: (process, lock)."""
    lock = tmp_path / "extensions" / "some_op" / "lock"
    lock.parent.mkdir(parents=True)
    process = subprocess.Popen([sys.executable, "-c", HOLD_BATON, str(lock)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    yield process, lock
    if process.poll() is None:
        process.kill()
        process.wait()


def killed(process) -> None:
    process.send_signal(signal.SIGKILL)  # as a rank killed at its cell's timeout: no finally runs
    process.wait()


def test_a_lock_a_live_build_holds_is_left_to_it_and_one_a_killed_build_left_is_stale(builder):
    process, lock = builder
    where = lock.parent.parent
    assert extension_builds.lock_holders(lock) == [process.pid]
    assert extension_builds.stale_lock("some_op", where) is None
    assert extension_builds.clear_stale_lock("some_op", where) is None  # a live build: waiting on it is right
    killed(process)
    assert lock.exists() and extension_builds.lock_holders(lock) == []
    assert extension_builds.stale_lock("some_op", where) == lock
    assert extension_builds.stale_lock("other_op", where) is None  # no lock at all


def test_a_stale_lock_outside_the_runs_directory_is_a_named_failure_not_a_wait(builder):
    process, lock = builder
    killed(process)
    began = time.monotonic()
    with pytest.raises(extension_builds.StaleBuildLock) as info:
        extension_builds.clear_stale_lock("some_op", lock.parent.parent)
    assert str(info.value).startswith(f"{lock} is held by no live process (left by a build of some_op that was killed)")
    assert time.monotonic() - began < 5
    assert lock.exists()  # not the run's to delete


def test_a_stale_lock_in_the_runs_own_directory_is_removed_and_the_next_build_takes_the_baton(builder, monkeypatch):
    from torch.utils.file_baton import FileBaton

    process, lock = builder
    where = lock.parent.parent
    monkeypatch.setattr(extension_builds, "owned_root", lambda: where)
    killed(process)
    said = []
    assert extension_builds.clear_stale_lock("some_op", where, log=said.append) == lock
    assert not lock.exists() and said and said[0].startswith(f"removed {lock}: a stale build lock")
    assert FileBaton(str(lock)).try_acquire()  # torch's next build goes ahead instead of waiting forever


def test_the_cells_build_extensions_in_a_directory_of_their_own_keyed_by_the_releases(monkeypatch):
    """Not ~/.cache/torch_extensions/py311_cpu, which every environment and release shares."""
    from importlib.metadata import version

    monkeypatch.delenv(extension_builds.VARIABLE, raising=False)
    directory = Path(cell_environment.variables()[extension_builds.VARIABLE])
    if os.access(sys.prefix, os.W_OK):  # this environment's own
        assert directory.parent == Path(sys.prefix) / "torch-extensions"
    else:  # a read-only environment's, in the user's cache
        assert directory.parent.parent == Path.home() / ".cache" / "precision-matrix" / "torch-extensions"
    assert directory.name.startswith(f"torch-{version('torch')}")
    assert extension_builds.owned(directory)
    with cell_environment.applied():
        assert os.environ[extension_builds.VARIABLE] == str(directory)
    monkeypatch.setenv(extension_builds.VARIABLE, "/somewhere/of/mine")  # an explicit setting is kept
    with cell_environment.applied():
        assert os.environ[extension_builds.VARIABLE] == "/somewhere/of/mine"
    assert not extension_builds.owned(Path("/somewhere/of/mine"))
