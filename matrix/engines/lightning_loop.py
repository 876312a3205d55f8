"""The lightning engine: a Lightning Trainer(precision=...) whose fit() runs the harness's schedule
with a validation loop and a ModelCheckpoint save after step k, and a resume from that checkpoint
(ckpt_path).

Lightning chooses a precision plugin from the precision string and may change it on its own
(16-mixed becomes bf16-mixed on a CPU); the cell records the plugin's effective precision.
fit() owns its loop: a callback records what the harness asks for after step k
(matrix/engines/base.py LibraryLoop).
"""

from __future__ import annotations

import functools
import logging
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from matrix.checks import assertions as checks
from matrix.engines.base import EngineSettings, Unsupported, one_switch_unsupported, register_with_compiled_twin
from matrix.engines.library_loop import LibraryLoop, LoopProgress
from matrix.grid.schedule import SCHEDULE
from matrix.harness.compiling import plain
from matrix.harness.measurements import fresh_model, generators_kept, model_holding, return_from_library_device
from matrix.precisions.policies import Precision

CHECKPOINT_FILE = "checkpoint.ckpt"
# Lightning's Strategy.teardown() ends fit() and validate() with lightning_module.cpu()
TEARDOWN_DEVICE = torch.device("cpu")


@dataclass(frozen=True)
class LightningSettings(EngineSettings):
    precision: str = "32-true"  # Lightning's precision string


@dataclass
class LightningRun:
    trainer: object  # lightning.Trainer
    module: object  # the CellModule (a LightningModule) around the cell's model
    progress: LoopProgress | None = None  # a training run's; None: an evaluation cell's
    resume_from: Path | None = None  # the checkpoint file a resumed fit starts from


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

        def __init__(self, state, model: torch.nn.Module) -> None:
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

    class Following(Callback):
        """Follows fit() for the harness."""

        def __init__(self, engine, state, run) -> None:
            self.engine, self.state, self.run = engine, state, run

        def on_train_start(self, trainer, pl_module):
            progress = self.run.progress
            if progress is not None and progress.resumed:
                # fit() has restored the checkpoint's weights, optimizer and precision plugin state
                self.engine.hold(self.state, self.run)
                progress.phase = "resumed_step"

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            # as a hand-written loop is checked after every optimizer step: the same bug, the same signature
            checks.check_finite_parameters(list(pl_module.model.named_parameters()), "after the optimizer step")
            progress = self.run.progress
            self.engine.step_ended(self.state, self.run, pl_module.training_losses[-1])
            if not progress.resumed and trainer.global_step == SCHEDULE.steps:
                self.engine.hold(self.state, self.run)
                progress.phase = "checkpoint_save"  # ModelCheckpoint saves after this callback

        def on_validation_start(self, trainer, pl_module):
            progress = self.run.progress
            if progress is not None and not progress.resumed:
                progress.phase = "mid_training_eval"

        def on_validation_end(self, trainer, pl_module):
            progress = self.run.progress
            if progress is not None and not progress.resumed:
                progress.evaluation = pl_module.validation_output
                progress.phase = "resumed_step"  # the uninterrupted run goes on with step k+1

    return types.SimpleNamespace(
        Trainer=L.Trainer, ModelCheckpoint=ModelCheckpoint, CellModule=CellModule, Following=Following
    )


class LightningEngine(LibraryLoop):
    name = "lightning"
    compiled_traits = frozenset(
        {"compiles-under-autocast"}
    )  # Lightning's precision plugin autocasts around the compiled module
    description = "Lightning Trainer(precision=...): fit with validation, ModelCheckpoint, resume"
    axis_position = 3
    Run = LightningRun
    requires = ("lightning",)
    compile_how = "the LightningModule's model compiled (self.model = torch.compile(model)), as Lightning's docs show"

    def derive_settings(self, precision: Precision) -> LightningSettings | Unsupported:
        unsupported = one_switch_unsupported(self.name, "a Lightning precision", precision)
        if unsupported:
            return unsupported
        if precision.autocast_dtype is not None:  # Lightning's mixed plugins autocast over the weights as built
            mixed = {torch.float16: "16-mixed", torch.bfloat16: "bf16-mixed"}[precision.autocast_dtype]
            return LightningSettings(precision=mixed)
        true = {torch.float32: "32-true", torch.float16: "16-true", torch.bfloat16: "bf16-true"}
        return LightningSettings(precision=true[precision.weights_dtype])

    # ---------------------------------------------------------------- Lightning's Trainer

    def _run(self, state, model, training: bool, resumed: bool = False) -> LightningRun:
        lightning = _lightning()
        if self.compiled:
            from matrix.harness.compiling import compile_module

            model = compile_module(model)
        run = LightningRun(trainer=None, module=lightning.CellModule(state, model))
        if training:
            run.progress = LoopProgress(phase="checkpoint_reload" if resumed else "train_steps", resumed=resumed)
        directory = state.shared_dir / ("lightning-resumed" if resumed else "lightning")
        grad_mode = state.kind.variant.eval_grad_mode
        checkpoints = lightning.ModelCheckpoint(
            dirpath=directory, filename="checkpoint", every_n_train_steps=SCHEDULE.steps, save_top_k=-1
        )
        run.trainer = lightning.Trainer(
            accelerator=state.device.type,  # Lightning's names for cpu, cuda, mps are torch's
            devices=[state.device.index or 0] if state.device_kind.indexed else 1,
            precision=state.settings.precision,
            max_steps=SCHEDULE.total if training else SCHEDULE.steps,
            check_val_every_n_epoch=SCHEDULE.steps,  # one batch per epoch: validation after step k
            num_sanity_val_steps=0,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[lightning.Following(self, state, run), checkpoints],
            default_root_dir=state.workdir,
            # None: Lightning's own default (validation under inference_mode)
            **({} if grad_mode is None else {"inference_mode": grad_mode == "inference_mode"}),
        )
        state.metrics.engine_effective = {
            "precision": str(run.trainer.precision),
            "plugin": type(run.trainer.precision_plugin).__name__,
        }
        return run

    @staticmethod
    def _loader(state):
        batch = {k: v.cpu() for k, v in state.batch.items()}
        return torch.utils.data.DataLoader([batch], batch_size=None)  # one fixed batch per epoch

    def start(self, state, model, training: bool) -> LightningRun:
        return self._run(state, model, training)

    def run_loop(self, state, run: LightningRun) -> None:
        if run.resume_from is None:  # the uninterrupted run: validation and the save after step k
            run.trainer.fit(run.module, train_dataloaders=self._loader(state), val_dataloaders=self._loader(state))
        else:
            run.trainer.fit(run.module, train_dataloaders=self._loader(state), ckpt_path=run.resume_from)
        when = "fit" if run.resume_from is None else "resumed fit"
        return_from_library_device(state, run.module, TEARDOWN_DEVICE, by="Lightning's strategy teardown", when=when)

    def evaluate_live(self, state, run: LightningRun):
        run.trainer.validate(run.module, dataloaders=self._loader(state), verbose=False)
        return_from_library_device(
            state, run.module, TEARDOWN_DEVICE, by="Lightning's strategy teardown", when="validate"
        )
        if run.module.validation_output is None:
            raise checks.CheckFailure("Lightning ran no validation")
        return run.module.validation_output

    def save(self, state, run: LightningRun, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        if run.progress is None:
            run.trainer.save_checkpoint(directory / CHECKPOINT_FILE)
            return
        progress = self.ran(state, run)
        written = sorted((state.shared_dir / "lightning").glob("*.ckpt"))
        if not written:
            self.fail(progress, "Lightning wrote no checkpoint")
        (directory / CHECKPOINT_FILE).symlink_to(written[0])

    def restore(self, state, directory: Path, training: bool) -> LightningRun:
        if training:
            run = self._run(state, fresh_model(state), training=True, resumed=True)
            run.resume_from = directory / CHECKPOINT_FILE
            return run
        # Tensors and plain containers only: no arbitrary unpickling.
        checkpoint = torch.load(directory / CHECKPOINT_FILE, weights_only=True, map_location=state.device)
        run = self._run(state, fresh_model(state), training=False)
        run.module.load_state_dict(checkpoint["state_dict"])
        return run

    # ---------------------------------------------------------------- what fit() holds

    def module(self, state, run: LightningRun):
        return run.module.model

    def live_weights(self, state, run: LightningRun):
        return plain(run.module.model)  # the compiled twin's model, without compile's wrapper

    def exported(self, state, run: LightningRun):
        return self.weights(state, run)  # the module's own model: no wrapper around its forward

    def live_optimizer_state(self, state, run: LightningRun) -> dict:
        optimizers = run.trainer.optimizers
        return checks.optimizer_state(optimizers[0]) if optimizers else {}

    def live_scaler_state(self, state, run: LightningRun) -> dict | None:
        scaler = getattr(run.trainer.precision_plugin, "scaler", None)
        return None if scaler is None else scaler.state_dict()

    def live_evaluation(self, state, run: LightningRun):
        """The resumed run's evaluation as it begins, under the precision plugin's own forward
        context, as Lightning validates; of a copy of its weights, so that evaluating leaves the
        run itself as fit() holds it (bitsandbytes' int8 layers keep state from a forward)."""
        from matrix.precisions.quantization import float_tensors

        model = plain(run.module.model)
        weights = model.state_dict() if state.precision.quantization is None else float_tensors(model)
        copy = model_holding(state, weights).eval()
        if self.compiled:  # evaluated as the resumed fit() would validate it: compiled
            from matrix.harness.compiling import compile_module

            copy = compile_module(copy)
        with generators_kept(state), state.eval_grad_context(), run.trainer.precision_plugin.forward_context():
            return state.kind.evaluate(copy, state.batch)

    def live_applied(self, state, run: LightningRun) -> int:
        optimizers = run.trainer.optimizers
        if not optimizers:
            return 0
        return max((int(entry["step"]) for entry in optimizers[0].state.values() if "step" in entry), default=0)


register_with_compiled_twin(LightningEngine())
