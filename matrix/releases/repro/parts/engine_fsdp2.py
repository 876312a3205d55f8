"""The fsdp2 engine written out (matrix/engines/fsdp2.py): torch's fully_shard on every layer (the
members of the model's ModuleLists) and on the root, with the MixedPrecisionPolicy the matrix
derives from the precision (ENGINE_SETTINGS) and its autocast besides, each rank training on its
rows. Its checkpoint a sharded one through torch.distributed.checkpoint (DCP); the export the
full state dict gathered from the shards, saved by rank 0 in the kind's format. `fsdp2-compile`
compiles each layer in place before fully_shard. Defines ENGINE."""

SCALER_FILE = "grad_scaler.pt"


class FSDP2Loop(RankEngine):
    def shard(self, model):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        def dtype(name):
            return None if ENGINE_SETTINGS.get(name) is None else getattr(torch, ENGINE_SETTINGS[name])

        policy = MixedPrecisionPolicy(
            param_dtype=dtype("param_dtype"), reduce_dtype=dtype("reduce_dtype"), output_dtype=dtype("output_dtype")
        )
        layers = [layer for module in model.modules() if isinstance(module, torch.nn.ModuleList) for layer in module]
        for layer in layers:
            if COMPILED:
                layer.compile(backend=COMPILE_BACKEND)
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model

    def start(self, model, training):
        sharded = self.shard(model)
        run = {"model": sharded, "optimizer": None, "scaler": None, "steps": 0}
        if training:
            sharded.train()
            run["optimizer"] = new_optimizer(sharded, DECAYED(sharded))
            run["scaler"] = new_scaler(CELL)
        return run

    def train(self, run, steps, seeds=None):
        run["model"].train()

        def step():
            run["steps"] += 1
            return rank_step(run["model"], run["optimizer"], run["scaler"])

        return rank_steps(step, steps, seeds)

    def evaluate(self, run):
        return evaluate_rows(run["model"])

    def dropout_off_loss(self, run):
        return dropout_off_rows_loss(run["model"])

    def weights(self, run):
        return gathered_weights(run, run["model"])

    def optimizer_state(self, run):
        return optimizer_tensors(run["optimizer"])

    def scaler_state(self, run):
        return None if run["scaler"] is None else run["scaler"].state_dict()

    def save(self, run, directory):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if run["optimizer"] is not None:
            model_state, optimizer_state = get_state_dict(run["model"], run["optimizer"])
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)
        else:
            dcp.save({"model": get_model_state_dict(run["model"])}, checkpoint_id=directory)
        if run["scaler"] is not None and writes():
            torch.save(run["scaler"].state_dict(), os.path.join(directory, SCALER_FILE))

    def export(self, run, directory, checkpoint):
        weights = self.weights(run)  # on every rank: gathering the shards is a collective
        if writes():
            os.makedirs(directory, exist_ok=True)
            save(weights, directory)
        return directory

    def restore(self, directory, training):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

        resumed = self.shard(build(CELL))
        if not training:
            model_state = get_model_state_dict(resumed)
            dcp.load({"model": model_state}, checkpoint_id=directory)
            set_state_dict(resumed, (), model_state_dict=model_state, optim_state_dict={})
            return {"model": resumed, "optimizer": None, "scaler": None, "steps": 0}
        optimizer = new_optimizer(resumed, DECAYED(resumed))
        model_state, optimizer_state = get_state_dict(resumed, optimizer)
        dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)
        set_state_dict(resumed, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
        scaler = new_scaler(CELL)
        if scaler is not None:
            scaler.load_state_dict(torch.load(os.path.join(directory, SCALER_FILE), weights_only=True))
        return {"model": resumed.train(), "optimizer": optimizer, "scaler": scaler, "steps": 0}


ENGINE = FSDP2Loop()
