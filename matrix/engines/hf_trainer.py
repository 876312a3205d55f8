"""The hf-trainer engine: transformers Trainer + TrainingArguments (fp16/bf16 flags, use_cpu
without a GPU, evaluation and saving on a step schedule, resume_from_checkpoint).

Trainer.train() runs several phases in one call (steps, then evaluation and a checkpoint at
step 3); a callback follows which one it is in, so a failure is attributed to its phase.
"""

from __future__ import annotations

import functools
import inspect
import tempfile
import types
from contextlib import nullcontext
from pathlib import Path

import torch

from matrix import checks, resume
from matrix.engines.accelerate_loop import reset_accelerate
from matrix.engines.base import Engine, Unsupported, one_switch_unsupported, register, run_tagged
from matrix.phases import (
    TRAIN_STEPS,
    CellState,
    check_against_fp32,
    check_agrees_with_torch_engine,
    check_reload,
    check_resumed_one_step,
    check_training_contract,
    evaluate_in_precision,
    fresh_model,
    record_library_steps,
    same_weights_copy,
    seed_first_training_forward,
    snapshot_trainable,
)
from matrix.precisions import PRECISIONS, Precision
from matrix.results.metrics import UNSET, given


class Rows(torch.utils.data.Dataset):
    """The cell's fixed batch as a dataset of rows; the collator stacks them back."""

    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.rows = [{k: v[i].cpu() for k, v in batch.items()} for i in range(len(next(iter(batch.values()))))]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


def stack_rows(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


@functools.cache
def _trainer_classes() -> types.SimpleNamespace:
    """transformers' Trainer, and this engine's subclasses of its classes, imported when a cell
    first runs here (the Trainer imports transformers' model machinery: about two seconds)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class PhaseTracker(TrainerCallback):
        """Which of the cell's phases Trainer.train() is in."""

        def __init__(self) -> None:
            self.phase = "train_steps"
            self.eval_metrics: dict | None = None
            self.trainer = None  # the Trainer it follows (_trainer sets it)
            self.optimizer_at_begin = None  # the optimizer's state as train() set it up (resumed: loaded)
            # how the optimizer's and the loss scaler's state are read: torch's optimizer and
            # accelerate's GradScaler, or another engine's own (DeepSpeed's)
            self.optimizer_state_of = lambda trainer: checks.optimizer_state(trainer.optimizer)
            self.scaler_state_of = lambda trainer: resume.scaler_state(trainer.accelerator.scaler)

        def on_train_begin(self, args, state, control, **kwargs):
            # after train() set up the optimizer and, resuming, loaded its state and the scaler's
            self.optimizer_at_begin = self.optimizer_state_of(self.trainer)
            self.scaler_state_at_begin = self.scaler_state_of(self.trainer)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            # as the torch engine checks after every optimizer step: the same bug, the same signature
            checks.check_finite_parameters(list(model.named_parameters()), "after the optimizer step")
            if args.eval_steps and state.global_step % args.eval_steps == 0:
                self.phase = "mid_training_eval"  # evaluation follows this step

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            self.eval_metrics = dict(metrics or {})
            self.phase = "checkpoint_save"  # the save follows the evaluation

        def on_save(self, args, state, control, **kwargs):
            self.phase = "train_steps"

    class RecordingTrainer(Trainer):
        """The real Trainer; it also keeps each training loss unrounded (logs round to 4 digits),
        and feeds the cell's rows in their own order, as every other engine feeds the batch (its
        default random sampler would permute them, and with dropout a permuted batch draws its
        masks for other rows than the torch engine's)."""

        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.training_losses: list[float] = []

        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            if model.training:
                value = loss[0] if isinstance(loss, tuple) else loss
                self.training_losses.append(value.detach().float().item())
            return loss

    return types.SimpleNamespace(
        TrainingArguments=TrainingArguments, PhaseTracker=PhaseTracker, RecordingTrainer=RecordingTrainer
    )


@functools.cache
def _forward_parameters(kind_type: type, kind_name: str) -> tuple[set[str], bool, set[str]]:
    from matrix.models import MODELS

    kind = MODELS[kind_name]
    with torch.random.fork_rng(devices=[]), tempfile.TemporaryDirectory() as workdir:
        model = kind.build(PRECISIONS["fp32"], torch.device("cpu"), Path(workdir))
    parameters = inspect.signature(model.forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return set(parameters), takes_any, set(kind.batch(torch.device("cpu")))


def forward_skip_reason(kind) -> str | None:
    """The Trainer calls model(**batch) with the labels in the batch and trains on the loss the
    model returns: a kind whose forward does not take the batch's keys cannot be trained by it."""
    if kind.skip_reason("cpu"):  # it cannot be built here at all: its own reason says why
        return None
    names, takes_any, keys = _forward_parameters(type(kind), kind.name)
    missing = sorted(keys - names) if not takes_any else []
    if missing:
        return (
            "Requires: [a model whose forward(**batch) takes the batch's keys, labels included, and returns the "
            f"loss] ({kind.name}'s forward does not take {', '.join(missing)})"
        )
    return None


def _arguments(state: CellState, max_steps: int, output: str, **overrides):
    """The TrainingArguments every cell of the Trainer runs with; `overrides` (a DeepSpeed config,
    per-rank batch sizes) replace or add to them."""
    rows = len(state.engine_state["rows"])
    arguments = dict(
        output_dir=str(state.workdir / output),
        max_steps=max_steps,
        per_device_train_batch_size=rows,
        per_device_eval_batch_size=rows,
        learning_rate=state.learning_rate,
        lr_scheduler_type="constant",
        weight_decay=0.01,  # torch.optim.AdamW's default, as in the torch engine
        optim="adamw_torch",
        eval_strategy="steps",
        eval_steps=TRAIN_STEPS,
        save_strategy="steps",
        save_steps=TRAIN_STEPS,
        logging_steps=1,
        report_to="none",
        use_cpu=state.device.type == "cpu",
        seed=0,
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
    )
    arguments.update({k: v for k, v in state.metrics.engine_settings.items() if k in ("fp16", "bf16")})
    arguments.update(overrides)
    return _trainer_classes().TrainingArguments(**arguments)


def _trainer(state: CellState, model, max_steps: int, output: str = "trainer", **overrides):
    state.device_kind.activate(state.device)
    rows = state.engine_state.setdefault("rows", Rows(state.batch))
    tracker = _trainer_classes().PhaseTracker()
    trainer = _trainer_classes().RecordingTrainer(
        model=model,
        args=_arguments(state, max_steps, output, **overrides),
        train_dataset=rows,
        eval_dataset=rows,
        data_collator=stack_rows,
        callbacks=[tracker],
    )
    tracker.trainer = trainer
    state.engine_state.update(trainer=trainer, tracker=tracker)
    if state.metrics.engine_effective is UNSET:  # the cell's first Trainer; a resumed one is set up alike
        state.metrics.engine_effective = {
            "mixed_precision": trainer.accelerator.mixed_precision,
            "native_amp": trainer.accelerator.native_amp,
            "device": str(trainer.args.device),
        }
    return trainer


def _evaluate_through_trainer_model(state: CellState):
    model = state.engine_state["trainer"].model
    model.eval()
    with state.eval_grad_context():
        return state.kind.evaluate(model, state.batch)


def train_steps(state: CellState) -> None:
    state.build()
    trainable, dtypes = snapshot_trainable(state.model, state.kind), checks.tensor_dtypes(state.model)
    trainer = _trainer(state, state.model, TRAIN_STEPS)
    run_tagged(trainer.train, state.engine_state["tracker"])
    state.metrics.train_losses = trainer.training_losses
    record_library_steps(state, trainer.optimizer, trainer.state.global_step)
    for loss in trainer.training_losses:
        checks.check_finite_loss(torch.tensor(loss), "training loss")
    check_training_contract(state, state.model, trainable, dtypes)
    check_agrees_with_torch_engine(state, trainer.training_losses[0], "train")


def mid_training_eval(state: CellState) -> None:
    metrics = state.engine_state["tracker"].eval_metrics
    if metrics is None:
        raise checks.CheckFailure("the Trainer ran no evaluation on its step schedule")
    state.metrics.trainer_eval_loss = metrics.get("eval_loss")
    check_against_fp32(state, _evaluate_through_trainer_model(state), "mid-training eval")


def evaluate(state: CellState) -> None:
    state.build()
    trainer = _trainer(state, state.model, TRAIN_STEPS)
    tracker = state.engine_state["tracker"]
    tracker.phase = "evaluate"
    metrics = run_tagged(trainer.evaluate, tracker)
    state.metrics.trainer_eval_loss = metrics.get("eval_loss")
    result = _evaluate_through_trainer_model(state)  # generate() too, for gemma-cache
    check_against_fp32(state, result, "eval")
    check_agrees_with_torch_engine(state, result.loss.float().item(), "eval")


# how the Trainer's resumed step and its uninterrupted twin get the same random numbers
TRAINER_RANDOM_NUMBERS = "the Trainer's own: the checkpoint's random states, restored on resume"


def _checkpoint_dir(state: CellState):
    if state.cell.mode == "train":
        return state.workdir / "trainer" / f"checkpoint-{TRAIN_STEPS}"
    return state.workdir / "saved-model"


def checkpoint_save(state: CellState) -> None:
    if state.cell.mode == "eval":
        state.engine_state["trainer"].save_model(str(_checkpoint_dir(state)))
    directory = _checkpoint_dir(state)
    if not directory.is_dir():
        raise checks.CheckFailure("the Trainer wrote no checkpoint on its save schedule")
    state.metrics.checkpoint_files = sorted(p.name for p in directory.iterdir())
    if state.cell.mode == "train":  # the Trainer saved at the end of its last step: what it holds now
        trainer = state.engine_state["trainer"]
        resume.remember_point(state, trainer.optimizer, resume.scaler_state(trainer.accelerator.scaler))
    # outputs of the same weights without the Trainer's forward wrapper, to compare with a reload
    state.outputs_before_save = _evaluate_as_trainer_ran(state, same_weights_copy(state, state.model)).logits


def _evaluate_as_trainer_ran(state: CellState, model):
    """Evaluation under the autocast the Trainer really used (observed in its forward), which
    can differ from the precision's: on a CPU, fp16 mixed precision runs without autocast."""
    observed = given(state.metrics.effective.autocast_dtype_in_forward, "not observed")
    if observed == "not observed":
        return evaluate_in_precision(state, model)
    model.eval()
    context = torch.autocast(state.device_type, dtype=getattr(torch, observed)) if observed else nullcontext()
    with state.eval_grad_context(), context:
        return state.kind.evaluate(model, state.batch)


def checkpoint_reload(state: CellState) -> None:
    reloaded = state.kind.load(_checkpoint_dir(state), state.precision, state.device, state.workdir)
    check_reload(state, reloaded, evaluate=_evaluate_as_trainer_ran)
    state.engine_state["reloaded"] = reloaded


def resumed_step(state: CellState) -> None:
    reset_accelerate(state)  # a resumed run is a new process
    model = state.kind.build(state.precision, state.device, state.workdir)
    trainer = _trainer(state, model, TRAIN_STEPS + 1)
    tracker = state.engine_state["tracker"]
    run_tagged(lambda: trainer.train(resume_from_checkpoint=str(_checkpoint_dir(state))), tracker)
    state.metrics.resumed_losses = trainer.training_losses
    check_resumed_one_step(state, trainer.training_losses, state.engine_state["reloaded"], model)

    def uninterrupted():  # TRAIN_STEPS + 1 steps from the start, with the same schedule
        reset_accelerate(state)
        again = fresh_model(state)
        seed_first_training_forward(state, again)  # the first forward's draws, as in train_steps
        run = _trainer(state, again, TRAIN_STEPS + 1, output="uninterrupted")
        run.train()
        return run.training_losses[TRAIN_STEPS:], resume.model_and_optimizer_tensors(again, run.optimizer)

    resume.check_library_resume(
        state,
        (tracker.optimizer_at_begin, tracker.scaler_state_at_begin),
        trainer.training_losses,
        resume.model_and_optimizer_tensors(model, trainer.optimizer),
        uninterrupted,
        TRAINER_RANDOM_NUMBERS,
    )


class HFTrainerEngine(Engine):
    name = "hf-trainer"
    description = "transformers Trainer: train() with eval/save on a step schedule, resume_from_checkpoint"

    axis_position = 2
    train_steps = staticmethod(train_steps)
    mid_training_eval = staticmethod(mid_training_eval)
    checkpoint_save = staticmethod(checkpoint_save)
    checkpoint_reload = staticmethod(checkpoint_reload)
    resumed_step = staticmethod(resumed_step)
    evaluate = staticmethod(evaluate)

    def kind_skip_reason(self, kind) -> str | None:
        return forward_skip_reason(kind)

    def derive_settings(self, precision: Precision) -> dict | Unsupported:
        unsupported = one_switch_unsupported(self.name, "a TrainingArguments setting", precision)
        if unsupported:
            return unsupported
        return {"fp16": precision.autocast_dtype == torch.float16, "bf16": precision.autocast_dtype == torch.bfloat16}

    def cleanup(self, state: CellState) -> None:
        reset_accelerate(state)  # the Trainer runs on accelerate's process-wide state
        state.engine_state.clear()


register(HFTrainerEngine())
