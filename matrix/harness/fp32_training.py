"""fp32 training in the torch engine, as the harness measures a kind before its cells: the seeded
loss before any step (the kind's fingerprint) and the fall after a number of steps at a learning
rate, on which the learning-rate search (matrix/harness/learning_rate.py) and the fp32 twin's
recorded fall (matrix/harness/kind_traits.py) rest."""

from __future__ import annotations

from pathlib import Path

import torch

from matrix.checks import assertions as checks
from matrix.grid.cell import Cell
from matrix.grid.schedule import FIRST_FORWARD_SEED, TRAIN_STEPS
from matrix.harness.cell_state import CellState
from matrix.harness.measurements import fresh_model, generators_kept, seeded_training_loss
from matrix.harness.torch_step import take_steps, train_step
from matrix.precisions.policies import PRECISIONS


class Fp32Training:
    """How the learning-rate search measures: fp32 in the torch engine, on the CPU, as a cell
    trains (seeded_training_loss before and after TRAIN_STEPS applied steps of train_step)."""

    @staticmethod
    def state(kind, workdir: Path) -> CellState:
        from matrix.models.observation import measurement_device

        cpu = measurement_device(kind)  # the CPU, unless the kind runs only on a GPU here
        return CellState.begin(
            Cell(kind.name, "fp32", "train", cpu.type, "torch"),
            kind,
            PRECISIONS["fp32"],
            cpu,
            workdir,
            batch=kind.batch(cpu),
        )

    @staticmethod
    def loss_before(kind, workdir: Path) -> float:
        """The fp32 model's seeded training loss before any step: the kind's fingerprint."""
        state = Fp32Training.state(kind, workdir)
        return seeded_training_loss(state, fresh_model(state))

    @staticmethod
    def fall(kind, rate: float, workdir: Path, steps: int = TRAIN_STEPS):
        """fp32 training of a fresh model at `rate`, `steps` applied steps; the global generators are
        left as they were."""
        from matrix.harness.learning_rate import Fall

        state = Fp32Training.state(kind, workdir)
        model = fresh_model(state)
        before = seeded_training_loss(state, model)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=rate)
        model.train()
        with generators_kept(state):
            torch.manual_seed(FIRST_FORWARD_SEED)  # the draws every engine's first training forward makes
            try:
                take_steps(lambda: train_step(state, model, optimizer, None), steps)
            except checks.CheckFailure as failure:  # a non-finite loss, gradient or weight: this rate does not learn
                return Fall(rate, before, None, error=f"{type(failure).__name__}: {failure}")
        return Fall(rate, before, seeded_training_loss(state, model))
