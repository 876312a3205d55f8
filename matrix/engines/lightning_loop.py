"""The lightning engine: a Lightning Trainer(precision=...) with a validation loop, a
ModelCheckpoint save and a resume from it (ckpt_path).

Lightning chooses a precision plugin from the precision string and may change it on its own
(16-mixed becomes bf16-mixed on a CPU); the cell records the plugin's effective precision.
Trainer.fit() runs several phases in one call; a callback follows which one it is in.
"""

from __future__ import annotations

import functools
import logging
import types

import torch

from matrix import checks, resume
from matrix.engines.base import Engine, Unsupported, one_switch_unsupported, register, run_tagged
from matrix.phases import (
    TRAIN_STEPS,
    CellState,
    check_against_fp32,
    check_agrees_with_torch_engine,
    check_reload,
    check_resumed_one_step,
    check_training_contract,
    fresh_model,
    record_library_steps,
    return_from_library_device,
    seed_first_training_forward,
    snapshot_trainable,
)
from matrix.precisions import Precision


@functools.cache
def _lightning() -> types.SimpleNamespace:
    """Lightning, and this engine's subclasses of its classes, imported when a cell first runs
    here: importing Lightning costs over two seconds, which a process that runs no Lightning
    cell does not pay."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    for _name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(_name).setLevel(logging.WARNING)  # "GPU available: False ..." per cell

    class CellModule(L.LightningModule):
        """The cell's model, loss and evaluation, as a LightningModule."""

        def __init__(self, state: CellState, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model
            self.cell_state = state
            self.training_losses: list[float] = []
            self.validation_output = None

        def training_step(self, batch, batch_idx):
            loss = self.cell_state.kind.loss(self.model, batch)
            self.training_losses.append(loss.detach().float().item())
            return loss

        def validation_step(self, batch, batch_idx):
            self.validation_output = self.cell_state.kind.evaluate(self.model, batch)  # generate() too
            return self.validation_output.loss

        def configure_optimizers(self):
            return self.cell_state.new_optimizer(self.model)

    class PhaseTracker(Callback):
        def __init__(self, first_phase: str) -> None:
            self.first_phase = self.phase = first_phase
            self.optimizer_at_start = None  # the optimizer's state as fit() set it up (resumed: loaded)
            self.scaler_state_at_start = None

        def on_train_start(self, trainer, pl_module):
            # after fit() restored the checkpoint's optimizer and precision plugin state
            self.optimizer_at_start = checks.optimizer_state(trainer.optimizers[0])
            self.scaler_state_at_start = resume.scaler_state(getattr(trainer.precision_plugin, "scaler", None))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.phase = self.first_phase

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            # as the torch engine checks after every optimizer step: the same bug, the same signature
            checks.check_finite_parameters(list(pl_module.model.named_parameters()), "after the optimizer step")

        def on_validation_start(self, trainer, pl_module):
            self.phase = "evaluate" if self.first_phase == "evaluate" else "mid_training_eval"

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            self.phase = "checkpoint_save"

    return types.SimpleNamespace(
        Trainer=L.Trainer, ModelCheckpoint=ModelCheckpoint, CellModule=CellModule, PhaseTracker=PhaseTracker
    )


# Lightning's Strategy.teardown() ends fit() and validate() with lightning_module.cpu()
TEARDOWN_DEVICE = torch.device("cpu")


def _after_teardown(state: CellState, module, when: str) -> None:
    return_from_library_device(state, module, TEARDOWN_DEVICE, by="Lightning's strategy teardown", when=when)


def _loader(state: CellState):
    batch = {k: v.cpu() for k, v in state.batch.items()}
    return torch.utils.data.DataLoader([batch], batch_size=None)  # one fixed batch per epoch


def _trainer(state: CellState, max_steps: int, first_phase: str, directory: str = "lightning"):
    lightning = _lightning()
    tracker = lightning.PhaseTracker(first_phase)
    grad_mode = state.kind.variant.eval_grad_mode
    checkpoints = lightning.ModelCheckpoint(
        dirpath=state.workdir / directory, filename="checkpoint", every_n_train_steps=TRAIN_STEPS, save_top_k=-1
    )
    trainer = lightning.Trainer(
        accelerator=state.device.type,  # Lightning's names for cpu, cuda, mps are torch's
        devices=[state.device.index or 0] if state.device_kind.indexed else 1,
        precision=state.metrics.engine_settings["precision"],
        max_steps=max_steps,
        check_val_every_n_epoch=TRAIN_STEPS,  # one batch per epoch: validation after step 3
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[tracker, checkpoints],
        default_root_dir=state.workdir,
        # None: Lightning's own default (validation under inference_mode)
        **({} if grad_mode is None else {"inference_mode": grad_mode == "inference_mode"}),
    )
    state.engine_state.update(trainer=trainer, tracker=tracker)
    state.metrics.engine_effective = {
        "precision": str(trainer.precision),
        "plugin": type(trainer.precision_plugin).__name__,
    }
    return trainer


def _evaluate_as_lightning(state: CellState, model):
    """Evaluation under the precision plugin's own forward context, as Lightning validates."""
    model.eval()
    with state.eval_grad_context(), state.engine_state["trainer"].precision_plugin.forward_context():
        return state.kind.evaluate(model, state.batch)


def _checkpoint_file(state: CellState):
    found = sorted((state.workdir / "lightning").glob("*.ckpt"))
    if not found:
        raise checks.CheckFailure("Lightning wrote no checkpoint")
    return found[0]


def train_steps(state: CellState) -> None:
    state.build()
    trainable, dtypes = snapshot_trainable(state.model, state.kind), checks.tensor_dtypes(state.model)
    module = _lightning().CellModule(state, state.model)
    trainer = _trainer(state, TRAIN_STEPS, "train_steps")
    state.engine_state["module"] = module
    run_tagged(
        lambda: trainer.fit(module, train_dataloaders=_loader(state), val_dataloaders=_loader(state)),
        state.engine_state["tracker"],
    )
    _after_teardown(state, module, "fit")
    state.metrics.train_losses = module.training_losses
    record_library_steps(state, trainer.optimizers[0], trainer.global_step)
    for loss in module.training_losses:
        checks.check_finite_loss(torch.tensor(loss), "training loss")
    check_training_contract(state, state.model, trainable, dtypes)
    check_agrees_with_torch_engine(state, module.training_losses[0], "train")


def mid_training_eval(state: CellState) -> None:
    output = state.engine_state["module"].validation_output
    if output is None:
        raise checks.CheckFailure("Lightning ran no validation during fit")
    check_against_fp32(state, output, "mid-training eval")


def evaluate(state: CellState) -> None:
    state.build()
    module = _lightning().CellModule(state, state.model)
    trainer = _trainer(state, TRAIN_STEPS, "evaluate")
    state.engine_state["module"] = module
    run_tagged(
        lambda: trainer.validate(module, dataloaders=_loader(state), verbose=False), state.engine_state["tracker"]
    )
    _after_teardown(state, module, "validate")
    check_against_fp32(state, module.validation_output, "eval")
    check_agrees_with_torch_engine(state, module.validation_output.loss.float().item(), "eval")


def checkpoint_save(state: CellState) -> None:
    if state.cell.mode == "eval":
        (state.workdir / "lightning").mkdir(parents=True, exist_ok=True)
        trainer = state.engine_state["trainer"]
        run_tagged(
            lambda: trainer.save_checkpoint(state.workdir / "lightning" / "checkpoint.ckpt"),
            state.engine_state["tracker"],
        )
    state.metrics.checkpoint_files = [_checkpoint_file(state).name]
    state.outputs_before_save = _evaluate_as_lightning(state, state.model).logits
    if state.cell.mode == "train":  # ModelCheckpoint saved at the end of the last step: what fit() left
        trainer = state.engine_state["trainer"]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        resume.remember_point(state, trainer.optimizers[0], resume.scaler_state(scaler))


def checkpoint_reload(state: CellState) -> None:
    # Tensors and plain containers only: no arbitrary unpickling.
    checkpoint = torch.load(_checkpoint_file(state), weights_only=True, map_location=state.device)
    reloaded = state.kind.build(state.precision, state.device, state.workdir)
    _lightning().CellModule(state, reloaded).load_state_dict(checkpoint["state_dict"])
    check_reload(state, reloaded, evaluate=_evaluate_as_lightning)
    state.engine_state["reloaded"] = reloaded


def resumed_step(state: CellState) -> None:
    model = state.kind.build(state.precision, state.device, state.workdir)
    module = _lightning().CellModule(state, model)
    trainer = _trainer(state, TRAIN_STEPS + 1, "resumed_step")
    tracker = state.engine_state["tracker"]
    path = _checkpoint_file(state)
    run_tagged(lambda: trainer.fit(module, train_dataloaders=_loader(state), ckpt_path=path), tracker)
    _after_teardown(state, module, "resumed fit")
    state.metrics.resumed_losses = module.training_losses
    check_resumed_one_step(state, module.training_losses, state.engine_state["reloaded"], model)

    def uninterrupted():  # TRAIN_STEPS + 1 steps from the start, validation and save included
        again = fresh_model(state)
        seed_first_training_forward(state, again)  # the first forward's draws, as in train_steps
        whole = _lightning().CellModule(state, again)
        run = _trainer(state, TRAIN_STEPS + 1, "resumed_step", directory="uninterrupted")
        run.fit(whole, train_dataloaders=_loader(state), val_dataloaders=_loader(state))
        _after_teardown(state, whole, "uninterrupted fit")
        return whole.training_losses[TRAIN_STEPS:], resume.model_and_optimizer_tensors(again, run.optimizers[0])

    resume.check_library_resume(
        state,
        (tracker.optimizer_at_start, tracker.scaler_state_at_start),
        module.training_losses,
        resume.model_and_optimizer_tensors(model, trainer.optimizers[0]),
        uninterrupted,
        "Lightning's own: whatever fit() restores from its checkpoint",
    )


class LightningEngine(Engine):
    name = "lightning"
    description = "Lightning Trainer(precision=...): fit with validation, ModelCheckpoint, resume"

    axis_position = 3
    train_steps = staticmethod(train_steps)
    mid_training_eval = staticmethod(mid_training_eval)
    checkpoint_save = staticmethod(checkpoint_save)
    checkpoint_reload = staticmethod(checkpoint_reload)
    resumed_step = staticmethod(resumed_step)
    evaluate = staticmethod(evaluate)

    def derive_settings(self, precision: Precision) -> dict | Unsupported:
        unsupported = one_switch_unsupported(self.name, "a Lightning precision", precision)
        if unsupported:
            return unsupported
        if precision.autocast_dtype is not None:  # Lightning's mixed plugins autocast over the weights as built
            return {"precision": {torch.float16: "16-mixed", torch.bfloat16: "bf16-mixed"}[precision.autocast_dtype]}
        true = {torch.float32: "32-true", torch.float16: "16-true", torch.bfloat16: "bf16-true"}
        return {"precision": true[precision.weights_dtype]}

    def cleanup(self, state: CellState) -> None:
        state.engine_state.clear()


register(LightningEngine())
