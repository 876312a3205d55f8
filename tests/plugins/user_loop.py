"""A team's own training loop, registered as an engine the way docs/ENGINES.md shows (-p user_loop):
autocast and a GradScaler, gradient clipping, and one torch.save checkpoint holding the model,
optimizer and scaler states. Written as such loops are written, not from the matrix's own engines.

And three twins of it with the bugs teams really ship, which the matrix's checks must catch (not
torch's own errors):

user-loop-model-only   its checkpoint keeps the model only ("the optimizer state is just
                       bookkeeping"): a resumed run starts with a fresh AdamW and GradScaler, the
                       class of accelerate#3971 and DeepSpeed#7786
user-loop-cast         "mixed" precision done as a cast: the model is moved to the autocast dtype
                       (model.to(torch.bfloat16)) and trained there, no fp32 master weights
user-loop-accumulating the gradients are never zeroed between optimizer steps: every step applies
                       the sum of all gradients so far, the class of DeepSpeed#7837 (ZeRO-0 in
                       bf16, 0.18.3 to 0.18.5). Nothing raises; only the loss curve shows it
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from matrix.engines import EngineSettings, Loop, Unsupported, register

CHECKPOINT = "checkpoint.pt"
MAX_GRAD_NORM = 1.0


@dataclass(frozen=True)
class Settings(EngineSettings):
    autocast: str | None = None  # the dtype the loop autocasts to
    grad_scaler: bool = False


@dataclass
class Run:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scaler: torch.amp.GradScaler | None = None


class UserLoop(Loop):
    name = "user-loop"
    description = "a team's own loop: autocast, GradScaler, gradient clipping, one torch.save checkpoint"
    Run = Run
    max_grad_norm = MAX_GRAD_NORM  # declared, so that the reference curves clip as this loop does

    def derive_settings(self, precision):
        if precision.grad_dtype is not None or precision.grad_accumulation > 1 or precision.reduce_dtype is not None:
            return Unsupported("Requires: [gradient accumulation, a gradient dtype or reduction in the user's loop]")
        autocast = str(precision.autocast_dtype).removeprefix("torch.") if precision.autocast_dtype else None
        return Settings(autocast=autocast, grad_scaler=precision.grad_scaler)

    def start(self, state, model, training):
        if not training:
            return Run(model)
        model.train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=state.learning_rate)
        scaler = torch.amp.GradScaler(state.device.type, enabled=state.settings.grad_scaler)
        return Run(model, optimizer, scaler)

    def autocast(self, state):
        dtype = state.settings.autocast
        return torch.autocast(state.device.type, dtype=getattr(torch, dtype or "float32"), enabled=dtype is not None)

    def step(self, state, run):
        model, optimizer, scaler = run.model, run.optimizer, run.scaler
        model.train()
        optimizer.zero_grad(set_to_none=True)
        with self.autocast(state):
            loss = state.kind.loss(model, state.batch)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], MAX_GRAD_NORM)
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped = scaler.is_enabled() and scaler.get_scale() < scale  # the scaler skipped an overflowing step
        return loss.item(), not skipped

    def evaluate(self, state, run):
        run.model.eval()
        with torch.no_grad(), self.autocast(state):
            return state.kind.evaluate(run.model, state.batch)

    def save(self, state, run, directory):
        directory.mkdir(parents=True, exist_ok=True)
        checkpoint = {"model": run.model.state_dict()}
        if run.optimizer is not None:
            checkpoint["optimizer"] = run.optimizer.state_dict()
            checkpoint["scaler"] = run.scaler.state_dict()
        torch.save(checkpoint, directory / CHECKPOINT)

    def restore(self, state, directory, training):
        checkpoint = torch.load(directory / CHECKPOINT, map_location=state.device, weights_only=True)
        model = state.fresh_model()
        model.load_state_dict(checkpoint["model"])
        run = self.start(state, model, training)
        if training and "optimizer" in checkpoint:
            run.optimizer.load_state_dict(checkpoint["optimizer"])
            run.scaler.load_state_dict(checkpoint["scaler"])
        return run


class UserLoopModelOnly(UserLoop):
    name = "user-loop-model-only"
    description = "the user's loop whose checkpoint keeps the model only (a bug: resumed runs start a fresh AdamW)"

    def save(self, state, run, directory):
        directory.mkdir(parents=True, exist_ok=True)
        torch.save({"model": run.model.state_dict()}, directory / CHECKPOINT)


class UserLoopCast(UserLoop):
    name = "user-loop-cast"
    description = "the user's loop doing 'mixed' precision as a cast to the half dtype (a bug: no fp32 master weights)"

    def start(self, state, model, training):
        if state.settings.autocast is not None:
            model = model.to(getattr(torch, state.settings.autocast))  # "bf16 training"
        return super().start(state, model, training)

    def autocast(self, state):
        return torch.autocast(state.device.type, enabled=False)  # the weights are half already


class UserLoopAccumulating(UserLoop):
    name = "user-loop-accumulating"
    description = "the user's loop that never zeroes its gradients between steps (a bug: they accumulate)"

    def step(self, state, run):
        zero_grad, run.optimizer.zero_grad = run.optimizer.zero_grad, lambda set_to_none=True: None
        try:
            return super().step(state, run)
        finally:
            run.optimizer.zero_grad = zero_grad


for engine in (UserLoop(), UserLoopModelOnly(), UserLoopCast(), UserLoopAccumulating()):
    register(engine)
