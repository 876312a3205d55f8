"""python -m matrix rejudge RUN (matrix/releases/rejudge.py): a run made here, judged again against
the catalogue as it is, without it, and with an entry added, without running a cell."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import run_matrix_cpu
from matrix.catalogue.entries import assemble
from matrix.releases import rejudge

ROOT = Path(__file__).resolve().parent.parent
CLAIMS_A_PASSING_CELL = """
[[entry]]
id = "test-claims-tiny-transformers-fp32-evaluation"
title = "an entry that claims a cell which passes"
kind = "bug"
upstream = []
signature = "evaluate: RuntimeError: never raised"
cells = [{ model = ["tiny-transformer"], precision = ["fp32"], mode = ["eval"], engine = ["torch"] }]
versions = { torch = ">=2.0" }
workaround = "none"
"""


@pytest.fixture(scope="module")
def evaluation_run(tmp_path_factory):
    """tiny-transformer's CPU evaluations on the torch engine: passed cells and known ones."""
    report_dir = tmp_path_factory.mktemp("rejudge")
    selection = ("--model", "tiny-transformer", "--engine", "torch", "--mode", "eval")
    done, document = run_matrix_cpu(report_dir, *selection, run_id="run")
    assert done.returncode == 0, done.stdout[-3000:]
    outcomes = {c["id"]: c["outcome"] for c in document["cells"]}
    assert outcomes["tiny-transformer-fp32-eval-cpu-torch"] == "passed"
    assert outcomes["tiny-transformer-bf16-mixed-eval-cpu-torch"] == "known"  # torch-encoder-fastpath-autocast
    return report_dir / "run", document


def rejudge_command(run: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "matrix", "rejudge", str(run), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_run_judged_again_against_its_own_catalogue_changes_nothing(evaluation_run):
    _, document = evaluation_run
    judged = rejudge.rejudge(document, assemble())
    ran = [c for c in document["cells"] if c["outcome"] != "skipped"]
    assert len(judged) == len(ran) and not [c for c in judged if c.changed]
    assert "  changed: 0" in rejudge.summary_lines(judged)


def test_without_the_builtin_catalogue_every_known_cell_reads_new(evaluation_run, tmp_path):
    run, document = evaluation_run
    known = sorted(c["id"] for c in document["cells"] if c["outcome"] == "known")
    out = tmp_path / "rejudged.json"
    done = rejudge_command(run, "--no-builtin-catalogue", "--json", str(out))
    assert done.returncode == 1, done.stdout + done.stderr  # a cell reads new: the run's gate
    after = {c["id"]: c for c in json.loads(out.read_text())}
    assert sorted(i for i, c in after.items() if c["after"] == "failed") == known
    assert all(after[i]["before"] == "known" and after[i]["after_entry"] is None for i in known)
    by_entry = Counter(c["known_failure"]["id"] for c in document["cells"] if c["outcome"] == "known")
    for entry, number in by_entry.items():
        assert f"{number:5d}  known ({entry}) -> new" in done.stdout, done.stdout


def test_an_entry_added_that_claims_a_passing_cell_reads_it_fixed(evaluation_run, tmp_path):
    _, document = evaluation_run
    extra = tmp_path / "extra.toml"
    extra.write_text(CLAIMS_A_PASSING_CELL)
    judged = {c.id: c for c in rejudge.rejudge(document, assemble((extra,)))}
    cell = judged["tiny-transformer-fp32-eval-cpu-torch"]
    assert (cell.before, cell.after, cell.after_entry) == (
        "passed",
        "fixed",
        "test-claims-tiny-transformers-fp32-evaluation",
    )
    assert [i for i, c in judged.items() if c.changed] == ["tiny-transformer-fp32-eval-cpu-torch"]
    assert "        1  passed -> fixed (test-claims-tiny-transformers-fp32-evaluation)" in rejudge.summary_lines(
        list(judged.values())
    )


def test_conditions_read_the_runs_machine_not_this_one(evaluation_run, tmp_path):
    """An entry whose hardware condition is "not:cpu-avx512" claims the fp32 evaluation: judged for
    the machine the run recorded, a CPU dispatching at AVX512 is where it does not apply (inapplicable),
    and the same results recorded on an AVX2 CPU read fixed, whatever CPU re-judges them."""
    _, document = evaluation_run
    extra = tmp_path / "extra.toml"
    extra.write_text(
        CLAIMS_A_PASSING_CELL.replace('workaround = "none"', 'workaround = "none"\nwhen = ["not:cpu-avx512"]')
    )
    catalogue = assemble((extra,))
    cell = "tiny-transformer-fp32-eval-cpu-torch"
    avx512 = json.loads(json.dumps(document))
    avx512["environment"]["hardware"]["cpu_capability"] = "AVX512"
    avx2 = json.loads(json.dumps(document))
    avx2["environment"]["hardware"]["cpu_capability"] = "AVX2"
    on_avx512 = {c.id: c for c in rejudge.rejudge(avx512, catalogue)}[cell]
    on_avx2 = {c.id: c for c in rejudge.rejudge(avx2, catalogue)}[cell]
    assert (on_avx512.after, on_avx2.after) == ("inapplicable", "fixed")
