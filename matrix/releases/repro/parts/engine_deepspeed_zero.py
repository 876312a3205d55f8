"""The deepspeed-zero0 ... deepspeed-zero3 engines (and their -compile twins) written out:
deepspeed.initialize with the config the engine builds (the ZeRO stage of ENGINE_SETTINGS, the
bf16/fp16 section, the config's AdamW with torch_adam), every rank training on its rows of the
batch through engine.backward/engine.step, save_checkpoint/load_checkpoint, and the export as
the engine makes it (ZeRO 1-3 training: the consolidated fp32 state dict of the checkpoint,
zero_to_fp32; otherwise the fp32 master weights in memory). Defines ENGINE for the phases, on
RankEngine (parts/distributed.py: the group, a rank's rows, the gathered evaluation). The
deepspeed_shm_comm op DeepSpeed's CPU accelerator builds on first use is built (once, about a
minute on a small CPU) in a directory of this script's per torch and DeepSpeed release
(parts/deepspeed_ops.py), unless TORCH_EXTENSIONS_DIR names one. Not imported: text of the script."""

DS_TAG = "step-k"  # the checkpoint written after step k
DS_INITIAL_SCALE_POWER = 16  # torch.amp.GradScaler starts at 2**16 too
DS_WEIGHT_DECAY = 0.01  # torch.optim.AdamW's default, which every engine trains with


class DeepSpeedZero(RankEngine):
    stage = ENGINE_SETTINGS["zero_stage"]

    def setup_rank(self, rank):
        """The rank joins the group as the matrix's do (RankEngine; deepspeed.initialize takes the
        gloo group over), with DeepSpeed's accelerator for the cell's device and its per-step lines
        quieted; a *-loaded-* precision's pretrained checkpoint is written once, by rank 0."""
        os.environ.setdefault("DS_ACCELERATOR", DEVICE_TYPE)
        super().setup_rank(rank)
        import logging

        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
        if CELL["weights_from"] == "load":
            if writes():
                build(CELL)
            dist.barrier()

    def config(self):
        rows = len(torch.tensor_split(next(iter(BATCH.values())), WORLD_SIZE)[0])
        config = {
            "train_micro_batch_size_per_gpu": rows,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": self.stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": LEARNING_RATE, "weight_decay": DS_WEIGHT_DECAY, "torch_adam": True},
            },
        }
        if ENGINE_SETTINGS.get("bf16"):
            config["bf16"] = {"enabled": True}
        if ENGINE_SETTINGS.get("fp16"):
            config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": DS_INITIAL_SCALE_POWER}
        if ENGINE_SETTINGS.get("communication_data_type"):
            config["communication_data_type"] = ENGINE_SETTINGS["communication_data_type"]
        return config

    def start(self, model, training):
        import deepspeed

        model.train(training)
        trainable = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=self.config())
        if COMPILED:
            engine.compile(backend=COMPILE_BACKEND)
        run = {"engine": engine, "model": model, "steps": 0, "plain": None, "plain_at": -1}
        if writes():
            basic = self.basic_optimizer(engine)
            print(
                f"ENGINE deepspeed {deepspeed.__version__}: ZeRO stage {engine.zero_optimization_stage()}, "
                f"bf16 {engine.bfloat16_enabled()}, fp16 {engine.fp16_enabled()}, optimizer "
                f"{type(engine.optimizer).__name__} over {type(basic).__name__}, AdamW steps taken at "
                f"construction: {self.steps_taken(basic)}",
                flush=True,
            )
        self.check_declared(run, "after prepare")
        return run

    # ---------------------------------------------------------------- views of the DeepSpeed engine

    @staticmethod
    def basic_optimizer(engine):
        """The torch AdamW under DeepSpeed's wrappers (its parameters: the fp32 master weights)."""
        return getattr(engine.optimizer, "optimizer", engine.optimizer)

    @staticmethod
    def steps_taken(optimizer):
        state = getattr(optimizer, "state", None)
        if not isinstance(state, dict):
            return None
        return max((int(s["step"]) for s in state.values() if isinstance(s, dict) and "step" in s), default=0)

    def partitions(self, engine):
        """The fp32 tensors AdamW steps (this rank's partitions), in order; ZeRO-3 keeps its flat
        partitions on its own optimizer between steps."""
        flat = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
        if flat:
            return list(flat)
        return [p for group in self.basic_optimizer(engine).param_groups for p in group["params"]]

    def master_weights(self, run):
        return {f"master tensor {i}": p.detach().clone() for i, p in enumerate(self.partitions(run["engine"]))}

    def named_master_weights(self, run):
        return full_master_weights(run["engine"])

    def check_declared(self, run, when):
        """With bf16 or fp16 enabled, DeepSpeed holds the module's trained parameters in that dtype
        and fp32 master weights in its optimizer (without: the precision's dtypes, as built)."""
        engine = run["engine"]
        half = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else None
        if half is None:
            return
        tensors = [(f"parameter {n}", p.dtype, half) for n, p in engine.module.named_parameters() if p.requires_grad]
        tensors += [(n, t.dtype, torch.float32) for n, t in self.master_weights(run).items()]
        wrong = [(n, d, w) for n, d, w in tensors if d != w]
        compared("DtypeContractBroken", f"{when}: DeepSpeed's declared dtypes", len(wrong), 0, "none", not wrong)
        if wrong:
            name, dtype, wanted = wrong[0]
            raise CheckFailed("DtypeContractBroken", f"{when}: {name} is {dtype}, DeepSpeed declares {wanted}")

    # ---------------------------------------------------------------- training

    def train(self, run, steps, seeds=None):
        engine = run["engine"]
        if seeds is not None:
            # the matrix seeds a forward at the model's own call; a model compiled in place
            # (engine.compile()) runs its hooks inside the graph, so there at DeepSpeed's call
            model = seeds.model
            seeds.is_model = lambda module: module is model or (COMPILED and getattr(module, "module", None) is model)

        def step():
            run["steps"] += 1
            rows = rank_rows(BATCH)
            loss = loss_of(engine, rows)  # DeepSpeed's bf16/fp16 cast the module: no autocast
            value = finite_loss(loss, "training loss")
            items = loss_items(rows)
            skipped = engine.skipped_steps
            # each rank's loss weighted by its share of the batch's items: the averaged gradients
            # are the whole batch's
            engine.backward(loss * loss_weight(rows))
            engine.step()
            applied = engine.skipped_steps == skipped  # the fp16 loss scaler skips a step that overflowed
            bad = [n for n, t in self.master_weights(run).items() if not torch.isfinite(t).all()]
            if bad:
                raise CheckFailed("NonFiniteValue", "parameters are not finite after the optimizer step", bad[0])
            if seeds is not None:
                seeds.step_ended(applied)
            return group_mean(value, items), applied

        attempts = take_steps(step, steps)
        if seeds is not None:
            self.check_declared(run, "after training")
        return attempts

    def dropout_off_loss(self, run):
        """The whole batch's training loss through DeepSpeed's engine with dropout off, before any
        step (the module brings its own dtype: no autocast)."""
        return dropout_off_rows_loss(run["engine"], with_autocast=False)

    def evaluate(self, run):
        return evaluate_rows(run["engine"].module, with_autocast=False)

    # ---------------------------------------------------------------- what the run holds

    def weights(self, run):
        """A plain model of the kind holding the module's weights in their dtypes (ZeRO-3: gathered
        on every rank), made once per step."""
        if run["plain"] is None or run["plain_at"] != run["steps"]:
            run["plain"], run["plain_at"] = plain_copy(run["engine"], run["plain"]), run["steps"]
        return run["plain"]

    def exported(self, run):
        """The trained weights as a user's checkpoint gives them back: a fresh model in the
        precision, every trained parameter from DeepSpeed's fp32 master weights (where it keeps
        none: the parameter; safe_get_full_fp32_param, a collective), in the model's dtypes."""
        from deepspeed.utils import safe_get_full_fp32_param

        engine = run["engine"]
        master = {}
        for name, parameter in engine.module.named_parameters():
            if parameter.requires_grad:
                full = safe_get_full_fp32_param(parameter)
                master[name] = (parameter if full is None else full).detach().clone()
        model = build(CELL)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if parameter.requires_grad and name in master:
                    parameter.copy_(master[name])
        return model

    def optimizer_state(self, run):
        """AdamW's state (step counts, moments) of each master tensor (this rank's), by position."""
        engine = run["engine"]
        state = self.basic_optimizer(engine).state
        return {
            f"master tensor {i}: {key}": value.detach().clone()
            for i, p in enumerate(self.partitions(engine))
            for key, value in state.get(p, {}).items()
            if isinstance(value, torch.Tensor)
        }

    def scaler_state(self, run):
        engine = run["engine"]
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        if scaler is None or not engine.fp16_enabled():
            return None
        found = {k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool))}
        return found | {"loss_scale": float(scaler.loss_scale)}

    # ---------------------------------------------------------------- checkpoint and resume

    def save(self, run, directory):
        run["engine"].save_checkpoint(directory, tag=DS_TAG)

    def export(self, run, directory, checkpoint):
        """The model rank 0 saves in the kind's format: ZeRO 1-3 training, a fresh model loaded
        (strictly) with the checkpoint's consolidated fp32 state dict; otherwise the trained
        weights in memory (stage 0 writes no ZeRO files). Every rank makes it."""
        if writes():
            files = sorted(
                os.path.relpath(os.path.join(where, name), checkpoint)
                for where, _, names in os.walk(checkpoint)
                for name in names
            )
            print(f"ENGINE DeepSpeed's checkpoint: {files}", flush=True)
        if self.stage == 0 or not TRAINING:
            plain = self.exported(run)
        else:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            consolidated = get_fp32_state_dict_from_zero_checkpoint(checkpoint, tag=DS_TAG)
            plain = build(CELL)
            plain.load_state_dict({k: v.to(DEVICE) for k, v in consolidated.items()})
        if writes():
            os.makedirs(directory, exist_ok=True)
            save(plain, directory)
        return directory

    def restore(self, directory, training):
        run = self.start(build(CELL), training)
        path, _ = run["engine"].load_checkpoint(directory, tag=DS_TAG)
        if path is None:
            raise CheckFailed("CheckFailure", "DeepSpeed's load_checkpoint found no checkpoint", directory)
        return run


ENGINE = DeepSpeedZero()
