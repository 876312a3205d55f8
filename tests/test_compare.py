"""python -m matrix diff: every change category, the gate's exit codes, and bad input."""

import json
import subprocess
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from test_report import ENV, RUN

from matrix.grid.cell import Cell
from matrix.precisions.policies import table
from matrix.results import compare
from matrix.results.document import results_document
from matrix.results.records import CellRecord
from matrix.results.signatures import Signature

ROOT = Path(__file__).resolve().parent.parent

ENTRY = {"id": "fastpath", "title": "fast path", "kind": "upstream", "upstream": [], "link": "https://x.test/1"}


def signature(message: str) -> dict:
    return Signature("evaluate", "RuntimeError", message, "torch.nn.modules.transformer:forward").as_dict()


def cell(model: str, outcome: str, sig: str | None = None, deviation: float | None = None, mode: str = "eval") -> dict:
    record = CellRecord.of(Cell(model, "bf16-mixed", mode, "cpu"), outcome).as_dict()
    if sig:
        record.update(phase="evaluate", signature=signature(sig), message=sig)
    if outcome in ("known", "fixed"):
        record["known_failure"] = ENTRY
    if outcome == "skipped":
        record["skip_reason"] = "Requires: [CUDA device] (none visible)"
    if deviation is not None:
        record["metrics"] = {
            "fp32_deviation_abs": deviation,
            "fp32_reference_loss": 4.0,
            "fp32_tolerance": {"atol": 0.02, "rtol": 0.02},  # allows 0.1 at a loss of 4
        }
    return record


def document(*records, run_id="run") -> dict:
    return results_document({**RUN, "id": run_id}, ENV, list(records), (), table())


OLD = document(
    cell("a", "passed"),
    cell("b", "failed", "mat1 and mat2 must have the same dtype"),
    cell("c", "known", "fast path ignores autocast"),
    cell("d", "passed", deviation=0.01),
    cell("e", "passed"),
    cell("f", "skipped"),
    cell("g", "passed"),
    cell("h", "known", "fast path ignores autocast"),
    cell("j", "passed"),
    cell("k", "passed", deviation=0.01),
    run_id="old",
)
NEW = document(
    cell("a", "failed", "expected scalar type Float but found BFloat16"),
    cell("b", "passed"),
    cell("c", "known", "fast path ignores autocast"),
    cell("d", "passed", deviation=0.05),  # grew by 0.04 = 40% of the 0.1 allowed
    cell("f", "failed", "expected scalar type Float but found BFloat16"),
    cell("g", "skipped"),
    cell("h", "failed", "a cache object cannot be cast"),
    cell("i", "passed"),
    cell("j", "known", "fast path ignores autocast"),
    cell("k", "passed", deviation=0.02),  # grew by 0.01 = 10%: noise, not drift
    run_id="new",
)


def cells_in(result, category):
    return [item["cell"].split("-bf16")[0] for item in result.changes[category]]


def test_each_change_lands_in_its_category():
    result = compare.diff(OLD, NEW)
    assert cells_in(result, "new") == ["a", "f"]  # passed before; skipped (not run) before
    assert cells_in(result, "fixed") == ["b"]
    assert cells_in(result, "signature-changed") == ["h"]
    assert cells_in(result, "added") == ["i"]
    assert cells_in(result, "removed") == ["e"]
    assert cells_in(result, "known-started") == ["j"]
    assert cells_in(result, "known-stopped") == ["h"]  # explained before, unexplained now: not "new"
    assert cells_in(result, "skipped") == ["g"]
    assert cells_in(result, "drift") == ["d"]
    assert result.unchanged == 2  # c (same known failure) and k (drift within noise)
    drift = result.changes["drift"][0]
    assert (drift["old_deviation"], drift["new_deviation"]) == (0.01, 0.05)
    assert abs(drift["growth_of_allowed"] - 0.4) < 1e-9


def test_the_drift_threshold_is_a_fraction_of_the_tolerance():
    assert cells_in(compare.diff(OLD, NEW, drift_fraction=0.05), "drift") == ["d", "k"]
    assert cells_in(compare.diff(OLD, NEW, drift_fraction=0.5), "drift") == []


def test_markdown_names_the_gate_and_the_cells():
    result = compare.diff(OLD, NEW)
    text = compare.diff_markdown(result, ("new",))
    assert "**Gate: FAIL** (2 new)" in text
    assert "## New failures (failed now; passed, skipped or absent before) (gates)" in text
    assert "| `a-bf16-mixed-eval-cpu-torch` | passed | failed in evaluate: `sig-" in text
    assert "### New signatures" in text and "expected scalar type Float but found BFloat16" in text
    assert "**Gate: pass**" in compare.diff_markdown(compare.diff(OLD, OLD), ("new",))


def test_package_changes_are_listed():
    newer = json.loads(json.dumps(NEW))
    newer["environment"]["packages"]["transformers"] = "4.50.0"
    result = compare.diff(OLD, newer)
    assert result.packages == {"transformers": ("5", "4.50.0")}
    assert "| transformers | 5 | 4.50.0 |" in compare.diff_markdown(result)


def test_fail_on_parsing():
    assert compare.parse_fail_on("new, drift") == ("new", "drift")
    assert compare.parse_fail_on("none") == ()
    for bad in ("", "new,regressions"):
        try:
            compare.parse_fail_on(bad)
        except ValueError as error:
            assert str(error).startswith("--fail-on:")
        else:
            raise AssertionError(f"{bad!r} accepted")


def run_diff(tmp_path, old, new, *args):
    paths = []
    for name, doc in (("old", old), ("new", new)):
        directory = tmp_path / name
        directory.mkdir(exist_ok=True)
        (directory / "results.json").write_text(json.dumps(doc) if isinstance(doc, dict) else doc)
        paths.append(str(directory))
    return subprocess.run(
        [sys.executable, "-m", "matrix", "diff", *paths, *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_the_gate_exit_codes(tmp_path):
    assert run_diff(tmp_path, OLD, NEW).returncode == 1  # new failures
    assert run_diff(tmp_path, NEW, NEW).returncode == 0  # nothing changed
    assert run_diff(tmp_path, OLD, NEW, "--fail-on", "none").returncode == 0
    b_fixed = document(*(cell("b", "passed") if c["model"] == "b" else c for c in OLD["cells"]), run_id="fixed")
    assert run_diff(tmp_path, OLD, b_fixed).returncode == 0  # a fix is no regression
    assert run_diff(tmp_path, OLD, b_fixed, "--fail-on", "new,fixed").returncode == 1
    assert run_diff(tmp_path, NEW, OLD).returncode == 1  # the other way round, b fails anew
    assert run_diff(tmp_path, OLD, NEW, "--fail-on", "drift").returncode == 1
    assert run_diff(tmp_path, OLD, NEW, "--fail-on", "drift", "--drift-threshold", "0.9").returncode == 0


def test_outputs_json_and_markdown_files(tmp_path):
    done = run_diff(
        tmp_path,
        OLD,
        NEW,
        "--format",
        "json",
        "--md-out",
        str(tmp_path / "d.md"),
        "--json-out",
        str(tmp_path / "d.json"),
    )
    assert done.returncode == 1
    printed = json.loads(done.stdout)
    assert printed == json.loads((tmp_path / "d.json").read_text())
    assert printed["gate"] == "fail" and printed["counts"]["new"] == 2 and printed["fail_on"] == ["new", "missing"]
    assert (tmp_path / "d.md").read_text().startswith("# Matrix diff: `old` → `new`")


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    cases = {
        "{not json": "not JSON",
        json.dumps({"hello": 1}): "schema_version: missing",
        json.dumps({**OLD, "schema_version": 99}): "schema_version: 99 is not one this version reads",
        json.dumps({**OLD, "cells": [{**OLD["cells"][0], "outcome": "great"}]}): "cells[0].outcome: 'great'",
        json.dumps({**OLD, "cells": [{k: v for k, v in OLD["cells"][0].items() if k != "metrics"}]}): "metrics",
    }
    for text, expected in cases.items():
        done = run_diff(tmp_path, text, NEW)
        assert done.returncode == 2, text
        assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
        assert expected in done.stderr and "old/results.json" in done.stderr, done.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "matrix", "diff", str(tmp_path / "nowhere"), str(tmp_path / "new")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "nowhere" in missing.stderr and "Traceback" not in missing.stderr


outcome = st.sampled_from(["passed", "failed", "known", "fixed", "skipped"])
runs = st.dictionaries(st.sampled_from("abcdefgh"), st.tuples(outcome, st.sampled_from(["x", "y"])), max_size=8)


def as_document(spec: dict, run_id: str) -> dict:
    return document(
        *(cell(name, o, sig if o in ("failed", "known") else None) for name, (o, sig) in spec.items()), run_id=run_id
    )


@given(runs, runs)
def test_diff_properties(first, second):
    a, b = as_document(first, "a"), as_document(second, "b")
    forward, backward = compare.diff(a, b), compare.diff(b, a)
    assert not any(compare.diff(a, a).changes.values())  # a run does not differ from itself
    assert cells_in(forward, "added") == cells_in(backward, "removed")
    assert cells_in(forward, "known-started") == cells_in(backward, "known-stopped")
    assert cells_in(forward, "signature-changed") == cells_in(backward, "signature-changed")
    for name in cells_in(forward, "new"):  # a new failure is an unexplained failure now
        assert second[name][0] == "failed" and first.get(name, ("absent",))[0] not in ("failed", "known")
    for name in cells_in(forward, "fixed"):
        assert first[name][0] in ("failed", "known") and second[name][0] in ("passed", "fixed")


def older_schema(document: dict, version: int) -> dict:
    """`document` as a run of an earlier schema wrote it: without the fields added since."""
    added = {"traceback"} | ({"cuda_index", "device_name", "rerun"} if version < 4 else set())
    cells = [{k: v for k, v in cell.items() if k not in added} for cell in document["cells"]]
    return {**document, "schema_version": version, "cells": cells}


def test_older_results_json_without_tracebacks_is_still_read_by_diff_and_merge(tmp_path, capsys):
    from matrix.__main__ import main
    from matrix.results.files import SCHEMA_FILE, load
    from matrix.shards.merge import merge

    (tmp_path / "new.json").write_text(json.dumps(NEW))
    for version in (3, 4):
        older = older_schema(OLD, version)
        (tmp_path / f"v{version}.json").write_text(json.dumps(older))
        assert main(["diff", str(tmp_path / f"v{version}.json"), str(tmp_path / "new.json")]) == 1  # read; it gates
        assert "**Gate: FAIL** (2 new)" in capsys.readouterr().out  # a, f: as from the current schema

        newer = document(cell("z", "failed", "mat1 and mat2 must have the same dtype"), run_id=f"newer-{version}")
        newer["cells"][0]["traceback"] = "Traceback (most recent call last):\n  ...\nRuntimeError: mat1 and mat2\n"
        paths = []
        for name, doc in (("older", older), ("newer", newer)):
            directory = tmp_path / f"merge-{version}" / name
            directory.mkdir(parents=True)
            (directory / "results.json").write_text(json.dumps(doc))
            paths.append(directory)
        assert "traceback" not in load(paths[0])[0]["cells"][1]
        merged = merge(paths, run_id=f"merged-{version}")
        required = json.loads(SCHEMA_FILE.read_text())["$defs"]["cell"]["required"]
        assert all(set(required) <= set(record) for record in merged["cells"])  # each a cell of the current schema
        tracebacks = {c["model"]: c["traceback"] for c in merged["cells"]}
        assert tracebacks.pop("z") == newer["cells"][0]["traceback"]
        assert set(tracebacks.values()) == {None} and len(tracebacks) == len(OLD["cells"])  # the older run's: none
