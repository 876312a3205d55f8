"""Models written as a user writes them, with the six methods alone (tests/plugins/user_gpt2.py;
user_bert.py in tests/test_real_model.py, which has the pretrained weights), run through the
whole CPU matrix as a user runs it: `python -m matrix run cases -p user_gpt2 --model user-gpt2
--device cpu`. The harness must observe what it needs (dropout, eval mode from from_pretrained,
LayerNorm, how the loss averages, a learning rate the model learns at) and leave no failure that
is its own: every failure is a catalogued class.
"""

import pytest

# past users_grid's own run limit (tests/conftest.py USERS_GRID_RUN_LIMIT_S, 1200 s), so that
# the run's limit, with its output, is what a hang reports
USERS_GRID_TIMEOUT_S = 1320
pytestmark = pytest.mark.timeout(USERS_GRID_TIMEOUT_S)  # the first test runs the whole grid


@pytest.fixture(scope="module")
def gpt2_grid(users_grid, tmp_path_factory):
    return users_grid("user_gpt2", "user-gpt2", tmp_path_factory.mktemp("user-gpt2"))


def test_a_users_gpt2_runs_the_whole_cpu_matrix_with_no_failure_of_the_harness(gpt2_grid):
    passed = [i for i, c in gpt2_grid.items() if c["outcome"] == "passed"]
    assert len(passed) >= 70, passed
    for engine in ("torch", "accelerate", "ddp", "fsdp2", "accelerate-fsdp2"):
        assert gpt2_grid[f"user-gpt2-bf16-mixed-train-cpu-{engine}"]["outcome"] == "passed", engine
    # Lightning's checkpoint carries no random state: with the GPT-2's dropout its resumed step draws
    # other masks than the run it interrupted (catalogued); everything before the resumed step passes
    lightning = gpt2_grid["user-gpt2-bf16-mixed-train-cpu-lightning"]
    assert lightning["outcome"] == "known" and lightning["phase"] == "resumed_step"
    assert lightning["known_failure"]["id"] == "lightning-checkpoint-carries-no-random-state"


def test_what_was_observed_about_it_is_in_every_record(gpt2_grid):
    record = gpt2_grid["user-gpt2-fp32-train-cpu-torch"]["metrics"]
    assert record["kind"]["declared_traits"] is None
    assert set(record["kind"]["traits"]) == {
        "full-weights",
        "layer-norm",
        "dropout",
        "loaded-from-pretrained",
        "unmapped-loss-type",
        "no-float8-layers",  # GPT-2's projections are Conv1D
        "next-token-loss-takes-num-items",  # GPT2LMHeadModel's loss divides by the count it is given
    }
    assert record["kind"]["observed"]["loss_items"] == "next-token labels"
    assert record["learning_rate"]["source"] == "calibrated" and record["learning_rate"]["fp32_learns"]


def test_its_dropout_is_compared_across_ranks_with_dropout_off(gpt2_grid):
    for engine in ("ddp", "fsdp2", "accelerate-fsdp2"):
        cross = gpt2_grid[f"user-gpt2-fp32-train-cpu-{engine}"]["metrics"]["cross_engine"]
        assert cross["random_numbers"].startswith("none: dropout off"), engine
        assert cross["spread_abs"] <= 1e-5, (engine, cross)
    # one process draws the whole batch's masks: the first step's loss itself compares there
    single = gpt2_grid["user-gpt2-fp32-train-cpu-accelerate"]["metrics"]["cross_engine"]
    assert single["random_numbers"].startswith("seeded with") and single["spread_abs"] <= 1e-5


def test_the_known_classes_reach_it_through_observed_traits(gpt2_grid):
    known = {i: c["known_failure"]["id"] for i, c in gpt2_grid.items() if c["outcome"] == "known"}
    # AdamW's fp16 eps in every engine that trains its fp16 weights: selected by full-weights
    assert known["user-gpt2-fp16-true-train-cpu-torch"] == "adamw-fp16-eps-underflow"
    # Lightning on CPU substitutes bf16 autocast over fp16 LayerNorm weights: selected by layer-norm
    assert known["user-gpt2-fp16-loaded-mixed-train-cpu-lightning"] == "lightning-cpu-bf16-autocast-over-fp16-weights"
    # Lightning keeps the eval mode from_pretrained() returns: selected by loaded-from-pretrained
    assert known["user-gpt2-bf16-loaded-mixed-train-cpu-lightning"] == "lightning-keeps-from-pretrained-eval-mode"
    # the Trainer over-counts GPT-2's labels (its class name names no loss type): unmapped-loss-type,
    # in fp32 too: a label count knows no precision
    assert known["user-gpt2-fp32-train-cpu-hf-trainer"] == "trainer-num-items-overcounts-unmapped-causal-lm"
    trainer = gpt2_grid["user-gpt2-fp32-train-cpu-hf-trainer"]["metrics"]["cross_engine"]
    assert trainer["first_step_loss"] / trainer["torch_engine_first_step_loss"] == pytest.approx(34 / 38, rel=1e-5)
