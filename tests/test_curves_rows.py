"""The loss-curve rows derived from the measured spread of right engines (issue 47): each row allows
CURVE_SAFETY times the largest deviation its family's right engines measured, so it accepts them
with that margin, and a gradient never zeroed (DeepSpeed 0.18.3-0.18.5's ZeRO-0 in bf16) leaves the
default 3-step curve at the step it shows; the engines' families; the measurement itself
(matrix/tools/curve_spread.py) leaves out the engines a curve entry of the catalogue claims."""

from __future__ import annotations

import json

import pytest
import torch

from matrix.checks import tolerances
from matrix.engines import ENGINES
from matrix.engines.traits import CURVE_FAMILY_BY_TRAIT, ENGINE_TRAITS, curve_family
from matrix.grid import schedule
from matrix.precisions.policies import PRECISIONS
from matrix.results import curves
from matrix.tools.curve_spread import document_of

# tiny-llama bf16-mixed: the torch engine's curve and DeepSpeed ZeRO-0's on 0.18.5, as the matrix
# recorded them (torch 2.13.0 CPU, two gloo ranks, the default 3 steps; deepspeed==0.18.5 installed
# beside the stack, python -m matrix run cases --engine deepspeed-zero0 --model tiny-llama --precision
# bf16-mixed --mode train --device cpu): every step applies the sum of the gradients so far
TORCH_ENGINE_CURVE = [4.579038143157959, 4.136424541473389, 3.8827764987945557]
ZERO0_0_18_5_CURVE = [4.578643997510274, 4.154198169708252, 3.909575581550598]


def test_the_rows_are_derived_from_the_measured_spread_with_the_safety_factor():
    spread = tolerances.load_curve_spread()
    assert spread, "matrix/checks/curve_spread.json holds no measurement"
    for key, measured in spread.items():
        row = tolerances.CURVE_ROWS[key]
        # one number k, in the shape every row has
        k = row.per_step / tolerances.CURVE_FORM.per_step
        assert (row.atol, row.rtol) == pytest.approx((k * tolerances.CURVE_FORM.atol, k * tolerances.CURVE_FORM.rtol))
        allowed = row.allowed(measured.step, measured.reference_loss)
        # at least CURVE_SAFETY times the largest, and not far more (rounded up to two digits)
        assert measured.deviation * tolerances.CURVE_SAFETY <= allowed + 1e-15, key
        if measured.share_of_form * tolerances.CURVE_SAFETY > tolerances.CURVE_ROW_FLOOR:
            assert allowed <= 1.1 * tolerances.CURVE_SAFETY * measured.deviation, key


def test_every_right_engine_measured_used_at_most_half_its_row():
    """The measurement's own worst comparisons, judged again by the rows derived from them."""
    for (reference, family, row), measured in tolerances.load_curve_spread().items():
        tolerance = tolerances.curve_row(reference, row, family)
        share = measured.deviation / tolerance.allowed(measured.step, measured.reference_loss)
        assert share <= 1 / tolerances.CURVE_SAFETY, (reference, family, row, share)


def test_the_derived_row_rejects_deepspeed_0_18_5_zero0_within_the_default_curve():
    """DeepSpeed#7837 in the default 3-step curve: 1.8e-2 at step 2, 2.7e-2 at step 3 of a loss of
    3.9, where the old bf16 row allowed 2.8e-2 at step 3 (97% of it used): the family's derived row
    names step 2, and the issue's 0.0275 at step 3 leaves it too."""
    assert schedule.TRAIN_STEPS == len(ZERO0_0_18_5_CURVE) == 3
    row = tolerances.curve_vs_torch_engine(torch.bfloat16, curve_family(ENGINES["deepspeed-zero0"].traits))
    assert row.row == "master-weights bfloat16"
    compared = curves.compare(ZERO0_0_18_5_CURVE, TORCH_ENGINE_CURVE, row, curves.TORCH_ENGINE)
    assert compared.first_step_outside == 2, compared.as_dict()
    assert compared.worst_share > 1.5  # not a rounding away: half again past the row
    assert "x the master-weights bfloat16 row" in compared.outside(ZERO0_0_18_5_CURVE)
    assert 0.0275 > row.allowed(3, 3.88)
    # the right engines of its family stay within half of it where they were measured
    measured = tolerances.CURVE_SPREAD[curves.TORCH_ENGINE, "master-weights", "bfloat16"]
    assert measured.deviation <= 0.5 * row.allowed(measured.step, measured.reference_loss)


def test_every_built_in_engine_is_in_the_family_its_traits_say():
    families = {name: curve_family(engine.traits) for name, engine in ENGINES.items()}
    for stage in range(4):
        assert families[f"deepspeed-zero{stage}"] == "master-weights"
    assert families["hf-trainer-zero2"] == families["hf-trainer-zero3"] == "master-weights"
    assert families["fsdp2"] == families["accelerate-fsdp2"] == "casts-parameters"
    for name in ("torch", "accelerate", "hf-trainer", "lightning", "ddp"):
        assert families[name] == curves.DEFAULT_FAMILY
    assert curve_family(frozenset()) == curves.DEFAULT_FAMILY  # a user's engine declaring no trait
    assert set(CURVE_FAMILY_BY_TRAIT) <= set(ENGINE_TRAITS)
    assert set(CURVE_FAMILY_BY_TRAIT.values()) | {curves.DEFAULT_FAMILY} == set(curves.FAMILIES)


def test_every_precision_and_family_has_a_row_against_both_references():
    for precision in PRECISIONS.values():
        scheme = precision.quantization.scheme if precision.quantization is not None else None
        for family in curves.FAMILIES:
            assert tolerances.curve_vs_torch_engine(precision.compute_dtype, family).row
            assert tolerances.curve_vs_fp32_twin(precision.compute_dtype, scheme, family).row


def test_a_family_without_its_own_measurement_takes_the_default_familys_row():
    default = tolerances.curve_row(curves.TORCH_ENGINE, "bfloat16")
    assert tolerances.curve_row(curves.TORCH_ENGINE, "bfloat16", "a-family-no-one-measured") == default
    with pytest.raises(tolerances.NoCurveRow, match=r"python -m matrix\.tools\.curve_spread"):
        tolerances.curve_row(curves.TORCH_ENGINE, "a-row-no-one-measured")


# ---------------------------------------------------------------- the measurement


def _comparison(deviations: list[float], reference: list[float]) -> dict:
    return {"reference_losses": reference, "deviations": deviations, "first_step_outside": None}


def _cell(engine: str, deviations: list[float], outcome: str = "passed", probe: int | None = None) -> dict:
    reference = [4.0, 3.6, 3.2]
    metrics = {
        "curve": {
            "losses": [r + d for r, d in zip(reference, deviations, strict=True)],
            "torch_engine": _comparison(deviations, reference),
            "fp32_twin": {"unchecked": "not this test's"},
        }
    }
    if probe is not None:
        metrics["engine_effective"] = {"optimizer_steps_at_construction": probe}
    cell_id = f"tiny-llama-bf16-mixed-train-cpu-{engine}"
    return {
        "id": cell_id,
        "model": "tiny-llama",
        "precision": "bf16-mixed",
        "mode": "train",
        "device": "cpu",
        "engine": engine,
        "outcome": outcome,
        "signature": "sig-x train_steps: boom" if outcome == "failed" else None,
        "metrics": metrics,
    }


def _run(run_id: str, cells: list[dict]) -> dict:
    return {
        "run": {"id": run_id, "command": "python -m matrix run cases", "curve_steps": 3},
        "environment": {"cpu": "a CPU", "packages": {"torch": "2.13.0", "deepspeed": "0.19.8"}},
        "cells": cells,
    }


def test_the_measurement_keeps_each_familys_largest_and_leaves_out_new_failures_and_claimed_engines():
    run = _run(
        "r1",
        [
            _cell("ddp", [0.0, 0.001, 0.002]),
            _cell("accelerate", [0.0, 0.004, 0.0], outcome="failed"),  # a new failure: not measured
            _cell("deepspeed-zero1", [0.0, 0.003, 0.001], probe=0),
            # ZeRO-0 whose AdamW stepped at construction: the catalogue's entry claims it, pass or fail
            _cell("deepspeed-zero0", [0.0, 0.011, 0.002], probe=1),
        ],
    )
    document = document_of([run], None, "python -m matrix.tools.curve_spread r1")
    spread = {(e["reference"], e["family"], e["row"]): e for e in document["spread"]}
    torch_family = spread[curves.TORCH_ENGINE, "torch", "bfloat16"]
    assert torch_family["comparisons"] == 1 and torch_family["worst"]["step"] == 3
    assert torch_family["worst"]["deviation"] == 0.002 and torch_family["worst"]["reference_loss"] == 3.2
    master = spread[curves.TORCH_ENGINE, "master-weights", "bfloat16"]
    assert master["comparisons"] == 1 and master["worst"]["cell"].endswith("deepspeed-zero1")
    why = {entry["cell"].rsplit("-cpu-", 1)[1]: entry["why"] for entry in document["left_out"]}
    assert why["accelerate"].startswith("a new failure")
    assert "deepspeed-zero0-bf16-adamw-stepped-at-construction" in why["deepspeed-zero0"]
    assert set(why) == {"accelerate", "deepspeed-zero0"}
    assert document["runs"][0]["id"] == "r1" and document["runs"][0]["packages"]["deepspeed"] == "0.19.8"


def test_a_row_the_runs_do_not_measure_keeps_what_the_file_held():
    previous = json.loads(tolerances.CURVE_SPREAD_FILE.read_text())
    document = document_of(
        [_run("r2", [_cell("ddp", [0.0, 0.001, 0.002])])], previous, "python -m matrix.tools.curve_spread r2"
    )
    rows = {(e["reference"], e["family"], e["row"]) for e in document["spread"]}
    assert {(e["reference"], e["family"], e["row"]) for e in previous["spread"]} <= rows
    (remeasured,) = [
        e
        for e in document["spread"]
        if (e["reference"], e["family"], e["row"]) == (curves.TORCH_ENGINE, "torch", "bfloat16")
    ]
    assert remeasured["worst"]["run"] == "r2"
    assert {run["id"] for run in document["runs"]} >= {"r2"}


def test_the_shape_of_a_row_grows_with_the_step_and_a_row_is_named_by_its_dtype_or_scheme():
    assert tolerances.curve_form(1, 4.0) == tolerances.CURVE_FORM.allowed(1, 4.0) > 0
    assert tolerances.curve_form(3, 4.0) > tolerances.curve_form(2, 4.0)  # the allowance grows with the steps
    assert tolerances.curve_row_key(torch.bfloat16) == "bfloat16"
    assert tolerances.curve_row_key(torch.bfloat16, "fp4") == "nf4"  # fp4 takes nf4's until measured


# The largest deviations of right engines over 8 steps that issue 38 recorded (CPU, torch 2.13.0, every
# training cell of the default CPU grid but DeepSpeed's with --curve-steps 8): (reference, family, row,
# step, deviation, reference loss). The rows are derived from 3-step curves; these say they hold for the
# longer curves of the golden selection and the version stacks too.
EIGHT_STEP_MAXIMA = [
    (curves.TORCH_ENGINE, "casts-parameters", torch.bfloat16, 8, 1.8e-2, 3.6),  # accelerate-fsdp2 reducing in bf16
    (curves.TORCH_ENGINE, "torch", torch.float16, 8, 5.5e-3, 2.5),  # accelerate: fp16 without autocast on a CPU
    (curves.FP32_TWIN, "torch", torch.bfloat16, 7, 2.6e-2, 2.6),  # bf16 weights loaded
    (curves.TORCH_ENGINE, "casts-parameters", torch.float32, 3, 7.0e-7, 3.9),  # FSDP2's reductions
]


@pytest.mark.parametrize(("reference", "family", "dtype", "step", "deviation", "loss"), EIGHT_STEP_MAXIMA)
def test_the_rows_hold_the_right_engines_longer_curves(reference, family, dtype, step, deviation, loss):
    if reference == curves.TORCH_ENGINE:
        row = tolerances.curve_vs_torch_engine(dtype, family)
    else:
        row = tolerances.curve_vs_fp32_twin(dtype, None, family)
    assert deviation <= 0.8 * row.allowed(step, loss), (row, row.allowed(step, loss))


def test_a_kind_the_spread_never_measured_is_judged_by_the_rows_written_before_it():
    """The derived rows hold for the kinds curve_spread.json measured; the every-engine sweep's
    architectures part further (issue 47: hf:mbart's bf16-true curve under its own torch loop left
    the derived fp32-twin row 4.6 times over), so a kind it did not measure takes the earlier rows,
    named so in the report, and a measured kind keeps its derived, tighter row."""
    from matrix.checks.tolerances import MEASURED_KINDS, UNMEASURED_KIND_ROWS, curve_vs_fp32_twin, curve_vs_torch_engine

    assert {"tiny-llama", "lora", "tiny-transformer", "gemma-cache"} <= MEASURED_KINDS
    assert "hf:mbart" not in MEASURED_KINDS
    measured = curve_vs_torch_engine(torch.bfloat16, "master-weights", "tiny-llama")
    other = curve_vs_torch_engine(torch.bfloat16, "master-weights", "hf:mbart")
    assert measured.row == "master-weights bfloat16" and other.row == "unmeasured-kind bfloat16"
    assert other == UNMEASURED_KIND_ROWS["torch engine", "bfloat16"]
    # DeepSpeed 0.18.5's ZeRO-0 curve of tiny-llama (0.0178 at step 2) leaves the measured kind's row
    assert 0.0178 > measured.allowed(2, 4.15)
    # a user's kind, measured by no run, is judged by the earlier row too; no kind named: the derived row
    twin = curve_vs_fp32_twin(torch.bfloat16, None, "torch", "my-model")
    assert twin.row == "unmeasured-kind bfloat16"
    assert curve_vs_torch_engine(torch.bfloat16, "master-weights").row == "master-weights bfloat16"
