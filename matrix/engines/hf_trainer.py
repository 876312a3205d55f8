"""The hf-trainer engine: the transformers Trainer with TrainingArguments (fp16/bf16 flags, use_cpu
without a GPU), train() with an evaluation and a checkpoint on its step schedule, and
resume_from_checkpoint.

The Trainer owns its loop: one train() runs the harness's whole schedule (k steps, its own
evaluation and checkpoint after step k, one step more), and a callback records what the harness
asks for after step k (matrix/engines/base.py LibraryLoop). A run resumed from the checkpoint is a
new Trainer with resume_from_checkpoint, as a new process would make it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from matrix.checks import assertions as checks
from matrix.engines.base import EngineSettings, Unsupported, one_switch_unsupported, register_with_compiled_twin
from matrix.engines.libraries.accelerate import reset_accelerate
from matrix.engines.libraries.trainer import (
    Rows,
    forward_skip_reason,
    recording,
    stack_rows,
    trainer_classes,
    training_arguments,
)
from matrix.engines.library_loop import LibraryLoop, LoopProgress
from matrix.grid.schedule import SCHEDULE
from matrix.harness.measurements import evaluate_rows, fresh_model, generators_kept
from matrix.precisions.policies import Precision
from matrix.results.metrics import UNSET

TRAINER_DIR = "trainer"  # the first run's output_dir, under the cell's shared directory
RESUMED_DIR = "resumed"  # the resumed run's


@dataclass(frozen=True)
class TrainerSettings(EngineSettings):
    fp16: bool = False
    bf16: bool = False
    torch_compile: bool | None = None  # the compiled twin: TrainingArguments(torch_compile=True)


@dataclass
class TrainerRun:
    trainer: object  # the RecordingTrainer
    progress: LoopProgress | None = None  # a training run's; None: an evaluation cell's
    resume_from: Path | None = None  # the checkpoint a resumed run starts from


@functools.cache
def _following_class():
    """The callback that follows the Trainer's run for the harness (TrainerCallback, imported
    when a cell first needs it)."""

    class Following(trainer_classes().TrainerCallback):
        def __init__(self, engine, state, run) -> None:
            self.engine, self.state, self.run = engine, state, run

        def on_train_begin(self, args, trainer_state, control, **kwargs):
            self.engine.train_began(self.state, self.run)  # the library has prepared the run: no step yet
            progress = self.run.progress
            if progress is not None and progress.resumed:
                # train() has loaded the checkpoint's weights, optimizer and scaler state
                self.engine.hold(self.state, self.run)
                progress.phase = "resumed_step"

        def on_step_end(self, args, trainer_state, control, model=None, **kwargs):
            # as a hand-written loop is checked after every optimizer step: the same bug, the same signature
            checks.check_finite_parameters(list(model.named_parameters()), "after the optimizer step")
            progress = self.run.progress
            if progress is None:
                return
            self.engine.step_ended(self.state, self.run, self.run.trainer.training_losses[-1])
            if not progress.resumed and trainer_state.global_step == SCHEDULE.steps:
                self.engine.hold(self.state, self.run)
                progress.phase = "mid_training_eval"  # its evaluation follows this step
            if trainer_state.global_step == SCHEDULE.total:
                # the Trainer evaluates and saves once more as its run ends: nothing the harness
                # compares comes after step k+1, so that work is left out
                control.should_evaluate = control.should_save = False

        def on_evaluate(self, args, trainer_state, control, metrics=None, **kwargs):
            progress = self.run.progress
            if progress is None:
                self.state.metrics.trainer_eval_loss = (metrics or {}).get("eval_loss")
            elif not progress.resumed and trainer_state.global_step == SCHEDULE.steps:
                self.state.metrics.trainer_eval_loss = (metrics or {}).get("eval_loss")
                progress.evaluation = self.engine.library_evaluation(self.state, self.run)
                progress.phase = "checkpoint_save"  # the save follows the evaluation

        def on_save(self, args, trainer_state, control, **kwargs):
            progress = self.run.progress
            if progress is not None and not progress.resumed and trainer_state.global_step == SCHEDULE.steps:
                progress.phase = "resumed_step"  # the uninterrupted run goes on with step k+1

    return Following


class HFTrainerEngine(LibraryLoop):
    name = "hf-trainer"
    description = "transformers Trainer: train() with eval/save on a step schedule, resume_from_checkpoint"
    axis_position = 2
    Run = TrainerRun
    forward_autocasts = True  # the Trainer's accelerate wraps the model's forward in its autocast
    compile_how = "TrainingArguments(torch_compile=True): the Trainer's accelerate compiles the model it prepares"
    requires = ("transformers", "accelerate")  # the Trainer refuses to start without accelerate
    max_grad_norm = 1.0  # TrainingArguments' default, which the cells keep (passed explicitly)

    def decayed_parameters(self, model) -> set[str]:
        # the Trainer's own rule (biases and norms are not decayed); the method reads nothing of
        # the Trainer but the model
        return set(trainer_classes().Trainer.get_decay_parameter_names(None, model))

    # a Trainer subclass (a user's, with its own compute_loss); None: transformers' Trainer
    trainer_class: type | None = None

    def kind_skip_reason(self, kind) -> str | None:
        return forward_skip_reason(kind)

    def derive_settings(self, precision: Precision) -> TrainerSettings | Unsupported:
        unsupported = one_switch_unsupported(self.name, "a TrainingArguments setting", precision)
        if unsupported:
            return unsupported
        return TrainerSettings(
            fp16=precision.autocast_dtype == torch.float16,
            bf16=precision.autocast_dtype == torch.bfloat16,
            torch_compile=True if self.compiled else None,
        )

    # ---------------------------------------------------------------- the Trainer

    def arguments(self, state, max_steps: int, output: Path):
        """The run's TrainingArguments (the hf-trainer-zero engines add a DeepSpeed config)."""
        return training_arguments(state, max_steps, output, rows=len(state.batch["input_ids"]))

    def make_trainer(self, state, model, max_steps: int, output: Path, run: TrainerRun) -> None:
        state.device_kind.activate(state.device)
        rows = Rows(state.batch)
        trainer_class = recording(self.trainer_class) if self.trainer_class else trainer_classes().RecordingTrainer
        run.trainer = trainer_class(
            model=model,
            args=self.arguments(state, max_steps, output),
            train_dataset=rows,
            eval_dataset=rows,
            data_collator=stack_rows,
            callbacks=[_following_class()(self, state, run)],
        )
        if state.metrics.engine_effective is UNSET:  # the cell's first Trainer; a resumed one is set up alike
            state.metrics.engine_effective = {
                "mixed_precision": run.trainer.accelerator.mixed_precision,
                "native_amp": run.trainer.accelerator.native_amp,
                "device": str(run.trainer.args.device),
            }

    def start(self, state, model, training: bool) -> TrainerRun:
        run = TrainerRun(trainer=None, progress=LoopProgress(phase="train_steps") if training else None)
        self.make_trainer(state, model, SCHEDULE.total if training else SCHEDULE.steps, self.output(state), run)
        return run

    def output(self, state, resumed: bool = False) -> Path:
        return state.shared_dir / (RESUMED_DIR if resumed else TRAINER_DIR)

    def call(self, state, run: TrainerRun, call):
        """A call of the Trainer (the hf-trainer-zero engines put their DeepSpeed config in force)."""
        return call()

    def run_loop(self, state, run: TrainerRun) -> None:
        resume = None if run.resume_from is None else str(run.resume_from)
        self.call(state, run, lambda: run.trainer.train(resume_from_checkpoint=resume))

    def evaluate_live(self, state, run: TrainerRun):
        metrics = self.call(state, run, run.trainer.evaluate)
        state.metrics.trainer_eval_loss = metrics.get("eval_loss")
        return self.library_evaluation(state, run)

    def train_began(self, state, run: TrainerRun) -> None:
        """train() has prepared the model and optimizer and takes no step yet (on_train_begin)."""

    def library_evaluation(self, state, run: TrainerRun):
        """The evaluation through the model as the Trainer holds it (its forward wrapped in the
        Trainer's autocast once train() or evaluate() prepared it): generate() too."""
        with generators_kept(state):
            return evaluate_rows(state, self.module(state, run), autocast=not self.forward_autocasts)

    def save(self, state, run: TrainerRun, directory: Path) -> None:
        if run.progress is None:
            self.call(state, run, lambda: run.trainer.save_model(str(directory)))
            return
        progress = self.ran(state, run)
        written = self.output(state) / f"checkpoint-{SCHEDULE.steps}"
        if not written.is_dir():
            self.fail(progress, "the Trainer wrote no checkpoint on its save schedule")
        if state.group.writes:  # the harness made `directory`: the Trainer's checkpoint, file by file
            for entry in written.iterdir():
                (directory / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
        state.group.barrier()

    def export(self, state, run: TrainerRun, directory: Path, checkpoint: Path) -> Path:
        return checkpoint  # the Trainer's checkpoint holds the model as save_pretrained writes it

    def restore(self, state, directory: Path, training: bool) -> TrainerRun:
        reset_accelerate()  # a resumed run is a new process
        if not training:
            run = TrainerRun(trainer=None)
            model = state.load(directory)  # the kind's own load of the saved model
            self.make_trainer(state, model, SCHEDULE.steps, self.output(state, resumed=True), run)
            return run
        run = TrainerRun(trainer=None, progress=LoopProgress(phase="checkpoint_reload", resumed=True))
        run.resume_from = directory
        self.make_trainer(state, fresh_model(state), SCHEDULE.total, self.output(state, resumed=True), run)
        return run

    def cleanup(self, state) -> None:
        reset_accelerate()  # the Trainer runs on accelerate's process-wide state

    # ---------------------------------------------------------------- what the Trainer holds

    def module(self, state, run: TrainerRun):
        if self.compiled:  # the Trainer's accelerate compiles the model it prepares: model_wrapped
            return run.trainer.model_wrapped
        return run.trainer.model

    def live_weights(self, state, run: TrainerRun):
        return run.trainer.model

    def live_optimizer_state(self, state, run: TrainerRun) -> dict:
        optimizer = run.trainer.optimizer
        return {} if optimizer is None else checks.optimizer_state(optimizer)

    def live_scaler_state(self, state, run: TrainerRun) -> dict | None:
        scaler = run.trainer.accelerator.scaler
        return None if scaler is None else scaler.state_dict()

    def live_evaluation(self, state, run: TrainerRun):
        return self.library_evaluation(state, run)

    def live_applied(self, state, run: TrainerRun) -> int:
        optimizer = run.trainer.optimizer
        if optimizer is None:
            return 0
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps one
        return max((int(entry["step"]) for entry in inner.state.values() if "step" in entry), default=0)


register_with_compiled_twin(HFTrainerEngine())
