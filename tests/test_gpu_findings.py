"""docs/gpu-findings.md is what the kept GPU runs say (matrix/results/gpu_findings.py), so it cannot
go stale, and it names nothing outside the project; the generator reads what a run recorded."""

from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

import pytest

from matrix.results import gpu_findings
from matrix.results.files import OUTCOMES, ResultsError

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# what a path outside the project looks like: absolute, or climbing out of it
OUTSIDE = re.compile(r"(?<![\w.<])/(?:tmp|work|home|root|usr|opt|var|mnt)\b|\.\./shared|\bshared/gpu-evidence")
KEPT_RUN = ROOT / "docs" / "gpu-runs" / "h100-2026-11-27-issue47" / "C"


def test_the_committed_page_is_the_generators_output():
    committed = gpu_findings.PAGE.read_text(encoding="utf-8")
    assert committed == gpu_findings.render(), (
        "docs/gpu-findings.md is not what docs/gpu-runs says: run python -m matrix.results.gpu_findings"
    )


def test_the_page_names_no_path_outside_the_project():
    text = gpu_findings.PAGE.read_text(encoding="utf-8")
    outside = sorted(set(OUTSIDE.findall(text)))
    assert not outside, f"docs/gpu-findings.md names paths outside the project: {outside}"
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue
        resolved = (gpu_findings.PAGE.parent / target.partition("#")[0]).resolve()
        assert resolved.is_relative_to(ROOT), f"docs/gpu-findings.md links {target}, outside the project"
        assert resolved.exists(), f"docs/gpu-findings.md links {target}, which does not exist"


def test_every_kept_run_is_on_the_page_with_its_counts():
    page = gpu_findings.PAGE.read_text(encoding="utf-8")
    sessions = gpu_findings.sessions()
    runs = [run for session in sessions for run in session.runs]
    assert len(runs) >= 12, [run.folder for run in runs]  # 1 + 3 + 8 kept when this test was written
    for run in runs:
        assert f"[{gpu_findings.relative(run.folder / 'summary.md', gpu_findings.PAGE)}]" in page, run.folder
        for device in {cell["device"] for cell in run.document["cells"]}:
            cells = [c for c in run.document["cells"] if c["device"] == device]
            ran = sum(c["outcome"] != "skipped" for c in cells)
            new = sum(c["outcome"] == "failed" for c in cells)
            assert f"| {device} | {len(cells)} | {ran} | {new} |" in page, (run.folder, device)


def test_the_shown_outcomes_are_every_outcome_a_report_has():
    assert sorted(gpu_findings.SHOWN_OUTCOMES) == sorted(OUTCOMES)
    assert set(gpu_findings.OUTCOME_HEADINGS) == set(OUTCOMES)


def test_the_distributed_engines_are_the_registrys():
    from matrix.engines import ENGINES

    distributed = {name for name in ENGINES if ENGINES[name].distributed and not name.endswith("-compile")}
    assert distributed == set(gpu_findings.DISTRIBUTED)


def copy_run(tmp_path: Path, edit=None) -> Path:
    """A gpu-runs folder holding one session with one kept run (issue 47's run C), edited."""
    session = tmp_path / "gpu-runs" / "h100-test"
    run = session / "C"
    shutil.copytree(KEPT_RUN, run)
    (session / "README.md").write_text("# A test session\n\nWhat ran.\n")
    if edit:
        document = json.loads(gzip.decompress((run / "results.json.gz").read_bytes()))
        edit(document)
        (run / "results.json.gz").write_bytes(gzip.compress(json.dumps(document).encode()))
    return tmp_path / "gpu-runs"


def test_a_run_shows_its_selection_stack_and_the_entry_of_each_signature(tmp_path):
    runs = copy_run(tmp_path)
    text = gpu_findings.render(runs, tmp_path / "page.md")
    assert "## A test session" in text and "[gpu-runs/h100-test/README.md](gpu-runs/h100-test/README.md)" in text
    # the command that ran, without where its report went (an absolute path) or its name
    assert (
        "`python -m matrix run cases -p matrix.plugin --device cuda --cuda-device per-worker --world-size 1 "
        "--model tiny-llama --precision float8-tensorwise,float8-rowwise --engine ddp-compile --mode train -n 2`"
    ) in text
    assert "/tmp" not in text and "--run-id" not in text
    assert "torch 2.11.0 (CUDA 13.0)" in text and "1 x NVIDIA H100 80GB HBM3" in text
    assert "c2994fa with uncommitted changes" in text
    assert "| `sig-773be0f0` | 2 cuda |" in text and "| `torchao-float8-inner-dims-multiple-of-16` |" in text
    assert "| ddp-compile | 2 | 1 | 1 |" in text  # the engine's cells ran on one rank


def test_a_failure_no_entry_claimed_is_new_here(tmp_path):
    def unclaim(document):
        cell = document["cells"][0]
        cell["outcome"], cell["known_failure"] = "failed", None
        cell["signature"]["message"] = "Parent directory /tmp/x/y does not exist"

    text = gpu_findings.render(copy_run(tmp_path, unclaim), tmp_path / "page.md")
    row = next(line for line in text.splitlines() if line.startswith("| `sig-773be0f0`"))
    assert "new here (1)" in row and "`torchao-float8-inner-dims-multiple-of-16` (1)" in row, row
    assert "Parent directory <path> does not exist" in row, row  # a path in a message is not shown
    assert "| cuda | 2 | 2 | 1 | 1 |" in text


def test_an_unreadable_results_file_is_named(tmp_path):
    runs = copy_run(tmp_path)
    (runs / "h100-test" / "C" / "results.json.gz").write_bytes(b"not gzip")
    with pytest.raises(ResultsError, match=r"results\.json\.gz"):
        gpu_findings.render(runs, tmp_path / "page.md")


def test_check_fails_on_a_stale_page(tmp_path):
    page = tmp_path / "gpu-findings.md"
    page.write_text("stale\n")
    assert gpu_findings.main(["--check", "-o", str(page)]) == 1
    assert gpu_findings.main(["-o", str(page)]) == 0
    assert gpu_findings.main(["--check", "-o", str(page)]) == 0
