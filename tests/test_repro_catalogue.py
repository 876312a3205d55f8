"""Every catalogued bug has a cell whose standalone script shows it: the catalogue's `shown_by`
names, for each entry of kind "bug", one cell the entry selects. Where the entry is in force on this stack and the
cell runs here, the matrix's run of the cell is "known" under the entry and the script `python -m
matrix repro` writes for it, run with nothing of this project importable, exits 1 with the
entry's check (or exception) in the entry's phase. A CPU selection runs in this session; the rest
run where their releases, extras or device are (the row says which)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from matrix.catalogue.entries import load
from matrix.devices.fingerprint import package_versions
from matrix.results.signatures import normalize_message
from matrix.selection.cells import cell_from_id

ROOT = Path(__file__).resolve().parent.parent


def bug_entries():
    return [entry for entry in load().entries if entry.kind == "bug"]


# entry id -> a cell it selects, whose script shows it: the catalogue's `shown_by`
REPRESENTATIVE = {entry.id: entry.shown_by for entry in bug_entries()}

# the CPU selection the tests session runs (cheap cells of the torch engine, and one distributed
# script whose ranks meet a BaseException: DCP's CheckpointException, which killed them until the
# scripts recorded it as the matrix does); nox -s repro (MATRIX_REPRO_EVERY_CELL=1) adds cells of
# the other engines of the tests' environment
RUN_HERE = [
    "torch-encoder-fastpath-autocast",
    "from-pretrained-thaws-frozen-parameters",
    "dcp-resume-needs-optimizer-state-of-every-parameter",
]
if os.environ.get("MATRIX_REPRO_EVERY_CELL") == "1":
    RUN_HERE += [
        "youtu-init-zeroes-loaded-pad-embedding",
        "xlstm-cache-state-rounded-to-64",
        "trainer-num-items-overcounts-unmapped-causal-lm",
        "accelerate-auto-wrap-needs-every-no-split-class",
        "accelerate-fsdp2-tail-group-splits-tied-output-bias",
    ]


def test_every_catalogued_bug_has_a_representative_cell_it_selects():
    import tests.plugins.user_qlora  # noqa: F401  (a user's kind: its entry was found through it)

    catalogue = {entry.id: entry for entry in bug_entries()}
    missing = sorted(entry_id for entry_id, cell_id in REPRESENTATIVE.items() if not cell_id)
    assert not missing, f"without a representative (shown_by in matrix/catalogue/known_failures.toml): {missing}"
    shown_by = [e.id for e in load().entries if e.kind != "bug" and e.shown_by]
    assert not shown_by, f"shown_by on entries that are not bugs: {shown_by}"
    for entry_id, cell_id in REPRESENTATIVE.items():
        cell = cell_from_id(cell_id)
        assert cell is not None, f"{entry_id}: {cell_id} is no cell of the grid"
        assert catalogue[entry_id].selects(cell), f"{entry_id} does not select {cell_id}"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    reports = tmp_path_factory.mktemp("reports")
    cells = [REPRESENTATIVE[entry] for entry in RUN_HERE]
    models = sorted({cell_from_id(c).model for c in cells})
    engines = sorted({cell_from_id(c).engine for c in cells})
    selection = " or ".join(f"test_cell[{c}]" for c in cells)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "cases", "--report-dir", str(reports), "--engine", ",".join(engines),
         "--device", "cpu", "--model", ",".join(models), "-k", selection.replace("[", " and ").replace("]", ""),
         "-p", "no:cacheprovider", "-q"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    runs = [p for p in reports.iterdir() if p.is_dir() and p.name != "latest"]
    assert len(runs) == 1, done.stdout[-3000:] + done.stderr[-3000:]
    return runs[0]


@pytest.mark.parametrize("entry_id", RUN_HERE)
def test_the_representatives_script_shows_the_bug_without_the_harness(entry_id, run_dir, tmp_path):
    from matrix.releases.repro import generate

    entry = next(e for e in bug_entries() if e.id == entry_id)
    if not entry.versions_hold(package_versions()):
        pytest.skip(f"{entry_id} is not in force on this stack ({entry.versions}): run where its releases are")
    cell = REPRESENTATIVE[entry_id]
    record = next(c for c in json.loads((run_dir / "results.json").read_text())["cells"] if c["id"] == cell)
    assert record["outcome"] == "known" and record["known_failure"]["id"] == entry_id, record.get("outcome")
    script = tmp_path / "repro.py"
    script.write_text(generate(cell, run_dir))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, str(script), "--json", str(tmp_path / "out.json")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    outcome = json.loads((tmp_path / "out.json").read_text())
    name = record["signature"]["exception"].rsplit(".", 1)[-1]
    assert (outcome["phase"], outcome["failure"]["name"]) == (record["phase"], name)
    # the entry's own signature matches what the script saw, written as the matrix writes it
    signature = record["signature"]
    message = normalize_message(outcome["failure"]["message"])
    seen = f"{outcome['phase']}: {signature['exception']}: {message} @ {signature['origin']}"
    assert entry.matches(seen), seen
