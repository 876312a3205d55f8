"""The engine axis: the settings table, skip reasons, effective precision, phase attribution,
cross-engine agreement, and isolation between cells."""

import dataclasses
import gc
import random
import weakref

import pytest
import torch
from accelerate.state import AcceleratorState

from matrix.engines import ENGINES
from matrix.engines.libraries.trainer import trainer_classes
from matrix.execute.cell_run import run_cell
from matrix.grid.cell import Cell
from matrix.harness import cell_state
from matrix.harness.cell_state import CellState
from matrix.harness.garbage import FULL_COLLECTION_EVERY, settle_garbage
from matrix.models import MODELS
from matrix.precisions.policies import PRECISIONS

LIGHTNING_PRECISIONS = {"32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true"}


# What each engine was told for each precision when the settings were a hand-written table (up
# to commit a3f4eac): every engine now derives them from the precision's row, and must say the same.
HAND_WRITTEN = {
    "fp32": ({}, {"mixed_precision": "no"}, {"fp16": False, "bf16": False}, {"precision": "32-true"}),
    "fp16-mixed": (
        {"autocast": "float16", "grad_scaler": True},
        {"mixed_precision": "fp16"},
        {"fp16": True, "bf16": False},
        {"precision": "16-mixed"},
    ),
    "bf16-mixed": (
        {"autocast": "bfloat16"},
        {"mixed_precision": "bf16"},
        {"fp16": False, "bf16": True},
        {"precision": "bf16-mixed"},
    ),
    "bf16-true": ({}, {"mixed_precision": "no"}, {"fp16": False, "bf16": False}, {"precision": "bf16-true"}),
    "fp16-true": ({}, {"mixed_precision": "no"}, {"fp16": False, "bf16": False}, {"precision": "16-true"}),
    "bf16-loaded-mixed": (
        {"autocast": "bfloat16"},
        {"mixed_precision": "bf16"},
        {"fp16": False, "bf16": True},
        {"precision": "bf16-mixed"},
    ),
    "fp16-loaded-mixed": (
        {"autocast": "float16", "grad_scaler": True},
        {"mixed_precision": "fp16"},
        {"fp16": True, "bf16": False},
        {"precision": "16-mixed"},
    ),
    "bf16-loaded-mixed-fp32-grads": (
        {"autocast": "bfloat16", "grad_dtype": "float32", "grad_accumulation": 2},
        "Requires: [an accelerate setting for gradients in another dtype than the weights]",
        "Requires: [a TrainingArguments setting for gradients in another dtype than the weights]",
        "Requires: [a Lightning precision for gradients in another dtype than the weights]",
    ),
}


@pytest.mark.parametrize("precision", list(HAND_WRITTEN))
def test_every_engine_derives_what_the_hand_written_table_said(precision):
    for engine, expected in zip(
        ("torch", "accelerate", "hf-trainer", "lightning"), HAND_WRITTEN[precision], strict=True
    ):
        settings = ENGINES[engine].settings(PRECISIONS[precision])
        assert settings == ({"unsupported": expected} if isinstance(expected, str) else expected), (engine, precision)


def test_a_precision_an_engine_cannot_express_is_skipped_with_its_reason():
    """fp16 autocast without a grad scaler: the torch loop runs it; the libraries that tie the
    scaler to fp16 autocast cannot be told it, and say so."""
    unscaled = dataclasses.replace(PRECISIONS["fp16-mixed"], name="fp16-mixed-unscaled", grad_scaler=False)
    assert ENGINES["torch"].unsupported_reason(unscaled) is None
    assert ENGINES["torch"].settings(unscaled) == {"autocast": "float16"}
    for engine in ("accelerate", "hf-trainer", "lightning"):
        reason = ENGINES[engine].unsupported_reason(unscaled)
        assert reason.startswith("Requires: [") and "float16 autocast without a grad scaler" in reason, reason
        assert ENGINES[engine].settings(unscaled) == {"unsupported": reason}
    assert ENGINES["lightning"].unsupported_reason(PRECISIONS["bf16-true"]) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="Requires: [no CUDA device] (CPU-only substitutions)")
def test_lightning_records_that_it_ran_16_mixed_as_bf16_on_cpu(tmp_path):
    result = run_cell(Cell("tiny-llama", "fp16-mixed", "train", "cpu", "lightning"), tmp_path)
    assert result.metrics.engine_settings == {"precision": "16-mixed"}
    assert result.metrics.engine_effective["precision"] == "bf16-mixed"
    assert result.metrics.effective.autocast_dtype_in_forward == "bfloat16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="Requires: [no CUDA device] (CPU-only substitutions)")
def test_accelerate_records_that_it_ran_fp16_without_autocast_on_cpu(tmp_path):
    result = run_cell(Cell("tiny-llama", "fp16-mixed", "eval", "cpu", "accelerate"), tmp_path)
    assert result.outcome == "passed", result.message
    assert result.metrics.engine_effective["mixed_precision"] == "fp16"
    assert result.metrics.effective.autocast_dtype_in_forward is None


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
    agreement = result.metrics.cross_engine
    assert agreement.spread_abs <= 1e-5
    assert all(state == "passed" for state in result.phases.values())


@pytest.mark.parametrize("engine", ["torch", "hf-trainer", "lightning", "accelerate"])
def test_a_cells_models_are_freed_when_it_ends(engine, tmp_path):
    """Every module that ran a forward in a cell (the run, the restored run, the reloaded
    export, the harness's references) is garbage once the cell ends: in a run of many cells of
    a pretrained model, what each cell kept added up to the OOM killer's SIGKILL. The cell runs
    twice and the second is watched: a library's first import may keep the frames it was
    imported from (and a first cell's state with them) once per process."""
    cell = Cell("tiny-llama", "fp32", "train", "cpu", engine)
    assert run_cell(cell, tmp_path / "first").outcome == "passed"
    ran = weakref.WeakSet()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: ran.add(module))
    try:
        result = run_cell(cell, tmp_path / "second")
    finally:
        handle.remove()
    assert result.outcome == "passed", result.message
    assert len(ran) > 0
    gc.collect()
    kept = sorted({type(module).__name__ for module in ran})
    assert not kept, f"modules the cell ran are still alive after it: {kept}"


def test_what_outlives_a_settle_and_is_then_let_go_is_collected_within_the_full_collection_period():
    """settle_garbage() freezes the survivors before each cell; one that a later cell lets go in
    a reference cycle (a cache's evicted model) is collected at the next full collection."""

    class Held:
        pass

    held = Held()
    held.itself = held  # a reference cycle: only the collector frees it
    alive = weakref.ref(held)
    settle_garbage()
    del held
    gc.collect()
    assert alive() is not None, "frozen survivors are not collected until they are unfrozen"
    for _ in range(FULL_COLLECTION_EVERY):
        settle_garbage()
    assert alive() is None


def test_scratch_models_are_fresh_copies_and_only_the_last_few_are_kept(tmp_path):
    """The harness's scratch models equal a fresh build, are never the same object twice, and
    the built ones it copies from are bounded: a pretrained model per precision (and per
    explored variant) held to the end of a run would add up like a leak."""
    kept = cell_state.PRISTINE_KEPT
    names = ["fp32", "bf16-true", "fp16-true", "bf16-mixed", "fp16-mixed", "bf16-loaded-mixed"]
    assert len(names) > kept
    for name in names:
        cell = Cell("tiny-llama", name, "eval", "cpu")
        state = CellState(cell, MODELS["tiny-llama"], PRECISIONS[name], torch.device("cpu"), tmp_path, {})
        first, second = state.scratch_model(), state.scratch_model()
        fresh = state.fresh_model()
        assert first is not second
        dicts = first.state_dict(), second.state_dict(), fresh.state_dict()
        for (n, a), b, c in zip(dicts[0].items(), dicts[1].values(), dicts[2].values(), strict=True):
            assert a.dtype == c.dtype and torch.equal(a, c), n
            assert a.data_ptr() != b.data_ptr(), f"{n}: two scratch models share memory"
        assert len(cell_state._PRISTINE) <= kept
    assert [key[3] for key in cell_state._PRISTINE][-kept:] == names[-kept:]


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
    if engine == "lightning":
        # Lightning's checkpoint carries no random state (lightning-checkpoint-carries-no-random-state):
        # its resumed step draws other masks; everything before it holds
        assert result.phase == "resumed_step" and result.signature.exc_type == "matrix.checks.ResumeDiverged"
        assert [result.phases[p] for p in ("train_steps", "checkpoint_reload")] == ["passed", "passed"]
    else:
        assert result.outcome == "passed", result.message
    compared = result.metrics.cross_engine
    assert compared.spread_abs == 0.0 and compared.random_numbers.startswith("seeded with")
    torch_run = run_cell(Cell(model, "fp32", "train", "cpu", "torch"), tmp_path / "torch", variant=variant)
    assert torch_run.metrics.train_losses[0] == result.metrics.train_losses[0]


@pytest.mark.parametrize(("dropout", "outcome"), [(DROPOUT, "failed"), (0.0, "passed")])
def test_an_engine_that_feeds_the_rows_in_another_order_fails_the_check_with_dropout(
    dropout, outcome, monkeypatch, tmp_path
):
    """A deliberately different engine: the Trainer fed the rows backwards. Without dropout the
    mean loss does not care; with dropout each row gets another row's masks, and the check says so."""
    monkeypatch.setattr(trainer_classes().RecordingTrainer, "_get_train_sampler", lambda self, *a, **k: [2, 1, 0])
    variant = MODELS["tiny-llama"].grid_variant.replace(dropout=dropout)
    result = run_cell(Cell("tiny-llama", "fp32", "train", "cpu", "hf-trainer"), tmp_path, variant=variant)
    assert result.outcome == outcome, result.message
    if outcome == "failed":
        assert result.phase == "train_steps"
        assert result.signature.exc_type == "matrix.checks.EngineDisagreement"
