"""A resume must equal the run it interrupted (matrix/harness/resume.py), in every engine: the optimizer's
and scaler's state come back exactly, and step k+1 after the reload is the uninterrupted run's
step k+1, bit for bit on a CPU, within the precision's tolerance row on a device whose kernels
are not deterministic. A stack that silently drops the optimizer's state (tests/plugins/
forgetful_optimizer.py, the class of accelerate#3971) fails every engine's training cell."""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest
import torch

from matrix.checks import assertions as checks
from matrix.checks.tolerances import resume_tolerance
from matrix.engines import EngineSettings, Loop
from matrix.grid.cell import Cell
from matrix.harness import pipeline, resume
from matrix.harness.cell_state import CellState
from matrix.models import MODELS
from matrix.precisions.policies import PRECISIONS
from matrix.results.metrics import CellMetrics


@dataclass
class Run:
    """A small real model and AdamW, stepped on a fixed batch, checkpointed as users do."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None = None

    @classmethod
    def new(cls) -> Run:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
        return cls(model, torch.optim.AdamW(model.parameters(), lr=1e-2))

    def step(self) -> tuple[float, bool]:
        self.optimizer.zero_grad()
        loss = self.model(torch.randn(32, 8, generator=torch.Generator().manual_seed(1))).pow(2).mean()
        loss.backward()
        self.optimizer.step()
        return loss.item(), True

    def reloaded(self, with_optimizer_state: bool = True) -> Run:
        """A fresh model and optimizer from a checkpoint written to bytes (a state dict shares its
        tensors: loaded in memory, both runs would step the same moments)."""
        buffer = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, buffer)
        buffer.seek(0)
        checkpoint = torch.load(buffer, weights_only=True)
        copy = Run.new()
        copy.model.load_state_dict(checkpoint["model"])
        if with_optimizer_state:
            copy.optimizer.load_state_dict(checkpoint["optimizer"])
        return copy


class Stepping(Loop):
    """The pipeline's resumed step over the test's runs: an engine whose step is the run's own."""

    name = "stepping"
    description = "the test's loop"
    Run = Run

    def derive_settings(self, precision):
        return EngineSettings()

    def step(self, state, run):
        return run.step()

    def start(self, state, model, training):
        raise NotImplementedError

    def save(self, state, run, directory):
        raise NotImplementedError

    def restore(self, state, directory, training):
        raise NotImplementedError


def _state(tmp_path, device: str = "cpu", precision: str = "fp32") -> CellState:
    return CellState(
        cell=Cell("tiny-llama", precision, "train", device, "stepping"),
        kind=MODELS["tiny-llama"],
        precision=PRECISIONS[precision],
        device=torch.device("cpu"),  # the tensors stay on the CPU: the device kind decides the judgement
        workdir=tmp_path,
        metrics=CellMetrics(),
        engine=Stepping(),
    )


def _trained() -> Run:
    run = Run.new()
    for _ in range(3):
        run.step()
    return run


def _resumed_step(state: CellState, run: Run, restored: Run, scaler_state: dict | None = None) -> None:
    """What the pipeline does from the save on: the point kept, step k+1 on both runs, compared."""
    state.run, state.restored = run, restored
    state.point = resume.point_of(checks.optimizer_state(run.optimizer), scaler_state)
    pipeline.resumed_step(state)


def _tensors(run: Run) -> dict:
    found = {f"parameter {n}": p.detach().clone() for n, p in run.model.named_parameters()}
    return found | {f"optimizer {k}": v for k, v in checks.optimizer_state(run.optimizer).items()}


def test_a_faithful_resume_equals_the_uninterrupted_step_bit_for_bit(tmp_path):
    state, run = _state(tmp_path), _trained()
    again = run.reloaded()
    _resumed_step(state, run, again)
    record = state.metrics.resume
    assert record.optimizer_state_restored is True and record.optimizer_state_tensors == 12
    assert record.judged.startswith("bit for bit")
    assert record.random_numbers.startswith("seeded with")
    assert record.step_losses == record.uninterrupted_step_losses  # dropout drew the same masks: the seed
    assert record.tensors_compared == 16 and record.tensors_differing == 0
    assert torch.equal(again.model[0].weight, run.model[0].weight)


def test_a_lost_optimizer_state_fails_both_checks(tmp_path):
    state, run = _state(tmp_path), _trained()
    forgetful = run.reloaded(with_optimizer_state=False)
    with pytest.raises(checks.CheckpointMismatch, match="optimizer state missing after reload"):
        _resumed_step(state, run, forgetful)
    record = state.metrics.resume
    assert record.optimizer_state_restored is False
    # the step itself was compared too: its loss is the same (the weights came back), its update is not
    assert record.step_losses == record.uninterrupted_step_losses
    assert record.tensors_differing > 0 and record.tensors_max_abs_difference > 1e-4


def test_the_step_comparison_alone_catches_the_lost_state(tmp_path):
    state, run = _state(tmp_path), _trained()
    forgetful = run.reloaded(with_optimizer_state=False)
    torch.manual_seed(1)
    losses, _ = forgetful.step()
    torch.manual_seed(1)  # the same dropout masks on both sides
    reference, _ = run.step()
    with pytest.raises(checks.ResumeDiverged, match="parameters or optimizer state after the resumed step differ"):
        resume.check_same_step(state, [losses], _tensors(forgetful), [reference], _tensors(run))


def test_a_resumed_run_holding_a_weight_in_another_dtype_is_named_apart(tmp_path):
    """Equal values in another dtype (a reload that keeps a declared module fp32 where the run
    cast it to half) are a divergence of their own, with the first such tensor in the details."""
    state, run = _state(tmp_path), _trained()
    again = run.reloaded()
    torch.manual_seed(1)
    losses, _ = again.step()
    torch.manual_seed(1)
    reference, _ = run.step()
    resumed = _tensors(again)
    resumed["parameter 0.bias"] = resumed["parameter 0.bias"].double()
    with pytest.raises(checks.ResumeDiverged, match="differ in dtype or shape") as raised:
        resume.check_same_step(state, [losses], resumed, [reference], _tensors(run))
    first = "first parameter 0.bias (torch.float64 (16,) resumed, torch.float32 (16,) uninterrupted)"
    assert raised.value.details.startswith(f"1 of 16 tensors, {first}")
    assert raised.value.details.endswith("0 others differ in value, by at most 0")


def test_a_lost_scaler_state_fails(tmp_path):
    state, run = _state(tmp_path, precision="fp16-mixed"), _trained()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    state.point = resume.point_of(checks.optimizer_state(run.optimizer), scaler.state_dict())
    fresh = torch.amp.GradScaler("cpu")  # starts at 2**16 again
    with pytest.raises(checks.CheckpointMismatch, match="grad scaler state differs after reload"):
        resume.check_restored(state, checks.optimizer_state(run.reloaded().optimizer), fresh.state_dict())
    assert state.metrics.resume.scaler_state_restored is False


def test_a_device_that_is_not_deterministic_is_judged_by_the_tolerance_row(tmp_path):
    """The CUDA judgement, on CPU tensors: a difference in the last bits passes, a lost state does not."""
    state, run = _state(tmp_path, device="cuda"), _trained()
    after = _tensors(run)
    nudged = {name: value + 1e-7 * value.abs() for name, value in after.items()}  # last-bits noise
    resume.check_same_step(state, [1.0], nudged, [1.0 + 1e-7], after)
    record = state.metrics.resume
    assert record.judged == "within tolerance (cuda kernels are not deterministic)"
    row = resume_tolerance(torch.float32)
    assert record.tensor_tolerance.as_dict() == row.tensors.as_dict() and record.tensors_differing == 0
    forgetful, reference = run.reloaded(with_optimizer_state=False), run.reloaded()
    losses, _ = forgetful.step()
    reference_loss, _ = reference.step()
    with pytest.raises(checks.ResumeDiverged):
        resume.check_same_step(state, [losses], _tensors(forgetful), [reference_loss], _tensors(reference))
    with pytest.raises(checks.ResumeDiverged, match="loss differs"):
        resume.check_same_step(state, [1.0], after, [1.1], after)


TRAINING_ENGINES = ("torch", "accelerate", "hf-trainer", "lightning", "ddp", "fsdp2", "accelerate-fsdp2")


def test_a_silently_lost_optimizer_state_fails_every_engine(forgetful_training):
    forgetful_training(TRAINING_ENGINES)
