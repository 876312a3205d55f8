"""The precision table, and what each precision actually puts in force on a real model."""

import pytest
import torch

from matrix.grid.cell import Cell
from matrix.harness.cell_state import CellState
from matrix.harness.measurements import effective_settings
from matrix.models import MODELS
from matrix.precisions.policies import PRECISIONS

EXPECTED = {  # name: (weights, autocast, scaler) -- the definitions
    "fp32": (torch.float32, None, False),
    "fp16-mixed": (torch.float32, torch.float16, True),
    "bf16-mixed": (torch.float32, torch.bfloat16, False),
    "bf16-true": (torch.bfloat16, None, False),
    "fp16-true": (torch.float16, None, False),
    "bf16-loaded-mixed": (torch.bfloat16, torch.bfloat16, False),
    "fp16-loaded-mixed": (torch.float16, torch.float16, True),
}


def test_only_the_simpletuner_policy_contradicts_itself():
    contradictory = {name for name, p in PRECISIONS.items() if p.contradictions()}
    assert contradictory == {"bf16-loaded-mixed-fp32-grads"}
    (problem,) = PRECISIONS["bf16-loaded-mixed-fp32-grads"].contradictions()
    assert problem.startswith("gradients kept in float32 for bfloat16 weights")


def test_a_contradiction_fails_in_configure_before_any_step(tmp_path):
    from matrix.execute.cell_run import run_cell

    result = run_cell(Cell("tiny-llama", "bf16-loaded-mixed-fp32-grads", "train", "cpu"), tmp_path)
    assert (result.outcome, result.phase) == ("failed", "configure")
    assert set(result.phases.values()) == {"not run"}
    assert result.signature.origin == "matrix.precisions:validate"
    assert not (tmp_path / "pretrained-fp32").exists()  # nothing was built


def test_run_anyway_records_what_torch_raises_and_where(tmp_path):
    from matrix.execute.cell_run import run_cell

    result = run_cell(
        Cell("tiny-llama", "bf16-loaded-mixed-fp32-grads", "train", "cpu"), tmp_path, run_contradictory=True
    )
    assert (result.outcome, result.phase) == ("failed", "train_steps")
    assert result.signature.origin.startswith("torch.optim.adam:")  # the optimizer step, not backward
    assert "expected dtype c10::BFloat16" in result.signature.message


@pytest.mark.parametrize("name", EXPECTED)
def test_table_defines_each_precision(name):
    precision = PRECISIONS[name]
    assert (precision.weights_dtype, precision.autocast_dtype, precision.grad_scaler) == EXPECTED[name]
    assert precision.weights_from == ("load" if "loaded" in name else "cast")


@pytest.mark.parametrize("name", EXPECTED)
@pytest.mark.parametrize("model", ["tiny-transformer", "lora"])
def test_effective_settings_are_measured_not_copied(name, model, tmp_path):
    precision = PRECISIONS[name]
    state = CellState(Cell(model, name, "train", "cpu"), MODELS[model], precision, torch.device("cpu"), tmp_path, {})
    model = state.kind.build(precision, state.device, tmp_path)
    effective = effective_settings(state, model)
    weights = str(precision.weights_dtype).removeprefix("torch.")
    assert weights in effective.parameter_dtypes
    assert effective.autocast_dtype == (
        str(precision.autocast_dtype).removeprefix("torch.") if precision.autocast_dtype else None
    )
    assert effective.grad_scaler is precision.grad_scaler
    if model == "lora" and weights != "float32":
        # peft keeps the adapters in fp32 over a half-precision base: recorded, not hidden
        assert effective.trainable_parameter_dtypes == {
            "float32": sum(p.numel() for p in model.parameters() if p.requires_grad)
        }


def test_loaded_precisions_go_through_from_pretrained(tmp_path):
    """The 'loaded' weights come from an fp32 checkpoint loaded with dtype=..., so the
    non-persistent RoPE buffer is recomputed in fp32 as from_pretrained does."""
    kind = MODELS["tiny-llama"]
    loaded = kind.build(PRECISIONS["bf16-loaded-mixed"], torch.device("cpu"), tmp_path)
    cast = kind.build(PRECISIONS["bf16-true"], torch.device("cpu"), tmp_path)
    assert (tmp_path / "pretrained-fp32").is_dir()
    assert dict(loaded.named_buffers())["model.rotary_emb.inv_freq"].dtype == torch.float32
    assert dict(cast.named_buffers())["model.rotary_emb.inv_freq"].dtype == torch.bfloat16
    for (name, a), (_, b) in zip(loaded.named_parameters(), cast.named_parameters(), strict=True):
        assert torch.equal(a, b), name  # same weights either way


@pytest.mark.parametrize("model", list(MODELS))
def test_models_are_deterministic(model, tmp_path):
    kind = MODELS[model]
    if kind.skip_reason("cpu"):
        pytest.skip(kind.skip_reason("cpu"))  # liger-llama without triton and liger-kernel
    a = kind.build(PRECISIONS["fp32"], torch.device("cpu"), tmp_path)
    b = kind.build(PRECISIONS["fp32"], torch.device("cpu"), tmp_path)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert all(torch.equal(x, y) for x, y in zip(kind.batch("cpu").values(), kind.batch("cpu").values(), strict=True))
