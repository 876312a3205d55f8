"""A loss handed over in a half dtype is rounded before anyone compares it (accelerate's FSDP2 on
a GPU returns its bf16 autocast loss as bf16: 4.59375 where the torch engine's fp32 loss is
4.57904, run F of docs/gpu-runs/h100-2026-11-27-issue47). matrix/results/curves.py adds half a step of
that dtype (at the larger of the two losses) to the row, so the row keeps judging the arithmetic:
a curve within its row stays within it once rounded, and a curve that leaves the row by more than
the rounding still fails."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from matrix.results.curves import CurveTolerance, compare, half_step, reported_in

ROW = CurveTolerance(0.014, 0.0, 0.014, "casts-parameters bfloat16")
TORCH_ENGINE = [4.579038143157959, 4.136407375335693, 3.8828887939453125]  # fp32 losses, run F


def rounded(values, dtype):
    return [float(torch.tensor(v, dtype=torch.float32).to(dtype).float()) for v in values]


def test_the_h100_accelerate_fsdp2_curve_is_judged_with_its_bf16_rounding():
    seen = [4.59375, 4.125, 3.890625]  # tiny-llama-bf16-mixed-train-cuda-accelerate-fsdp2
    assert reported_in(seen) == "bfloat16" and reported_in(TORCH_ENGINE) is None
    result = compare(seen, TORCH_ENGINE, ROW, "torch engine")
    assert result.held and result.rounding == {"losses": "bfloat16"}
    assert result.allowed[0] == 0.014 + 2.0**-6  # half a bfloat16 step between 4 and 8
    assert result.as_dict()["rounding"] == {"losses": "bfloat16"}
    # the same numbers as fp32 values get no allowance beyond the row: 0.0147 > 0.014
    assert not compare([4.5937501, 4.125, 3.890625], TORCH_ENGINE, ROW, "torch engine").held


def test_a_curve_that_leaves_its_row_by_more_than_the_rounding_still_fails_and_says_why():
    drifted = rounded([4.579, 4.20, 3.96], torch.bfloat16)  # 0.0636 and 0.0771 off at steps 2 and 3
    result = compare(drifted, TORCH_ENGINE, ROW, "torch engine")
    assert result.first_step_outside == 2
    assert "half a bfloat16 step, the losses being bfloat16 numbers" in result.outside(drifted)


def test_float32_and_float16_curves_are_told_apart():
    assert reported_in([4.578829765319824, 4.138333797454834]) is None
    assert reported_in([4.578125, 4.1328125, 3.88671875]) == "float16"  # two ranks' bf16 losses averaged
    assert reported_in([float("nan")]) is None
    assert half_step("float16", 4.5) == 2.0**-9 and half_step(None, 4.5) == 0.0


losses = st.floats(min_value=0.05, max_value=30.0, allow_nan=False)


@given(st.lists(st.tuples(losses, st.floats(min_value=-1.0, max_value=1.0)), min_size=1, max_size=6))
def test_rounding_a_curve_within_its_row_into_bf16_keeps_it_within(steps):
    reference = [float(torch.tensor(r, dtype=torch.float32)) for r, _ in steps]
    exact = [r + 0.999 * share * ROW.allowed(i, r) for i, (r, share) in enumerate(steps, start=1)]
    assert compare(exact, reference, ROW, "torch engine").held
    half = rounded(exact, torch.bfloat16)
    assert compare(half, reference, ROW, "torch engine").held
