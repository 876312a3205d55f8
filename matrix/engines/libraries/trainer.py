"""The transformers Trainer as the hf-trainer and hf-trainer-zero2/3 engines run it: the cell's
fixed batch as a dataset, the Trainer that records each training loss unrounded and feeds the
rows in their own order, the TrainingArguments every cell runs with (the schedule's steps, an
evaluation and a checkpoint after step k), and which model kinds it can train at all."""

from __future__ import annotations

import functools
import inspect
import tempfile
import types
from pathlib import Path

import torch

from matrix.grid.schedule import SCHEDULE
from matrix.precisions.policies import PRECISIONS


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
def trainer_classes() -> types.SimpleNamespace:
    """transformers' Trainer, TrainerCallback and TrainingArguments, and the recording Trainer,
    imported when a cell first needs them (the Trainer imports transformers' model machinery:
    about two seconds)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    return types.SimpleNamespace(
        Trainer=Trainer,
        TrainerCallback=TrainerCallback,
        TrainingArguments=TrainingArguments,
        RecordingTrainer=recording(Trainer),
    )


@functools.cache
def recording(trainer_class: type) -> type:
    """`trainer_class` (transformers' Trainer, or a user's subclass of it with its own
    compute_loss) as the harness runs it: it also keeps each training loss unrounded (logs round
    to 4 digits), and feeds the cell's rows in their own order, as every other engine feeds the
    batch (the default random sampler would permute them, and with dropout a permuted batch draws
    its masks for other rows than the torch engine's)."""

    class Recording(trainer_class):
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

    Recording.__name__ = Recording.__qualname__ = f"Recording{trainer_class.__name__}"
    return Recording


def training_arguments(state, max_steps: int, output: Path, rows: int, **overrides):
    """The TrainingArguments every cell of the Trainer runs with: the harness's schedule (an
    evaluation and a checkpoint after step k), the cell's learning rate, the precision's switch;
    `overrides` (a DeepSpeed config, per-rank batch sizes) replace or add to them."""
    arguments = dict(
        output_dir=str(output),
        max_steps=max_steps,
        per_device_train_batch_size=rows,
        per_device_eval_batch_size=rows,
        learning_rate=state.learning_rate,
        lr_scheduler_type="constant",
        weight_decay=0.01,  # torch.optim.AdamW's default, as in the torch engine
        max_grad_norm=state.engine.max_grad_norm or 0.0,  # the engine's (its library's default); 0: none
        optim="adamw_torch",
        eval_strategy="steps",
        eval_steps=SCHEDULE.steps,
        save_strategy="steps",
        save_steps=SCHEDULE.steps,
        logging_steps=1,
        report_to="none",
        use_cpu=state.device.type == "cpu",
        seed=0,
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
    )
    arguments.update(fp16=state.settings.fp16, bf16=state.settings.bf16)
    if getattr(state.settings, "torch_compile", None):
        arguments.update(torch_compile=True)
    arguments.update(overrides)
    return trainer_classes().TrainingArguments(**arguments)


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
