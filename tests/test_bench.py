"""python -m matrix.tools.bench: a real (small) measurement, its failures, and the figures, targets
and report from hand-made measurements."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import python_path
from matrix.tools import bench

ROOT = Path(__file__).resolve().parent.parent
TWO_CELLS = ("--model", "tiny-transformer", "--precision", "fp32", "--engine", "torch", "--device", "cpu")


def run_bench(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_ADDOPTS", "PYTEST_XDIST"))}
    env["PYTHONPATH"] = python_path()
    command = [sys.executable, "-m", "matrix.tools.bench", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_small_real_measurement_gives_consistent_figures(tmp_path):
    out = tmp_path / "bench.json"
    options = ("--runner", "pytest", "--repeat", "1", "--per-cell-sample", "1", "--per-engine", "--json", str(out))
    done = run_bench(*options, "--", *TWO_CELLS)
    assert done.returncode == 0, done.stderr[-3000:]
    f = json.loads(out.read_text())

    assert f["selection"]["cells"] == 2 and f["selection"]["whole_torch_cpu_matrix"] is False
    assert f["selection"]["counts"]["passed"] == 2
    wall = f["matrix"]["median_s"]
    assert f["matrix"]["walls_s"] == [wall] and f["matrix"]["exit_statuses"] == [0]
    floor = f["floor"]
    # the floor imports what the run imported: torch and the matrix, none of the libraries that
    # only other models and engines need
    assert floor["modules_from_runs"] is True
    assert floor["modules"] == [
        "torch",
        "matrix.plugin",
        "matrix.harness.pipeline",
        "matrix.engines",
        "matrix.models",
    ]
    assert floor["import_walls_s"] == [floor["import_s"]] and floor["import_s"] > 0
    assert 0 < floor["compute_s"] < wall  # the cells' own time is part of the run's wall
    assert floor["floor_s"] == pytest.approx(floor["import_s"] + floor["compute_s"])
    assert f["overhead_ratio"] == pytest.approx(wall / floor["floor_s"])

    per_cell = f["per_cell"]
    assert (per_cell["cells_run"], per_cell["cells_total"], per_cell["extrapolated"]) == (1, 2, True)
    assert per_cell["cells"][0] in ("tiny-transformer-fp32-eval-cpu-torch", "tiny-transformer-fp32-train-cpu-torch")
    assert per_cell["total_s"] == pytest.approx(per_cell["walls_s"][0] * 2)
    assert f["speedup"] == pytest.approx(per_cell["total_s"] / wall)

    targets = {t["figure"]: t for t in f["targets"]}
    assert targets["matrix_wall_s"]["met"] is None  # 2 cells are not the torch-engine CPU matrix
    assert targets["overhead_ratio"]["met"] == (f["overhead_ratio"] < 1.5)
    assert targets["speedup"]["met"] == (f["speedup"] >= 5)

    # each engine's cells of the per-engine run (here the two cells' one engine), and its slowest phase
    per_engine = f["per_engine"]
    costs = {(c["engine"], c["part"]): c for c in per_engine["engines"]}
    assert set(costs) == {("torch", "train"), ("torch", "eval")}
    assert all(c["cells"] == 1 and 0 < c["median_s"] == c["total_s"] for c in costs.values())
    assert per_engine["compute_s"] == pytest.approx(sum(c["total_s"] for c in costs.values()))
    slowest = per_engine["slowest_phase"]["torch"]
    assert slowest["part"] in (
        "train_steps",
        "mid_training_eval",
        "checkpoint_save",
        "checkpoint_reload",
        "resumed_step",
        "evaluate",
    )
    assert 0 < slowest["total_s"] <= per_engine["compute_s"]
    assert "## Cell cost per engine" in done.stdout and "| torch | train | 1 |" in done.stdout
    # each cell's floor: the time inside the torch loop's own calls, a part of the cell's time
    floors = {(c["engine"], c["part"]): c for c in per_engine["floors"]}
    assert set(floors) == set(costs)
    assert all(0 < floors[key]["total_s"] < costs[key]["total_s"] for key in costs)
    ratio = costs[("torch", "train")]["total_s"] / floors[("torch", "train")]["total_s"]
    assert f"| {ratio:.1f}x |" in done.stdout

    assert done.stdout.startswith("# Benchmarks")
    assert "extrapolated from 1 of 2 cells" in done.stdout
    assert f"nox -s bench -- {f['arguments']}" in done.stdout
    assert f["machine"]["cpu_count"] == os.cpu_count() and f["machine"]["packages"]["torch"]
    assert set(f["load"]["other_cpu_cores"]) == {"matrix", "import", "per_cell", "per_engine"}
    assert "matrix run 1/1:" in done.stderr and "per-cell 1/1:" in done.stderr  # progress


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--runner", "pytest", "--", "--model", "nope"), "matrix run 1 exited with status 4: ERROR: --model: unknown"),
        (("--runner", "python -c pass"), "matrix run 1 wrote no readable"),
        (("--runner", "no-such-runner-command"), "cannot start no-such-runner-command"),
    ],
)
def test_a_broken_run_exits_2_with_one_line(args, expected):
    done = run_bench("--repeat", "1", *args)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"python -m matrix.tools.bench: {expected}"), done.stderr


TARGET_LT = bench.Target("matrix_wall_s", "wall", "<", 30.0, "s")
TARGET_GE = bench.Target("speedup", "speed-up", ">=", 5.0, "x")
TARGET_RATIO = bench.Target("overhead_ratio", "ratio", "<", 1.5, "")


@pytest.mark.parametrize(
    ("target", "value", "met", "verdict"),
    [
        (TARGET_LT, 18.0, True, "met by 12.0 s (40% under the limit)"),
        (TARGET_LT, 45.0, False, "missed by 15.0 s (50% over the limit)"),
        (TARGET_LT, 30.0, False, "missed by 0.0 s (0% over the limit)"),  # the limit is exclusive
        (TARGET_GE, 7.5, True, "met by 2.50x (50% above the minimum)"),
        (TARGET_GE, 5.0, True, "met by 0.00x (0% above the minimum)"),  # the minimum is inclusive
        (TARGET_GE, 4.0, False, "missed by 1.00x (20% short of the minimum)"),
        (TARGET_RATIO, 1.8, False, "missed by 0.30 (20% over the limit)"),
    ],
)
def test_target_evaluation_says_met_or_missed_and_by_how_much(target, value, met, verdict):
    result = bench.evaluate(target, value, whole_torch_cpu_matrix=True)
    assert (result["met"], result["verdict"], result["value"]) == (met, verdict, value)


def test_the_wall_target_applies_only_to_the_whole_torch_cpu_matrix():
    target = bench.TARGETS[0]
    assert target.whole_torch_cpu_matrix_only and target.figure == "matrix_wall_s"
    result = bench.evaluate(target, 10.0, whole_torch_cpu_matrix=False)
    assert result["met"] is None and result["verdict"].startswith("not evaluated")
    assert bench.evaluate(target, 10.0, whole_torch_cpu_matrix=True)["met"] is True


def hand_made(per_cell_busy=0.05, whole=True, sample=4):
    runs = [
        {"wall_s": w, "exit_status": 0, "compute_s": c, "cells": [f"c{i}" for i in range(64)]}
        for w, c in ((22.0, 14.5), (20.0, 14.0), (21.0, 13.0))
    ]
    for run in runs:
        run.update(counts={"passed": 40, "known": 24, "failed": 0}, whole_torch_cpu_matrix=whole)
    per_cell = bench.per_cell_figures(64, bench.spread(runs[0]["cells"], sample), [6.0, 6.5, 5.5, 6.0][:sample])
    meta = {
        "date": "2025-01-02 03:04 UTC",
        "machine": {
            "cpu": "Test CPU",
            "cpu_count": 2,
            "python": "3.11.7",
            "platform": "Linux",
            "packages": {"torch": "2.13.0+cpu", "peft": None},
            "git": {"commit": "0123456789abcdef", "dirty": True},
        },
        "load": {
            "before": 0.1,
            "after": 1.0,
            "other_cpu_cores": {"matrix": 0.01, "import": None, "per_cell": per_cell_busy},
        },
        "runner": "python -m matrix run",
        "pytest_args": ["--engine", "torch", "--device", "cpu"],
        "arguments": "--per-cell-sample 4",
    }
    return bench.figures([4.2, 4.0, 3.9], runs, per_cell, meta)


def test_figures_from_hand_made_measurements():
    f = hand_made()
    assert (f["matrix"]["median_s"], f["matrix"]["min_s"]) == (21.0, 20.0)
    assert (f["floor"]["import_s"], f["floor"]["compute_s"], f["floor"]["floor_s"]) == (4.0, 14.0, 18.0)
    assert f["overhead_ratio"] == pytest.approx(21.0 / 18.0)
    assert f["per_cell"]["cells"] == ["c8", "c24", "c40", "c56"]
    assert f["per_cell"]["total_s"] == pytest.approx(6.0 * 64) and f["per_cell"]["measured_s"] == 24.0
    assert f["speedup"] == pytest.approx(6.0 * 64 / 21.0)
    assert [t["met"] for t in f["targets"]] == [True, True, True]


def test_the_floor_imports_what_the_runs_imported_in_import_order():
    runs = [{"imports": ["matrix.plugin", "torch"]}, {"imports": ["peft", "torch", "transformers"]}, {}]
    assert bench.imported_modules(runs) == ["torch", "transformers", "peft", "matrix.plugin"]
    assert bench.imported_modules([{"imports": None}, {}]) == list(bench.STACK_MODULES)  # no run said
    f = hand_made()  # runs that did not say: the whole stack, and the report says why
    assert f["floor"]["modules"] == list(bench.STACK_MODULES) and f["floor"]["modules_from_runs"] is False
    assert "the whole stack, because the runs did not say what they imported." in bench.report_markdown(f)


def test_the_markdown_report_shows_every_figure():
    text = bench.report_markdown(hand_made())
    lines = text.splitlines()
    assert lines[0] == "# Benchmarks"
    for expected in (
        "| CPU | Test CPU, 2 cores |",
        "| packages | torch 2.13.0+cpu |",
        "| project commit | 0123456789ab (uncommitted changes) |",
        "| load average (1 min) | 0.10 before, 1.00 after (the bench adds about 1) |",
        "| cores other processes kept busy, on average | matrix runs 0.01, imports unknown, per-cell runs 0.05 |",
        "`python -m matrix run --engine torch --device cpu`: 64 cells (40 passed, 24 known).",
        "| matrix wall, each run | 22.0 s, 20.0 s, 21.0 s |",
        "| matrix wall, median (min) | 21.0 s (20.0 s) |",
        "| floor = import + cell compute | 18.0 s = 4.0 s + 14.0 s |",
        "| import what the runs imported, each time (median) | 4.2 s, 4.0 s, 3.9 s (4.0 s) |",
        "| overhead ratio = wall / floor | 1.17 |",
        "| process-per-cell total | 384.0 s, 6.00 s per cell; extrapolated from 4 of 64 cells "
        "(6.0 s, 6.5 s, 5.5 s, 6.0 s) |",
        "| speed-up = process-per-cell / wall | 18.3x |",
        "| torch-engine CPU matrix wall (median) | < 30.0 s | 21.0 s | ✅ met by 9.0 s (30% under the limit) |",
        "| overhead ratio (matrix wall / floor) | < 1.50 | 1.17 | ✅ met by 0.33 (22% under the limit) |",
        "nox -s bench -- --per-cell-sample 4",
        "python -m matrix.tools.bench --per-cell-sample 4   # the same, in an environment with the stack",
    ):
        assert expected in lines, expected
    assert "⚠️" not in text


def test_the_report_warns_of_a_busy_machine_and_marks_missed_targets():
    f = hand_made(per_cell_busy=0.9, sample=1)
    f["per_cell"] = bench.per_cell_figures(64, ["c32"], [1.0])
    f["targets"][2] = bench.evaluate(bench.TARGETS[2], 64 / 21.0, whole_torch_cpu_matrix=True)
    text = bench.report_markdown(f)
    assert "⚠️ Other processes were busy during the per-cell runs: those timings are inflated." in text
    missed = "| speed-up over process-per-cell | >= 5.00x | 3.05x | ❌ missed by 1.95x (39% short of the minimum) |"
    assert missed in text
    assert "extrapolated from 1 of 64 cells" in text
    unmeasured = hand_made(whole=False)
    assert "| ➖ not evaluated: the target is for the whole torch-engine CPU matrix |" in bench.report_markdown(
        unmeasured
    )


def test_all_cells_measured_are_not_extrapolated():
    per_cell = bench.per_cell_figures(3, ["a", "b", "c"], [1.0, 2.0, 4.0])
    assert per_cell["total_s"] == 7.0 and not per_cell["extrapolated"]
    f = hand_made()
    f["per_cell"] = per_cell
    assert "all 3 cells measured" in bench.report_markdown(f)


def test_spread_runner_and_arguments():
    cells = [str(i) for i in range(10)]
    assert bench.spread(cells, None) == cells and bench.spread(cells, 12) == cells
    assert bench.spread(cells, 1) == ["5"] and bench.spread(cells, 2) == ["2", "7"]
    assert bench.runner_command("pytest") == [sys.executable, "-m", "pytest", "cases"]
    assert bench.runner_command("python -m matrix run") == [sys.executable, "-m", "matrix", "run"]
    args, extra = bench.parse_args(["--repeat", "2", "--", "--model", "lora", "-k", "eval"])
    assert (args.repeat, args.runner, args.per_cell_sample, extra) == (2, "python -m matrix run", None, extra)
    assert extra == ["--model", "lora", "-k", "eval"]
    assert bench.bench_arguments(args, extra) == "--repeat 2 -- --model lora -k eval"
    assert bench.bench_arguments(*bench.parse_args([])) == ""


def test_the_one_line_names_what_went_wrong():
    collection_error = subprocess.CompletedProcess(
        [],
        2,
        stdout="cases/test_cells.py:11: in <module>\n    from conftest import X\n"
        "E   ImportError: cannot import name 'X'\n=== short test summary info ===\nERROR cases/test_cells.py\n",
        stderr="",
    )
    assert bench.last_line(collection_error) == "E ImportError: cannot import name 'X'"
    usage = subprocess.CompletedProcess([], 4, stdout="", stderr="ERROR: --model: unknown value 'nope'\n")
    assert bench.last_line(usage) == "ERROR: --model: unknown value 'nope'"
    assert bench.last_line(subprocess.CompletedProcess([], 3, stdout="", stderr="")) == "(no output)"


def test_a_cell_that_never_reached_its_engine_spent_nothing_of_its_floor():
    """A precision refused in `configure` never starts the engine: its floor is 0 s, and the row of
    its engine still has a floor; a run from before floors were recorded has none."""
    from matrix.results.phase_costs import floor_costs

    def cell(seconds, outcome="passed"):
        metrics = {} if seconds is None else {"library_seconds": seconds}
        return {"engine": "torch", "mode": "train", "outcome": outcome, "duration_s": 1.0, "metrics": metrics}

    (floor,) = floor_costs([cell(0.5), cell(0.25), cell(None, "failed"), cell(None, "skipped")])
    assert (floor.cells, floor.total_s, floor.median_s) == (3, 0.75, 0.25)
    assert floor_costs([cell(None), cell(None)]) == []


def test_the_per_engine_section_names_the_cells_its_failed_and_fixed_count():
    """A count of failed or fixed cells says nothing of which: the page lists them with their signature."""
    cells = [
        {"id": "a-fp32-train-cpu-ddp", "outcome": "passed", "signature": None},
        {"id": "b-fp16-mixed-train-cpu-ddp", "outcome": "failed", "signature": {"text": "train_steps: CurveDiverged"}},
        {"id": "c-bf16-true-eval-cpu-torch", "outcome": "fixed", "signature": None},
        {"id": "d-fp32-eval-cpu-torch", "outcome": "known", "signature": {"text": "evaluate: x"}},
    ]
    found = bench.unexplained(cells)
    assert [(c["id"], c["outcome"]) for c in found] == [
        ("b-fp16-mixed-train-cpu-ddp", "failed"),
        ("c-bf16-true-eval-cpu-torch", "fixed"),
    ]
    per_engine = {
        "pytest_args": ["--device", "cpu"],
        "counts": {"passed": 1, "failed": 1, "fixed": 1, "known": 1},
        "wall_s": 3.0,
        "compute_s": 2.0,
        "engines": [],
        "floors": [],
        "slowest_phase": {},
        "unexplained": found,
    }
    lines = bench.per_engine_markdown(per_engine, "python -m matrix run")
    assert "- failed: `b-fp16-mixed-train-cpu-ddp`: train_steps: CurveDiverged" in lines
    assert "- fixed: `c-bf16-true-eval-cpu-torch`" in lines
    assert lines.index("- fixed: `c-bf16-true-eval-cpu-torch`") < lines.index("|---|---|---|---|---|---|---|---|---|")
    assert not any(line.startswith("- ") for line in bench.per_engine_markdown({**per_engine, "unexplained": []}, "x"))
