"""The lightning engine written out (and its compiled twin, lightning-compile: the
LightningModule's model compiled): a Lightning Trainer(precision=...) whose fit() runs the whole
schedule in one call (STEPS steps, a validation and a ModelCheckpoint save after step k, one step
more), and a resume from that checkpoint (ckpt_path). A callback records the losses, what fit()
held after step k and its validation there; the phases see the run as if it had paused after
step k. Defines ENGINE."""

import logging

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

for _name in ("lightning.pytorch", "lightning.fabric", "lightning"):
    logging.getLogger(_name).setLevel(logging.WARNING)

LIGHTNING_TOTAL = STEPS + 1  # the uninterrupted run: k steps, its validation and checkpoint, step k+1
LIGHTNING_CHECKPOINT = "checkpoint.ckpt"


class CellModule(L.LightningModule):
    """The cell's model, loss and evaluation, as a LightningModule."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.training_losses = []
        self.validation_output = None

    def training_step(self, batch, batch_idx):
        loss = loss_of(self.model, batch)
        self.training_losses.append(loss.detach().float().item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.validation_output = outputs_of(evaluate_model(self.model, batch))
        return self.validation_output[0]

    def configure_optimizers(self):
        return new_optimizer(self.model, DECAYED(self.model))


class LightningFollowing(Callback):
    """Follows fit() for the phases: each step's loss and whether it was applied, what it held
    after step k (a resumed fit: as it begins), its validation there."""

    def __init__(self, engine, run):
        self.engine, self.run = engine, run

    def on_train_start(self, trainer, pl_module):
        progress = self.run["progress"]
        if progress is not None and progress["resumed"]:
            self.engine.hold(self.run)  # fit() has restored the weights, optimizer and precision plugin

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        finite_parameters(pl_module.model, "after the optimizer step")
        progress = self.run["progress"]
        self.engine.step_ended(self.run, pl_module.training_losses[-1])
        if not progress["resumed"] and trainer.global_step == STEPS:
            self.engine.hold(self.run)

    def on_validation_end(self, trainer, pl_module):
        progress = self.run["progress"]
        if progress is not None and not progress["resumed"]:
            progress["evaluation"] = pl_module.validation_output


def lightning_loader():
    batch = {k: v.cpu() for k, v in BATCH.items()}
    return torch.utils.data.DataLoader([batch], batch_size=None)  # one fixed batch per epoch


def lightning_back_on_device(module):
    """Lightning's strategy teardown moves the module to the CPU as fit() and validate() end:
    a model of another device is moved back, as the matrix does."""
    if DEVICE_TYPE != "cpu" and all(t.device.type == "cpu" for t in module.state_dict().values()):
        module.to(DEVICE)


class LightningLoop(ReplayedLoop):
    total = LIGHTNING_TOTAL

    owns_loop = True

    def new_run(self, model, training, resumed=False):
        if COMPILED:
            model = torch.compile(model, backend=COMPILE_BACKEND)
        run = {"trainer": None, "module": CellModule(model), "progress": None, "resume_from": None}
        if training:
            run["progress"] = {
                "resumed": resumed,
                "losses": [],
                "applied_after": [],
                "applied_before": 0,
                "held": None,
                "evaluation": None,
                "error": None,
                "ran": False,
                "handed": 0,
                "seeds": None,
                "model": None,
            }
        directory = os.path.join(WORKDIR, "lightning-resumed" if resumed else "lightning")
        checkpoints = ModelCheckpoint(
            dirpath=directory, filename="checkpoint", every_n_train_steps=STEPS, save_top_k=-1
        )
        grad_mode = {} if EVAL_GRAD_MODE is None else {"inference_mode": EVAL_GRAD_MODE == "inference_mode"}
        run["trainer"] = L.Trainer(
            accelerator=DEVICE_TYPE,
            devices=[0] if DEVICE_TYPE != "cpu" else 1,
            precision=ENGINE_SETTINGS["precision"],
            max_steps=LIGHTNING_TOTAL if training else STEPS,
            check_val_every_n_epoch=STEPS,  # one batch per epoch: validation after step k
            num_sanity_val_steps=0,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[LightningFollowing(self, run), checkpoints],
            default_root_dir=WORKDIR,
            **grad_mode,
        )
        return run

    def start(self, model, training):
        return self.new_run(model, training)

    # -- the callbacks' side

    def hold(self, run):
        progress = run["progress"]
        if progress["resumed"]:  # the steps it applies count from the checkpoint's
            progress["applied_before"] = self.live_applied(run)
        weights = plain_of(run["module"].model).state_dict()
        copies = {}
        progress["held"] = {
            "weights": {name: copies.setdefault(id(t), t.detach().clone()) for name, t in weights.items()},
            "optimizer_state": self.live_optimizer_state(run),
            "scaler_state": self.live_scaler_state(run),
            "evaluation": self.live_evaluation(run) if progress["resumed"] else None,
        }

    def step_ended(self, run, loss):
        progress = run["progress"]
        applied = self.live_applied(run)
        before = progress["applied_after"][-1] if progress["applied_after"] else progress["applied_before"]
        progress["losses"].append(float(loss))
        progress["applied_after"].append(applied)
        if progress["seeds"] is not None:
            progress["seeds"].step_ended(applied > before)
            if len(progress["losses"]) >= STEPS:  # past step k the loop runs on unseeded, as in the matrix
                progress["seeds"].stop()

    def live_evaluation(self, run):
        """The resumed fit's evaluation as it begins, under the precision plugin's forward
        context as Lightning validates, of a copy of its weights (the run left as fit() holds it)."""
        copy = model_holding(plain_of(run["module"].model).state_dict()).eval()
        if COMPILED:
            copy = torch.compile(copy, backend=COMPILE_BACKEND)
        with torch.random.fork_rng(devices=RNG_DEVICES), eval_grad_mode():
            with run["trainer"].precision_plugin.forward_context():
                return outputs_of(evaluate_model(copy, BATCH))

    def live_optimizer_state(self, run):
        optimizers = run["trainer"].optimizers
        return optimizer_tensors(optimizers[0]) if optimizers else {}

    def live_scaler_state(self, run):
        scaler = getattr(run["trainer"].precision_plugin, "scaler", None)
        return None if scaler is None else scaler.state_dict()

    def live_applied(self, run):
        optimizers = run["trainer"].optimizers
        if not optimizers:
            return 0
        return max((int(entry["step"]) for entry in optimizers[0].state.values() if "step" in entry), default=0)

    # -- the phases' side

    def ran(self, run):
        """The run's progress, its fit() run first if it has not run yet; a library error is
        kept and raised where the phases ask for what it prevented."""
        progress = run["progress"]
        if not progress["ran"]:
            progress["ran"] = True
            trainer, module = run["trainer"], run["module"]
            try:
                if run["resume_from"] is None:  # the uninterrupted run: validation and save after step k
                    trainer.fit(module, train_dataloaders=lightning_loader(), val_dataloaders=lightning_loader())
                else:
                    trainer.fit(module, train_dataloaders=lightning_loader(), ckpt_path=run["resume_from"])
                lightning_back_on_device(module)
            except Exception as exc:  # raised where the phases ask for what it prevented
                progress["error"] = exc
        return progress

    def evaluate(self, run):
        progress = run["progress"]
        if progress is None:  # an evaluation cell: Lightning's validate()
            run["trainer"].validate(run["module"], dataloaders=lightning_loader(), verbose=False)
            lightning_back_on_device(run["module"])
            if run["module"].validation_output is None:
                raise CheckFailed("CheckFailure", "Lightning ran no validation")
            return run["module"].validation_output
        return self.held_evaluation(run)

    def weights(self, run):
        progress = run["progress"]
        if progress is None or not self.paused(progress):
            return plain_of(run["module"].model)
        if progress["model"] is None:
            progress["model"] = model_holding(progress["held"]["weights"])
        return progress["model"]

    def exported(self, run):
        return self.weights(run)  # the module's own model: no wrapper around its forward

    def optimizer_state(self, run):
        progress = run["progress"]
        if progress is not None and self.paused(progress):
            return progress["held"]["optimizer_state"]
        return self.live_optimizer_state(run)

    def scaler_state(self, run):
        progress = run["progress"]
        if progress is not None and self.paused(progress):
            return progress["held"]["scaler_state"]
        return self.live_scaler_state(run)

    def save(self, run, directory):
        os.makedirs(directory, exist_ok=True)
        progress = run["progress"]
        if progress is None:
            run["trainer"].save_checkpoint(os.path.join(directory, LIGHTNING_CHECKPOINT))
            return
        self.ran(run)
        folder = os.path.join(WORKDIR, "lightning")
        written = sorted(n for n in os.listdir(folder) if n.endswith(".ckpt")) if os.path.isdir(folder) else []
        if not written:
            self.fail(progress, "Lightning wrote no checkpoint")
        os.symlink(os.path.join(folder, written[0]), os.path.join(directory, LIGHTNING_CHECKPOINT))

    def export(self, run, directory, checkpoint):
        os.makedirs(directory, exist_ok=True)
        save(self.weights(run), directory)  # the weights as users save a model for the kind's loader
        return directory

    def restore(self, directory, training):
        if training:
            run = self.new_run(build(CELL), training=True, resumed=True)
            run["resume_from"] = os.path.join(directory, LIGHTNING_CHECKPOINT)
            return run
        # tensors and plain containers only: no arbitrary unpickling
        checkpoint = torch.load(os.path.join(directory, LIGHTNING_CHECKPOINT), weights_only=True, map_location=DEVICE)
        run = self.new_run(build(CELL), training=False)
        run["module"].load_state_dict(checkpoint["state_dict"])
        return run


ENGINE = LightningLoop()
