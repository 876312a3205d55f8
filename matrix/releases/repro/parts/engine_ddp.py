"""The ddp engine written out (matrix/engines/ddp.py): torch DistributedDataParallel on the ranks'
process group, each rank training on its rows with the precision's autocast and GradScaler, a
communication hook where the precision reduces gradients in half precision; the checkpoint the
torch loop's format, written by rank 0 and read back by every rank. `ddp-compile` trains through
torch.compile(DDP(model)) and evaluates the wrapped module compiled. Defines ENGINE."""


class DDPLoop(RankEngine):
    def wrap(self, model):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [torch.device(DEVICE).index] if DEVICE_TYPE == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids)
        if ENGINE_SETTINGS.get("comm_hook") is not None:
            wrapped.register_comm_hook(None, getattr(default_hooks, ENGINE_SETTINGS["comm_hook"]))
        return compiled_if_asked(wrapped)

    def start(self, model, training):
        run = {"model": self.wrap(model), "optimizer": None, "scaler": None}
        if training:
            model.train()
            run["optimizer"] = new_optimizer(model, DECAYED(model))
            run["scaler"] = new_scaler(CELL)
        return run

    def train(self, run, steps, seeds=None):
        run["model"].train()
        return rank_steps(lambda: rank_step(run["model"], run["optimizer"], run["scaler"]), steps, seeds)

    def evaluate(self, run):
        # the module DDP wraps, each rank on its rows (DDP has no generate()); compiled in ddp-compile
        return evaluate_rows(compiled_if_asked(self.weights(run)))

    def dropout_off_loss(self, run):
        return dropout_off_rows_loss(run["model"])

    def weights(self, run):
        return plain_of(run["model"]).module  # every rank holds the whole model

    def optimizer_state(self, run):
        return optimizer_tensors(run["optimizer"])

    def scaler_state(self, run):
        return None if run["scaler"] is None else run["scaler"].state_dict()

    def save(self, run, directory):
        if not writes():  # the torch loop's format, written once
            return
        save(self.weights(run), directory)
        if run["optimizer"] is not None:
            state = {"optimizer": run["optimizer"].state_dict()}
            if run["scaler"] is not None:
                state["grad_scaler"] = run["scaler"].state_dict()
            torch.save(state, os.path.join(directory, "trainer_state.pt"))

    def export(self, run, directory, checkpoint):
        return checkpoint  # the model in its kind's own format is there already

    def restore(self, directory, training):
        model = reload(directory, CELL)  # every rank reads what rank 0 wrote
        run = {"model": None, "optimizer": None, "scaler": None}
        if training:
            state = torch.load(os.path.join(directory, "trainer_state.pt"), weights_only=True, map_location=DEVICE)
            run["optimizer"] = new_optimizer(model, DECAYED(model))
            run["optimizer"].load_state_dict(state["optimizer"])
            run["scaler"] = new_scaler(CELL)
            if run["scaler"] is not None:
                run["scaler"].load_state_dict(state["grad_scaler"])
        run["model"] = self.wrap(model)
        return run


ENGINE = DDPLoop()
