"""What every training cell runs, in every engine: how many optimizer steps before the checkpoint,
how many after the resume, how many attempts a grad scaler may skip, and the seeds that give
every engine's first training forward, and both sides of the resumed step, the same random
numbers. A library that owns its loop (the Trainer, Lightning) is configured from this; a
hand-written loop is driven by it (matrix/harness/pipeline.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

TRAIN_STEPS = 3  # optimizer steps applied before the checkpoint (step k), unless a run asks for a longer curve
# A run's longer loss curve (--curve-steps N, matrix/results/curves.py): step k is N in every training
# cell of the run. An environment variable, so that the ranks of a distributed engine (processes
# started by the run) train the same number of steps.
CURVE_STEPS_VARIABLE = "MATRIX_CURVE_STEPS"
# and the directory of saved initial weights every model of the run starts from (--initial-weights,
# matrix/models/initial_weights.py), alike
INITIAL_WEIGHTS_VARIABLE = "MATRIX_INITIAL_WEIGHTS"
RESUMED_STEPS = 1  # steps taken after it, on the resumed run and on the uninterrupted one (step k+1)
# GradScaler starts at 2**16 and halves the scale on every overflow, skipping that step by
# design; on these tiny models the first few fp16 steps overflow. Attempts are capped so a
# scaler that never recovers is a failure, not a hang.
MAX_STEP_ATTEMPTS = 16
# The random numbers of the first training forward (dropout masks) are drawn from this seed in
# every engine, and in the torch engine's yardstick: the cross-engine check compares losses
# computed from the same draws (measurements.seed_first_training_forward).
FIRST_FORWARD_SEED = 20261123
RESUME_SEED = 20261125  # the global generator's seed before step k+1 of a hand-written loop, on both sides


def train_steps() -> int:
    """Step k of this run: TRAIN_STEPS, or the curve length the run asked for."""
    given = os.environ.get(CURVE_STEPS_VARIABLE)
    return int(given) if given else TRAIN_STEPS


def forward_seed(step: int, micro: int = 0) -> int:
    """The seed of a training cell's forward of micro-batch `micro` (0-based) in the attempt at
    step `step` (the steps applied before it) within its first train_steps() steps: every engine's
    forwards, and the reference curves', draw the same dropout masks step by step, whichever
    attempts a grad scaler skipped."""
    return FIRST_FORWARD_SEED + 1000 * step + micro


@dataclass(frozen=True)
class Schedule:
    """A training cell's run as a library that owns its loop is told it: `steps` steps, its own
    evaluation and checkpoint after the last of them, then `then` steps more, all in one run
    (the uninterrupted run); a run resumed from that checkpoint runs to the same end."""

    then: int = RESUMED_STEPS

    @property
    def steps(self) -> int:
        return train_steps()

    @property
    def total(self) -> int:
        return self.steps + self.then


SCHEDULE = Schedule()
