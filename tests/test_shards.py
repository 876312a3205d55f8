"""--shard K/N (round-robin, or balanced by --shard-costs), python -m matrix merge, and
--cuda-device per-worker: a selection run whole and as three shards in separate processes,
merged, gives the same cells, outcomes, signatures and reports."""

import copy
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_report import ENV, RUN

from conftest import python_path
from matrix.devices import resolve_index
from matrix.grid.cell import Cell, SelectionError
from matrix.precisions.policies import table
from matrix.results.document import results_document
from matrix.results.files import SCHEMA_FILE
from matrix.results.html import html_report
from matrix.results.markdown import summary_markdown
from matrix.results.records import CellRecord
from matrix.shards.merge import MergeError, merge
from matrix.shards.plan import PLAN_FILE, SPLIT_FRACTION, Costs, parse_shard, plan, shard_cells

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # a test about skipped cuda cells makes them skip, GPU or not
# train and eval: the reports compared below hold the training cells' loss curves too
SELECTION = ("--model", "tiny-transformer", "--precision", "fp32,bf16-mixed,bf16-true,fp16-true", "--engine", "torch")
SHARDS = 3


@given(st.lists(st.integers(), max_size=40, unique=True), st.integers(min_value=1, max_value=9))
def test_shards_cover_every_cell_once_and_evenly(cells, n):
    shards = [shard_cells(cells, (k, n)) for k in range(1, n + 1)]
    assert sorted(c for shard in shards for c in shard) == sorted(cells)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert shard_cells(cells, None) == cells


@pytest.mark.parametrize("text", ["0/2", "3/2", "1/0", "1", "a/b", "1/2/3", "-1/2"])
def test_a_bad_shard_is_refused(text):
    with pytest.raises(SelectionError, match=r"^--shard: .* is not K/N"):
        parse_shard(text)


def test_shard_parsing():
    assert parse_shard("2/3") == (2, 3) and parse_shard(None) is None and parse_shard("") is None


def costs_of(seconds: dict[Cell, float], setups: dict[str, float] | None = None) -> Costs:
    cells = {cell.id: (cell.axes(), cost) for cell, cost in seconds.items()}
    return Costs(cells, dict(setups or {}), "previous")


CELLS = st.lists(
    st.builds(
        Cell,
        model=st.sampled_from(["tiny-llama", "lora", "hf:gpt2"]),
        precision=st.sampled_from(["fp32", "bf16-mixed", "fp16-mixed"]),
        mode=st.sampled_from(["train", "eval"]),
        device=st.just("cpu"),
        engine=st.sampled_from(["torch", "ddp", "deepspeed-zero3"]),
    ),
    unique=True,
    max_size=40,
)


@given(CELLS, st.integers(min_value=1, max_value=6), st.data())
def test_a_balanced_plan_runs_every_cell_once_in_the_selections_order(cells, n, data):
    """Whatever the costs: each cell in exactly one shard, each shard in the selection's order,
    the same plan every time, and (greedy, dearest unit first) no shard more than one unit past
    the cheapest, where no unit is dearer than a quarter of a shard's share or one cell and its setup."""
    seconds = {cell: data.draw(st.floats(min_value=0, max_value=100)) for cell in cells}
    setups = {kind: data.draw(st.floats(min_value=0, max_value=30)) for kind in ("tiny-llama", "lora", "hf:gpt2")}
    costs = costs_of(seconds, setups)
    shards = plan(cells, n, costs)
    assert sorted((c for shard in shards.shards for c in shard), key=cells.index) == cells
    for shard in shards.shards:
        assert list(shard) == sorted(shard, key=cells.index)
    assert plan(cells, n, costs) == shards
    share = (sum(seconds.values()) + sum(setups[kind] for kind in {c.model for c in cells})) / n
    largest_unit = max([SPLIT_FRACTION * share, *(seconds[c] + setups[c.model] for c in cells)], default=0)
    assert max(shards.predicted_s) - min(shards.predicted_s) <= largest_unit + 0.002  # rounded to ms


def test_costs_balance_what_round_robin_deals_unevenly():
    """Every other cell a slow one (a distributed engine's): round-robin gives them all to one
    shard, twice the other's time; balanced by the costs, the slowest is within a quarter of the median."""
    cells = [Cell(f"kind{k}", "fp32", "train", "cpu", e) for k in range(20) for e in ("torch", "deepspeed-zero3")]
    seconds = {cell: 20.0 if cell.engine == "deepspeed-zero3" else 1.0 for cell in cells}
    for n in (2, 4):
        dealt = [sum(seconds[c] for c in shard_cells(cells, (k, n))) for k in range(1, n + 1)]
        balanced = plan(cells, n, costs_of(seconds)).predicted_s
        assert max(dealt) >= 1.8 * statistics.median(dealt), dealt
        assert max(balanced) <= 1.25 * statistics.median(balanced), balanced


def test_a_cell_the_previous_run_lacked_costs_what_its_like_cost():
    before = {
        Cell("tiny-llama", "fp32", "train", "cpu", "ddp"): 10.0,
        Cell("tiny-llama", "bf16-mixed", "train", "cpu", "ddp"): 20.0,
        Cell("tiny-llama", "fp32", "eval", "cpu", "ddp"): 2.0,
        Cell("tiny-llama", "fp32", "train", "cpu", "torch"): 0.5,
    }
    cost = costs_of(before).estimator()
    assert cost(Cell("tiny-llama", "fp32", "train", "cpu", "ddp")) == 10.0  # measured
    assert cost(Cell("lora", "bf16-mixed", "train", "cpu", "ddp")) == 20.0  # its engine, precision, mode, device
    assert cost(Cell("lora", "fp16-mixed", "train", "cpu", "ddp")) == 15.0  # its engine, mode and device
    assert cost(Cell("lora", "fp16-mixed", "eval", "cuda", "ddp")) == 10.0  # its engine
    assert cost(Cell("lora", "fp32", "eval", "cpu", "fsdp2")) == 6.0  # any cell
    assert Costs({}).estimator()(Cell("lora", "fp32", "eval", "cpu", "fsdp2")) == 1.0


def test_per_worker_gpu_pinning():
    assert [resolve_index("per-worker", f"gw{k}", 2) for k in range(5)] == [0, 1, 0, 1, 0]
    assert resolve_index("per-worker", None, 4) == 0  # no xdist: the first GPU
    assert resolve_index("per-worker", "gw3", 0) == 0  # no GPU: cuda cells skip anyway
    assert resolve_index("2", "gw1", 4) == 2  # an explicit index wins on every worker
    with pytest.raises(ValueError, match="--cuda-device: 'gpu1'"):
        resolve_index("gpu1", None, 1)


def results(directory: Path) -> dict:
    return json.loads((directory / "results.json").read_text())


def rate_found_anyhow(metrics: dict | None) -> None:
    """Where a kind's learning rate came from differs by what ran before on the machine: searched
    in this run, or read from the cache an earlier run of the stack left (`cached`; on a fresh
    machine the unsharded run searches and the shards after it read). The rate and its falls are the
    same either way."""
    if isinstance(metrics, dict) and isinstance(metrics.get("learning_rate"), dict):
        metrics["learning_rate"] = {**metrics["learning_rate"], "cached": None}


def comparable(document: dict) -> dict:
    """Everything a grid shows; durations differ from run to run (a cell's, its phases', the time in its
    library's calls), and so does where a kind's learning rate came from (rate_found_anyhow); nothing
    else may."""
    cells = [{k: v for k, v in c.items() if k not in ("duration_s", "phase_seconds")} for c in document["cells"]]
    for cell in cells:
        if isinstance(cell.get("metrics"), dict):
            cell["metrics"] = {k: v for k, v in cell["metrics"].items() if k != "library_seconds"}
            rate_found_anyhow(cell["metrics"])
    return {
        "cells": cells,
        "counts": document["counts"],
        "signatures": document["signatures"],
        "known_failures": document["known_failures"],
    }


def matrix_command(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "matrix", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def merge_command(*args: str) -> subprocess.CompletedProcess:
    return matrix_command("merge", *args)


def matrix_run(root: Path, run_id: str, *extra: str) -> None:
    command = [sys.executable, "-m", "matrix", "run", "cases", *SELECTION, *extra]
    done = subprocess.run(
        [*command, "--report-dir", str(root), "--run-id", run_id],
        cwd=ROOT,
        env={**os.environ, **NO_GPU},  # the cuda cells skip on any machine: the merge must carry skips
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def shard_runs(tmp_path_factory):
    """One unsharded run, then its three shards balanced by what its cells cost, each shard
    `python -m matrix run` in its own process as N machines would run them."""
    root = tmp_path_factory.mktemp("shards")
    matrix_run(root, "whole")
    for k in range(1, SHARDS + 1):
        matrix_run(root, f"shard-{k}", "--shard", f"{k}/{SHARDS}", "--shard-costs", str(root / "whole"))
    return root


def shard_dirs(root: Path, *ks: int) -> list[str]:
    return [str(root / f"shard-{k}") for k in (ks or range(1, SHARDS + 1))]


def rendered(document: dict) -> tuple[str, str]:
    """index.html and summary.md with what differs between any two runs of the same cells made
    equal: the run's id, command, times and shard bookkeeping, each cell's seconds (its phases' and
    its library calls' too), and the kinds' one-time work (each process does its own: N shards, N of it)."""
    document = copy.deepcopy(document)
    run = document["run"]
    run.update(id="run", command="python -m matrix run", started_at="", finished_at="", duration_s=0.0)
    for key in ("merged_at", "merged_from", "shard", "workers"):
        run.pop(key, None)
    for cell in document["cells"]:
        cell["duration_s"] = 0.0
        cell["phase_seconds"] = {phase: 0.0 for phase in cell.get("phase_seconds") or {}}
        if "library_seconds" in (cell.get("metrics") or {}):
            cell["metrics"]["library_seconds"] = 0.0
        rate_found_anyhow(cell.get("metrics"))
    document["kind_setups"] = []
    return html_report(document), summary_markdown(document)


def test_shards_merged_equal_one_unsharded_run(shard_runs, tmp_path):
    shards = [results(Path(d)) for d in shard_dirs(shard_runs)]
    assert [s["run"]["shard"] for s in shards] == [f"{k}/{SHARDS}" for k in range(1, SHARDS + 1)]
    ids = [{c["id"] for c in s["cells"]} for s in shards]
    assert all(ids) and sum(map(len, ids)) == len(set().union(*ids)), "every shard runs cells, none twice"
    plans = [json.loads((Path(d) / PLAN_FILE).read_text()) for d in shard_dirs(shard_runs)]
    assert all(p == plans[0] for p in plans) and plans[0]["costs_from"] == "whole"
    assert [set(cells) for cells in plans[0]["cells"]] == ids

    done = merge_command(*shard_dirs(shard_runs), "-o", str(tmp_path / "merged"))
    assert done.returncode == 0, done.stdout + done.stderr
    merged, whole = results(tmp_path / "merged"), results(shard_runs / "whole")
    assert comparable(merged) == comparable(whole)
    assert len(whole["cells"]) == 16 and whole["counts"]["passed"] > 0 and whole["counts"]["skipped"] > 0
    assert any(c["metrics"].get("curve") for c in whole["cells"]), "training cells' curves are compared too"
    assert [m["shard"] for m in merged["run"]["merged_from"]] == [f"{k}/{SHARDS}" for k in range(1, SHARDS + 1)]
    assert merged["run"]["incomplete"] is False and merged["missing"] == []
    assert merged["run"]["selection"] == whole["run"]["selection"]
    html, markdown = rendered(merged)
    assert (html, markdown) == rendered(whole)
    assert "tiny-transformer-bf16-true-train-cpu-torch" in markdown and "<svg" in html


USERS = ("-p", "user_gpt2", "-p", "user_loop", "--model", "user-gpt2", "--engine", "user-loop,user-loop-model-only")
USERS += ("--precision", "fp32,bf16-mixed", "--device", "cpu")


def test_a_users_model_and_loops_sharded_give_the_unsharded_answer(tmp_path):
    """The plan, the costs and the merge hold for a model and loops written as users write them
    (tests/plugins/user_gpt2.py, user_loop.py), failures and their signatures included."""
    env = {**os.environ, "PYTHONPATH": python_path(ROOT / "tests" / "plugins")}
    env.pop("PYTEST_ADDOPTS", None)

    def run(run_id: str, *extra: str) -> None:
        command = [sys.executable, "-m", "matrix", "run", "cases", *USERS, *extra, "--report-dir", str(tmp_path)]
        done = subprocess.run([*command, "--run-id", run_id], cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]

    run("whole")
    for k in (1, 2):
        run(f"shard-{k}", "--shard", f"{k}/2", "--shard-costs", str(tmp_path / "whole"))
    done = merge_command(str(tmp_path / "shard-1"), str(tmp_path / "shard-2"), "-o", str(tmp_path / "merged"))
    assert done.returncode == 0, done.stdout + done.stderr
    whole, merged = results(tmp_path / "whole"), results(tmp_path / "merged")
    assert comparable(merged) == comparable(whole) and len(whole["cells"]) == 8
    assert whole["counts"]["failed"] > 0, "the model-only loop's lost optimizer state fails, in both"
    assert rendered(merged) == rendered(whole)


def test_a_missing_shard_is_missing_in_the_merge_and_fails_the_gate(shard_runs, tmp_path):
    done = merge_command(*shard_dirs(shard_runs, 1, 3), "-o", str(tmp_path / "partial"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"warning: shards 2/{SHARDS} are missing" in done.stdout
    merged = results(tmp_path / "partial")
    planned = json.loads((shard_runs / "shard-2" / PLAN_FILE).read_text())["cells"][1]
    assert merged["run"]["incomplete"] is True
    assert merged["missing"] == [{"id": i, "shard": f"2/{SHARDS}"} for i in sorted(planned)]
    assert not {c["id"] for c in merged["cells"]} & set(planned), "a missing cell is never a passed one"
    summary = (tmp_path / "partial" / "summary.md").read_text()
    assert "## Missing: selected, never reported" in summary and f"shard 2/{SHARDS}" in summary
    assert all(f"`{i}`" in summary for i in planned)
    assert f"{len(planned)} selected cells never reported" in (tmp_path / "partial" / "index.html").read_text()
    runs = (str(shard_runs / "whole"), str(tmp_path / "partial"))
    gate = matrix_command("diff", *runs)
    assert gate.returncode == 1, gate.stdout + gate.stderr
    assert f"Gate: FAIL** ({len(planned)} missing)" in gate.stdout
    as_json = matrix_command("diff", *runs, "--format", "json")
    counts = json.loads(as_json.stdout)["counts"]
    assert (counts["missing"], counts["removed"], counts["new"]) == (len(planned), 0, 0), "missing, not removed"


def test_a_shard_that_died_lists_the_cells_it_never_reached(shard_runs, tmp_path):
    """A shard that ended early (killed, timed out: its journal folded by python -m matrix fold)
    reports part of its plan: the merge lists the rest of it as missing, under that shard."""
    k = max(range(1, SHARDS + 1), key=lambda k: len(results(shard_runs / f"shard-{k}")["cells"]))
    died = tmp_path / f"shard-{k}"
    died.mkdir()
    (died / PLAN_FILE).write_text((shard_runs / f"shard-{k}" / PLAN_FILE).read_text())
    document = results(shard_runs / f"shard-{k}")
    kept, lost = document["cells"][:1], document["cells"][1:]
    document.update(cells=kept, run={**document["run"], "id": "died", "incomplete": True})
    (died / "results.json").write_text(json.dumps(document))
    others = [Path(d) for d in shard_dirs(shard_runs) if Path(d).name != died.name]
    merged = merge([died, *others])
    assert lost and {m["id"] for m in merged["missing"]} == {c["id"] for c in lost}
    assert {m["shard"] for m in merged["missing"]} == {f"{k}/{SHARDS}"}


def test_shards_planned_differently_are_not_merged(shard_runs, tmp_path):
    other = tmp_path / "shard-2"
    other.mkdir()
    (other / "results.json").write_text((shard_runs / "shard-2" / "results.json").read_text())
    replanned = json.loads((shard_runs / "shard-2" / PLAN_FILE).read_text())
    replanned["cells"] = replanned["cells"][::-1]
    (other / PLAN_FILE).write_text(json.dumps(replanned))
    with pytest.raises(MergeError, match="plan different shards"):
        merge([shard_runs / "shard-1", other, shard_runs / "shard-3"])


def test_shard_costs_need_a_shard_and_a_readable_run(tmp_path):
    for extra, message in (
        (("--shard-costs", str(tmp_path)), "--shard-costs: balances shards, so it needs --shard K/N"),
        (("--shard", "1/2", "--shard-costs", str(tmp_path)), "--shard-costs: " + str(tmp_path)),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "cases", *SELECTION, "--no-report", *extra],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 4 and message in done.stderr, done.stdout[-2000:] + done.stderr[-2000:]


def test_merge_refuses_different_stacks_unless_asked(shard_runs, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    document = results(shard_runs / "shard-2")
    document["environment"]["packages"]["transformers"] = "4.50.0"
    (other / "results.json").write_text(json.dumps(document))
    done = merge_command(str(shard_runs / "shard-1"), str(other), "-o", str(tmp_path / "mixed"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "different stacks: transformers" in done.stderr and "4.50.0" in done.stderr
    assert not (tmp_path / "mixed").exists()
    mixed = ("-o", str(tmp_path / "mixed"), "--allow-mixed-stacks")
    allowed = merge_command(str(shard_runs / "shard-1"), str(other), *mixed)
    assert allowed.returncode == 1, allowed.stderr  # written, but shard 3 is missing


def test_merge_refuses_overlap_and_an_existing_output(shard_runs, tmp_path):
    overlap = merge_command(str(shard_runs / "whole"), str(shard_runs / "shard-1"), "-o", str(tmp_path / "x"))
    assert overlap.returncode == 2 and "Traceback" not in overlap.stderr
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.partial-*"))
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "keep.txt").write_text("mine")
    done = merge_command(*shard_dirs(shard_runs), "-o", str(tmp_path / "exists"))
    assert done.returncode == 2 and "exists" in done.stderr
    assert [p.name for p in (tmp_path / "exists").iterdir()] == ["keep.txt"]


def gpu_cell(model: str, gpu: str) -> dict:
    record = CellRecord.of(Cell(model, "bf16-mixed", "eval", "cuda"), "passed").as_dict()
    record.update(cuda_index=0, device_name=gpu)
    return record


def test_different_gpus_keep_their_own_columns(tmp_path):
    paths = []
    for n, gpu in enumerate(("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB")):
        directory = tmp_path / f"run{n}"
        directory.mkdir()
        run = {**RUN, "id": f"run{n}", "shard": f"{n + 1}/2"}
        cells = [gpu_cell("tiny-llama", gpu), gpu_cell("tiny-transformer", gpu)]
        (directory / "results.json").write_text(json.dumps(results_document(run, ENV, cells, (), table())))
        paths.append(directory)
    document = merge(paths)
    assert sorted({c["device"] for c in document["cells"]}) == ["cuda-a100-sxm4-40gb", "cuda-h100-80gb-hbm3"]
    assert "tiny-llama-bf16-mixed-eval-cuda-h100-80gb-hbm3-torch" in {c["id"] for c in document["cells"]}
    assert document["counts"]["passed"] == 4
    with pytest.raises(MergeError, match="run run0 is given more than once"):
        merge([paths[0], paths[0]])


def test_each_cell_records_where_it_ran_and_how_to_rerun_it(shard_runs):
    import jsonschema

    document = results(shard_runs / "whole")
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.validate(document, schema)
    for cell in document["cells"]:
        assert cell["rerun"] == f"pytest 'cases/test_cells.py::test_cell[{cell['id']}]'"
        if cell["device"] == "cpu":
            assert (cell["cuda_index"], cell["device_name"]) == (None, document["environment"]["cpu"])
    assert document["run"]["shard"] is None and document["run"]["cuda_device"] == "0"
    assert not (shard_runs / "whole" / PLAN_FILE).exists(), "an unsharded run has no plan"


def test_a_run_id_in_use_is_refused_before_anything_runs(shard_runs):
    before = (shard_runs / "whole" / "results.json").read_bytes()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "cases", *SELECTION, "--report-dir", str(shard_runs), "--run-id", "whole"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 4, done.stdout[-2000:]  # pytest's usage error
    assert "--run-id:" in done.stderr and "exists" in done.stderr and "passed" not in done.stdout
    assert (shard_runs / "whole" / "results.json").read_bytes() == before
