"""The torch engine written out: a hand-written loop (the precision's autocast and grad scaler,
AdamW), its checkpoint the model in the kind's own format with the optimizer's and scaler's state
beside it. Defines ENGINE for the script's phases."""


class TorchLoop:
    owns_loop = False

    def start(self, model, training):
        run = {"model": compiled_if_asked(model), "plain": model, "optimizer": None, "scaler": None}
        if training:
            model.train()
            run["optimizer"] = new_optimizer(model, DECAYED(model))
            run["scaler"] = new_scaler(CELL)
        return run

    def train(self, run, steps, seeds=None):
        model, optimizer, scaler = run["model"], run["optimizer"], run["scaler"]
        model.train()

        def step():
            taken = torch_step(CELL, model, optimizer, scaler, MAX_GRAD_NORM)
            if seeds is not None:
                seeds.step_ended(taken[1])
            return taken

        return take_steps(step, steps)

    def evaluate(self, run):
        return evaluate_in(CELL, run["model"])

    def weights(self, run):
        return run["plain"]

    def optimizer_state(self, run):
        return optimizer_tensors(run["optimizer"])

    def scaler_state(self, run):
        return None if run["scaler"] is None else run["scaler"].state_dict()

    def save(self, run, directory):
        save(run["plain"], directory)
        if run["optimizer"] is not None:
            state = {"optimizer": run["optimizer"].state_dict()}
            if run["scaler"] is not None:
                state["grad_scaler"] = run["scaler"].state_dict()
            torch.save(state, os.path.join(directory, "trainer_state.pt"))

    def export(self, run, directory, checkpoint):
        return checkpoint  # the model in its kind's own format is there already

    def restore(self, directory, training):
        model = reload(directory, CELL)
        run = {"model": compiled_if_asked(model), "plain": model, "optimizer": None, "scaler": None}
        if training:
            state = torch.load(os.path.join(directory, "trainer_state.pt"), weights_only=True, map_location=DEVICE)
            run["optimizer"] = new_optimizer(model, DECAYED(model))
            run["optimizer"].load_state_dict(state["optimizer"])
            run["scaler"] = new_scaler(CELL)
            if run["scaler"] is not None:
                run["scaler"].load_state_dict(state["grad_scaler"])
        return run


ENGINE = TorchLoop()
