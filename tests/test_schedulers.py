"""docs/schedulers/: the Slurm job array and the Kubernetes indexed Job that run the matrix's
shards and their merge. Each recipe is read as its scheduler would read it (the array's range,
the Job's completions and index), and its shard and merge commands run here, as the scheduler
would run them on N nodes, on a small selection: the merge must hold every cell of the
selection, none missing."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "docs" / "schedulers"
# four eval cells on the CPU: one per shard of four (eval: no optimizer, so no torch._dynamo import)
SELECTION = "--model tiny-transformer --precision fp32,bf16-mixed,bf16-true,fp16-true --engine torch --mode eval"
SELECTION += " --device cpu -p no:cacheprovider"


def python_first(tmp_path: Path) -> str:
    """A PATH whose `python` is this interpreter, as a node's environment would have it."""
    if shutil.which("bash") is None:
        pytest.skip("Requires: [bash] (not on PATH)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / "python"  # not a symlink: a venv's interpreter is known by its own path
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    wrapper.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def run_bash(script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PATH": python_first(tmp_path), **env}
    environment.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600
    )


def merged_cells(reports: Path) -> dict:
    document = json.loads((reports / "merged" / "results.json").read_text())
    assert document["run"]["incomplete"] is False and document["missing"] == []
    return {cell["id"]: cell["outcome"] for cell in document["cells"]}


def slurm_task(script: str, tmp_path: Path, reports: Path, task: int, count: int) -> subprocess.CompletedProcess:
    """One array task as Slurm runs it: SLURM_ARRAY_TASK_ID of SLURM_ARRAY_TASK_COUNT."""
    return run_bash(
        script,
        tmp_path,
        REPORTS=str(reports),
        MATRIX_ARGS=SELECTION,
        SLURM_ARRAY_TASK_ID=str(task),
        SLURM_ARRAY_TASK_COUNT=str(count),
    )


def sbatch_options(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script, re.MULTILINE))


def test_the_slurm_array_runs_every_shard_and_the_merge_holds_every_cell(tmp_path):
    shard_script = (RECIPES / "shard.sbatch").read_text()
    merge_script = (RECIPES / "merge.sbatch").read_text()
    first, last = map(int, sbatch_options(shard_script)["array"].split("-"))
    assert first == 1 and last >= 2, "task ids 1..N are the shards 1/N..N/N"
    assert "merge.sbatch" in shard_script and "--dependency=afterany" in shard_script
    reports = tmp_path / "reports"
    for task in range(first, last + 1):
        done = slurm_task(shard_script, tmp_path, reports, task, last)
        assert done.returncode in (0, 1), done.stdout[-2000:] + done.stderr[-2000:]
        assert json.loads((reports / f"shard-{task}" / "results.json").read_text())["run"]["shard"] == f"{task}/{last}"
    done = run_bash(merge_script, tmp_path, REPORTS=str(reports))
    assert done.returncode == 0, done.stdout + done.stderr
    cells = merged_cells(reports)
    assert len(cells) == 4 and set(cells.values()) <= {"passed", "known"}


def test_a_slurm_task_that_never_ran_is_missing_in_the_merge(tmp_path):
    shard_script = (RECIPES / "shard.sbatch").read_text()
    reports = tmp_path / "reports"
    last = int(sbatch_options(shard_script)["array"].split("-")[1])
    done = slurm_task(shard_script, tmp_path, reports, 1, last)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    merge = run_bash((RECIPES / "merge.sbatch").read_text(), tmp_path, REPORTS=str(reports))
    assert merge.returncode == 1, "cells missing: the merge job fails"
    document = json.loads((reports / "merged" / "results.json").read_text())
    assert len(document["missing"]) == 3 and {m["shard"] for m in document["missing"]} == {
        f"{k}/{last}" for k in range(2, last + 1)
    }


def job_script(document: dict) -> tuple[str, dict[str, str]]:
    container = document["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["bash", "-c"], container["command"]
    return container["command"][2], {e["name"]: e["value"] for e in container.get("env", [])}


def test_the_indexed_job_runs_every_shard_and_the_merge_job_holds_every_cell(tmp_path):
    job = yaml.safe_load((RECIPES / "indexed-job.yaml").read_text())
    merge_job = yaml.safe_load((RECIPES / "merge-job.yaml").read_text())
    assert (job["apiVersion"], job["kind"], merge_job["kind"]) == ("batch/v1", "Job", "Job")
    spec = job["spec"]
    script, env = job_script(job)
    assert spec["completionMode"] == "Indexed" and spec["completions"] == int(env["SHARDS"]) >= 2
    assert spec["parallelism"] <= spec["completions"]
    mounts = {m["mountPath"] for m in job["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert env["REPORTS"] in mounts, "the shards write where every pod (and the merge) sees it"
    reports = tmp_path / "reports"
    for index in range(spec["completions"]):
        done = run_bash(
            script,
            tmp_path,
            **{**env, "REPORTS": str(reports), "MATRIX_ARGS": SELECTION, "JOB_COMPLETION_INDEX": str(index)},
        )
        assert done.returncode in (0, 1), done.stdout[-2000:] + done.stderr[-2000:]
    merge_script, merge_env = job_script(merge_job)
    assert merge_env["REPORTS"] == env["REPORTS"]
    done = run_bash(merge_script, tmp_path, REPORTS=str(reports))
    assert done.returncode == 0, done.stdout + done.stderr
    cells = merged_cells(reports)
    assert len(cells) == 4 and set(cells.values()) <= {"passed", "known"}
    plan = json.loads((reports / "shard-1" / "shard-plan.json").read_text())
    assert plan["shards"] == spec["completions"]
    assert sorted(cell for shard in plan["cells"] for cell in shard) == sorted(cells)
