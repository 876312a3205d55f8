"""A learning rate at which a kind learns is established, not assumed (matrix/harness/learning_rate.py),
and a precision's loss fall is judged against its fp32 twin's (pipeline.check_training_contract):
a kind that does not learn in fp32 is one finding on its fp32 cells, not one per precision."""

import pytest

from matrix.checks.tolerances import LOSS_FALL_VS_FP32
from matrix.execute.cell_run import run_cell
from matrix.grid.cell import Cell
from matrix.harness import kind_traits
from matrix.harness import learning_rate as lr
from matrix.harness.cell_state import CellState
from matrix.models import MODELS
from matrix.models.tiny_llama import TinyLlama


@pytest.fixture
def fresh_rates(monkeypatch, tmp_path):
    """An empty cache on disk and in the process."""
    monkeypatch.setenv("MATRIX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(lr, "_RATES", {})
    return tmp_path / "cache"


class CalibratedLlama(TinyLlama):
    name = "calibrated-llama"


def test_a_kind_that_sets_no_rate_gets_the_largest_candidate_it_learns_at_and_it_is_cached(fresh_rates, monkeypatch):
    found = kind_traits.kind_learning_rate(CalibratedLlama())
    assert (found.value, found.source, found.cached) == (lr.CANDIDATES[0], "calibrated", False)
    assert found.fp32_learns and found.fp32_fall.relative > 0.1  # tiny-llama fell 24% in fp32
    assert [f.rate for f in found.tried] == [lr.CANDIDATES[0]]
    (written,) = (fresh_rates / "learning-rates").iterdir()
    assert written.name.startswith("calibrated-llama-")
    monkeypatch.setattr(lr, "_RATES", {})  # a new process: read from disk, not measured again
    again = kind_traits.kind_learning_rate(CalibratedLlama())
    assert again.cached and again.value == found.value and again.fp32_fall == found.fp32_fall


class FlatLossLlama(TinyLlama):
    """A loss that no weight moves: no rate learns."""

    name = "flat-loss-llama"

    def loss(self, model, batch):
        return super().loss(model, batch) * 0 + 3.0


def test_a_kind_that_learns_at_no_candidate_keeps_the_largest_and_says_fp32_does_not_learn(fresh_rates):
    found = kind_traits.kind_learning_rate(FlatLossLlama())
    assert [f.rate for f in found.tried] == list(lr.CANDIDATES)
    assert found.value == lr.CANDIDATES[0] and not found.fp32_learns
    assert found.as_dict()["fp32_learns"] is False


class SlowLlama(TinyLlama):
    """A user's kind that sets a learning rate too small to learn at."""

    name = "slow-llama"
    learning_rate = 1e-7


def test_fp32_that_does_not_learn_is_one_finding_on_the_fp32_cells(fresh_rates, registered, tmp_path):
    registered(MODELS, SlowLlama())
    fp32 = run_cell(Cell("slow-llama", "fp32", "train", "cpu", "torch"), tmp_path / "fp32")
    assert fp32.outcome == "failed" and fp32.phase == "train_steps"
    assert fp32.signature.exc_type == "matrix.checks.LossNotDecreasing"
    assert "fp32 training did not lower the loss by the bound" in fp32.signature.text
    assert "learning rate 1e-07" in fp32.message
    assert fp32.metrics.learning_rate.source == "declared"
    # every other precision records its fall unchecked, naming why, instead of failing for fp32
    other = run_cell(Cell("slow-llama", "bf16-mixed", "train", "cpu", "torch"), tmp_path / "bf16")
    assert other.outcome == "passed", other.message
    assert other.metrics.loss_decrease.bound_relative is None
    assert other.metrics.loss_decrease.judged_by.startswith("unchecked: the fp32 twin does not learn")


def test_a_precision_that_learns_less_than_its_fp32_twin_fails(monkeypatch, tmp_path):
    """The precision's engine trains at a rate too small to move the loss while its fp32 twin
    learned at the kind's rate: every other check holds (the weights change, stay finite, keep
    their dtypes), the fall against the twin does not."""
    monkeypatch.setattr(CellState, "learning_rate", property(lambda self: 1e-6))
    result = run_cell(Cell("tiny-llama", "bf16-mixed", "train", "cpu", "torch"), tmp_path)
    assert result.outcome == "failed" and result.phase == "train_steps"
    assert result.signature.exc_type == "matrix.checks.LossNotDecreasing"
    assert "fell less than its fp32 twin's bound" in result.signature.text
    assert result.metrics.train_losses[0] > result.metrics.train_losses[-1]  # it fell, a little
    fall = result.metrics.loss_decrease
    twin = kind_traits.kind_learning_rate(MODELS["tiny-llama"]).fp32_fall.relative
    assert fall.bound_relative == pytest.approx(LOSS_FALL_VS_FP32 * twin)
    assert 0 < fall.relative < fall.bound_relative
    assert "fp32 twin" in fall.judged_by
    assert fall.loss_before_training == pytest.approx(result.metrics.train_losses[0], rel=1e-6)


def test_a_passing_precision_records_its_rate_and_the_twin_it_was_judged_by(tmp_path):
    result = run_cell(Cell("tiny-llama", "bf16-mixed", "train", "cpu", "torch"), tmp_path)
    assert result.outcome == "passed", result.message
    assert result.metrics.learning_rate.value == 1e-2
    assert result.metrics.loss_decrease.relative >= result.metrics.loss_decrease.bound_relative > 0.05
