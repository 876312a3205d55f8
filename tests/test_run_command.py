"""python -m matrix run's own command line (matrix/run/supervisor.py): --help lists this command's options
and the matrix's pytest options (matrix/run/options.py), exits 0, and neither starts pytest nor
imports torch."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import python_path
from matrix.run import options

ROOT = Path(__file__).resolve().parent.parent
BLOCKED = ("torch", "transformers", "peft", "accelerate", "lightning", "pytest", "_pytest", "xdist")

# `python -m matrix ARGS` with the stack and pytest unimportable and no process allowed to start
HELP = textwrap.dedent(
    """
    import runpy, subprocess, sys

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {blocked!r}:
                raise ImportError(f"blocked: {{name}}")

    def no_process(*args, **kwargs):
        raise AssertionError(f"started a process: {{args}}")

    sys.meta_path.insert(0, Blocked())
    subprocess.Popen = no_process
    sys.argv = ["python -m matrix", *{args!r}]
    runpy.run_module("matrix", run_name="__main__", alter_sys=True)
    """
)


def matrix_command(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": python_path(), "COLUMNS": "120"}
    script = HELP.format(blocked=BLOCKED, args=args)
    return subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)


@pytest.mark.parametrize(
    "args",
    [("run", "--help"), ("run", "-h"), ("run", "--model", "lora", "-k", "eval", "--help")],
    ids=["--help", "-h", "after-other-arguments"],
)
def test_run_help_lists_its_options_and_the_matrix_options(tmp_path, args):
    done = matrix_command(tmp_path, *args)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr[-3000:]
    text = done.stdout
    assert text.startswith("usage: python -m matrix run [-h] [options] [pytest args]"), text[:300]
    listed = re.findall(r"^  (-p|--[a-z-]+)", text, flags=re.MULTILINE)
    # this command's own, then the rest of the matrix's (--no-report is refused here, --matrix-resume internal)
    own = ["--cell-timeout", "--kind-setup-timeout", "--run-id", "--report-dir", "-p"]
    rest = [o.flag for o in options.OPTIONS if o.flag not in (*own, "--no-report") and not o.hidden]
    assert listed == own + rest
    assert "\n  -h, --help " in text
    assert "the matrix's pytest options" in text and "'mixed-precision matrix'" in text
    assert "Any other argument goes to pytest" in text
    assert not (tmp_path / "reports").exists()


def test_the_blocker_blocks_torch_and_processes(tmp_path):
    """The help test's guard is not a no-op: a run that would start pytest is stopped by it."""
    done = matrix_command(tmp_path, "run", "--run-id", "x", "--report-dir", str(tmp_path / "r"))
    assert done.returncode != 0 and "AssertionError: started a process" in done.stderr, done.stderr[-2000:]
    blocked = HELP.format(blocked=BLOCKED, args=()).split("sys.argv")[0] + "import torch\n"
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True)
    assert done.returncode != 0 and "blocked: torch" in done.stderr


def test_the_top_level_help_still_lists_run(tmp_path):
    done = matrix_command(tmp_path, "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "{run,fold," in done.stdout and "the matrix in one pytest process" in done.stdout
