"""Twins of the loop docs/ENGINES.md shows (tests/plugins/docs_loop.py), each with one mistake a
user writing it makes (-p docs_loop_mistakes; it registers my-loop too).

Bugs the matrix's checks must catch:
my-loop-model-only   its checkpoint keeps the model and scaler, not the optimizer
my-loop-scaled-clip  clips the gradients before unscale_(): in fp16-mixed it clips the
                       scaled gradients, so every step is a tiny one (the loss curve shows it)

Ordinary ways of writing it that must give a verdict, never a dead worker:
my-loop-tensor-loss  step() returns the loss as a tensor (loss.detach()): taken as its float
my-loop-no-applied   step() returns the loss alone: a named failure of the cell
my-loop-eval-dict    evaluate() returns a dict, not the kind's EvalOutput: a named failure
"""

from __future__ import annotations

import torch
from docs_loop import MyLoop, autocast

from matrix.engines import register


class ModelOnly(MyLoop):
    name, description = "my-loop-model-only", "the docs' loop, its checkpoint without the optimizer"

    def save(self, state, run, directory):
        torch.save({"model": run.model.state_dict(), "scaler": run.scaler.state_dict()}, directory / "checkpoint.pt")

    def restore(self, state, directory, training):
        checkpoint = torch.load(directory / "checkpoint.pt", map_location=state.device)
        model = state.fresh_model()
        model.load_state_dict(checkpoint["model"])
        run = self.start(state, model, training)
        run.scaler.load_state_dict(checkpoint["scaler"])
        return run


class ScaledClip(MyLoop):
    name, description = "my-loop-scaled-clip", "the docs' loop, clipping before unscale_()"

    def step(self, state, run):
        run.optimizer.zero_grad()
        with autocast(state):
            loss = state.kind.loss(run.model, state.batch)
        run.scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), self.max_grad_norm)  # the scaled gradients
        scale = run.scaler.get_scale()
        run.scaler.step(run.optimizer)
        run.scaler.update()
        return loss.item(), not run.scaler.is_enabled() or run.scaler.get_scale() >= scale


class TensorLoss(MyLoop):
    name, description = "my-loop-tensor-loss", "the docs' loop, its step returning the loss tensor"

    def step(self, state, run):
        loss, applied = super().step(state, run)
        return torch.tensor(loss), applied


class NoApplied(MyLoop):
    name, description = "my-loop-no-applied", "the docs' loop, its step returning the loss alone"

    def step(self, state, run):
        return super().step(state, run)[0]


class EvalDict(MyLoop):
    name, description = "my-loop-eval-dict", "the docs' loop, its evaluate returning a dict"

    def evaluate(self, state, run):
        output = super().evaluate(state, run)
        return {"loss": output.loss, "logits": output.logits}


for engine in (ModelOnly(), ScaledClip(), TensorLoss(), NoApplied(), EvalDict()):
    register(engine)
