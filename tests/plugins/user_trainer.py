"""A team's Trainer subclass, with its own compute_loss, registered as an engine the way
docs/ENGINES.md shows (-p user_trainer): the Trainer owns the loop, the harness runs it through
the hf-trainer engine's machinery and checks it like any other engine.

And two twins of it with the bugs teams really ship, which the matrix's checks must catch:

user-trainer-model-only  TrainingArguments(save_only_model=True), to keep checkpoints small; a
                         run resumed from one starts with a fresh optimizer and grad scaler
user-trainer-cast        the model loaded in the half dtype and handed to Trainer(bf16=True) or
                         (fp16=True): "mixed" precision without fp32 master weights
"""

from __future__ import annotations

import torch
from transformers import Trainer

from matrix.engines import register
from matrix.engines.hf_trainer import HFTrainerEngine
from matrix.models.causal_lm import CausalLMKind


class FloatLossTrainer(Trainer):
    """Computes the causal LM loss itself, from the logits upcast to fp32, as teams do for a loss
    that stays stable under bf16 autocast."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        outputs = model(**{key: value for key, value in inputs.items() if key != "labels"})
        logits = outputs.logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        return (loss, outputs) if return_outputs else loss


class UserTrainer(HFTrainerEngine):
    name = "user-trainer"
    description = "a team's Trainer subclass with its own compute_loss (fp32 loss from the logits)"
    trainer_class = FloatLossTrainer

    def kind_skip_reason(self, kind):
        if not isinstance(kind, CausalLMKind):
            return f"Requires: [a causal LM] (the user's compute_loss shifts labels; {kind.name} is not one)"
        return super().kind_skip_reason(kind)


class UserTrainerModelOnly(UserTrainer):
    name = "user-trainer-model-only"
    description = "the user's Trainer saving the model only (save_only_model=True): resumed runs start a fresh AdamW"

    def arguments(self, state, max_steps, output):
        arguments = super().arguments(state, max_steps, output)
        arguments.save_only_model = True  # "checkpoints a third the size"
        return arguments


class UserTrainerCast(UserTrainer):
    name = "user-trainer-cast"
    description = "the user's Trainer given a model cast to the half dtype under bf16=True / fp16=True"

    def start(self, state, model, training):
        if state.settings.bf16:
            model = model.to(torch.bfloat16)
        elif state.settings.fp16:
            model = model.to(torch.float16)
        return super().start(state, model, training)


for engine in (UserTrainer(), UserTrainerModelOnly(), UserTrainerCast()):
    register(engine)
