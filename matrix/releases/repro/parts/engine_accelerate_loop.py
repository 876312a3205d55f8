"""The accelerate engine written out (and its compiled twin, accelerate-compile): an
Accelerator(mixed_precision=...) that prepares the model and AdamW (its forward autocasts and
returns fp32 outputs), accelerator.backward, evaluation through the prepared model,
save_state / load_state into a new Accelerator over a fresh model. Defines ENGINE."""


def accelerate_reset():
    """accelerate's process-wide state forgotten, as a new process starts without it."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


class AccelerateLoop:
    owns_loop = False

    def accelerator(self):
        from accelerate import Accelerator

        if DEVICE_TYPE == "cuda":
            torch.cuda.set_device(DEVICE)
        options = {"dynamo_backend": "inductor"} if COMPILED else {}  # prepare() compiles the model
        return Accelerator(mixed_precision=ENGINE_SETTINGS["mixed_precision"], cpu=DEVICE_TYPE == "cpu", **options)

    def start(self, model, training):
        accelerator = self.accelerator()
        if not training:
            return {"accelerator": accelerator, "model": accelerator.prepare(model), "optimizer": None}
        model.train()
        prepared, optimizer = accelerator.prepare(model, new_optimizer(model, DECAYED(model)))
        return {"accelerator": accelerator, "model": prepared, "optimizer": optimizer}

    def train(self, run, steps, seeds=None):
        accelerator, model, optimizer = run["accelerator"], run["model"], run["optimizer"]
        model.train()  # an evaluation left it in eval mode

        def step():
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(model, BATCH)  # the autocast comes from the prepared forward
            value = finite_loss(loss, "training loss")
            accelerator.backward(loss)
            optimizer.step()
            applied = not accelerator.optimizer_step_was_skipped
            finite_parameters(model, "after the optimizer step")
            if seeds is not None:
                seeds.step_ended(applied)
            return value, applied

        return take_steps(step, steps)

    def evaluate(self, run):
        # through the prepared model: its forward brings accelerate's autocast, none added
        return evaluate_in(CELL, run["model"], around=contextlib.nullcontext())

    def weights(self, run):
        return plain_of(run["model"])

    def exported(self, run):
        """The weights in a fresh model of the kind, without accelerate's forward wrapper."""
        copy = build(CELL)
        copy.load_state_dict(plain_of(run["model"]).state_dict())
        return copy

    def optimizer_state(self, run):
        return optimizer_tensors(run["optimizer"])

    def scaler_state(self, run):
        scaler = run["accelerator"].scaler
        return None if scaler is None else scaler.state_dict()

    def save(self, run, directory):
        run["accelerator"].save_state(directory)

    def export(self, run, directory, checkpoint):
        os.makedirs(directory, exist_ok=True)
        save(plain_of(run["model"]), directory)  # the weights as users save a model for the kind's loader
        return directory

    def restore(self, directory, training):
        accelerate_reset()  # a resumed run is a new process: a new Accelerator, then load_state
        run = self.start(build(CELL), training)
        run["accelerator"].load_state(directory)
        return run


ENGINE = AccelerateLoop()
