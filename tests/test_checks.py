"""The checks a cell makes fail when they should, and their messages are stable."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from matrix.checks import assertions as checks
from matrix.checks import tolerances
from matrix.checks.tolerances import EVAL_LOSS_VS_FP32, Tolerance
from matrix.execute import cell_run as execute
from matrix.grid.cell import Cell
from matrix.harness import kind_traits
from matrix.models import MODELS
from matrix.results.signatures import signature_of

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


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64]


class Wrapped(torch.Tensor):
    """A tensor subclass (as a quantized or float8 weight is): tested element by element."""


@given(
    tensors=st.lists(
        st.tuples(
            st.sampled_from(DTYPES),
            st.lists(
                st.sampled_from([0.0, -1.5, 3.0, 6e4, 3e38, math.nan, math.inf, -math.inf]), min_size=1, max_size=9
            ),
            st.booleans(),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_nonfinite_names_are_those_an_element_by_element_test_names(tensors):
    """The sum-first test names exactly the tensors torch.isfinite(t).all() names, in order: a sum that
    overflows (6e4 in float16, 3e38 added up in float32) is no NaN, and NaN or infinity in any dtype is."""
    named = []
    for index, (dtype, values, subclass) in enumerate(tensors):
        if dtype == torch.int64:
            values = [0 if not math.isfinite(v) or abs(v) > 1e18 else v for v in values]
        tensor = torch.tensor(values, dtype=torch.float64).to(dtype)  # 3e38 is inf in float16 and bfloat16 too
        named.append((f"t{index}", tensor.as_subclass(Wrapped) if subclass else tensor))
    expected = [name for name, tensor in named if not torch.isfinite(tensor.as_subclass(torch.Tensor)).all()]
    assert checks.nonfinite_names(named) == expected


def test_a_gradient_or_weight_with_nan_is_named_among_parameters():
    good, nan_grad, inf_weight = (torch.nn.Parameter(torch.ones(4)) for _ in range(3))
    nan_grad.grad = torch.tensor([1.0, math.nan, 0.0, 0.0])
    good.grad = torch.full((4,), 6e4, dtype=torch.float32)
    inf_weight.data[2] = math.inf
    parameters = [("good", good), ("nan_grad", nan_grad), ("inf_weight", inf_weight)]
    assert checks.nonfinite_gradients(parameters) == ["nan_grad"]
    with pytest.raises(checks.NonFiniteValue, match="parameters are not finite after the step") as raised:
        checks.check_finite_parameters(parameters, "after the step")
    assert raised.value.details == "1 tensors, first inf_weight"


@pytest.fixture
def one_rank_mesh(tmp_path):
    """A one-rank gloo group and its mesh, destroyed after the test (this process keeps no group)."""
    from torch.distributed.device_mesh import init_device_mesh

    assert not torch.distributed.is_initialized()
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        torch.distributed.destroy_process_group()


def test_a_dtensors_nan_is_named_from_its_local_parts_in_one_all_reduce(one_rank_mesh, monkeypatch):
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    def dtensor(values, placement):
        return distribute_tensor(torch.tensor(values), one_rank_mesh, [placement])

    reductions = []
    all_reduce = torch.distributed.all_reduce
    monkeypatch.setattr(
        torch.distributed, "all_reduce", lambda t, **kw: reductions.append(t.numel()) or all_reduce(t, **kw)
    )
    named = [
        ("sharded_nan", dtensor([1.0, math.nan], Shard(0))),
        ("sharded_overflowing", dtensor([3e38, 3e38], Shard(0))),  # its sum is inf: tested element by element
        ("replicated_inf", dtensor([math.inf, 0.0], Replicate())),
        ("fine", dtensor([1.0, 2.0], Shard(0))),
    ]
    assert checks.nonfinite_names(named) == ["sharded_nan", "replicated_inf"]
    assert reductions == [4]  # the four sums, added across the ranks at once
    partial = torch.distributed.tensor.DTensor.from_local(torch.tensor([math.nan]), one_rank_mesh, [Partial()])
    reductions.clear()
    assert checks.nonfinite_names([("partial", partial)]) == ["partial"] and reductions == []


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


def test_a_half_copy_whose_master_moved_changed_and_one_whose_master_stayed_did_not():
    """Where the optimizer steps fp32 master weights (DeepSpeed's bf16), a step below half a bf16 ulp
    leaves the bf16 parameter bit-identical while its master moves: the master is what changed."""
    master = {"weight": torch.ones(2, 2), "bias": torch.zeros(2)}
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.copy_(master["weight"])
        model.bias.copy_(master["bias"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stepped = {"weight": master["weight"] - 1e-4, "bias": master["bias"] - 1e-4}
    with torch.no_grad():  # the bf16 copy, cast from the stepped master: 1 - 1e-4 rounds back to 1.0
        model.weight.copy_(stepped["weight"])
        model.bias.copy_(stepped["bias"])
    assert torch.equal(model.weight, before["weight"]) and not torch.equal(model.bias, before["bias"])
    with pytest.raises(checks.ParametersUnchanged, match="trainable tensors did not change"):
        checks.check_parameters_changed(before, model)  # the copy alone: the weight looks frozen
    checks.check_parameters_changed(before, model, master, stepped)
    with pytest.raises(checks.ParametersUnchanged) as info:  # a master that did not move: still caught
        checks.check_parameters_changed(before, model, master, {**stepped, "weight": master["weight"].clone()})
    assert info.value.details == "1 of 2, first weight"
    with pytest.raises(checks.ParametersUnchanged):  # no master read before: the parameters compared
        checks.check_parameters_changed(before, model, None, stepped)


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


def test_a_loss_that_does_not_fall_fails_with_the_numbers():
    bound = tolerances.LossDecrease(min_relative=0.005)
    assert checks.check_loss_decreased(4.0, 2.0, bound) == 0.5
    with pytest.raises(checks.LossNotDecreasing) as raised:
        checks.check_loss_decreased(4.0, 3.99, bound)
    assert raised.value.details == "4 -> 3.99: 0.25%, bound 0.50%"
    with pytest.raises(checks.LossNotDecreasing):
        checks.check_loss_decreased(4.0, 4.1, bound)  # rising


@pytest.mark.parametrize("engine", ["hf-trainer", "lightning"])
def test_steps_a_grad_scaler_skipped_are_counted_and_the_fall_is_still_measured(engine, monkeypatch, tmp_path):
    """What the grad scaler did to gemma-cache fp16-mixed on an H100 (docs/GPU.md): the first
    two of the library's three optimizer steps skipped, so its recorded losses (each taken
    before a step) never move. Simulated on the CPU: AdamW computes the gradients (Lightning's
    closure) but applies no update for its first two calls, as GradScaler.step does on infs."""
    kind_traits.kind_learning_rate(MODELS["gemma-cache"])  # the rate's fp32 search steps AdamW too: before the patch
    skipped: dict[int, int] = {}  # optimizer -> steps skipped so far
    original = torch.optim.AdamW.step

    def step(self, closure=None):
        # an optimizer restored from a checkpoint has skipped its two already (its scaler's state
        # comes back with it), as a resumed run's and the uninterrupted run's have
        skipped.setdefault(id(self), 2 if self.state else 0)
        if skipped[id(self)] < 2:
            skipped[id(self)] += 1
            return closure() if closure is not None else None
        return original(self, closure)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    result = execute.run_cell(Cell("gemma-cache", "fp32", "train", "cpu", engine), tmp_path)
    assert result.outcome == "passed", result.message
    losses = result.metrics.train_losses
    assert len(losses) == 3 and losses[0] == losses[1] == losses[2]  # nothing applied before the last step
    assert result.metrics.steps_skipped_by_grad_scaler == 2
    assert result.metrics.optimizer_steps_applied == 1
    fall = result.metrics.loss_decrease
    assert fall.loss_before_training == pytest.approx(losses[0], rel=1e-6)
    assert fall.relative > fall.bound_relative  # the one applied step, measured after training


def test_every_built_in_kind_learns_in_fp32_by_more_than_the_bound(tmp_path):
    for model in ("tiny-transformer", "tiny-llama", "lora", "gemma-cache"):
        result = execute.run_cell(Cell(model, "fp32", "train", "cpu", "torch"), tmp_path / model)
        assert result.outcome == "passed", result.message
        fallen = result.metrics.loss_decrease.relative
        assert fallen >= 2 * tolerances.loss_decrease_bound(model).min_relative, (model, fallen)


def test_outputs_that_are_nan_on_both_sides_say_so_and_never_count_zero_differences():
    nan = torch.tensor([[1.0, float("nan")], [float("nan"), 2.0]])
    with pytest.raises(checks.NonFiniteValue) as raised:
        checks.check_outputs_equal("eval logits", nan, nan.clone(), Tolerance(0, 0))
    assert str(raised.value) == "eval logits are not finite, before and after reload alike"
    assert raised.value.details == "2 of 4 values non-finite on both sides"


def test_a_value_that_turns_nan_across_reload_is_counted_as_differing():
    before = torch.tensor([1.0, 2.0, 3.0])
    after = torch.tensor([1.0, float("nan"), 3.5])
    with pytest.raises(checks.CheckpointMismatch) as raised:
        checks.check_outputs_equal("eval logits", before, after, Tolerance(0, 0))
    assert raised.value.details == "2 of 3 values (1 finite on one side only), max abs difference 0.5"


def test_an_engine_and_a_torch_engine_both_nan_say_so():
    with pytest.raises(checks.NonFiniteValue, match="not finite in this engine nor in the torch engine"):
        checks.check_engine_agreement("first step loss", math.nan, math.nan, Tolerance(1, 1))
    with pytest.raises(checks.EngineDisagreement):
        checks.check_engine_agreement("first step loss", math.nan, 1.0, Tolerance(1, 1))
