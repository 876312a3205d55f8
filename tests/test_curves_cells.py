"""Loss curves in real cells (issue 38): a library's loop is compared step by step with a reference
that trains as the library declares it trains (the Trainer's clipping and weight-decay groups),
so a right library matches bit for bit on the CPU and an undeclared difference leaves the curve;
a run's longer curve trains every engine that many steps; saved initial weights are what every
model of the run starts from."""

from __future__ import annotations

import pytest
import torch

from matrix.execute.cell_run import run_cell
from matrix.grid import schedule
from matrix.grid.cell import Cell
from matrix.models import MODELS, initial_weights


def _run(tmp_path, model: str, precision: str, engine: str):
    return run_cell(Cell(model, precision, "train", "cpu", engine), tmp_path / f"{model}-{precision}-{engine}")


@pytest.mark.parametrize("engine", ["hf-trainer", "lightning", "accelerate"])
def test_a_library_trains_its_fp32_curve_bit_for_bit_as_its_declared_reference(tmp_path, engine):
    result = _run(tmp_path, "tiny-llama", "fp32", engine)
    assert result.outcome == "passed", result.message
    curve = result.metrics.curve.torch_engine
    assert curve.steps_compared == schedule.TRAIN_STEPS
    assert curve.deviations == [0.0] * schedule.TRAIN_STEPS, curve.deviations
    assert curve.reference_losses == result.metrics.train_losses


def test_a_difference_the_engine_does_not_declare_leaves_the_curve_and_the_failure_says_what_to_declare(
    tmp_path, monkeypatch
):
    """The Trainer's AdamW decays neither biases nor norms: a reference told that every parameter
    decays (as a loop that builds its optimizer its own way but does not say so) trains another
    curve from the first update on, in fp32 far beyond rounding."""
    from matrix.engines.hf_trainer import HFTrainerEngine

    monkeypatch.setattr(HFTrainerEngine, "decayed_parameters", lambda self, model: None)
    result = _run(tmp_path, "tiny-llama", "fp32", "hf-trainer")
    assert result.outcome == "failed" and result.phase == "train_steps", result.message
    assert result.signature.text.startswith(
        "train_steps: matrix.checks.CurveDiverged: the training loss curve leaves the torch engine's at step <n>"
    )
    assert result.metrics.curve.torch_engine.first_step_outside in (2, 3)
    assert "gradients clipped to norm 1" in result.message
    assert (
        "weight decay on all trainable parameters" in result.message and "Engine.decayed_parameters" in result.message
    )


def test_a_run_asking_for_a_longer_curve_trains_every_engine_that_many_steps_and_resumes_after_them(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(schedule.CURVE_STEPS_VARIABLE, "5")
    for engine in ("torch", "hf-trainer", "lightning"):
        result = _run(tmp_path, "tiny-transformer", "fp32", engine)
        assert result.outcome == "passed", (engine, result.message)
        assert len(result.metrics.train_losses) == 5 and result.metrics.curve.steps == 5
        assert result.metrics.resume.tensors_differing == 0  # step k+1 = step 6 on both sides
        if engine != "torch":
            assert len(result.metrics.curve.torch_engine.reference_losses) == 5
            assert result.metrics.curve.torch_engine.first_step_outside is None


def test_every_model_of_a_run_with_initial_weights_starts_from_them(tmp_path, monkeypatch):
    kind = MODELS["tiny-llama"]
    directory = tmp_path / "initial"
    path = initial_weights.save(kind, directory, tmp_path)
    seeded = _run(tmp_path / "seeded", "tiny-llama", "bf16-mixed", "hf-trainer")
    monkeypatch.setenv(schedule.INITIAL_WEIGHTS_VARIABLE, str(directory))
    same = _run(tmp_path / "same", "tiny-llama", "bf16-mixed", "hf-trainer")
    # the saved weights are the kind's own build: the same curve, bit for bit
    assert same.outcome == "passed", same.message
    assert same.metrics.train_losses == seeded.metrics.train_losses
    # other saved weights: every model of the cell (the engine's and both references') starts from them
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    tensors = {name: t * 1.5 if name.endswith("embed_tokens.weight") else t for name, t in tensors.items()}
    other = tmp_path / "other-initial"  # another run's weights: a directory of their own, as runs name them
    other.mkdir()
    save_file(tensors, str(initial_weights.path_of(kind.name, other)))
    monkeypatch.setenv(schedule.INITIAL_WEIGHTS_VARIABLE, str(other))
    moved = _run(tmp_path / "moved", "tiny-llama", "bf16-mixed", "hf-trainer")
    assert moved.outcome == "passed", moved.message
    assert moved.metrics.train_losses[0] != seeded.metrics.train_losses[0]
    assert moved.metrics.curve.torch_engine.deviations == [0.0] * schedule.TRAIN_STEPS
    assert moved.metrics.curve.fp32_twin.reference_losses[0] != seeded.metrics.curve.fp32_twin.reference_losses[0]


def test_saved_initial_weights_that_do_not_fit_the_model_fail_its_build(tmp_path, monkeypatch):
    directory = tmp_path / "initial"
    path = initial_weights.save(MODELS["tiny-llama"], directory, tmp_path)
    path.rename(initial_weights.path_of("gemma-cache", directory))  # tiny-llama's tensors for gemma-cache
    monkeypatch.setenv(schedule.INITIAL_WEIGHTS_VARIABLE, str(directory))
    result = _run(tmp_path, "gemma-cache", "fp32", "torch")
    assert result.outcome == "failed" and result.phase == "train_steps"
    assert "InitialWeightsError: initial weights: the saved tensors do not match the model's parameters" in (
        result.signature.text
    )


def test_a_run_on_the_stack_of_the_golden_curves_matches_them(tmp_path):
    """The golden curves of the default stack (matrix/golden/curves-default.json, written by
    `nox -s curves -- --write`): the torch engine's cells of two golden kinds (`nox -s curves` runs
    them all), trained here from the saved initial weights, stay within the row of their golden
    curves."""
    import json
    from importlib.metadata import version

    from conftest import run_matrix_cpu
    from matrix.results import compare, curves

    golden = json.loads(curves.golden_path("default").read_text())
    recorded = {
        name: golden["environment"]["packages"].get(name)
        for name in ("torch", "transformers", "peft", "accelerate", "lightning")
    }
    installed = {name: version(name) for name in recorded}
    if installed != recorded:
        pytest.skip(
            f"Requires: [the versions the golden curves were made with] ({recorded}; here {installed}; "
            "`nox -s curves` compares across versions)"
        )
    selection = [*curves.GOLDEN_SELECTION, "--engine", "torch", "--model", "tiny-llama,tiny-transformer"]
    _, document = run_matrix_cpu(
        tmp_path,
        *selection,
        "--curve-steps",
        str(curves.GOLDEN_STEPS),
        "--initial-weights",
        str(curves.INITIAL_WEIGHTS_DIR),
    )
    assert document["run"]["curve_steps"] == curves.GOLDEN_STEPS
    result = compare.diff(golden, document)
    ran = {c["id"] for c in document["cells"] if (c["metrics"].get("curve") or {}).get("losses")}
    assert len(ran) == 8, sorted(ran)
    assert ran <= {c["id"] for c in golden["cells"]}
    assert result.changes["curve-moved"] == [], result.changes["curve-moved"]
    assert {c["cell"] for c in result.changes["removed"]} == {
        c["id"] for c in golden["cells"]
    } - ran  # the other engines'


def test_a_cell_is_judged_by_its_engine_familys_row_and_records_which_and_how_much_of_it_it_used(tmp_path):
    """Issue 47: the rows are derived per engine family from the measured spread of right engines
    (matrix/checks/curve_spread.json); a right library's curve uses at most half of its row, and the record
    names the row, so a report can say "45% of the master-weights bfloat16 row"."""
    from matrix.checks import tolerances
    from matrix.engines import ENGINES
    from matrix.engines.traits import curve_family
    from matrix.results import curves

    result = _run(tmp_path, "tiny-llama", "fp16-mixed", "lightning")  # Lightning computes 16-mixed in bf16 on a CPU
    assert result.outcome == "passed", result.message
    curve = result.metrics.curve
    family = curve_family(ENGINES["lightning"].traits)
    assert family == curves.DEFAULT_FAMILY
    expected = tolerances.curve_vs_torch_engine(torch.bfloat16, family)
    assert curve.torch_engine.tolerance == expected.as_dict() and expected.row == "torch bfloat16"
    assert curve.golden_tolerance == expected.as_dict()
    assert 0 < curve.torch_engine.worst_share <= 1 / tolerances.CURVE_SAFETY
    assert curve.fp32_twin.tolerance["row"] == "torch bfloat16"
