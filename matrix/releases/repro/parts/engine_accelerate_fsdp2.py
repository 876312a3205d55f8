"""The accelerate-fsdp2 engine written out (matrix/engines/accelerate_fsdp2.py,
matrix/engines/libraries/accelerate.py): Accelerator(mixed_precision=..., fsdp_plugin=
FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", the layers the
model names in _no_split_modules wrapped)), prepare(model, optimizer), accelerator.backward,
save_state / load_state (a new Accelerator over a fresh model), get_state_dict for the full
checkpoint rank 0 saves in the kind's format. On a CPU accelerate leaves a group MULTI_CPU and
ignores the plugin: as the matrix does, the script makes the selection accelerate makes on a GPU
(FSDP in both shared states, the plugin's mixed precision, the plugin attached). Under mixed
precision accelerate declares fp32 master weights, checked after prepare. `accelerate-fsdp2-compile`
adds dynamo_backend="inductor". Defines ENGINE."""


def reset_accelerate():
    """The Accelerator's state is a process-wide singleton: forgotten, as a new process would."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


class AccelerateFSDP2Loop(RankEngine):
    def plugin(self, model):
        from accelerate.utils import FullyShardedDataParallelPlugin

        options = {"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"}
        policy = ENGINE_SETTINGS.get("mixed_precision_policy")
        if policy is not None:
            options["mixed_precision_policy"] = {k: getattr(torch, v) for k, v in policy.items()}
        layers = getattr(model, "_no_split_modules", None)
        if layers:  # a transformers model names its layers: one FSDP unit each
            options["auto_wrap_policy"] = "transformer_based_wrap"
            options["transformer_cls_names_to_wrap"] = list(layers)
        return FullyShardedDataParallelPlugin(**options)

    def accelerator(self, model):
        from accelerate import Accelerator
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType

        mixed = ENGINE_SETTINGS["mixed_precision"]
        plugin = self.plugin(model)
        options = {"dynamo_backend": "inductor"} if COMPILED else {}
        accelerator = Accelerator(mixed_precision=mixed, cpu=DEVICE_TYPE == "cpu", fsdp_plugin=plugin, **options)
        if accelerator.distributed_type != DistributedType.FSDP:
            # accelerate selects FSDP on accelerator devices only: the selection it makes there
            print(f"accelerate left a {accelerator.device.type} group {accelerator.distributed_type}: FSDP selected")
            accelerator.state.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            if mixed != "no":
                plugin.set_mixed_precision(mixed)
            accelerator.state.fsdp_plugin = plugin
        if not accelerator.is_fsdp2:
            raise RuntimeError(
                f"accelerate did not take the FSDP2 path (distributed_type {accelerator.distributed_type})"
            )
        return accelerator

    def prepared(self, model, training):
        """prepare(model, optimizer): accelerate's FSDP2 path takes both together, in eval too."""
        accelerator = self.accelerator(model)
        model.train(training)
        prepared, optimizer = accelerator.prepare(model, new_optimizer(model, DECAYED(model)))
        return {"accelerator": accelerator, "model": prepared, "optimizer": optimizer, "steps": 0}

    def start(self, model, training):
        run = self.prepared(model, training)
        self.check_declared(run, "after prepare")
        return run

    def check_declared(self, run, when):
        """What accelerate declares under mixed precision: the trained parameters are fp32 master
        weights (the matrix's check_fp32_master_weights); without it the precision's dtypes stay."""
        if ENGINE_SETTINGS["mixed_precision"] == "no":
            return
        trained = {n: p for n, p in self.weights(run).named_parameters() if p.requires_grad}
        wrong = {n: p.dtype for n, p in trained.items() if p.dtype != torch.float32}
        what = f"{when}, the trained parameters (fp32 master weights under FSDP2)"
        dtype = next(iter(wrong.values()), torch.float32)
        compared("DtypeContractBroken", what, f"{len(wrong)} not fp32", "0", "none", not wrong)
        if wrong:
            raise CheckFailed(
                "DtypeContractBroken",
                f"{what}: weights are {dtype}, not torch.float32",
                f"{len(wrong)} of {len(trained)}, first {next(iter(wrong))}",
            )

    def train(self, run, steps, seeds=None):
        run["model"].train()
        return rank_steps(lambda: self.step(run), steps, seeds)

    def step(self, run):
        run["steps"] += 1
        rows = rank_rows(BATCH)
        run["optimizer"].zero_grad(set_to_none=True)
        loss = loss_of(run["model"], rows)  # autocast comes from the prepared forward
        value = finite_loss(loss, "training loss")
        run["accelerator"].backward(loss * loss_weight(rows))
        run["optimizer"].step()
        applied = not run["accelerator"].optimizer_step_was_skipped
        finite_parameters(run["model"], "after the optimizer step")
        return group_mean(value, loss_items(rows)), applied

    def evaluate(self, run):
        return evaluate_rows(run["model"], with_autocast=False)  # the prepared forward autocasts

    def dropout_off_loss(self, run):
        return dropout_off_rows_loss(run["model"], with_autocast=False)

    def weights(self, run):
        return gathered_weights(run, plain_of(run["model"]))

    def exported(self, run):
        """The trained weights read in the cell's precision: copied into a model in its dtypes."""
        in_precision = build(CELL)
        in_precision.load_state_dict(self.weights(run).state_dict())
        return in_precision

    def optimizer_state(self, run):
        return optimizer_tensors(run["optimizer"])

    def scaler_state(self, run):
        scaler = run["accelerator"].scaler
        return None if scaler is None else scaler.state_dict()

    def save(self, run, directory):
        run["accelerator"].save_state(str(directory))

    def export(self, run, directory, checkpoint):
        full = run["accelerator"].get_state_dict(run["model"])  # every rank gathers
        if writes():
            saved = build(CELL)
            saved.load_state_dict({k: v.to(DEVICE) for k, v in full.items()}, assign=True)
            os.makedirs(directory, exist_ok=True)
            save(saved, directory)
        return directory

    def restore(self, directory, training):
        reset_accelerate()
        run = self.prepared(build(CELL), training)
        run["accelerator"].load_state(str(directory))
        return run


ENGINE = AccelerateFSDP2Loop()
