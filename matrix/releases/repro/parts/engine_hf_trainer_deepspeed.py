"""The hf-trainer-zero2 and hf-trainer-zero3 engines (and their -compile twins) written out: the
transformers Trainer with a DeepSpeed config (TrainingArguments(deepspeed=...), "auto" where the
Trainer fills it in), every rank feeding it its rows of the batch. Its loop is the library's: one
train() runs the matrix's whole schedule (STEPS steps, the Trainer's evaluation and checkpoint
after step k, one step more), a callback records what the run holds after step k, and the
phases read the run as if it had paused there (the matrix's LibraryLoop, matrix/engines/base.py).
A resumed run is a new Trainer with resume_from_checkpoint. The run's weights, master weights,
optimizer and scaler state are read from the DeepSpeed engine the Trainer trains through.
Defines ENGINE for the phases, on RankEngine (parts/distributed.py). Not imported: text of the
script."""

TRAINER_WEIGHT_DECAY = 0.01  # torch.optim.AdamW's default, as in the torch engine
TRAINER_TOTAL = STEPS + 1  # the schedule: step k, its evaluation and checkpoint, then step k+1


class TrainerRows(torch.utils.data.Dataset):
    """The cell's fixed batch as a dataset of rows; stack_rows stacks them back."""

    def __init__(self, batch):
        self.rows = [{k: v[i].cpu() for k, v in batch.items()} for i in range(len(next(iter(batch.values()))))]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


def stack_rows(rows):
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def recording_trainer():
    """The Trainer as the matrix runs it: it keeps each training loss unrounded and feeds the rows
    in their own order (the default random sampler would permute them)."""
    from transformers import Trainer

    class RecordingTrainer(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.training_losses = []

        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            if model.training:
                value = loss[0] if isinstance(loss, tuple) else loss
                self.training_losses.append(value.detach().float().item())
            return loss

    return RecordingTrainer


def following(engine, run):
    """The callback that follows the Trainer's run: what it holds after step k (a resumed run: as
    it begins), each step's loss, the Trainer's own evaluation after step k."""
    from transformers import TrainerCallback

    class Following(TrainerCallback):
        def on_train_begin(self, args, trainer_state, control, **kwargs):
            progress = run["progress"]
            if progress is not None and not progress["resumed"]:
                progress["masters_at_start"] = engine.live_named_master_weights(run)
            if progress is not None and progress["resumed"]:
                engine.hold(run)  # train() has loaded the checkpoint's weights, optimizer and scaler state
                progress["phase"] = "resumed_step"

        def on_step_end(self, args, trainer_state, control, model=None, **kwargs):
            finite_parameters(model, "after the optimizer step")
            progress = run["progress"]
            if progress is None:
                return
            engine.step_ended(run, run["trainer"].training_losses[-1])
            if not progress["resumed"] and trainer_state.global_step == STEPS:
                engine.hold(run)
                progress["phase"] = "mid_training_eval"
            if trainer_state.global_step == TRAINER_TOTAL:  # nothing compared comes after step k+1
                control.should_evaluate = control.should_save = False

        def on_evaluate(self, args, trainer_state, control, metrics=None, **kwargs):
            progress = run["progress"]
            if progress is not None and not progress["resumed"] and trainer_state.global_step == STEPS:
                progress["evaluation"] = engine.library_evaluation(run)
                progress["phase"] = "checkpoint_save"

        def on_save(self, args, trainer_state, control, **kwargs):
            progress = run["progress"]
            if progress is not None and not progress["resumed"] and trainer_state.global_step == STEPS:
                progress["phase"] = "resumed_step"

    return Following()


def new_progress(phase, resumed=False):
    return {
        "phase": phase,
        "resumed": resumed,
        "losses": [],
        "applied_after": [],
        "applied_before": 0,
        "held": None,
        "evaluation": None,
        "error": None,
        "ran": False,
        "handed": 0,
        "weights_model": None,
        "masters_at_start": {},  # the master weights by name as train() began, before step 1
    }


class TrainerOnDeepSpeed(RankEngine):
    owns_loop = True
    stage = ENGINE_SETTINGS["zero_stage"]

    def setup_rank(self, rank):
        """The rank joins the group as the matrix's do (RankEngine), with DeepSpeed's accelerator
        for the cell's device; a *-loaded-* precision's pretrained checkpoint is written once."""
        os.environ.setdefault("DS_ACCELERATOR", DEVICE_TYPE)
        super().setup_rank(rank)
        import logging

        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
        if CELL["weights_from"] == "load":
            if writes():
                build(CELL)
            dist.barrier()

    # ---------------------------------------------------------------- the Trainer

    def config(self):
        """The DeepSpeed config handed to TrainingArguments, "auto" where the Trainer fills it in."""
        zero = {"stage": self.stage}
        if self.stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = True  # save_model writes the weights
        config = {
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto",
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": "auto"},
            "fp16": {"enabled": "auto"},
        }
        if ENGINE_SETTINGS.get("communication_data_type"):
            config["communication_data_type"] = ENGINE_SETTINGS["communication_data_type"]
        return config

    def arguments(self, max_steps, output):
        from transformers import TrainingArguments

        rows = len(torch.tensor_split(next(iter(BATCH.values())), WORLD_SIZE)[0])
        arguments = dict(
            output_dir=output,
            max_steps=max_steps,
            per_device_train_batch_size=rows,
            per_device_eval_batch_size=rows,
            learning_rate=LEARNING_RATE,
            lr_scheduler_type="constant",
            weight_decay=TRAINER_WEIGHT_DECAY,
            max_grad_norm=MAX_GRAD_NORM or 0.0,  # DeepSpeed's own default clipping applies anyway
            optim="adamw_torch",
            eval_strategy="steps",
            eval_steps=STEPS,
            save_strategy="steps",
            save_steps=STEPS,
            logging_steps=1,
            report_to="none",
            use_cpu=DEVICE_TYPE == "cpu",
            seed=0,
            disable_tqdm=True,
            remove_unused_columns=False,
            dataloader_num_workers=0,
            fp16=bool(ENGINE_SETTINGS.get("fp16")),
            bf16=bool(ENGINE_SETTINGS.get("bf16")),
            deepspeed=self.config(),
            # each rank its contiguous rows, as the other distributed engines split the batch
            accelerator_config={"even_batches": False},
        )
        if ENGINE_SETTINGS.get("torch_compile"):
            arguments["torch_compile"] = True
        return TrainingArguments(**arguments)

    def make_trainer(self, model, max_steps, output, run):
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        rows = TrainerRows(BATCH)
        run["trainer"] = recording_trainer()(
            model=model,
            args=self.arguments(max_steps, output),
            train_dataset=rows,
            eval_dataset=rows,
            data_collator=stack_rows,
            callbacks=[following(self, run)],
        )
        # While a ZeRO-3 TrainingArguments is alive, transformers builds every model partitioned
        # (deepspeed.zero.Init): the script's own models (references, reloads) are built as in a
        # new process, and the config is put in force around the Trainer's own calls (call()).
        unset_hf_deepspeed_config()

    def call(self, run, call):
        from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

        set_hf_deepspeed_config(run["trainer"].args.hf_deepspeed_config)
        try:
            return call()
        finally:
            unset_hf_deepspeed_config()

    def start(self, model, training):
        run = {"trainer": None, "progress": new_progress("train_steps") if training else None, "resume_from": None}
        self.make_trainer(model, TRAINER_TOTAL if training else STEPS, os.path.join(WORKDIR, "trainer"), run)
        return run

    def run_loop(self, run):
        resume = run["resume_from"]
        self.call(run, lambda: run["trainer"].train(resume_from_checkpoint=resume))
        if writes():
            engine = self.engine(run)
            basic = getattr(engine.optimizer, "optimizer", engine.optimizer)
            print(
                f"ENGINE the Trainer trained through DeepSpeed's {type(engine).__name__}: ZeRO stage "
                f"{engine.zero_optimization_stage()}, bf16 {engine.bfloat16_enabled()}, fp16 "
                f"{engine.fp16_enabled()}, optimizer {type(engine.optimizer).__name__} over {type(basic).__name__}",
                flush=True,
            )

    def ran(self, run):
        """The run's progress, its loop run first if it has not run yet; the library's error is
        raised where the phases ask for what it prevented."""
        progress = run["progress"]
        if not progress["ran"]:
            progress["ran"] = True
            try:
                self.run_loop(run)
            except Exception as exc:  # raised where the phases ask for what it prevented
                print(f"ENGINE the Trainer raised in {progress['phase']}: {type(exc).__name__}: {exc}", flush=True)
                progress["error"] = exc
        return progress

    @staticmethod
    def fail(progress, missing):
        if progress["error"] is not None:
            raise progress["error"]
        raise CheckFailed("CheckFailure", missing)

    # ---------------------------------------------------------------- the callbacks' side

    def engine(self, run):
        """The DeepSpeed engine the Trainer trains through (its model_wrapped once train() or
        evaluate() set it up)."""
        engine = run["trainer"].model_wrapped
        if not hasattr(engine, "zero_optimization_stage"):
            raise CheckFailed(
                "CheckFailure", "the Trainer did not train through a DeepSpeed engine", type(engine).__name__
            )
        return engine

    def prepared(self, run):
        return hasattr(run["trainer"].model_wrapped, "zero_optimization_stage")

    def hold(self, run):
        """What the loop holds now, read inside the Trainer's call: its DeepSpeed config is put
        out of force meanwhile, so that the models made here are built as in a new process."""
        from transformers.integrations.deepspeed import (
            deepspeed_config,
            set_hf_deepspeed_config,
            unset_hf_deepspeed_config,
        )

        in_force = deepspeed_config() is not None
        unset_hf_deepspeed_config()
        try:
            progress = run["progress"]
            weights = plain_of(self.live_weights(run))
            if progress["resumed"]:  # the steps it applies count from the checkpoint's
                progress["applied_before"] = self.live_applied(run)
            progress["held"] = {
                "weights": {k: v.detach().clone() for k, v in weights.state_dict().items()},
                "optimizer_state": self.live_optimizer_state(run),
                "scaler_state": self.live_scaler_state(run),
                "evaluation": self.library_evaluation(run) if progress["resumed"] else None,
                "named_master_weights": self.live_named_master_weights(run),
            }
        finally:
            if in_force:
                set_hf_deepspeed_config(run["trainer"].args.hf_deepspeed_config)

    def whole_batch_loss(self, run, value):
        """The whole batch's mean loss from a rank's Trainer loss: where the Trainer averages tokens
        across devices, each rank's loss is its token sum over the whole batch's count, times the
        world size; otherwise the rank's own mean."""
        trainer = run["trainer"]
        if trainer.args.average_tokens_across_devices and (
            trainer.model_accepts_loss_kwargs or trainer.compute_loss_func
        ):
            total = torch.tensor([value], dtype=torch.float64)
            dist.all_reduce(total)
            return total.item() / WORLD_SIZE
        rows = rank_rows(BATCH)
        return group_mean(value, loss_items(rows))

    def step_ended(self, run, loss):
        progress = run["progress"]
        loss = self.whole_batch_loss(run, float(loss))
        applied = self.live_applied(run)
        before = progress["applied_after"][-1] if progress["applied_after"] else progress["applied_before"]
        seeds = run.get("seeds")
        if seeds is not None:
            seeds.step_ended(applied > before)
            if len(progress["losses"]) + 1 >= STEPS:  # a library's loop runs on past step k in one go
                seeds.stop()
        progress["losses"].append(loss)
        progress["applied_after"].append(applied)

    def library_evaluation(self, run):
        """The evaluation through the module DeepSpeed holds (it brings its own dtype), each rank
        on its rows, gathered; the global generators left as they were."""
        with torch.random.fork_rng(devices=RNG_DEVICES):
            return evaluate_rows(self.engine(run).module, with_autocast=False)

    def live_weights(self, run):
        if not self.prepared(run):
            return run["trainer"].model  # before train(): the model as built
        return plain_copy(self.engine(run))

    def partitions(self, engine):
        flat = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
        if flat:
            return list(flat)
        basic = getattr(engine.optimizer, "optimizer", engine.optimizer)
        return [p for group in basic.param_groups for p in group["params"]]

    def live_optimizer_state(self, run):
        engine = self.engine(run)
        state = getattr(engine.optimizer, "optimizer", engine.optimizer).state
        return {
            f"master tensor {i}: {key}": value.detach().clone()
            for i, p in enumerate(self.partitions(engine))
            for key, value in state.get(p, {}).items()
            if isinstance(value, torch.Tensor)
        }

    def live_scaler_state(self, run):
        engine = self.engine(run)
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        if scaler is None or not engine.fp16_enabled():
            return None
        found = {k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool))}
        return found | {"loss_scale": float(scaler.loss_scale)}

    def live_applied(self, run):
        """Optimizer steps applied so far, from AdamW's own step counts."""
        if not self.prepared(run):
            return 0
        engine = self.engine(run)
        state = getattr(engine.optimizer, "optimizer", engine.optimizer).state
        return max((int(entry["step"]) for entry in state.values() if "step" in entry), default=0)

    # ---------------------------------------------------------------- the phases' side

    def train(self, run, steps, seeds=None):
        """The next `steps` steps the loop ran, each (loss, applied); a resumed run hands all it ran."""
        if seeds is not None:
            # the matrix seeds a forward at the model's own call (a compiled twin's: at the call
            # around the compiled model, the last eager point before its forward)
            model = seeds.model

            def is_model(module):
                if module is model:
                    return True
                return COMPILED and model in (getattr(module, "module", None), getattr(module, "_orig_mod", None))

            seeds.is_model = is_model
            run["seeds"] = seeds
        progress = self.ran(run)
        start, end = progress["handed"], progress["handed"] + steps
        if len(progress["losses"]) < end:
            self.fail(
                progress, f"the library's loop ran {len(progress['losses']) - start} of the {steps} steps asked for"
            )
        if progress["resumed"]:
            end = len(progress["losses"])
        progress["handed"] = end
        if progress["error"] is not None and (progress["resumed"] or end >= TRAINER_TOTAL):
            raise progress["error"]  # after its last step: the library failed as its loop ended
        counts = [progress["applied_after"][start - 1] if start else progress["applied_before"]]
        counts += progress["applied_after"][start:end]
        return [(loss, counts[i + 1] != counts[i]) for i, loss in enumerate(progress["losses"][start:end])]

    def dropout_off_loss(self, run):
        """The Trainer's first loss with dropout off (eval mode), through its own arithmetic: each
        rank's compute_loss on its rows with the item count the Trainer passes (gathered over the
        ranks), made the whole batch's as a step's loss is. Before train(): the model as built,
        under the precision's autocast."""
        trainer = run["trainer"]
        model = trainer.model
        rows = rank_rows(BATCH)
        count = getattr(trainer, "_get_num_items_in_batch", None)  # transformers >= 4.46
        was = model.training
        model.eval()
        try:
            with torch.no_grad(), autocast(CELL):
                items = count([rows], trainer.args.device) if count is not None else None
                loss = trainer.compute_loss(model, dict(rows), num_items_in_batch=items)
                value = float((loss[0] if isinstance(loss, tuple) else loss).float().item())
        finally:
            model.train(was)
        return self.whole_batch_loss(run, value)

    def evaluate(self, run):
        progress = run["progress"]
        if progress is None:  # an evaluation cell: the Trainer's evaluate(), then its module's
            self.call(run, run["trainer"].evaluate)
            return self.library_evaluation(run)
        progress = self.ran(run)
        evaluation = None
        if self.paused(progress):
            evaluation = progress["held"]["evaluation"] if progress["resumed"] else progress["evaluation"]
        if evaluation is None:
            self.fail(progress, "the library ran no evaluation on its schedule")
        return evaluation

    @staticmethod
    def paused(progress):
        """Whether the phases see the run where the loop held it (after step k; a resumed run
        before its first step)."""
        return progress["held"] is not None and progress["handed"] == (0 if progress["resumed"] else STEPS)

    def held(self, run):
        progress = run["progress"]
        return progress["held"] if progress is not None and self.paused(progress) else None

    def weights(self, run):
        held = self.held(run)
        if held is None:
            return plain_of(self.live_weights(run))
        if run["progress"]["weights_model"] is None:
            run["progress"]["weights_model"] = model_holding(held["weights"])
        return run["progress"]["weights_model"]

    def dtype_changes(self, run):
        """DeepSpeed, set up inside train(), casts the module's parameters to the half dtype its
        config enables (keeping fp32 master weights); buffers keep theirs."""
        half = torch.bfloat16 if ENGINE_SETTINGS.get("bf16") else torch.float16 if ENGINE_SETTINGS.get("fp16") else None
        if half is None:
            return {}
        return {f"parameter {n}": half for n, p in run["trainer"].model.named_parameters() if p.is_floating_point()}

    def optimizer_state(self, run):
        held = self.held(run)
        return self.live_optimizer_state(run) if held is None else held["optimizer_state"]

    def scaler_state(self, run):
        held = self.held(run)
        return self.live_scaler_state(run) if held is None else held["scaler_state"]

    def live_named_master_weights(self, run):
        return full_master_weights(self.engine(run)) if self.prepared(run) else {}  # before train(): none

    def named_master_weights(self, run):
        held = self.held(run)
        return self.live_named_master_weights(run) if held is None else held["named_master_weights"]

    def named_master_weights_at_start(self, run):
        return {} if run["progress"] is None else run["progress"]["masters_at_start"]

    def exported(self, run):
        """The Trainer saves the module's 16-bit weights: a fresh model of the kind in the precision
        with the trained parameters taken from them, as from_pretrained gives them back."""
        weights = dict(self.weights(run).named_parameters())
        model = build(CELL)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if parameter.requires_grad and name in weights:
                    parameter.copy_(weights[name])
        return model

    def save(self, run, directory):
        if run["progress"] is None:
            self.call(run, lambda: run["trainer"].save_model(directory))
            return
        progress = self.ran(run)
        written = os.path.join(WORKDIR, "trainer", f"checkpoint-{STEPS}")
        if not os.path.isdir(written):
            self.fail(progress, "the Trainer wrote no checkpoint on its save schedule")
        if writes():  # the Trainer's checkpoint, entry by entry
            for entry in os.listdir(written):
                os.symlink(os.path.join(written, entry), os.path.join(directory, entry))

    def export(self, run, directory, checkpoint):
        return checkpoint  # the Trainer's checkpoint holds the model as save_pretrained writes it

    def restore(self, directory, training):
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)  # a resumed run is a new process
        GradientState._reset_state()
        if not training:
            run = {"trainer": None, "progress": None, "resume_from": None}
            self.make_trainer(reload(directory, CELL), STEPS, os.path.join(WORKDIR, "resumed"), run)
            return run
        run = {"trainer": None, "progress": new_progress("checkpoint_reload", resumed=True), "resume_from": directory}
        self.make_trainer(build(CELL), TRAINER_TOTAL, os.path.join(WORKDIR, "resumed"), run)
        return run


ENGINE = TrainerOnDeepSpeed()
