"""A loop the library owns (the Trainer's, Lightning's, DeepSpeed's under the Trainer), replayed to
the harness as if it paused: the loop runs once, its callbacks hold what the run had after step k
(weights, optimizer and scaler state, master weights, the library's evaluation) and record each
step, and the harness reads each part in its own phase. LibraryLoop is the Engine base such an
engine subclasses (matrix/engines/base.py says what every engine supplies)."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from matrix.checks import assertions as checks
from matrix.engines.base import Engine, Steps, loss_value, reads
from matrix.grid.schedule import SCHEDULE
from matrix.harness.compiling import plain
from matrix.harness.measurements import model_holding, same_weights_copy
from matrix.models.base import EvalOutput


def clone_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached copies, one per tensor: names that share a tensor (tied weights) share the copy."""
    copies: dict[int, torch.Tensor] = {}
    return {name: copies.setdefault(id(t), t.detach().clone()) for name, t in tensors.items()}


@dataclass
class Held:
    """What a library-owned loop held at one point of its run (after step k; or as a resumed run
    began): its weights, optimizer and scaler state, master weights, and its evaluation there."""

    weights: dict[str, torch.Tensor]
    optimizer_state: dict[str, torch.Tensor]
    scaler_state: dict | None
    master_weights: dict[str, torch.Tensor]
    evaluation: EvalOutput | None = None
    named_master_weights: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class LoopProgress:
    """A library-owned loop's training run as its callbacks recorded it. The loop runs once, when
    the harness first asks for a result of it; the harness then gets each part in its own phase:
    the first k losses and what was held after step k, the evaluation, the checkpoint, step k+1.
    A library error is raised where the harness asks for what the error prevented, tagged with
    the phase the library was in (execute.run_cell records that phase)."""

    phase: str  # the harness phase the library is in now (its callbacks advance it)
    resumed: bool = False  # a run resumed from a checkpoint: it pauses as it begins, not after step k
    losses: list[float] = field(default_factory=list)
    applied_after: list[int] = field(default_factory=list)  # optimizer steps applied after each step
    applied_before: int = 0  # applied before the loop's first step (a resumed run: the checkpoint's)
    held: Held | None = None  # after step k (a first run), or as a resumed run began
    evaluation: EvalOutput | None = None  # the library's evaluation after step k
    error: BaseException | None = None
    ran: bool = False
    handed: int = 0  # steps handed to the harness so far
    weights_model: torch.nn.Module | None = None  # held.weights as a module, made once
    # the master weights by name as the loop began (a library that makes them inside its loop)
    masters_at_start: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def paused(self) -> bool:
        """Whether the harness sees the run where the loop held it: the steps handed end there
        (a first run after step k; a resumed run before its first step)."""
        return self.held is not None and self.handed == (0 if self.resumed else SCHEDULE.steps)


class LibraryLoop(Engine):
    """A loop the library owns. A training run's `progress` is a LoopProgress; the engine's
    run_loop(state, run) runs the loop (the whole schedule for a first run, to its end for a
    resumed one), its callbacks calling hold() after step k (a resumed run: as it begins) and
    step_ended() after each step, and setting progress.evaluation to the library's evaluation.
    The harness reads the run as if it had paused after step k. An evaluation cell's run has no
    progress: its views are the live ones."""

    owns_loop = True
    resume_random_numbers = "the library's own: the checkpoint's random states, restored on resume"

    @abc.abstractmethod
    def run_loop(self, state, run) -> None:
        """Run the library's loop for this training run (its progress: run.progress)."""

    @abc.abstractmethod
    def evaluate_live(self, state, run) -> EvalOutput:
        """Evaluate an evaluation cell's run through the library."""

    @abc.abstractmethod
    def live_weights(self, state, run) -> torch.nn.Module: ...

    @abc.abstractmethod
    def live_optimizer_state(self, state, run) -> dict[str, torch.Tensor]: ...

    @abc.abstractmethod
    def live_scaler_state(self, state, run) -> dict | None: ...

    def live_master_weights(self, state, run) -> dict[str, torch.Tensor]:
        return {}

    def live_named_master_weights(self, state, run) -> dict[str, torch.Tensor]:
        return {}

    def live_evaluation(self, state, run) -> EvalOutput | None:
        """The evaluation a resumed run holds as it begins, through the library's model."""
        return None

    def live_applied(self, state, run) -> int:
        """Optimizer steps applied so far, from the optimizer's own step counts."""
        return 0

    # -- the callbacks' side

    def hold(self, state, run) -> None:
        """Record what the loop holds now (after step k; a resumed run as it begins, with its
        evaluation there)."""
        from matrix.precisions.quantization import float_tensors

        weights = plain(self.live_weights(state, run))
        held = weights.state_dict() if state.precision.quantization is None else float_tensors(weights)
        if run.progress.resumed:  # the steps it applies count from the checkpoint's
            run.progress.applied_before = self.live_applied(state, run)
        run.progress.held = Held(
            weights=clone_tensors(held),
            optimizer_state=self.live_optimizer_state(state, run),
            scaler_state=self.live_scaler_state(state, run),
            master_weights=self.live_master_weights(state, run),
            evaluation=self.live_evaluation(state, run) if run.progress.resumed else None,
            named_master_weights=self.live_named_master_weights(state, run),
        )

    def step_ended(self, state, run, loss: float) -> None:
        progress = run.progress
        loss = loss_value(loss, "the library's step")  # a callback's loss.detach() too
        applied = self.live_applied(state, run)
        before = progress.applied_after[-1] if progress.applied_after else progress.applied_before
        state.step_ended(applied=applied > before)
        progress.losses.append(loss)
        progress.applied_after.append(applied)

    # -- the harness's side

    @reads("progress")
    def ran(self, state, run) -> LoopProgress:
        """The run's progress, its loop run first if it has not run yet."""
        progress = run.progress
        if not progress.ran:
            progress.ran = True
            try:
                self.run_loop(state, run)
            except Exception as exc:  # raised where the harness asks for what it prevented
                exc.matrix_phase = progress.phase
                progress.error = exc
        return progress

    @staticmethod
    def fail(progress: LoopProgress, missing: str):
        if progress.error is not None:
            raise progress.error
        raise checks.CheckFailure(missing)

    def train(self, state, run, steps: int) -> Steps:
        """The next `steps` steps the loop ran; a resumed run hands all it ran, which the harness
        checks is the one step left (a loop that restarted from the beginning runs more)."""
        progress = self.ran(state, run)
        start, end = progress.handed, progress.handed + steps
        if len(progress.losses) < end:
            self.fail(progress, f"the library's loop ran {len(progress.losses) - start} of the {steps} steps asked for")
        if progress.resumed:
            end = len(progress.losses)
        progress.handed = end
        if progress.error is not None and (progress.resumed or end >= SCHEDULE.total):
            raise progress.error  # after its last step: the library failed as its loop ended
        before = progress.applied_after[start - 1] if start else progress.applied_before
        counts = [before, *progress.applied_after[start:end]]
        skipped = tuple(i for i in range(end - start) if counts[i + 1] == counts[i])
        return Steps(progress.losses[start:end], progress.applied_after[end - 1] - before, skipped)

    def evaluate(self, state, run) -> EvalOutput:
        if run.progress is None:
            return self.evaluate_live(state, run)
        progress = self.ran(state, run)
        evaluation = None
        if progress.paused:
            evaluation = progress.held.evaluation if progress.resumed else progress.evaluation
        if evaluation is None:
            self.fail(progress, "the library ran no evaluation on its schedule")
        return evaluation

    def _held(self, run) -> Held | None:
        """What the views read while the run is seen paused; None: the live objects. Views never
        start the loop: before it ran, the live objects are the run's state."""
        progress = run.progress
        return progress.held if progress is not None and progress.paused else None

    @reads("progress")
    def weights(self, state, run) -> torch.nn.Module:
        held = self._held(run)
        if held is None:
            return plain(self.live_weights(state, run))
        if run.progress.weights_model is None:
            run.progress.weights_model = model_holding(state, held.weights)
        return run.progress.weights_model

    @reads("progress")
    def optimizer_state(self, state, run) -> dict[str, torch.Tensor]:
        held = self._held(run)
        return self.live_optimizer_state(state, run) if held is None else held.optimizer_state

    @reads("progress")
    def scaler_state(self, state, run) -> dict | None:
        held = self._held(run)
        return self.live_scaler_state(state, run) if held is None else held.scaler_state

    @reads("progress")
    def master_weights(self, state, run) -> dict[str, torch.Tensor]:
        held = self._held(run)
        return self.live_master_weights(state, run) if held is None else held.master_weights

    @reads("progress")
    def named_master_weights(self, state, run) -> dict[str, torch.Tensor]:
        held = self._held(run)
        return self.live_named_master_weights(state, run) if held is None else held.named_master_weights

    @reads("progress")
    def named_master_weights_at_start(self, state, run) -> dict[str, torch.Tensor]:
        return {} if run.progress is None else run.progress.masters_at_start

    def exported(self, state, run) -> torch.nn.Module:
        return same_weights_copy(state, self.weights(state, run))
