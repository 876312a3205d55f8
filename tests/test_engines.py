"""The engine axis: the settings table, skip reasons, effective precision, phase attribution,
cross-engine agreement, and isolation between cells."""

import random

import pytest
import torch
from accelerate.state import AcceleratorState

from matrix.cells import Cell
from matrix.engines import ENGINES
from matrix.engines import settings as engine_settings
from matrix.engines.hf_trainer import RecordingTrainer
from matrix.models import MODELS
from matrix.phases import run_cell
from matrix.precisions import PRECISIONS

LIGHTNING_PRECISIONS = {"32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true"}


def test_the_table_maps_every_precision_for_every_engine():
    for precision in PRECISIONS:
        assert set(engine_settings.ENGINE_SETTINGS[precision]) == set(ENGINES), precision
        if PRECISIONS[precision].grad_dtype is not None:  # only the hand-written loop can keep fp32 grads
            for engine in ("accelerate", "hf-trainer", "lightning"):
                reason = ENGINES[engine].unsupported_reason(PRECISIONS[precision])
                assert reason.startswith("Requires: [") and "gradients in another dtype" in reason
            continue
        lightning = engine_settings.ENGINE_SETTINGS[precision]["lightning"]
        assert isinstance(lightning, engine_settings.Unsupported) or lightning["precision"] in LIGHTNING_PRECISIONS
        accelerate = engine_settings.ENGINE_SETTINGS[precision]["accelerate"]
        autocast = PRECISIONS[precision].autocast_dtype
        expected = {None: "no", torch.float16: "fp16", torch.bfloat16: "bf16"}[autocast]
        assert accelerate == {"mixed_precision": expected}
        trainer = engine_settings.ENGINE_SETTINGS[precision]["hf-trainer"]
        assert trainer == {"fp16": autocast == torch.float16, "bf16": autocast == torch.bfloat16}


def test_a_combination_an_engine_cannot_express_is_skipped_with_its_reason(monkeypatch):
    reason = "Requires: [an engine setting for fp16-true] (test)"
    monkeypatch.setitem(engine_settings.ENGINE_SETTINGS["fp16-true"], "lightning", engine_settings.Unsupported(reason))
    assert ENGINES["lightning"].unsupported_reason(PRECISIONS["fp16-true"]) == reason
    assert ENGINES["lightning"].settings(PRECISIONS["fp16-true"]) == {"unsupported": reason}
    assert ENGINES["lightning"].unsupported_reason(PRECISIONS["bf16-true"]) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="Requires: [no CUDA device] (CPU-only substitutions)")
def test_lightning_records_that_it_ran_16_mixed_as_bf16_on_cpu(tmp_path):
    result = run_cell(Cell("tiny-llama", "fp16-mixed", "train", "cpu", "lightning"), tmp_path)
    assert result.metrics["engine_settings"] == {"precision": "16-mixed"}
    assert result.metrics["engine_effective"]["precision"] == "bf16-mixed"
    assert result.metrics["effective"]["autocast_dtype_in_forward"] == "bfloat16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="Requires: [no CUDA device] (CPU-only substitutions)")
def test_accelerate_records_that_it_ran_fp16_without_autocast_on_cpu(tmp_path):
    result = run_cell(Cell("tiny-llama", "fp16-mixed", "eval", "cpu", "accelerate"), tmp_path)
    assert result.outcome == "passed", result.message
    assert result.metrics["engine_effective"]["mixed_precision"] == "fp16"
    assert result.metrics["effective"]["autocast_dtype_in_forward"] is None


def test_trainer_failures_are_attributed_to_the_phase_the_trainer_was_in(tmp_path):
    """Seed 003 through the transformers Trainer: training works, its evaluation fails."""
    result = run_cell(Cell("tiny-transformer", "bf16-mixed", "train", "cpu", "hf-trainer"), tmp_path)
    assert result.outcome == "failed"
    assert result.phase == "mid_training_eval"
    assert result.phases["train_steps"] == "passed"
    assert result.signature.message == "expected scalar type Float but found BFloat16"


@pytest.mark.parametrize("engine", ["accelerate", "hf-trainer", "lightning"])
def test_engines_agree_with_the_torch_engine_on_the_first_step(engine, tmp_path):
    result = run_cell(Cell("tiny-llama", "fp32", "train", "cpu", engine), tmp_path)
    assert result.outcome == "passed", result.message
    agreement = result.metrics["cross_engine"]
    assert agreement["spread_abs"] <= 1e-5
    assert all(state == "passed" for state in result.phases.values())


ISOLATION_CELLS = [
    Cell(model, precision, mode, "cpu", engine)
    for engine in ("accelerate", "hf-trainer")
    for model, precision, mode in (
        ("tiny-llama", "fp32", "train"),
        ("tiny-llama", "bf16-mixed", "eval"),
        ("tiny-transformer", "bf16-mixed", "eval"),
        ("lora", "fp16-mixed", "train"),
    )
]


def _outcomes(cells, tmp_path):
    found = {}
    for index, cell in enumerate(cells):
        result = run_cell(cell, tmp_path / f"{index}")
        found[cell.id] = (result.outcome, result.phase, result.signature.id if result.signature else None)
        assert not AcceleratorState._shared_state, f"{cell.id} left accelerate's state behind"
    return found


def test_shuffled_order_gives_the_same_outcomes_and_signatures(tmp_path):
    in_order = _outcomes(ISOLATION_CELLS, tmp_path / "ordered")
    shuffled = list(ISOLATION_CELLS)
    random.Random(7).shuffle(shuffled)
    assert shuffled != ISOLATION_CELLS
    assert _outcomes(shuffled, tmp_path / "shuffled") == in_order
    assert {outcome for outcome, _, _ in in_order.values()} == {"passed", "failed"}  # both kinds exercised


DROPOUT = 0.1  # the real models' value (BERT's hidden and attention dropout)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-transformer"])
@pytest.mark.parametrize("engine", ["accelerate", "hf-trainer", "lightning"])
def test_with_dropout_the_first_step_agrees_with_the_torch_engine(model, engine, tmp_path):
    """Each engine's first training forward draws its dropout masks from the same seed as the
    torch engine's yardstick, and the rows come in the same order: the losses are equal."""
    variant = MODELS[model].grid_variant.replace(dropout=DROPOUT)
    result = run_cell(Cell(model, "fp32", "train", "cpu", engine), tmp_path, variant=variant)
    assert result.outcome == "passed", result.message
    compared = result.metrics["cross_engine"]
    assert compared["spread_abs"] == 0.0 and compared["random_numbers"].startswith("seeded with")
    torch_run = run_cell(Cell(model, "fp32", "train", "cpu", "torch"), tmp_path / "torch", variant=variant)
    assert torch_run.metrics["train_losses"][0] == result.metrics["train_losses"][0]


@pytest.mark.parametrize(("dropout", "outcome"), [(DROPOUT, "failed"), (0.0, "passed")])
def test_an_engine_that_feeds_the_rows_in_another_order_fails_the_check_with_dropout(
    dropout, outcome, monkeypatch, tmp_path
):
    """A deliberately different engine: the Trainer fed the rows backwards. Without dropout the
    mean loss does not care; with dropout each row gets another row's masks, and the check says so."""
    monkeypatch.setattr(RecordingTrainer, "_get_train_sampler", lambda self, *a, **k: [2, 1, 0])
    variant = MODELS["tiny-llama"].grid_variant.replace(dropout=dropout)
    result = run_cell(Cell("tiny-llama", "fp32", "train", "cpu", "hf-trainer"), tmp_path, variant=variant)
    assert result.outcome == outcome, result.message
    if outcome == "failed":
        assert result.phase == "train_steps"
        assert result.signature.exc_type == "matrix.checks.EngineDisagreement"
