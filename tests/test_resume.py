"""A resume must equal the run it interrupted (matrix/resume.py), in every engine: the optimizer's
and scaler's state come back exactly, and step k+1 after the reload is the uninterrupted run's
step k+1, bit for bit on a CPU, within the precision's tolerance row on a device whose kernels
are not deterministic. A stack that silently drops the optimizer's state (tests/plugins/
forgetful_optimizer.py, the class of accelerate#3971) fails every engine's training cell."""

from __future__ import annotations

import io

import pytest
import torch

from matrix import checks, resume
from matrix.cell import Cell
from matrix.models import MODELS
from matrix.phases import CellState
from matrix.precisions import PRECISIONS
from matrix.results.metrics import CellMetrics
from matrix.tolerances import resume_tolerance


def _state(tmp_path, device: str = "cpu", precision: str = "fp32") -> CellState:
    return CellState(
        cell=Cell("tiny-llama", precision, "train", device, "torch"),
        kind=MODELS["tiny-llama"],
        precision=PRECISIONS[precision],
        device=torch.device("cpu"),  # the tensors stay on the CPU: the device kind decides the judgement
        workdir=tmp_path,
        metrics=CellMetrics(),
    )


class Run:
    """A small real model and AdamW, stepped on a fixed batch, checkpointed as users do."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.x = torch.randn(32, 8)

    def step(self) -> tuple[float, bool]:
        self.optimizer.zero_grad()
        loss = self.model(self.x).pow(2).mean()
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
        copy = Run()
        copy.model.load_state_dict(checkpoint["model"])
        if with_optimizer_state:
            copy.optimizer.load_state_dict(checkpoint["optimizer"])
        return copy

    def continuation(self) -> resume.Continuation:
        return resume.Continuation(self.step, lambda: resume.model_and_optimizer_tensors(self.model, self.optimizer))


def _trained() -> Run:
    run = Run()
    for _ in range(3):
        run.step()
    return run


def test_a_faithful_resume_equals_the_uninterrupted_step_bit_for_bit(tmp_path):
    state, run = _state(tmp_path), _trained()
    resume.remember_point(state, run.optimizer)
    again = run.reloaded()
    resume.check_resume(state, again.continuation(), run.continuation(), again.optimizer)
    record = state.metrics.resume
    assert record.optimizer_state_restored is True and record.optimizer_state_tensors == 12
    assert record.judged.startswith("bit for bit")
    assert record.step_losses == record.uninterrupted_step_losses  # dropout drew the same masks: the seed
    assert record.tensors_compared == 16 and record.tensors_differing == 0
    assert torch.equal(again.model[0].weight, run.model[0].weight)


def test_a_lost_optimizer_state_fails_both_checks(tmp_path):
    state, run = _state(tmp_path), _trained()
    resume.remember_point(state, run.optimizer)
    forgetful = run.reloaded(with_optimizer_state=False)
    with pytest.raises(checks.CheckpointMismatch, match="optimizer state missing after reload"):
        resume.check_resume(state, forgetful.continuation(), run.continuation(), forgetful.optimizer)
    record = state.metrics.resume
    assert record.optimizer_state_restored is False
    # the step itself was compared too: its loss is the same (the weights came back), its update is not
    assert record.step_losses == record.uninterrupted_step_losses
    assert record.tensors_differing > 0 and record.tensors_max_abs_difference > 1e-4


def test_the_step_comparison_alone_catches_the_lost_state(tmp_path):
    state, run = _state(tmp_path), _trained()
    forgetful = run.reloaded(with_optimizer_state=False)
    losses = resume.take_step(state, forgetful.continuation())
    reference = resume.take_step(state, run.continuation())
    with pytest.raises(checks.ResumeDiverged, match="parameters or optimizer state after the resumed step differ"):
        resume.check_same_step(
            state,
            losses,
            resume.model_and_optimizer_tensors(forgetful.model, forgetful.optimizer),
            reference,
            resume.model_and_optimizer_tensors(run.model, run.optimizer),
        )


def test_a_lost_scaler_state_fails(tmp_path):
    state, run = _state(tmp_path, precision="fp16-mixed"), _trained()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    resume.remember_point(state, run.optimizer, resume.scaler_state(scaler))
    fresh = torch.amp.GradScaler("cpu")  # starts at 2**16 again
    with pytest.raises(checks.CheckpointMismatch, match="grad scaler state differs after reload"):
        resume.check_restored(state, run.reloaded().optimizer, resume.scaler_state(fresh))
    assert state.metrics.resume.scaler_state_restored is False


def test_a_device_that_is_not_deterministic_is_judged_by_the_tolerance_row(tmp_path):
    """The CUDA judgement, on CPU tensors: a difference in the last bits passes, a lost state does not."""
    state, run = _state(tmp_path, device="cuda"), _trained()
    after = resume.model_and_optimizer_tensors(run.model, run.optimizer)
    nudged = {name: value + 1e-7 * value.abs() for name, value in after.items()}  # last-bits noise
    resume.check_same_step(state, [1.0], nudged, [1.0 + 1e-7], after)
    record = state.metrics.resume
    assert record.judged == "within tolerance (cuda kernels are not deterministic)"
    row = resume_tolerance(torch.float32)
    assert record.tensor_tolerance.as_dict() == row.tensors.as_dict() and record.tensors_differing == 0
    forgetful = run.reloaded(with_optimizer_state=False)
    reference = run.reloaded()
    stepper = _state(tmp_path)  # the steps run here, on the CPU, from the resume seed
    losses = resume.take_step(stepper, forgetful.continuation())
    with pytest.raises(checks.ResumeDiverged):
        resume.check_same_step(
            state,
            losses,
            resume.model_and_optimizer_tensors(forgetful.model, forgetful.optimizer),
            resume.take_step(stepper, reference.continuation()),
            resume.model_and_optimizer_tensors(reference.model, reference.optimizer),
        )
    with pytest.raises(checks.ResumeDiverged, match="loss differs"):
        resume.check_same_step(state, [1.0], after, [1.1], after)


TRAINING_ENGINES = ("torch", "accelerate", "hf-trainer", "lightning", "ddp", "fsdp2", "accelerate-fsdp2")


def test_a_silently_lost_optimizer_state_fails_every_engine(forgetful_training):
    forgetful_training(TRAINING_ENGINES)
