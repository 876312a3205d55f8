"""python -m matrix triage: a real run of a user's kinds (tests/plugins/triage_kinds.py), each
failing in the matrix for another reason, triaged into the three classifications: the bugs that
show without the harness (an exception, and an evaluation off fp32: reproduces, with their
drafts), the one that shows only inside it (does not reproduce), the one that fails another way
standalone (another failure). Then the page, the nightly's step, the run without a new failure,
bad input, and how a script's verdict is read."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import PLUGINS, ROOT, python_path, run_matrix_cpu
from matrix.grid.cell import Cell
from matrix.releases import triage

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

KINDS = {"triage-real-bug": "reproduces", "triage-off-fp32": "reproduces"}
KINDS.update({"triage-harness-only": "does-not-reproduce", "triage-other-failure": "another-failure"})
SELECTION = ("--model", ",".join(KINDS), "--precision", "bf16-mixed,fp16-mixed", "--mode", "eval", "--engine", "torch")
# four scripts, each importing the stack (seconds apiece, more on a loaded machine), after the run
pytestmark = pytest.mark.timeout(900)


def triage_command(run: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m matrix triage RUN` as a user runs it after `python -m matrix run -p triage_kinds`:
    the plugin importable, no -p given (the run's cells name it)."""
    env = {**os.environ, "PYTHONPATH": python_path(PLUGINS)}
    command = [sys.executable, "-m", "matrix", "triage", str(run), *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)


@pytest.fixture(scope="module")
def triaged(tmp_path_factory):
    """The run (8 cells: 4 kinds x 2 precisions, every one failing), triaged: (run directory,
    its results.json, the triage process, triage.json as it wrote it, entries by kind)."""
    reports = tmp_path_factory.mktemp("triage-reports")
    _, document = run_matrix_cpu(reports, "-p", "triage_kinds", *SELECTION, run_id="triage")
    run = reports / "triage"
    done = triage_command(run)
    assert (run / triage.TRIAGE_JSON).is_file(), done.stdout + done.stderr[-3000:]
    summary = json.loads((run / triage.TRIAGE_JSON).read_text())
    by_kind = {entry["smallest_cell"].split("-bf16")[0].split("-fp16")[0]: entry for entry in summary["signatures"]}
    return run, document, done, summary, by_kind


def test_each_kind_gets_its_classification(triaged):
    run, document, done, summary, by_kind = triaged
    assert done.returncode == 0, done.stdout + done.stderr
    assert [c["outcome"] for c in document["cells"]] == ["failed"] * 8
    assert {kind: entry["classification"] for kind, entry in by_kind.items()} == KINDS, done.stdout
    assert summary["counts"]["reproduces"] == 2 and summary["counts"]["does-not-reproduce"] == 1
    for entry in summary["signatures"]:
        assert len(entry["cells"]) == 2 and len(entry["runs"]) == 1  # a CPU steps deterministically: once
        assert (run / entry["script"]).is_file() and (run / entry["runs"][0]["log"]).is_file()
        assert f"{entry['signature']['id']} (2 cells): {triage.CLASSIFICATIONS[entry['classification']]}" in done.stdout


def test_the_smallest_cell_of_each_signature_is_the_one_run(triaged):
    _, document, _, summary, _ = triaged
    for entry in summary["signatures"]:
        cells = [c for c in document["cells"] if c["id"] in entry["cells"]]
        assert entry["smallest_cell"] == min(cells, key=lambda c: (c["duration_s"], c["id"]))["id"]
        assert entry["cell_seconds"] == min(c["duration_s"] for c in cells)


def test_the_real_bug_reproduces_with_a_draft_entry_that_selects_its_cells(triaged):
    _, document, _, _, by_kind = triaged
    entry = by_kind["triage-real-bug"]
    (script_run,) = entry["runs"]
    assert script_run["outcome"] == "reproduced" and script_run["exit_status"] == 1
    assert script_run["last_line"].startswith("REPRODUCED in evaluate: ValueError: the classifier's head")
    draft = tomllib.loads(entry["catalogue_entry"])["entry"][0]
    assert draft["kind"] == "bug" and draft["upstream"] == []
    torch_version = document["environment"]["packages"]["torch"].split("+")[0]
    assert draft["versions"]["torch"] == f">={torch_version}"
    assert entry["script"] in draft["notes"]
    # the catalogue reads it as an entry: its signature matches the cells' and it selects them, and no other
    from matrix.catalogue.entries import parse
    from matrix.selection.cells import axis_values

    axes = {**axis_values(), "model": (*axis_values()["model"], *KINDS)}
    (parsed,) = parse(entry["catalogue_entry"], Path("draft.toml"), axes=axes).entries
    assert parsed.matches(entry["signature"]["text"])
    cells = {c["id"]: Cell(**{axis: c[axis] for axis in ("model", "precision", "mode", "device", "engine")})
             for c in document["cells"]}  # fmt: skip
    assert {cell_id for cell_id, cell in cells.items() if parsed.selects(cell)} == set(entry["cells"])


def test_the_real_bug_has_a_draft_issue_a_maintainer_could_paste(triaged):
    run, document, _, _, by_kind = triaged
    entry = by_kind["triage-real-bug"]
    issue = entry["issue"]
    for heading in ("### What happens", "### Versions", "### Reproduction", "### Expected", "### Actual"):
        assert heading in issue, heading
    assert f"torch {document['environment']['packages']['torch']}" in issue
    assert (run / entry["script"]).read_text().rstrip() in issue  # the whole script, inline
    assert "REPRODUCED in evaluate: ValueError" in issue.split("### Actual")[1]
    assert "user's model kind" in issue  # built through the plugin's module: said so


def test_an_evaluation_off_fp32_reproduces_with_its_numbers_in_the_draft_issue(triaged):
    _, document, _, _, by_kind = triaged
    entry = by_kind["triage-off-fp32"]
    assert entry["signature"]["exception"] == "matrix.checks.OutOfTolerance"  # a check of the matrix, not raised
    (script_run,) = entry["runs"]
    assert script_run["outcome"] == "reproduced" and script_run["failure"]["name"] == "OutOfTolerance"
    (failing,) = [c for c in script_run["checks"] if not c["held"]]
    expected, actual = entry["issue"].split("### Expected")[1].split("### Actual")
    assert str(failing["reference"]) in expected and str(failing["allowance"]) in expected
    assert str(failing["value"]) in actual
    # the run recorded the same deviation the script measured: the cell's numbers, standalone
    record = next(c for c in document["cells"] if c["id"] == entry["smallest_cell"])
    numbers = [float(n) for n in re.findall(r"\d+\.\d+", record["message"].splitlines()[0])]
    for measured in (failing["value"], failing["reference"]):
        assert any(abs(n - measured) <= 1e-4 * abs(measured) for n in numbers), (measured, record["message"])


def test_the_harness_only_failure_does_not_reproduce_and_says_what_differed(triaged):
    _, _, _, _, by_kind = triaged
    entry = by_kind["triage-harness-only"]
    (script_run,) = entry["runs"]
    assert script_run["outcome"] == "holds" and script_run["exit_status"] == 0
    assert entry["catalogue_entry"] is None and entry["issue"] is None
    matrix_line, *standalone = entry["differed"]
    assert matrix_line.startswith(f"in the matrix, {entry['smallest_cell']} failed in evaluate: RuntimeError: ")
    assert "harness's own pipeline" in matrix_line
    assert standalone and all(line.startswith("standalone") for line in standalone)


def test_the_other_failure_names_the_scripts_own(triaged):
    _, _, _, _, by_kind = triaged
    entry = by_kind["triage-other-failure"]
    (script_run,) = entry["runs"]
    assert script_run["outcome"] == "another" and script_run["failure"]["name"] == "LookupError"
    assert entry["summary"].startswith("LookupError: and another way outside it")
    assert entry["catalogue_entry"] is None and entry["differed"] == []


def test_the_page_has_one_row_per_signature_and_the_drafts(triaged):
    run, _, _, summary, by_kind = triaged
    page = (run / triage.TRIAGE_MD).read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `sig-")]
    assert len(rows) == 4
    for entry in summary["signatures"]:
        (row,) = [line for line in rows if line.startswith(f"| `{entry['signature']['id']}`")]
        assert f"`{entry['smallest_cell']}`" in row and f"]({entry['script']})" in row
        assert triage.CLASSIFICATIONS[entry["classification"]] in row
    assert by_kind["triage-real-bug"]["catalogue_entry"].rstrip() in page and "````markdown" in page
    html = (run / "index.html").read_text()
    assert '<section id="triage">' in html and html.count("<strong>does-not-reproduce</strong>") == 1
    assert f'href="{by_kind["triage-real-bug"]["script"]}"' in html


def test_only_one_signature_with_a_short_timeout_times_out_and_keeps_the_others(triaged, tmp_path):
    run, _, _, summary, by_kind = triaged
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    signature = by_kind["triage-real-bug"]["signature"]["id"]
    done = triage_command(copy, "--only", signature, "--timeout", "1")  # the script's imports alone take longer
    assert done.returncode == 0, done.stderr
    again = {e["signature"]["id"]: e for e in json.loads((copy / triage.TRIAGE_JSON).read_text())["signatures"]}
    assert again[signature]["classification"] == "timed-out"
    assert again[signature]["summary"] == "the script ran past 1 s"
    before = {e["signature"]["id"]: e["classification"] for e in summary["signatures"]}
    assert {k: e["classification"] for k, e in again.items() if k != signature} == {
        k: v for k, v in before.items() if k != signature
    }


def test_a_run_without_a_new_failure_has_nothing_to_triage(triaged, tmp_path):
    _, document, _, _, _ = triaged
    quiet = json.loads(json.dumps(document))
    for cell in quiet["cells"]:
        cell.update(outcome="passed", phase=None, signature=None, message=None, traceback=None)
    (tmp_path / "results.json").write_text(json.dumps(quiet))
    done = triage_command(tmp_path)
    assert done.returncode == triage.NOTHING_NEW_STATUS, done.stderr
    assert "no new failure to triage" in done.stderr
    assert "No new failure" in (tmp_path / triage.TRIAGE_MD).read_text()
    assert not (tmp_path / triage.TRIAGE_DIR).exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--only", "sig-00000000"), "--only sig-00000000: not a new signature of this run"),
        (("--timeout", "0"), "--timeout: 0 is not a positive number of seconds"),
        (("-p", "no_such_plugin_module"), "-p no_such_plugin_module: ModuleNotFoundError"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(triaged, args, message):
    run = triaged[0]
    done = triage_command(run, *args)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("python -m matrix triage: ") and message in done.stderr, done.stderr


def test_a_directory_without_a_run_is_bad_input(tmp_path):
    done = triage_command(tmp_path)
    assert done.returncode == 2 and "no results.json" in done.stderr and "Traceback" not in done.stderr


# ------------------------------------------------------------------ how a script's verdict is read


SIGNATURE = {"phase": "evaluate", "exception": "matrix.checks.OutOfTolerance", "message": "m", "id": "sig-1"}


def verdict(status: int, last: str, stderr: str = "", written: dict | None = None, tmp_path: Path | None = None):
    path = (tmp_path or Path("/nonexistent")) / "out.json"
    if written is not None:
        path.write_text(json.dumps(written))
    return triage.read_verdict(status, last, stderr, path)


def test_a_verdict_is_read_from_the_json_file_first(tmp_path):
    written = {"outcome": "holds", "phase": None, "failure": None, "checks": [{"name": "OutOfTolerance"}]}
    run = verdict(1, "REPRODUCED in evaluate: X: y", written=written, tmp_path=tmp_path)
    assert run.outcome == "holds" and run.checks == [{"name": "OutOfTolerance"}]


def test_without_a_json_file_the_exit_status_and_last_line_decide():
    run = verdict(1, "REPRODUCED in evaluate: OutOfTolerance: eval loss is off the fp32 reference")
    assert run.outcome == "reproduced" and run.phase == "evaluate" and run.failure["name"] == "OutOfTolerance"
    assert verdict(0, "not reproduced: every phase completed").outcome == "holds"  # the older scripts' line
    crashed = verdict(1, "phase evaluate", stderr="Traceback ...\nImportError: no module named x")
    assert crashed.outcome == "another" and crashed.failure == {"name": "ImportError", "message": "no module named x"}
    killed = verdict(-9, "phase evaluate")
    assert killed.outcome == "another" and "killed by signal 9" in killed.note


def test_a_reproduced_line_naming_another_exception_or_phase_is_another_failure():
    other = verdict(1, "REPRODUCED in evaluate: LookupError: x")
    assert triage.combine([other], SIGNATURE)[0] == "another-failure"
    assert "not matrix.checks.OutOfTolerance" in other.note
    elsewhere = verdict(1, "REPRODUCED in checkpoint_save: OutOfTolerance: x")
    assert triage.combine([elsewhere], SIGNATURE)[0] == "another-failure"
    same = verdict(1, "REPRODUCED in evaluate: OutOfTolerance: x")
    assert triage.combine([same], SIGNATURE)[0] == "reproduces"


def test_on_a_nondeterministic_device_one_run_of_two_reproducing_is_a_candidate():
    held, reproduced = verdict(0, "HOLDS: every check of the cell held"), verdict(1, "REPRODUCED in evaluate: X: y")
    classification, line = triage.combine([held, reproduced], {**SIGNATURE, "exception": "X"})
    assert classification == "reproduces" and line.endswith("(in 1 of 2 runs)")
    timed_out = triage.ScriptRun("timeout", None, 1.0)
    assert triage.combine([timed_out, held], SIGNATURE)[0] == "does-not-reproduce"
    assert triage.combine([timed_out], SIGNATURE)[0] == "timed-out"
    assert triage.runs_for("cuda") == 2 and triage.runs_for("cpu") == 1


def test_a_script_never_sees_this_project_on_its_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(tmp_path)]))
    environment = triage.script_environment([PLUGINS])
    assert environment["PYTHONPATH"].split(os.pathsep) == [str(PLUGINS), str(tmp_path)]
    # a -p module's directory is the one its top-level name is found in; never this checkout's root
    for name, file in (
        ("top_plugin", tmp_path / "top_plugin.py"),
        ("company.kinds", tmp_path / "company" / "kinds.py"),
        ("company_pkg", tmp_path / "company_pkg" / "__init__.py"),
        ("tests.plugins.in_checkout", ROOT / "tests" / "plugins" / "in_checkout.py"),
    ):
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(__file__=str(file)))
    names = ["top_plugin", "company.kinds", "company_pkg", "tests.plugins.in_checkout"]
    assert triage.module_directories(names) == [tmp_path.resolve()]


# ------------------------------------------------------------------ the nightly's triage step, run here


def test_the_nightlys_triage_step_triages_the_merged_run_within_its_budget(triaged, tmp_path, monkeypatch):
    """sharded-matrix.yml's merge job: after the merge and the diff, triage runs on the merged run
    (here: the run above, with a budget that one script's imports outlast), writes its page into the
    job summary and never fails the step; the upload step takes the page and the scripts."""
    from test_workflows import RUN_ID, SHARDED_WORKFLOW, job_step, load_workflow, run_step

    sharded = load_workflow(SHARDED_WORKFLOW)
    names = [step.get("name", "") for step in sharded["jobs"]["merge"]["steps"]]
    triage_at = next(i for i, name in enumerate(names) if name.startswith("Triage"))
    assert names.index(next(n for n in names if n.startswith("Compare"))) < triage_at < names.index("Gate")
    assert "triage" not in str(job_step(sharded, "merge", "Gate")["env"]), "triage never gates"
    merged = tmp_path / f"merged-report/merged-{RUN_ID}"
    shutil.copytree(triaged[0], merged, ignore=shutil.ignore_patterns("triage*"))
    monkeypatch.setenv("PYTHONPATH", python_path(PLUGINS))  # where the run's plugin module is
    context = {"inputs.python": sys.executable, "github.run_id": RUN_ID, "inputs.triage-budget": 1}
    step = job_step(sharded, "merge", "Triage the new failures")
    code, outputs, log = run_step(sharded, "merge", step, tmp_path, context)
    assert code == 0 and outputs["status"] == "0", log[-3000:]
    assert "# Triage of run triage" in log
    entries = json.loads((merged / triage.TRIAGE_JSON).read_text())["signatures"]
    assert sorted(e["classification"] for e in entries) == ["not-run", "not-run", "not-run", "timed-out"]
    upload = job_step(sharded, "merge", "Upload the triage")
    paths = [line.strip() for line in upload["with"]["path"].splitlines() if line.strip()]
    for path in paths:
        assert (tmp_path / path.replace("${{ env.MERGED }}", f"merged-report/merged-{RUN_ID}")).exists(), path


def test_the_html_section_escapes_what_the_triage_says():
    from matrix.results.html import triage_section

    hostile = "<script>alert(1)</script>"
    entry = {
        "signature": {"id": hostile, "text": hostile},
        "cells": [hostile],
        "smallest_cell": hostile,
        "classification": hostile,
        "summary": hostile,
        "script": "javascript:alert(1)",
        "differed": [hostile],
        "catalogue_entry": hostile,
        "issue": hostile,
    }
    section = triage_section({"signatures": [entry]})
    assert "<script>" not in section and section.count("&lt;script&gt;") >= 7
    assert 'href="javascript:' not in section  # the script's path is a relative link, quoted
    assert triage_section(None) == ""
    assert "nothing to triage" in triage_section({"signatures": []})


def test_a_cell_this_machine_cannot_run_is_not_run_with_its_devices_reason():
    cuda = {"device": "cuda", "precision": "bf16-mixed"}
    from matrix.devices import DEVICES
    from matrix.precisions.policies import PRECISIONS

    reason = DEVICES["cuda"].skip_reason(PRECISIONS["bf16-mixed"])
    assert triage.not_runnable_here(cuda) == reason  # None on a machine with a bf16-capable GPU
    assert triage.not_runnable_here({"device": "cpu", "precision": "fp32"}) is None
    assert triage.not_runnable_here({"device": "tpu", "precision": "fp32"}) is None  # unknown here: the script says
