"""Loss curves (issue 38): the comparison step by step, the diff's curve-moved category, golden
curves as a slim run, the release sweep's "where a curve moved", and the bisection's curve state.
Standard library only, as a diff and a report are: every input is a results.json-shaped dict."""

from __future__ import annotations

import copy
import math

from hypothesis import given
from hypothesis import strategies as st

from matrix.releases.bisection import CurveJudge
from matrix.results import SCHEMA_VERSION, compare, curves
from matrix.results.files import check
from matrix.results.sweep_table import brief_cell, curve_moves, sweep_markdown

ROW = curves.CurveTolerance(atol=1e-3, rtol=1e-3, per_step=1e-3)


def test_the_first_step_outside_the_row_is_named_with_both_losses_and_the_allowance():
    # float32 losses as engines report them (round numbers like 3.5 would read as bfloat16 ones,
    # curves.reported_in, and be allowed its rounding)
    reference = [4.0001, 3.5001, 3.0001, 2.5001]
    losses = [4.0001, 3.5006, 3.0201, 2.7001]  # step 2 within (allowed 1e-3 + 3.5e-3 + 1e-3), step 3 outside
    compared = curves.compare(losses, reference, ROW, curves.TORCH_ENGINE)
    assert compared.rounding is None
    assert compared.first_step_outside == 3
    assert compared.allowed[1] == ROW.atol + ROW.rtol * 3.5001 + ROW.per_step
    assert compared.deviations[0] == 0.0
    assert compared.worst_step == 4 and compared.worst_share > 1
    words = compared.outside(losses)
    assert words.startswith("step 3: 3.0201 vs 3.0001,") and "allowed 0.006" in words


def test_a_non_finite_loss_leaves_the_row_where_it_appears():
    compared = curves.compare([4.0, math.nan, 3.0], [4.0, 3.5, 3.0], ROW, curves.FP32_TWIN)
    assert compared.first_step_outside == 2
    assert compared.deviations[1] == math.inf


def test_only_the_steps_both_curves_took_are_compared():
    compared = curves.compare([4.0, 3.5], [4.0, 3.5, 3.0, 2.0], ROW, curves.TORCH_ENGINE)
    assert len(compared.deviations) == 2 and compared.held


finite = st.floats(min_value=0.01, max_value=20, allow_nan=False)


@given(st.lists(finite, min_size=1, max_size=12), st.data())
def test_a_curve_holds_against_itself_and_leaves_at_the_first_step_moved_beyond_the_row(reference, data):
    assert curves.compare(reference, reference, ROW, curves.GOLDEN).held
    step = data.draw(st.integers(min_value=1, max_value=len(reference)))
    moved = list(reference)
    moved[step - 1] += 2 * ROW.allowed(step, reference[step - 1])
    assert curves.compare(moved, reference, ROW, curves.GOLDEN).first_step_outside == step


def _cell(cell_id: str, losses: list[float] | None, outcome: str = "passed") -> dict:
    model, precision, mode, device, engine = "tiny-llama", "bf16-mixed", "train", "cpu", cell_id.rsplit("-", 1)[-1]
    metrics = {}
    if losses is not None:
        metrics = {"train_losses": losses, "curve": {"losses": losses, "golden_tolerance": ROW.as_dict()}}
    return {
        "id": cell_id,
        "model": model,
        "precision": precision,
        "mode": mode,
        "device": device,
        "engine": engine,
        "outcome": outcome,
        "phase": None,
        "signature": None,
        "metrics": metrics,
    }


def _run(run_id: str, cells: list[dict], packages: dict | None = None) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "run": {"id": run_id, "stack": "default", "curve_steps": 3, "initial_weights": "/somewhere/initial"},
        "environment": {"packages": packages or {"deepspeed": "0.18.6"}, "python": "3.11", "warnings": []},
        "cells": cells,
    }


def test_the_diff_puts_a_moved_curve_in_its_own_category_named_by_its_step_and_gates_on_it():
    old = _run("old", [_cell("a-torch", [4.0, 3.5, 3.0]), _cell("b-ddp", [4.0, 3.5, 3.0])])
    new = copy.deepcopy(old)
    new["run"]["id"] = "new"
    new["cells"][1]["metrics"]["curve"]["losses"] = [4.0, 3.5, 3.2]  # b moved at step 3
    result = compare.diff(old, new)
    (moved,) = result.changes["curve-moved"]
    assert moved["cell"] == "b-ddp" and moved["step"] == 3 and moved["new_loss"] == 3.2 and moved["old_loss"] == 3.0
    assert result.gating(("curve-moved",)) == {"curve-moved": 1}
    assert result.gating(compare.DEFAULT_FAIL_ON) == {}  # reported, gating only where asked
    assert "| `b-ddp` | 3 of 3 | 3 | 3.2 |" in compare.diff_markdown(result, ("curve-moved",))


def test_a_curve_within_its_row_or_of_another_length_is_not_moved():
    old = _run("old", [_cell("a-torch", [4.0, 3.5, 3.0])])
    within, longer = copy.deepcopy(old), copy.deepcopy(old)
    within["cells"][0]["metrics"]["curve"]["losses"] = [4.0, 3.5, 3.004]
    longer["cells"][0]["metrics"]["curve"]["losses"] = [4.0, 3.5, 3.0, 2.0]
    assert compare.diff(old, within).changes["curve-moved"] == []
    assert compare.diff(old, longer).changes["curve-moved"] == []


def test_golden_curves_are_a_slim_run_the_diff_reads_and_a_missing_curve_is_removed():
    results = _run("run", [_cell("a-torch", [4.0, 3.5, 3.0]), _cell("e-torch", None), _cell("c-torch", [2.0, 1.0])])
    golden = curves.golden_document(results)
    check(golden, curves.golden_path("default"))  # a results.json the readers take
    assert [c["id"] for c in golden["cells"]] == ["a-torch", "c-torch"]  # curves only, in id order
    assert golden["run"]["initial_weights"] == "initial"  # named in the repository, not on one machine
    assert golden["cells"][0]["metrics"] == {"curve": {"losses": [4.0, 3.5, 3.0], "golden_tolerance": ROW.as_dict()}}
    same = compare.diff(golden, results)
    assert same.changes["curve-moved"] == [] and same.changes["removed"] == []
    moved = copy.deepcopy(results)
    moved["cells"][0]["metrics"]["curve"]["losses"][1] = 3.6
    moved["cells"].pop(2)
    changed = compare.diff(golden, moved)
    assert [(c["cell"], c["step"]) for c in changed.changes["curve-moved"]] == [("a-torch", 2)]
    assert [c["cell"] for c in changed.changes["removed"]] == ["c-torch"]


def _sweep(curves_by_release: dict[str, list[float]]) -> dict:
    releases = []
    for version, losses in curves_by_release.items():
        cell = brief_cell(_cell("tiny-llama-bf16-mixed-train-cpu-deepspeed", losses))
        releases.append({"version": version, "status": "ran", "cells": {cell_id(cell): cell}, "seconds": 1})
    return {"package": "deepspeed", "stack": "deepspeed", "selection": [], "releases": releases}


def cell_id(cell: dict) -> str:
    return "-".join(cell[axis] for axis in ("model", "precision", "mode", "device", "engine"))


def test_the_release_sweep_names_the_first_release_where_a_curve_moved_and_where_it_came_back():
    document = _sweep(
        {"0.18.2": [4.0, 3.5, 3.0], "0.18.3": [4.0, 3.5, 3.3], "0.18.5": [4.0, 3.5, 3.3], "0.18.6": [4.0, 3.5, 3.0]}
    )
    moves = curve_moves(document)
    assert [(m["first_release"], m["last_before"], m["step"]) for m in moves] == [
        ("0.18.3", "0.18.2", 3),
        ("0.18.6", "0.18.5", 3),
    ]
    page = sweep_markdown(document)
    assert "## Where a loss curve moved" in page and "| 0.18.3 | 0.18.2 | 3 | 3 | 3.3 |" in page


def test_a_sweep_whose_curves_hold_says_so():
    page = sweep_markdown(_sweep({"1.0": [4.0, 3.5], "1.1": [4.0, 3.5002]}))
    assert "No training curve left the row of the release before it across the 2 releases." in page


def test_a_bisection_of_a_moved_curve_judges_each_release_by_its_curve():
    judge = CurveJudge((4.0, 3.5, 3.0), ROW.as_dict(), ("--curve-steps", "3"))
    assert judge(_cell("a-torch", [4.0, 3.5, 3.0]))[0] == "curve as the old run's"
    state, text = judge(_cell("a-torch", [4.0, 3.5, 3.3], outcome="failed"))
    assert state == "curve moved" and text.startswith("step 3: 3.3 vs 3,")
    assert judge(_cell("a-torch", None, outcome="failed"))[0].startswith("error: no curve")


# ---------------------------------------------------------------- the margin in the reports (issue 47)

NAMED = curves.CurveTolerance(atol=0.0042, rtol=0.0, per_step=0.0042, row="master-weights bfloat16")
# tiny-llama bf16-mixed on DeepSpeed 0.18.5's ZeRO-0 against the torch engine (a real run's, 3 steps),
# and ZeRO-1's on the same stack (right: within its row)
TORCH_CURVE = [4.579038143157959, 4.136424541473389, 3.8827764987945557]
ZERO0_CURVE = [4.578643997510274, 4.154198169708252, 3.909575581550598]
ZERO1_CURVE = [4.578643997510274, 4.140171567598979, 3.8879654010136924]


def test_a_row_says_its_name_and_the_failure_how_far_past_it_the_step_went():
    compared = curves.compare(ZERO0_CURVE, TORCH_CURVE, NAMED, curves.TORCH_ENGINE)
    assert compared.first_step_outside == 2 and compared.as_dict()["tolerance"]["row"] == NAMED.row
    assert curves.CurveTolerance.from_dict(compared.as_dict()["tolerance"]) == NAMED
    words = compared.outside(ZERO0_CURVE)
    assert "> allowed 0.0084, 2.1x the master-weights bfloat16 row (atol 0.0042" in words, words
    # a row without a name (an older run's, a test's) is "the row"
    assert "x the row (" in curves.compare(ZERO0_CURVE, TORCH_CURVE, ROW, curves.TORCH_ENGINE).outside(ZERO0_CURVE)
    assert curves.share_words(0.97) == "97% of the row" and curves.share_words(1.0) == "100% of the row"
    assert curves.share_words(0.0004, "torch float16") == "<0.1% of the torch float16 row"


def test_the_summary_and_the_page_show_the_share_of_the_row_for_cells_that_left_it_and_cells_within():
    from matrix.results.html import curve_figure
    from matrix.results.markdown import curves_markdown

    def cell(cell_id: str, losses: list[float], outcome: str) -> dict:
        compared = curves.compare(losses, TORCH_CURVE, NAMED, curves.TORCH_ENGINE).as_dict()
        curve = {"steps": 3, "losses": losses, "torch_engine": compared, "golden_tolerance": NAMED.as_dict()}
        return {"id": cell_id, "outcome": outcome, "metrics": {"train_losses": losses, "curve": curve}}

    left, within = cell("zero0", ZERO0_CURVE, "known"), cell("zero1", ZERO1_CURVE, "passed")
    rows = [line for line in curves_markdown([left, within]) if line.startswith("| `")]
    assert rows[0].endswith("| 2.1x | left the master-weights bfloat16 row at step 2 |"), rows
    assert rows[1].endswith("| 45% | within the master-weights bfloat16 row |"), rows
    page_left, page_within = curve_figure(left["metrics"]), curve_figure(within["metrics"])
    assert "allowed 0.0084, 2.1x the master-weights bfloat16 row</p>" in page_left, page_left
    assert "nearest at step 2, 44.6% of what it allows (the master-weights bfloat16 row)</p>" in page_within
