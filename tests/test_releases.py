"""Releases as an axis (issue 28): the release sweep, its table, and the nightly's bisection of
new failures over the packages that changed."""

import json
import subprocess
import sys
from importlib.metadata import version as installed
from pathlib import Path

import pytest

from matrix.releases import new_failures as release_bisect
from matrix.releases import sweep
from matrix.releases.bisection import BisectError, ScratchEnvironment
from matrix.releases.stacks import load as load_stacks
from matrix.results import compare, sweep_table

ROOT = Path(__file__).resolve().parent.parent


def test_last_releases_are_the_newest_finals_oldest_first():
    listed = ["4.51.0", "4.50.3", "4.52.0rc1", "4.50.0", "not-a-version", "4.49.0", "2.13.0+cpu"]
    assert sweep.last_releases(listed, 3) == ["4.50.0", "4.50.3", "4.51.0"]
    assert sweep.last_releases(listed, 2, newest="4.50.3") == ["4.50.0", "4.50.3"]
    assert sweep.last_releases(listed, 10) == ["4.49.0", "4.50.0", "4.50.3", "4.51.0"]
    assert sweep.last_releases(listed, 2, per="minor") == ["4.50.3", "4.51.0"]
    assert sweep.last_releases(listed, 2, newest="4.50.0", per="minor") == ["4.49.0", "4.50.0"]
    with pytest.raises(BisectError, match="--last"):
        sweep.last_releases(listed, 0)
    assert sweep.chosen_versions("1.13.0, 1.12.0,1.14.0") == ["1.12.0", "1.13.0", "1.14.0"]
    with pytest.raises(BisectError, match="not a version"):
        sweep.chosen_versions("1.13.0,latest")


def _cell(cell_id, precision, engine, state, text=None):
    return {
        "model": cell_id.split("-")[0],
        "precision": precision,
        "mode": "eval",
        "device": "cpu",
        "engine": engine,
        "state": state,
        "signature_text": text,
    }


def _sweep_document():
    """Three releases of a package that ran, one that did not install: the cell a-bf16 breaks in
    the second and is fixed in the third, a-fp32 never changes."""

    def cells(bf16_state):
        return {
            "a-fp32": _cell("a-fp32", "fp32", "torch", "passed"),
            "a-bf16": {
                **_cell("a-bf16", "bf16-mixed", "torch", bf16_state, "evaluate: RuntimeError: boom @ x:y"),
                "known_failure": "boom-entry" if bf16_state != "passed" else None,
            },
        }

    return {
        "package": "pkg",
        "stack": "default",
        "selection": ["--device", "cpu"],
        "axis_order": {"precision": ["fp32", "bf16-mixed"], "engine": ["torch"]},
        "wall_s": 12.0,
        "environment_mb": 900,
        "releases": [
            {
                "version": "1.0",
                "status": "ran",
                "seconds": 3,
                "cells": cells("passed"),
                "packages": {"torch": "2.13.0"},
            },
            {"version": "1.1", "status": "ran", "seconds": 3, "cells": cells("failed sig-1"), "packages": {}},
            {"version": "1.2", "status": "does not install", "detail": "ERROR: No matching distribution", "seconds": 1},
            {"version": "1.3", "status": "ran", "seconds": 3, "cells": cells("passed"), "packages": {}},
        ],
    }


def test_the_table_names_the_first_release_of_each_change_and_lists_what_did_not_install():
    document = _sweep_document()
    assert sweep_table.releases_ran(document) == ["1.0", "1.1", "1.3"]
    assert sweep_table.first_changes(document) == [
        {"cell": "a-bf16", "first_release": "1.1", "last_before": "1.0", "from": "passed", "to": "failed sig-1"},
        {"cell": "a-bf16", "first_release": "1.3", "last_before": "1.1", "from": "failed sig-1", "to": "passed"},
    ]
    rows = sweep_table.folded(document)
    assert list(rows) == [("fp32", "torch"), ("bf16-mixed", "torch")]
    assert rows[("bf16-mixed", "torch")]["1.1"] == {"failed sig-1": 1}
    markdown = sweep_table.sweep_markdown(document)
    assert "| 1.2 | does not install: ERROR: No matching distribution |" in markdown
    assert "| bf16-mixed | torch | 1 ok | 1 sig-1 | 1 ok |" in markdown
    assert "| 1.1 | 1.0 | passed | failed sig-1 | 1: `a-bf16` |" in markdown
    assert "- `sig-1`: (known: boom-entry) evaluate: RuntimeError: boom @ x:y" in markdown
    page = sweep_table.sweep_html(document)
    assert "<td class='bad'>1 sig-1</td>" in page and "does not install: ERROR: No matching distribution" in page


def test_a_cells_state_is_its_raw_result():
    assert sweep_table.cell_state({"outcome": "known", "signature": {"id": "sig-9"}}) == "failed sig-9"
    assert sweep_table.cell_state({"outcome": "fixed", "signature": None}) == "passed"
    assert sweep_table.cell_state({"outcome": "skipped", "signature": None}) == "skipped"


@pytest.fixture
def this_environment(tmp_path):
    """The sweep's scratch environment, standing on the interpreter running the tests: a release
    already installed installs as a no-op, so nothing here changes the environment."""
    env = ScratchEnvironment(load_stacks()["default"], "torch")
    env.python = Path(sys.executable)
    env.path = tmp_path / "env"
    env.path.mkdir()
    return env


def test_a_release_runs_its_selection_for_real_and_one_that_does_not_exist_is_listed(this_environment, tmp_path):
    runs = tmp_path / "runs"
    version = installed("safetensors")
    selection = ["--model", "tiny-llama", "--precision", "fp32,bf16-mixed", "--mode", "eval", "--engine", "torch"]
    selection += ["--device", "cpu"]
    ran = sweep.run_release(this_environment, "safetensors", version, selection, runs)
    assert ran.status == "ran", ran.detail
    assert set(ran.cells) == {"tiny-llama-fp32-eval-cpu-torch", "tiny-llama-bf16-mixed-eval-cpu-torch"}
    assert {c["state"] for c in ran.cells.values()} == {"passed"}
    assert ran.packages["safetensors"] == version
    assert (runs / version / "results.json").exists()
    missing = sweep.run_release(this_environment, "safetensors", "0.0.0", selection, runs)
    assert missing.status == "does not install" and missing.cells is None
    assert "0.0.0" in missing.detail or "matching distribution" in missing.detail
    # what a sweep puts the package back to: the version recorded when the environment was first used
    assert this_environment.baseline()["safetensors"] == version
    this_environment.restore("safetensors", log=pytest.fail)
    assert installed("safetensors") == version


def test_the_sweep_command_refuses_bad_input_in_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "matrix", "sweep", "--package", "accelerate", "--versions", "1.0,latest"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "python -m matrix sweep: --versions: not a version: Invalid version: 'latest'"


def test_pruning_keeps_the_most_recently_used_environments(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "SCRATCH", tmp_path)
    for age, name in enumerate(("newest", "middle", "oldest", "in-use")):
        (tmp_path / name).mkdir()
        stamp = tmp_path / name / ".bisect-stack"
        stamp.write_text("x")
        import os

        os.utime(stamp, (1_000_000 - age * 1000, 1_000_000 - age * 1000))
    removed = sweep.prune_scratch(keep=2, in_use=tmp_path / "in-use", log=lambda line: None)
    assert removed == ["oldest"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in-use", "middle", "newest"]


def _new(cell, signature, text="train_steps: E: m @ a:b"):
    return {"cell": cell, "new": {"signature": signature, "signature_text": text, "phase": "train_steps"}}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_nightly_bisects_each_new_signature_over_each_changed_package_within_its_budget(tmp_path):
    clock, calls = Clock(), []

    def bisect_fn(package, good, bad, cell, stack, output, extra, log, deadline):
        calls.append((package, good, bad, cell, stack))
        clock.now += 100  # each bisection takes 100 s
        if package == "peft":
            raise BisectError(f"{good} and {bad} give the same result (passed): nothing to bisect")
        return {
            "first_changed": "4.51.0",
            "last_before_change": "4.50.3",
            "from_state": "passed",
            "to_state": "failed sig-a",
            "evidence": [{"version": "4.50.0"}, {"version": "4.51.0"}],
        }

    changes = [_new("x-bf16-mixed-train-cpu-torch", "sig-a"), _new("a-bf16-mixed-train-cpu-torch", "sig-a")]
    changes.append(_new("b-fp32-eval-cpu-torch", "sig-b"))
    records = release_bisect.bisect_new_failures(
        changes,
        {"transformers": ("4.50.0", "4.52.0"), "peft": ("0.15.0", "0.16.0")},
        stack="default",
        budget_s=250,
        output=tmp_path,
        bisect_fn=bisect_fn,
        repro_fn=lambda cell, run, output: f"{output}/repro-{cell}.py",
        clock=clock,
        log=lambda line: None,
    )
    # sig-a (2 cells) first, its first cell in id order; packages in name order; the third
    # bisection starts at 200 s and the fourth finds the budget spent
    assert calls == [
        ("peft", "0.15.0", "0.16.0", "a-bf16-mixed-train-cpu-torch", "default"),
        ("transformers", "4.50.0", "4.52.0", "a-bf16-mixed-train-cpu-torch", "default"),
        ("peft", "0.15.0", "0.16.0", "b-fp32-eval-cpu-torch", "default"),
    ]
    assert [r["status"] for r in records] == ["same at both ends", "found", "same at both ends", "not run"]
    found = records[1]
    assert (
        found["cells"] == 2
        and found["direction"] == "up"
        and found["repro"].endswith("repro-a-bf16-mixed-train-cpu-torch.py")
    )
    assert compare.bisection_verdict(found).startswith(
        "first bad: transformers 4.51.0 (last good: 4.50.3; passed -> failed sig-a); repro: "
    )
    assert compare.bisection_verdict(records[0]) == "not peft: 0.15.0 and 0.16.0 give the same result"
    assert json.loads((tmp_path / "bisections.json").read_text()) == records


def test_the_diff_report_says_which_release_broke_it():
    old = _document("old", {"transformers": "4.50.0"}, "passed")
    new = _document("new", {"transformers": "4.51.0"}, "failed")
    result = compare.diff(old, new)
    assert result.packages == {"transformers": ("4.50.0", "4.51.0")} and len(result.changes["new"]) == 1
    result.bisections = [
        {
            "signature": "sig-a",
            "cell": "x",
            "cells": 1,
            "package": "transformers",
            "old": "4.50.0",
            "new": "4.51.0",
            "direction": "up",
            "status": "found",
            "first_changed": "4.51.0",
            "last_before": "4.50.0",
            "from_state": "passed",
            "to_state": "failed sig-a",
            "repro": "reports/diff-bisect-new/repro-x.py",
        }
    ]
    markdown = compare.diff_markdown(result)
    assert "## Which release broke it" in markdown
    assert "first bad: transformers 4.51.0 (last good: 4.50.0; passed -> failed sig-a); repro: reports/" in markdown
    assert result.as_dict()["bisections"] == result.bisections


def _document(run_id, packages, outcome):
    cell = {
        "id": "x",
        "model": "x",
        "precision": "fp32",
        "mode": "eval",
        "device": "cpu",
        "engine": "torch",
        "outcome": outcome,
        "phase": "evaluate" if outcome == "failed" else None,
        "signature": {"id": "sig-a", "text": "evaluate: E: m @ a:b"} if outcome == "failed" else None,
        "known_failure": None,
        "metrics": {},
    }
    return {"run": {"id": run_id}, "environment": {"packages": packages}, "cells": [cell]}


def test_the_published_sweeps_are_data_and_the_page_is_built_from_sweeps():
    selection, sweeps = sweep.published_sweeps()
    assert {entry["package"] for entry in sweeps} == {"transformers", "peft", "accelerate", "torch"}
    assert "--device" in selection and "cpu" in selection
    page = sweep_table.releases_page([_sweep_document()], "nox -s releases")
    assert page.startswith("# Releases: which versions work together")
    assert "## pkg" in page and "### Precision x engine, by release" in page
    assert "Generated by `nox -s releases`" in page


def test_a_malformed_published_sweep_is_refused_naming_the_file(tmp_path):
    bad = tmp_path / "releases.toml"
    bad.write_text('selection = []\n[[sweep]]\npackage = "peft"\nlast = 2\nversions = ["0.1"]\n')
    with pytest.raises(BisectError, match="either last or versions"):
        sweep.published_sweeps(bad)


def test_the_nightly_bisects_a_moved_curve_by_its_curve_within_what_the_budget_left(tmp_path):
    """A curve that moved overnight (diff's curve-moved) is bisected per changed package, each
    release judged by whether the cell's curve stays within the row of last night's, and run with
    the curve length and initial weights the runs had."""
    from matrix.releases.bisection import CurveJudge

    clock, calls = Clock(), []
    row = {"atol": 1e-3, "rtol": 1e-3, "per_step": 1e-3}

    def bisect_fn(package, good, bad, cell, stack, output, extra, log, deadline, judge):
        calls.append((package, good, bad, cell, tuple(extra)))
        assert isinstance(judge, CurveJudge) and judge.reference_losses == (4.0, 3.5, 3.0) and judge.row == row
        moved = {"metrics": {"curve": {"losses": [4.0, 3.5, 3.3], "golden_tolerance": row}}, "outcome": "failed"}
        assert judge(moved)[0] == "curve moved"
        clock.now += 100
        return {
            "first_changed": "0.18.3",
            "last_before_change": "0.18.2",
            "from_state": "curve as the old run's",
            "to_state": "curve moved",
            "evidence": [{"version": "0.18.2"}, {"version": "0.18.3"}],
        }

    cell = "tiny-llama-bf16-mixed-train-cpu-deepspeed-zero0"
    old = {"cells": [{"id": cell, "metrics": {"curve": {"losses": [4.0, 3.5, 3.0], "golden_tolerance": row}}}]}
    records = release_bisect.bisect_moved_curves(
        [{"cell": cell, "step": 3}],
        {"deepspeed": ("0.18.2", "0.18.5")},
        old,
        {"curve_steps": 3, "initial_weights": "initial"},
        stack="deepspeed",
        budget_s=150,
        output=tmp_path,
        bisect_fn=bisect_fn,
        clock=clock,
        log=lambda line: None,
    )
    (extra,) = {c[4] for c in calls}
    assert extra[:2] == ("--curve-steps", "3") and extra[2] == "--initial-weights"
    assert extra[3].endswith("matrix/golden/initial")  # a golden run names the directory in the repository
    (record,) = records
    assert record["status"] == "found" and record["signature"] == "curve-moved"
    assert compare.bisection_verdict(record).startswith(
        "first moved: deepspeed 0.18.3 (last before: 0.18.2; curve as the old run's -> curve moved)"
    )
    assert json.loads((tmp_path / "curve-bisections.json").read_text()) == records


def _skipped(cell_id, reason):
    return {**_cell(cell_id, "nf4-bf16-mixed", "torch", "skipped"), "skip_reason": reason}


def test_a_release_whose_selected_cells_all_skipped_is_named_and_decides_nothing():
    """The issue's sweep: without bitsandbytes every quantized cell skipped in both releases, and the
    page said no cell changed across them. A release whose cells did not run is listed with the
    skips' reasons, and the change section does not count it."""
    missing = "Requires: [bitsandbytes] (not installed)"
    document = {
        **_sweep_document(),
        "releases": [
            {"version": "0.21.1", "status": "ran", "seconds": 3, "cells": {"a": _skipped("a", missing)}},
            {"version": "0.21.2", "status": "ran", "seconds": 3, "cells": {"a": _skipped("a", missing)}},
        ],
    }
    assert sweep_table.nothing_ran(document) == [
        {"version": "0.21.1", "cells": 1, "reasons": {missing: 1}},
        {"version": "0.21.2", "cells": 1, "reasons": {missing: 1}},
    ]
    markdown = sweep_table.sweep_markdown(document)
    assert "**No verdict: the selected cells ran in no release; this sweep decides nothing.**" in markdown
    assert f"- **nothing ran in 0.21.1: 1 cell skipped: {missing}**" in markdown
    assert "| 0.21.2 | **nothing ran** |" in markdown
    assert "No cell changed its state" not in markdown and "No verdict: no release ran a selected cell." in markdown
    assert "nothing ran in 0.21.2: 1 cell skipped: Requires: [bitsandbytes]" in sweep_table.sweep_html(document)

    # one release ran its cells, one ran none, one came back without a run: two without a verdict
    document["releases"] = [
        {
            "version": "1.0",
            "status": "ran",
            "seconds": 3,
            "cells": {"a": {**_skipped("a", missing), "state": "passed"}},
        },
        {
            "version": "1.1",
            "status": "ran",
            "seconds": 3,
            "cells": {"a": _skipped("a", missing), "b": _skipped("b", "R")},
        },
        {"version": "1.2", "status": "did not run", "detail": "exit status 3, no results.json", "seconds": 1},
    ]
    assert [sweep_table.nothing_ran_line(e) for e in sweep_table.nothing_ran(document)] == [
        f"nothing ran in 1.1: 2 cells skipped: {missing} (1); R (1)",
        "nothing ran in 1.2: exit status 3, no results.json",
    ]
    markdown = sweep_table.sweep_markdown(document)
    assert "No verdict: the selected cells ran in no release" not in markdown
    assert "No cell changed its state across the 1 releases whose cells ran." not in markdown  # 1.0 -> 1.1 changed


@pytest.mark.parametrize("separator", [[], ["--"]], ids=["selection", "selection-after-separator"])
def test_a_sweep_whose_selected_cells_all_skip_exits_4_saying_why(tmp_path, separator):
    """For real, cheaply: the release already installed, swept in this environment (a no-op
    install), with a selection whose one cell skips on this machine for want of a GPU. The
    selection may follow a `--`, as nox's sessions take it: pytest gets it without the `--`
    (with it, pytest took the selection for file names and found none)."""
    version = installed("safetensors")
    command = [sys.executable, "-m", "matrix", "sweep", "--package", "safetensors", "--versions", version]
    command += ["--in-this-environment", "--report-dir", str(tmp_path), *separator]
    command += ["--model", "tiny-llama", "--precision", "fp32", "--mode", "eval", "--engine", "torch"]
    import torch

    if torch.cuda.is_available():
        pytest.skip("Requires: [no CUDA device] (the selection's cell must skip: it runs here)")
    done = subprocess.run([*command, "--device", "cuda"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"nothing ran in {version}: 1 cell skipped: Requires: [CUDA device]" in done.stdout
    assert done.stderr.strip().endswith(
        f"python -m matrix sweep: nothing ran in {version}: no verdict there (see the page)"
    )
    (page,) = tmp_path.glob("sweep-safetensors-*/sweep.md")
    text = page.read_text()
    assert "**No verdict: the selected cells ran in no release; this sweep decides nothing.**" in text
    assert "in the environment running the sweep" in text
    assert installed("safetensors") == version  # put back (it never moved)


def test_a_scratch_environment_has_the_default_environments_extras(tmp_path, monkeypatch):
    """The issue's sweep built its scratch environment without bitsandbytes, which nox's environments
    have (matrix/releases/stacks.py DEFAULT_EXTRAS, read by noxfile.py too): the project goes in with them."""
    from matrix.releases import bisection as bisect
    from matrix.releases import stacks

    assert stacks.DEFAULT_EXTRAS == ("quantized",)
    assert "DEFAULT_EXTRAS = version_stacks.DEFAULT_EXTRAS" in (ROOT / "noxfile.py").read_text()
    monkeypatch.setattr(bisect, "SCRATCH", tmp_path)
    env = bisect.ScratchEnvironment(load_stacks()["default"], "torch==2.13.0")
    env.path.mkdir()  # what the venv would have made
    installs = []
    monkeypatch.setattr(bisect.subprocess, "run", lambda *a, **k: None)  # the venv itself
    monkeypatch.setattr(env, "pip", lambda *args: installs.append(args) or subprocess.CompletedProcess(args, 0, "[]"))
    env.ensure()
    assert ("install", "-q", "-e", f"{bisect.ROOT}[quantized]") in installs, installs


def test_the_nightly_says_nothing_ran_where_a_bisections_cell_skipped(tmp_path):
    """A bisection whose cell skips with a release decides nothing: its record says so, apart
    from an error and from 'same at both ends' (which would clear the package)."""
    from matrix.releases.bisection import NothingRan

    def bisect_fn(package, good, bad, cell, stack, output, extra, log, deadline):
        raise NothingRan(f"nothing ran in {package}=={good}: the cell skipped: Requires: [bitsandbytes]")

    (record,) = release_bisect.bisect_new_failures(
        [_new("qlora-nf4-bf16-mixed-train-cpu-torch", "sig-a")],
        {"peft": ("0.21.1", "0.21.2")},
        stack="default",
        budget_s=100,
        output=tmp_path,
        bisect_fn=bisect_fn,
        clock=Clock(),
        log=lambda line: None,
    )
    assert record["status"] == "nothing ran"
    assert compare.bisection_verdict(record) == (
        "peft 0.21.1 -> 0.21.2: nothing ran (nothing ran in peft==0.21.1: the cell skipped: Requires: [bitsandbytes])"
    )


def test_a_run_whose_selected_cells_all_skipped_is_one_line_for_the_stack_session():
    skipped = {"outcome": "skipped", "skip_reason": "Requires: [CUDA device] (none visible)"}
    document = {"cells": [skipped, skipped]}
    assert sweep_table.run_nothing_ran(document, "stack default") == (
        "nothing ran in stack default: 2 cells skipped: Requires: [CUDA device] (none visible)"
    )
    assert sweep_table.run_nothing_ran({"cells": []}, "stack x") == "nothing ran in stack x: the selection has no cell"
    assert sweep_table.run_nothing_ran({"cells": [skipped, {"outcome": "known"}]}, "stack x") is None


def test_the_published_table_exits_4_naming_each_release_that_ran_nothing(tmp_path):
    """python -m matrix releases --from: the page is written, and the exit status says a sweep
    had a release without a verdict (as sweep's does)."""
    missing = "Requires: [bitsandbytes] (not installed)"
    document = {
        **_sweep_document(),
        "releases": [{"version": "0.21.1", "status": "ran", "seconds": 3, "cells": {"a": _skipped("a", missing)}}],
    }
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "sweep.json").write_text(json.dumps(document))
    page = tmp_path / "RELEASES.md"
    command = [sys.executable, "-m", "matrix", "releases", "-o", str(page), "--from", str(tmp_path / "sweep")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 4, done.stderr
    assert done.stderr.strip() == "python -m matrix releases: nothing ran in pkg 0.21.1: no verdict there"
    assert f"nothing ran in 0.21.1: 1 cell skipped: {missing}" in page.read_text()
