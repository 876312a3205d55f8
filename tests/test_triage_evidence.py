"""The evidence scripts of docs/triage-every-engine/: standalone, and true to the matrix they explain.

half_weights_vs_autocast.py explains the every-engine sweep's curve cells that remain new (OLMo2 in
fp16, Gemma 4 in bf16) without any engine. What it shows holds only while it builds the matrix's
models and batch, and judges by the matrix's rows: these tests hold it to both, and run it with
nothing of the project importable.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "triage-every-engine" / "half_weights_vs_autocast.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("half_weights_vs_autocast", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_its_rows_are_the_matrix_rows_for_an_unmeasured_kind(script):
    from matrix.checks.tolerances import UNMEASURED_KIND_ROWS
    from matrix.results.curves import FP32_TWIN, TORCH_ENGINE

    names = {"fp32 twin": FP32_TWIN, "torch engine": TORCH_ENGINE}
    for (reference, dtype), (atol, rtol, per_step) in script.ROWS.items():
        row = UNMEASURED_KIND_ROWS[names[reference], str(dtype).removeprefix("torch.")]
        assert (row.atol, row.rtol, row.per_step) == (atol, rtol, per_step), (reference, dtype)


@pytest.mark.parametrize("name", ["olmo2", "gemma4_unified_text"])
def test_it_builds_the_matrix_model_and_batch(script, name):
    """Its model holds the weights the matrix's hf: kind starts every cell from, and its batch is the kind's."""
    from matrix.models import MODELS
    from matrix.precisions.policies import PRECISIONS

    kind = MODELS[f"hf:{name}"]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        theirs = kind.build(PRECISIONS["fp32"], torch.device("cpu"), Path("/nonexistent")).state_dict()
        ours = script.create(name).state_dict()
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[key], ours[key]) for key in theirs)
    batch = kind.batch(torch.device("cpu"))
    assert batch.keys() == script.BATCH.keys()
    assert all(torch.equal(batch[key], script.BATCH[key]) for key in batch)


def test_it_shows_the_half_weights_curves_leave_the_rows_with_nothing_of_the_project(tmp_path):
    """Run as a user runs it, from a directory where the project is not importable: exit 1, and the
    steps the sweep's cells failed at are the ones outside the rows (OLMo2 against its fp32 twin,
    Gemma 4 against the torch engine, both at step 3); the torch loop's autocast stays within."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-I", str(SCRIPT)], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()

    def share(model: str, what: str, reference: str, step: int) -> float:
        start = next(i for i, line in enumerate(lines) if line.startswith(f"{model}:"))
        section = lines[start : lines.index("", start)]  # a model's lines end at a blank one
        prefix = f"  {what} against the {reference}, step {step}:"
        (line,) = [line for line in section if line.startswith(prefix)]
        return float(line.rsplit("(", 1)[1].split("x the")[0])

    assert share("olmo2", "half weights", "fp32 twin", 3) > 1
    assert share("gemma4_unified_text", "half weights", "torch engine", 3) > 1
    for model in ("olmo2", "gemma4_unified_text"):
        assert all(share(model, "autocast", "fp32 twin", step) <= 1 for step in (1, 2, 3))
    assert lines[-1] == "the half-weights loop leaves a row on: olmo2, gemma4_unified_text"
