"""Placement is part of a cell's contract: no engine hands the model back on another device
unnoticed.

On CUDA, Lightning's strategy teardown moves the LightningModule to the CPU at the end of
fit() and validate() (the first GPU run: 43 lightning cells failed with device mismatches far
from their cause). These tests make the same kind of move happen on a CPU-only machine: a
teardown that moves the model to the meta device, and the engine's restore from a simulated
library device.
"""

import pytest
import torch

from matrix.checks import assertions as checks
from matrix.execute.cell_run import run_cell
from matrix.grid.cell import Cell
from matrix.harness.cell_state import CellState
from matrix.harness.measurements import return_from_library_device
from matrix.models import MODELS
from matrix.precisions.policies import PRECISIONS
from matrix.results.metrics import CellMetrics


def test_a_model_partly_elsewhere_breaks_placement_naming_both_devices():
    model = MODELS["tiny-llama"].initialise()
    checks.check_placement(model, torch.device("cpu"), "after build")  # all on the cpu: holds
    model.lm_head.to("meta")
    with pytest.raises(checks.PlacementChanged) as raised:
        checks.check_placement(model, torch.device("cpu"), "after fit")
    assert str(raised.value) == "after fit: the model is on meta, not on the cell's device cpu"
    assert raised.value.details == "1 tensors elsewhere, first parameter lm_head.weight"


@pytest.fixture
def teardown_moves_the_model_to_meta(monkeypatch):
    """Lightning's teardown as it behaves on CUDA, seen from a CPU cell: the module leaves the
    cell's device when fit() or validate() returns."""
    from lightning.pytorch.strategies import Strategy  # here: collecting this module imports no Lightning

    original = Strategy.teardown

    def teardown(self):
        original(self)
        if self.lightning_module is not None:
            self.lightning_module.to("meta")

    monkeypatch.setattr(Strategy, "teardown", teardown)


# fit() runs the whole schedule, the uninterrupted step k+1 included: its teardown is met there
@pytest.mark.parametrize(
    ("mode", "phase", "library_call"), [("train", "resumed_step", "fit"), ("eval", "evaluate", "validate")]
)
def test_a_library_that_moves_the_model_away_fails_the_cell_with_a_placement_signature(
    teardown_moves_the_model_to_meta, tmp_path, mode, phase, library_call
):
    result = run_cell(Cell("tiny-llama", "fp32", mode, "cpu", "lightning"), tmp_path)
    assert result.outcome == "failed" and result.phase == phase
    assert result.signature.text == (
        f"{phase}: matrix.checks.PlacementChanged: after {library_call}: the model is on meta, "
        "not on the cell's device cpu @ matrix.checks:check_placement"
    )


def test_lightning_cells_on_the_cpu_stay_where_they_are(tmp_path):
    result = run_cell(Cell("tiny-llama", "fp32", "train", "cpu", "lightning"), tmp_path)
    assert result.outcome == "passed", result.message
    assert "placement_restored" not in result.metrics.as_dict()  # Lightning's teardown moved nothing on a CPU


def lightning_cell_state(device: torch.device, workdir) -> CellState:
    return CellState(
        cell=Cell("tiny-llama", "fp32", "train", device.type, "lightning"),
        kind=MODELS["tiny-llama"],
        precision=PRECISIONS["fp32"],
        device=device,
        workdir=workdir,
        metrics=CellMetrics(),
    )


def test_the_move_a_library_is_known_to_make_is_undone_and_recorded(tmp_path):
    """The CUDA case simulated: the cell's device is not the CPU, the library left the model
    on the CPU. (meta stands in for the GPU: a device other than the one the library uses.)"""
    state = lightning_cell_state(torch.device("meta"), tmp_path)
    model = state.kind.initialise()  # where Lightning's teardown leaves it: on the CPU
    return_from_library_device(state, model, torch.device("cpu"), by="Lightning's strategy teardown", when="fit")
    assert set(checks.tensor_devices(model).values()) == {"meta"}
    assert state.metrics.placement_restored == [
        {"after": "fit", "by": "Lightning's strategy teardown", "found_on": "cpu", "moved_back_to": "meta"}
    ]


def test_a_move_the_library_is_not_known_to_make_is_not_undone(tmp_path):
    state = lightning_cell_state(torch.device("cpu"), tmp_path)
    model = state.kind.initialise().to("meta")
    with pytest.raises(checks.PlacementChanged, match=r"^after validate: the model is on meta"):
        return_from_library_device(state, model, torch.device("cpu"), by="teardown", when="validate")
    assert "placement_restored" not in state.metrics.as_dict()
