"""--shard K/N, python -m matrix merge, and --cuda-device per-worker."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_report import ENV, RUN

from matrix.cell import Cell, SelectionError
from matrix.devices import resolve_index
from matrix.precisions import table
from matrix.results.document import results_document
from matrix.results.files import SCHEMA_FILE
from matrix.results.merge import MergeError, merge
from matrix.results.records import CellRecord
from matrix.shards import parse_shard, shard_cells

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # a test about skipped cuda cells makes them skip, GPU or not
# eval only: sharding and merging do not depend on the mode, and a train cell's first optimizer
# imports torch._dynamo (1.5 s per process)
SELECTION = ("--model", "tiny-transformer", "--precision", "fp32,bf16-mixed,bf16-true,fp16-true", "--engine", "torch")
SELECTION += ("--mode", "eval")


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


def test_per_worker_gpu_pinning():
    assert [resolve_index("per-worker", f"gw{k}", 2) for k in range(5)] == [0, 1, 0, 1, 0]
    assert resolve_index("per-worker", None, 4) == 0  # no xdist: the first GPU
    assert resolve_index("per-worker", "gw3", 0) == 0  # no GPU: cuda cells skip anyway
    assert resolve_index("2", "gw1", 4) == 2  # an explicit index wins on every worker
    with pytest.raises(ValueError, match="--cuda-device: 'gpu1'"):
        resolve_index("gpu1", None, 1)


def results(directory: Path) -> dict:
    return json.loads((directory / "results.json").read_text())


def comparable(document: dict) -> dict:
    """Everything a grid shows; durations differ from run to run, nothing else may."""
    cells = [{k: v for k, v in c.items() if k not in ("duration_s", "phase_seconds")} for c in document["cells"]]
    return {
        "cells": cells,
        "counts": document["counts"],
        "signatures": document["signatures"],
        "known_failures": document["known_failures"],
    }


def merge_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "matrix", "merge", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def shard_runs(tmp_path_factory):
    """One unsharded run and its two shards, each in its own pytest process."""
    root = tmp_path_factory.mktemp("shards")
    for run_id, extra in (("whole", ()), ("one", ("--shard", "1/2")), ("two", ("--shard", "2/2"))):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "cases",
                *SELECTION,
                "--report-dir",
                str(root),
                "--run-id",
                run_id,
                *extra,
            ],
            cwd=ROOT,
            env={**os.environ, **NO_GPU},  # the cuda cells skip on any machine: the merge must carry skips
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    return root


def test_two_shards_merged_equal_one_unsharded_run(shard_runs, tmp_path):
    one, two = results(shard_runs / "one"), results(shard_runs / "two")
    assert (one["run"]["shard"], two["run"]["shard"]) == ("1/2", "2/2")
    assert {c["id"] for c in one["cells"]}.isdisjoint({c["id"] for c in two["cells"]})
    assert abs(len(one["cells"]) - len(two["cells"])) <= 1 and one["cells"] and two["cells"]

    done = merge_command(str(shard_runs / "one"), str(shard_runs / "two"), "-o", str(tmp_path / "merged"))
    assert done.returncode == 0, done.stderr
    merged, whole = results(tmp_path / "merged"), results(shard_runs / "whole")
    assert comparable(merged) == comparable(whole)
    assert len(whole["cells"]) == 8 and whole["counts"]["passed"] > 0 and whole["counts"]["skipped"] > 0
    assert [m["shard"] for m in merged["run"]["merged_from"]] == ["1/2", "2/2"]
    assert merged["run"]["incomplete"] is False and merged["run"]["selection"] == whole["run"]["selection"]
    for name in ("summary.md", "junit.xml", "index.html"):
        assert (tmp_path / "merged" / name).stat().st_size > 0


def test_a_missing_shard_makes_the_merge_incomplete(shard_runs, tmp_path):
    done = merge_command(str(shard_runs / "one"), "-o", str(tmp_path / "half"))
    assert done.returncode == 0, done.stderr
    assert "warning: shards 2/2 are missing" in done.stdout
    assert results(tmp_path / "half")["run"]["incomplete"] is True


def test_merge_refuses_different_stacks_unless_asked(shard_runs, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    document = results(shard_runs / "two")
    document["environment"]["packages"]["transformers"] = "4.50.0"
    (other / "results.json").write_text(json.dumps(document))
    done = merge_command(str(shard_runs / "one"), str(other), "-o", str(tmp_path / "mixed"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "different stacks: transformers" in done.stderr and "4.50.0" in done.stderr
    assert not (tmp_path / "mixed").exists()
    allowed = merge_command(str(shard_runs / "one"), str(other), "-o", str(tmp_path / "mixed"), "--allow-mixed-stacks")
    assert allowed.returncode == 0, allowed.stderr


def test_merge_refuses_overlap_and_an_existing_output(shard_runs, tmp_path):
    overlap = merge_command(str(shard_runs / "whole"), str(shard_runs / "one"), "-o", str(tmp_path / "x"))
    assert overlap.returncode == 2 and "Traceback" not in overlap.stderr
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.partial-*"))
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "keep.txt").write_text("mine")
    done = merge_command(str(shard_runs / "one"), str(shard_runs / "two"), "-o", str(tmp_path / "exists"))
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
