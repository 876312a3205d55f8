"""DeepSpeed's ops, built on first use (matrix/engines/libraries/extension_builds.py): once, outside
the cells, in the run's own directory, a stale lock taken back or named, a build past its budget
killed. A file of its own: `nox -s deepspeed -- --all` (every night, nightly-cpu.yml) runs it, on a
worker of its own beside tests/test_deepspeed.py's grids (--dist loadfile); CI's slice of the session
builds the op once for its grids and leaves this file out."""

from __future__ import annotations

import pytest
from test_deepspeed import needs_deepspeed

from matrix.engines.libraries import deepspeed as ds


def left_by_a_killed_build(directory) -> None:
    """The lock torch's FileBaton leaves when its builder is killed mid-build: the file, no holder."""
    lock = directory / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()


@needs_deepspeed
def test_a_stale_build_lock_in_a_directory_of_ones_own_fails_the_cells_at_once_naming_it(tmp_path, monkeypatch):
    """Before: every DeepSpeed cell waited on the lock until its ranks' timeout (RankTimeout), in
    any later run, until the file was deleted by hand. The directory is the user's: named, kept."""
    from conftest import run_matrix_cpu

    chosen = tmp_path / "my-extensions"
    left_by_a_killed_build(chosen)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(chosen))
    selection = ("--model", "tiny-llama", "--precision", "fp32", "--mode", "eval", "--engine", "deepspeed-zero0")
    _, document = run_matrix_cpu(tmp_path / "reports", *selection, run_id="stale")
    (cell,) = document["cells"]
    assert cell["outcome"] == "failed" and cell["phase"] == "kind_setup", cell["signature"]
    assert cell["signature"]["exception"] == "matrix.extension_builds.StaleBuildLock"
    assert cell["signature"]["text"].startswith(
        "kind_setup: matrix.extension_builds.StaleBuildLock: <path> is held by no live process (left by a build "
        "of deepspeed_shm_comm that was killed)"
    )
    assert cell["duration_s"] < 1
    (library,) = [s for s in document["kind_setups"] if s["kind"].startswith("deepspeed ")]
    assert library["outcome"] == "failed" and str(chosen / "deepspeed_shm_comm" / "lock") in library["error"]
    assert (chosen / "deepspeed_shm_comm" / "lock").exists()  # not the run's to delete


@needs_deepspeed
def test_deepspeeds_op_is_built_once_outside_the_cells_in_the_runs_directory_a_stale_lock_taken_back(
    tmp_path, monkeypatch
):
    """The run's own directory (this environment's, keyed by the torch and DeepSpeed releases): a
    lock a killed build left there is removed, the op built (or found built) before the first
    cell under the one-time budget, and recorded in the report's one-time work. (A directory of
    the run's that only this test uses, beside the environment's, which other runs may be using:
    a copy of the op built there, or else a build of it.)"""
    import json
    import shutil
    from pathlib import Path

    import jsonschema

    from conftest import run_matrix_cpu
    from matrix.engines.libraries import extension_builds

    owned = extension_builds.owned_directory()
    assert owned.name == f"torch-{extension_builds._version('torch')}-deepspeed-{ds.installed_version()}"
    private = extension_builds.owned_root() / f"test-{tmp_path.name}"
    built = owned / "deepspeed_shm_comm"
    try:
        if (built / "deepspeed_shm_comm.so").is_file():
            shutil.copytree(built, private / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("lock"))
        left_by_a_killed_build(private)
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(private))
        selection = ("--model", "tiny-llama", "--precision", "fp32", "--mode", "eval", "--engine", "deepspeed-zero0")
        _, document = run_matrix_cpu(tmp_path, *selection, run_id="owned")
        (cell,) = document["cells"]
        assert cell["outcome"] == "passed", cell["signature"]
        (library,) = [s for s in document["kind_setups"] if s["kind"].startswith("deepspeed ")]
        assert library["outcome"] == "done" and library["directory"] == str(private)
        assert library["reclaimed"] == [str(private / "deepspeed_shm_comm" / "lock")]
        assert list(library["steps"]) == ["deepspeed_shm_comm (a stale build lock removed first)"]
        assert (private / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").is_file()
        assert not (private / "deepspeed_shm_comm" / "lock").exists()
        summary = (tmp_path / "owned" / "summary.md").read_text()
        row = f"| deepspeed {ds.installed_version()} (the ops it builds on first use) | its engines' cells |"
        assert row in summary
        package = Path(extension_builds.__file__).parents[2]
        schema = json.loads((package / "results" / "results.schema.json").read_text())
        jsonschema.validate(document, schema)  # the library's record is a one-time work record the schema knows
    finally:
        shutil.rmtree(private, ignore_errors=True)


@needs_deepspeed
def test_a_rank_meets_a_stale_build_lock_as_a_named_failure_before_it_waits(tmp_path, monkeypatch):
    """A lock left after the one-time build (a rank killed at its cell's timeout mid-load): the
    next rank to import DeepSpeed names it instead of waiting on it."""
    from types import SimpleNamespace

    import torch

    from matrix.engines.libraries import extension_builds

    left_by_a_killed_build(tmp_path)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with pytest.raises(extension_builds.StaleBuildLock, match="is held by no live process"):
        ds.import_deepspeed(SimpleNamespace(device=torch.device("cpu")))


@needs_deepspeed
def test_a_build_that_runs_out_of_its_budget_is_killed_its_lock_taken_back_and_its_cells_stopped(tmp_path, monkeypatch):
    """The one-time build's budget (--kind-setup-timeout): the build (a child process and its
    compilers) is killed mid-compile, the lock it held is removed (its owner is known dead: killed
    here), and the engine's cells in this process fail at once with ExtensionBuildTimedOut. The
    compiler torch's extension builder runs (CXX) hangs on every compile, so the build is still
    compiling when its budget runs out however fast this machine compiles."""
    from matrix.engines.libraries import extension_builds

    hanging = tmp_path / "hanging-c++"
    hanging.write_text('#!/bin/sh\ncase " $* " in *" -c "*) sleep 600 ;; esac\nexec c++ "$@"\n')
    hanging.chmod(0o755)
    monkeypatch.setenv("CXX", str(hanging))
    fresh = tmp_path / "extensions"
    budget = 60  # importing deepspeed in the build's child takes seconds; its compile never ends
    setup = extension_builds.build("deepspeed", ds, ("ShareMemCommBuilder",), "cpu", fresh, budget, log=print)
    assert setup.outcome == "timed out", setup
    assert setup.error == f"building ShareMemCommBuilder was still running when the budget of {budget} s ran out"
    assert isinstance(setup.blocked, extension_builds.ExtensionBuildTimedOut)
    assert str(setup.blocked) == (
        f"deepspeed's one-time build of its ops (ShareMemCommBuilder) ran past --kind-setup-timeout {budget} s"
    )
    assert setup.reclaimed == [str(fresh / "deepspeed_shm_comm" / "lock")]  # it had started building
    assert not (fresh / "deepspeed_shm_comm" / "lock").exists()
    assert working_in(fresh) == []  # ninja and its compilers (which run in the build directory) went with it


def working_in(directory) -> list[int]:
    """The processes whose working directory is in `directory`."""
    import os
    from pathlib import Path

    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and Path(os.readlink(entry / "cwd")).is_relative_to(directory):
                found.append(int(entry.name))
        except OSError:
            continue
    return found
