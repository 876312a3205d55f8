"""The hf-trainer engine written out (and its compiled twin, hf-trainer-compile): the transformers
Trainer with the TrainingArguments every cell runs with (the precision's fp16/bf16 flag, use_cpu
without a GPU, torch_compile for the twin), whose own train() runs the whole schedule in one call:
STEPS steps, its evaluation and checkpoint after step k, one step more. A callback records the
losses, what the Trainer held after step k and its evaluation there; the phases see the run as
if it had paused after step k. A resumed run is a new Trainer with resume_from_checkpoint, as a
new process makes it. Defines ENGINE."""

from transformers import Trainer, TrainerCallback, TrainingArguments

TRAINER_TOTAL = STEPS + 1  # the uninterrupted run: k steps, its evaluation and checkpoint, step k+1


class TrainerRows(torch.utils.data.Dataset):
    """The cell's batch as a dataset of rows; trainer_stack_rows stacks them back."""

    def __init__(self, batch):
        count = len(next(iter(batch.values())))
        self.rows = [{k: v[i].cpu() for k, v in batch.items()} for i in range(count)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


def trainer_stack_rows(rows):
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


class RecordingTrainer(Trainer):
    """transformers' Trainer that keeps each training loss unrounded and feeds the rows in their
    own order (its default sampler permutes them, and with dropout a permuted batch draws its
    masks for other rows than the torch loop's)."""

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


def trainer_clone(tensors):
    """Detached copies; names that share a tensor (tied weights) share the copy."""
    copies = {}
    return {name: copies.setdefault(id(t), t.detach().clone()) for name, t in tensors.items()}


class TrainerFollowing(TrainerCallback):
    """Follows the Trainer's train() for the phases: each step's loss and whether it was applied,
    what the Trainer held after step k (a resumed run: as it begins), its evaluation there."""

    def __init__(self, engine, run):
        self.engine, self.run = engine, run

    def on_train_begin(self, args, trainer_state, control, **kwargs):
        progress = self.run["progress"]
        if progress is not None and progress["resumed"]:
            self.engine.hold(self.run)  # train() has loaded the checkpoint's weights and optimizer

    def on_step_end(self, args, trainer_state, control, model=None, **kwargs):
        finite_parameters(model, "after the optimizer step")
        progress = self.run["progress"]
        if progress is None:
            return
        self.engine.step_ended(self.run, self.run["trainer"].training_losses[-1])
        if not progress["resumed"] and trainer_state.global_step == STEPS:
            self.engine.hold(self.run)
        if trainer_state.global_step == TRAINER_TOTAL:
            # the Trainer would evaluate and save once more as its run ends: nothing compared follows
            control.should_evaluate = control.should_save = False

    def on_evaluate(self, args, trainer_state, control, metrics=None, **kwargs):
        progress = self.run["progress"]
        if progress is not None and not progress["resumed"] and trainer_state.global_step == STEPS:
            progress["evaluation"] = self.engine.library_evaluation(self.run)


class HFTrainerLoop(ReplayedLoop):
    total = TRAINER_TOTAL

    owns_loop = True

    def make_trainer(self, model, max_steps, output, run):
        if DEVICE_TYPE == "cuda":
            torch.cuda.set_device(DEVICE)
        rows = TrainerRows(BATCH)
        arguments = dict(
            output_dir=output,
            max_steps=max_steps,
            per_device_train_batch_size=len(rows),
            per_device_eval_batch_size=len(rows),
            learning_rate=LEARNING_RATE,
            lr_scheduler_type="constant",
            weight_decay=0.01,
            max_grad_norm=MAX_GRAD_NORM or 0.0,
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
            fp16=ENGINE_SETTINGS["fp16"],
            bf16=ENGINE_SETTINGS["bf16"],
        )
        if ENGINE_SETTINGS.get("torch_compile"):
            arguments["torch_compile"] = True
        run["trainer"] = RecordingTrainer(
            model=model,
            args=TrainingArguments(**arguments),
            train_dataset=rows,
            eval_dataset=rows,
            data_collator=trainer_stack_rows,
            callbacks=[TrainerFollowing(self, run)],
        )
        return run

    @staticmethod
    def new_progress(resumed):
        return {
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

    def start(self, model, training):
        run = {"trainer": None, "progress": self.new_progress(False) if training else None, "resume_from": None}
        return self.make_trainer(model, TRAINER_TOTAL if training else STEPS, os.path.join(WORKDIR, "trainer"), run)

    # -- the callbacks' side

    def hold(self, run):
        progress = run["progress"]
        if progress["resumed"]:  # the steps it applies count from the checkpoint's
            progress["applied_before"] = self.live_applied(run)
        progress["held"] = {
            "weights": trainer_clone(plain_of(run["trainer"].model).state_dict()),
            "optimizer_state": optimizer_tensors(run["trainer"].optimizer),
            "scaler_state": self.live_scaler_state(run),
            "evaluation": self.library_evaluation(run) if progress["resumed"] else None,
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

    def library_evaluation(self, run):
        """Through the model as the Trainer holds it (its forward in accelerate's autocast once
        train() or evaluate() prepared it); the compiled twin's through the compiled model."""
        trainer = run["trainer"]
        module = trainer.model_wrapped if COMPILED else trainer.model
        with torch.random.fork_rng(devices=RNG_DEVICES):
            return evaluate_in(CELL, module, around=contextlib.nullcontext())

    def live_applied(self, run):
        optimizer = run["trainer"].optimizer
        if optimizer is None:
            return 0
        inner = getattr(optimizer, "optimizer", optimizer)
        return max((int(entry["step"]) for entry in inner.state.values() if "step" in entry), default=0)

    def live_scaler_state(self, run):
        scaler = run["trainer"].accelerator.scaler
        return None if scaler is None else scaler.state_dict()

    # -- the phases' side

    def ran(self, run):
        """The run's progress, its train() run first if it has not run yet; a library error is
        kept and raised where the phases ask for what it prevented."""
        progress = run["progress"]
        if not progress["ran"]:
            progress["ran"] = True
            try:
                run["trainer"].train(resume_from_checkpoint=run["resume_from"])
            except Exception as exc:  # raised where the phases ask for what it prevented
                progress["error"] = exc
        return progress

    def evaluate(self, run):
        progress = run["progress"]
        if progress is None:  # an evaluation cell: the Trainer's evaluate(), then through its model
            run["trainer"].evaluate()
            return self.library_evaluation(run)
        return self.held_evaluation(run)

    def weights(self, run):
        progress = run["progress"]
        if progress is None or not self.paused(progress):
            return plain_of(run["trainer"].model)
        if progress["model"] is None:
            progress["model"] = model_holding(progress["held"]["weights"])
        return progress["model"]

    def exported(self, run):
        copy = build(CELL)
        copy.load_state_dict(self.weights(run).state_dict())
        return copy

    def optimizer_state(self, run):
        progress = run["progress"]
        if progress is not None and self.paused(progress):
            return progress["held"]["optimizer_state"]
        return optimizer_tensors(run["trainer"].optimizer)

    def scaler_state(self, run):
        progress = run["progress"]
        if progress is not None and self.paused(progress):
            return progress["held"]["scaler_state"]
        return self.live_scaler_state(run)

    def save(self, run, directory):
        progress = run["progress"]
        if progress is None:
            run["trainer"].save_model(directory)
            return
        self.ran(run)
        written = os.path.join(WORKDIR, "trainer", f"checkpoint-{STEPS}")
        if not os.path.isdir(written):
            self.fail(progress, "the Trainer wrote no checkpoint on its save schedule")
        for name in os.listdir(written):  # the Trainer's checkpoint, file by file
            entry = os.path.join(written, name)
            os.symlink(entry, os.path.join(directory, name), target_is_directory=os.path.isdir(entry))

    def export(self, run, directory, checkpoint):
        return checkpoint  # the Trainer's checkpoint holds the model as save_pretrained writes it

    def restore(self, directory, training):
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)  # a resumed run is a new process
        GradientState._reset_state()
        output = os.path.join(WORKDIR, "resumed")
        if not training:
            run = {"trainer": None, "progress": None, "resume_from": None}
            return self.make_trainer(reload(directory, CELL), STEPS, output, run)
        run = {"trainer": None, "progress": self.new_progress(True), "resume_from": directory}
        return self.make_trainer(build(CELL), TRAINER_TOTAL, output, run)


ENGINE = HFTrainerLoop()
