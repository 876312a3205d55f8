"""Standalone reproduction scripts: generated from a real run, run with nothing of this
project importable, they reproduce the same signature (or complete when the cell passed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from matrix import repro
from matrix.signatures import normalize_message

ROOT = Path(__file__).resolve().parent.parent

FAILING = ["tiny-transformer-bf16-mixed-eval-cpu-torch", "tiny-llama-fp16-loaded-mixed-train-cpu-torch"]
PASSING = ["gemma-cache-fp32-eval-cpu-torch", "lora-fp16-loaded-mixed-train-cpu-torch"]
CHECK_FAILURE = "tiny-llama-bf16-true-eval-cpu-torch"  # found by a matrix check, not raised by the stack


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    reports = tmp_path_factory.mktemp("reports")
    selection = " or ".join(f"test_cell[{cell}]" for cell in [*FAILING, *PASSING, CHECK_FAILURE])
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "cases",
            "--report-dir",
            str(reports),
            "--engine",
            "torch",
            "--device",
            "cpu",
            "-k",
            selection.replace("[", " and ").replace("]", ""),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    (latest,) = [p for p in reports.iterdir() if p.is_dir() and p.name != "latest"]
    return latest


def generate(cell, run_dir, tmp_path):
    """`python -m matrix repro` itself: its exit status and one-line refusals are the subject."""
    script = tmp_path / f"{cell}.py"
    done = subprocess.run(
        [sys.executable, "-m", "matrix", "repro", cell, "--run", str(run_dir), "-o", str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return done, script


def write_script(cell, run_dir, tmp_path) -> Path:
    """The script `python -m matrix repro` writes, generated in this process: the script, run
    on its own, is the subject (the command's own path is the test above and below)."""
    script = tmp_path / f"{cell}.py"
    script.write_text(repro.generate(cell, run_dir))
    return script


def run_standalone(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("cell", FAILING)
def test_a_script_reproduces_the_failing_cells_signature(cell, run_dir, tmp_path):
    record = next(c for c in json.loads((run_dir / "results.json").read_text())["cells"] if c["id"] == cell)
    script = write_script(cell, run_dir, tmp_path)
    text = script.read_text()
    assert "matrix" not in "".join(line for line in text.splitlines() if line.startswith(("import", "from")))
    assert "pip install torch==" in text and record["signature"]["text"] in text
    done = run_standalone(script, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    reproduced = done.stdout.strip().splitlines()[-1]
    assert reproduced.startswith(f"REPRODUCED in {record['phase']}: {record['signature']['exception']}: ")
    assert normalize_message(reproduced.split(": ", 2)[2]) == record["signature"]["message"]


@pytest.mark.parametrize("cell", PASSING)
def test_a_script_for_a_passing_cell_completes(cell, run_dir, tmp_path):
    done = run_standalone(write_script(cell, run_dir, tmp_path), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("not reproduced: every phase completed")


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        (CHECK_FAILURE, "failed a matrix check (matrix.checks.DtypeContractBroken), not a stack exception"),
        ("tiny-llama-fp32-eval-cpu-accelerate", "only torch-engine cells are written as standalone scripts so far"),
        ("no-such-cell", "no cell 'no-such-cell'"),
    ],
)
def test_what_cannot_be_written_says_why(cell, message, run_dir, tmp_path):
    generated, _ = generate(cell, run_dir, tmp_path)
    assert generated.returncode == 2
    assert generated.stderr.strip().startswith("python -m matrix repro: ") and message in generated.stderr


@pytest.mark.parametrize(
    ("variant", "outcome"),
    [
        ('{"seq_len":1,"padding":"right","pad_counts":[0]}', 1),  # an exploration's minimal finding
        ('{"seq_len":1,"padding":"none","pad_counts":[0]}', 0),  # its base: no padding mask at all
    ],
)
def test_a_script_carries_an_explorations_variant(variant, outcome, tmp_path):
    cell = "tiny-transformer-bf16-mixed-eval-cpu-torch"
    script = tmp_path / "variant.py"
    generated = subprocess.run(
        [sys.executable, "-m", "matrix", "repro", cell, "--variant", variant, "-o", str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert generated.returncode == 0, generated.stderr
    text = script.read_text()
    assert variant in text and "torch.tensor([[" in text
    done = run_standalone(script, tmp_path)
    assert done.returncode == outcome, done.stdout + done.stderr
    if outcome:
        assert "REPRODUCED in evaluate: RuntimeError: expected scalar type Float but found BFloat16" in done.stdout


def test_a_variant_the_model_cannot_take_is_refused(tmp_path):
    cell = "tiny-llama-bf16-mixed-eval-cpu-torch"
    generated = subprocess.run(
        [sys.executable, "-m", "matrix", "repro", cell, "--variant", '{"num_heads":3}'],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert generated.returncode == 2 and "Traceback" not in generated.stderr
    assert generated.stderr.startswith("python -m matrix repro: --variant: ")
