"""my_loop.py: a hand-written training loop as an engine of the matrix (docs/ENGINES.md shows
this file whole; tests/test_docs_journeys.py checks that the two agree and runs it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from matrix.engines import EngineSettings, Loop, Unsupported, register


@dataclass(frozen=True)
class Settings(EngineSettings):  # what a precision row is called in this loop; recorded per cell
    autocast: torch.dtype | None = None  # recorded by name: "bfloat16"
    grad_scaler: bool = False


@dataclass
class Run:  # what the loop keeps between the harness's calls; the harness reads these three fields
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scaler: torch.amp.GradScaler | None = None


def autocast(state):
    dtype = state.settings.autocast
    return torch.autocast(state.device.type, dtype=dtype, enabled=dtype is not None)


class MyLoop(Loop):
    name, description, Run = "my-loop", "our training loop", Run
    max_grad_norm = 1.0  # it clips: the reference curves clip alike

    def derive_settings(self, precision):
        # the *-reduce rows never get here: the harness skips them for a one-process engine
        if precision.grad_dtype is not None or precision.grad_accumulation > 1:
            return Unsupported("Requires: [gradients in their own dtype, over micro-batches, in my-loop]")
        return Settings(autocast=precision.autocast_dtype, grad_scaler=precision.grad_scaler)

    def start(self, state, model, training):
        optimizer = torch.optim.AdamW(model.parameters(), lr=state.learning_rate) if training else None
        return Run(model, optimizer, torch.amp.GradScaler(state.device.type, enabled=state.settings.grad_scaler))

    def step(self, state, run):
        run.optimizer.zero_grad()
        with autocast(state):
            loss = state.kind.loss(run.model, state.batch)
        run.scaler.scale(loss).backward()
        run.scaler.unscale_(run.optimizer)
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), self.max_grad_norm)
        scale = run.scaler.get_scale()
        run.scaler.step(run.optimizer)
        run.scaler.update()
        applied = not run.scaler.is_enabled() or run.scaler.get_scale() >= scale  # a skipped step lowers the scale
        return loss.item(), applied

    def evaluate(self, state, run):
        run.model.eval()
        with torch.no_grad(), autocast(state):
            return state.kind.evaluate(run.model, state.batch)

    def save(self, state, run, directory):
        checkpoint = {"model": run.model.state_dict(), "scaler": run.scaler.state_dict()}
        if run.optimizer is not None:
            checkpoint["optimizer"] = run.optimizer.state_dict()
        torch.save(checkpoint, directory / "checkpoint.pt")

    def restore(self, state, directory, training):
        checkpoint = torch.load(directory / "checkpoint.pt", map_location=state.device)
        model = state.fresh_model()
        model.load_state_dict(checkpoint["model"])
        run = self.start(state, model, training)
        if training:
            run.optimizer.load_state_dict(checkpoint["optimizer"])
        run.scaler.load_state_dict(checkpoint["scaler"])
        return run


register(MyLoop())
