"""The real pretrained model (minilm-bert) and what real models bring: dropout, eval mode from
from_pretrained(), known classes recognised by trait in a user's model."""

import pytest
import torch

from matrix import catalogue, environment
from matrix.cell import Cell
from matrix.execute import run_cell
from matrix.models import MODELS
from matrix.models.minilm_bert import PIP_NAME, SENTENCES, model_directory
from matrix.models.tiny_llama import TinyLlama

KIND = MODELS["minilm-bert"]
needs_wheel = pytest.mark.skipif(model_directory() is None, reason=f"Requires: [{PIP_NAME}] (nox -s real installs it)")


def test_without_the_wheel_its_cells_skip_naming_it(monkeypatch):
    monkeypatch.setattr("matrix.models.minilm_bert.model_directory", lambda: None)
    assert KIND.skip_reason("cpu") == f"Requires: [{PIP_NAME}] (the pretrained weights; not installed: nox -s real)"


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
    assert result.metrics["loss_decrease"]["relative"] > 0.08  # 16% measured at lr 1e-4
    if engine != "torch":
        assert result.metrics["cross_engine"]["spread_abs"] <= 1e-5


class UsersPretrainedLlama(TinyLlama):
    """A user's kind loaded the way from_pretrained() leaves models: in eval mode."""

    name = "users-pretrained-llama"
    traits = frozenset({"full-weights", "from-pretrained"})

    def build(self, precision, device, workdir):
        return super().build(precision, device, workdir).eval()


def test_lightning_training_a_model_left_in_eval_mode_is_the_known_class_for_a_users_kind(
    monkeypatch, tmp_path, registered
):
    kind = UsersPretrainedLlama()
    registered(MODELS, kind)
    cell = Cell(kind.name, "fp32", "train", "cpu", "lightning")
    result = run_cell(cell, tmp_path)
    assert result.metrics["effective"]["model_training_in_first_forward"] is False
    assert result.signature.exc_type == "matrix.checks.TrainedInEvalMode"
    in_force = catalogue.load().in_force(cell, environment.package_versions())
    outcome, entry = catalogue.classify(result.outcome, result.signature.text, in_force)
    assert (outcome, entry.id) == ("known", "lightning-keeps-from-pretrained-eval-mode")
    # the torch loop calls model.train() itself: the same kind trains with dropout on there
    torch_run = run_cell(Cell(kind.name, "fp32", "train", "cpu", "torch"), tmp_path / "torch")
    assert torch_run.outcome == "passed" and torch_run.metrics["effective"]["model_training_in_first_forward"]
