"""The checks a cell makes fail when they should, and their messages are stable."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from matrix import checks
from matrix.signatures import signature_of
from matrix.tolerances import EVAL_LOSS_VS_FP32, Tolerance

finite = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False)


def test_tolerance_rows_loosen_with_the_dtype():
    f32, f16, bf16 = (EVAL_LOSS_VS_FP32[d] for d in (torch.float32, torch.float16, torch.bfloat16))
    assert f32.atol < f16.atol <= bf16.atol and f32.rtol < f16.rtol <= bf16.rtol


@given(finite, st.floats(min_value=0, max_value=1))
def test_within_tolerance_is_exactly_the_documented_rule(reference, offset):
    tolerance = Tolerance(atol=1e-2, rtol=1e-2)
    value = reference + offset
    allowed = abs(value - reference) <= 1e-2 + 1e-2 * abs(reference)
    if allowed:
        checks.check_within_tolerance("eval loss", value, reference, tolerance)
    else:
        with pytest.raises(checks.OutOfTolerance):
            checks.check_within_tolerance("eval loss", value, reference, tolerance)


@given(finite, finite, finite)
def test_out_of_tolerance_signatures_do_not_depend_on_the_numbers(a, b, c):
    def failure(value, reference):
        try:
            checks.check_within_tolerance("eval loss", value, reference, Tolerance(0, 0))
        except checks.CheckFailure as exc:
            return signature_of("evaluate", exc)

    first, second = failure(a, a + 1), failure(b, b + abs(c) + 1)
    assert first is not None and second is not None
    assert first.id == second.id


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_values_fail_as_such(bad):
    with pytest.raises(checks.NonFiniteValue):
        checks.check_finite_loss(torch.tensor(bad), "training loss")
    with pytest.raises(checks.NonFiniteValue):
        checks.check_within_tolerance("eval loss", bad, 1.0, Tolerance(1, 1))


def test_unchanged_parameters_are_caught():
    model = torch.nn.Linear(2, 2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(checks.ParametersUnchanged) as info:
        checks.check_parameters_changed(before, model)
    assert info.value.details == "2 of 2, first bias" and "bias" not in str(info.value)
    with torch.no_grad():
        model.weight.add_(1)
        model.bias.add_(1)
    checks.check_parameters_changed(before, model)


def test_a_buffer_changing_dtype_is_a_broken_contract():
    model = torch.nn.BatchNorm1d(2)
    before = checks.tensor_dtypes(model)
    model.running_mean = model.running_mean.to(torch.bfloat16)
    with pytest.raises(checks.DtypeContractBroken, match=r"a buffer was torch\.float32, is now torch\.bfloat16"):
        checks.check_same_dtypes(before, model, "after reload")


def test_reload_comparison_is_exact_and_dtype_aware():
    x = torch.randn(3, 4)
    assert checks.check_outputs_equal("logits", x, x.clone(), Tolerance(0, 0)) == 0.0
    with pytest.raises(checks.CheckpointMismatch, match="logits differ after reload"):
        checks.check_outputs_equal("logits", x, x + 1e-6, Tolerance(0, 0))
    with pytest.raises(checks.CheckpointMismatch, match="dtype"):
        checks.check_outputs_equal("logits", x, x.bfloat16(), Tolerance(1, 1))
