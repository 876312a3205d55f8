"""What every training cell runs, in every engine: how many optimizer steps before the checkpoint,
how many after the resume, how many attempts a grad scaler may skip, and the seeds that give
every engine's first training forward, and both sides of the resumed step, the same random
numbers. A library that owns its loop (the Trainer, Lightning) is configured from this; a
hand-written loop is driven by it (matrix/pipeline.py)."""

from __future__ import annotations

from dataclasses import dataclass

TRAIN_STEPS = 3  # optimizer steps applied before the checkpoint (step k)
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


@dataclass(frozen=True)
class Schedule:
    """A training cell's run as a library that owns its loop is told it: `steps` steps, its own
    evaluation and checkpoint after the last of them, then `then` steps more, all in one run
    (the uninterrupted run); a run resumed from that checkpoint runs to the same end."""

    steps: int = TRAIN_STEPS
    then: int = RESUMED_STEPS

    @property
    def total(self) -> int:
        return self.steps + self.then


SCHEDULE = Schedule()
