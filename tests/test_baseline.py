"""The fp32 baseline of the whole matrix on this machine, run as a user runs it.

Every other precision is compared with fp32, so its cells have to pass here before any other
result means anything. This module's name sorts first: under pytest-xdist a worker starts the
run (about half a minute on 2 cores) at once, beside the shorter tests, instead of ending
the session alone.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARGUMENTS = ("-m", "matrix", "run", "cases", "--precision", "fp32", "--device", "cpu")


def test_the_fp32_cells_of_every_model_and_engine_pass_here(tmp_path):
    """Any cell may skip, naming the capability missing here (Triton, the real model's weights);
    none may fail in a way the known-failure catalogue does not know, and every engine passes
    cells of its own, but one whose library is not installed (deepspeed: an extra), whose cells
    all skip naming it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    command = [sys.executable, *ARGUMENTS, "--report-dir", str(tmp_path), "--run-id", "baseline"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    report = tmp_path / "baseline"
    summary = report / "summary.md"
    assert done.returncode == 0, summary.read_text() if summary.exists() else done.stdout[-3000:] + done.stderr[-3000:]

    document = json.loads((report / "results.json").read_text())
    cells, selection = document["cells"], document["run"]["selection"]
    assert len(cells) == len(selection["model"]) * len(selection["engine"]) * 2  # train and eval
    assert [c["id"] for c in cells if c["outcome"] == "failed"] == []
    for cell in cells:
        if cell["outcome"] == "skipped":
            assert cell["skip_reason"].startswith("Requires: ["), cell
    for engine in selection["engine"]:
        own = [c for c in cells if c["engine"] == engine]
        if all(c["outcome"] == "skipped" for c in own):  # its library is an extra not installed here
            reasons = {c["skip_reason"] for c in own}
            assert len(reasons) == 1 and "not installed" in reasons.pop(), (engine, reasons)
        else:
            assert any(c["outcome"] == "passed" for c in own), engine
