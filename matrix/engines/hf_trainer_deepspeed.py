"""The hf-trainer-zero2 and hf-trainer-zero3 engines: the transformers Trainer with a DeepSpeed
config (TrainingArguments(deepspeed=...)), the path most DeepSpeed users take, on the run's group
of ranks (gloo on CPU, nccl on CUDA), each rank feeding the Trainer its rows of the batch.

The config is the one Hugging Face's documentation recommends: ZeRO stage 2 or 3, "auto" for
what the Trainer fills in (batch sizes, bf16/fp16 from its --bf16/--fp16, which the precision
sets as in the hf-trainer engine), the Trainer's own AdamW (no optimizer section), and at stage 3
the 16-bit weights gathered for save_model. The Trainer averages tokens across devices, so each
rank's loss is its share of the whole batch's mean, which DeepSpeed's averaged gradients make the
whole batch's step.

Everything else is the hf-trainer engine's (one train() over the harness's schedule, a callback
recording what it held after step k, resume_from_checkpoint), with the run's weights, master
weights, optimizer and scaler state read from the DeepSpeed engine the Trainer trains through
(matrix/engines/libraries/deepspeed.py), as the deepspeed-zero* engines read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from matrix.checks import assertions as checks
from matrix.engines.base import Unsupported, one_switch_unsupported, register_with_compiled_twin
from matrix.engines.deepspeed_zero import (
    DeepSpeedSettings,
    deepspeed_precision_refusal,
    derive_deepspeed,
)
from matrix.engines.distributed import DistributedEngine, set_launcher_environment
from matrix.engines.hf_trainer import HFTrainerEngine, TrainerRun
from matrix.engines.libraries import deepspeed as ds
from matrix.engines.libraries.trainer import training_arguments
from matrix.harness.measurements import dropout_off_loss, evaluate_rows, generators_kept
from matrix.precisions.policies import Precision


@dataclass(frozen=True)
class TrainerDeepSpeedSettings(DeepSpeedSettings):
    torch_compile: bool | None = None  # the compiled twin: TrainingArguments(torch_compile=True)


class TrainerOnDeepSpeed(DistributedEngine, HFTrainerEngine):
    """The Trainer with a DeepSpeed config of one ZeRO stage."""

    forward_autocasts = True  # DeepSpeed casts the module to its half dtype: no autocast around it
    traits = frozenset({"casts-parameters", "steps-master-weights"})
    requires = (*HFTrainerEngine.requires, "deepspeed")

    @property
    def max_grad_norm(self) -> float | None:
        """On DeepSpeed the Trainer leaves clipping to DeepSpeed, and its config here sets no
        gradient_clipping (the Trainer fills in only an "auto"): DeepSpeed's own default applies,
        whatever TrainingArguments.max_grad_norm says."""
        from matrix.engines.libraries.deepspeed import default_gradient_clipping

        return default_gradient_clipping()

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.name = f"hf-trainer-zero{stage}"
        self.axis_position = 9 + stage  # after deepspeed-zero0 ... deepspeed-zero3
        self.description = (
            f"transformers Trainer with a DeepSpeed ZeRO-{stage} config (TrainingArguments(deepspeed=...)), "
            "save and resume_from_checkpoint through DeepSpeed"
        )

    def derive_settings(self, precision: Precision) -> TrainerDeepSpeedSettings | Unsupported:
        unsupported = one_switch_unsupported(self.name, "a TrainingArguments setting", precision)
        if unsupported:
            return unsupported
        derived = derive_deepspeed(self.stage, precision)
        if isinstance(derived, Unsupported):
            return derived
        return TrainerDeepSpeedSettings(**derived.as_dict(), torch_compile=True if self.compiled else None)

    def precision_device_skip_reason(self, precision: Precision, device) -> str | None:
        return deepspeed_precision_refusal(self.derive_or_refuse(precision), device)

    def config(self, state) -> dict:
        """The DeepSpeed config handed to TrainingArguments, "auto" where the Trainer fills it in."""
        zero: dict = {"stage": self.stage}
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
        if state.settings.communication_data_type:
            config["communication_data_type"] = state.settings.communication_data_type
        return config

    def arguments(self, state, max_steps: int, output):
        rows = state.group.largest_share(state.batch)
        # each rank its contiguous rows, the last rank fewer where they do not divide, as the other
        # distributed engines split the batch: accelerate's default (even_batches) would repeat the
        # first rows on the last rank, and the step would train on another batch than theirs
        return training_arguments(
            state,
            max_steps,
            output,
            rows=rows,
            deepspeed=self.config(state),
            fp16=bool(state.settings.fp16),
            bf16=bool(state.settings.bf16),
            accelerator_config={"even_batches": False},
        )

    def make_trainer(self, state, model, max_steps: int, output, run: TrainerRun) -> None:
        ds.import_deepspeed(
            state
        )  # DeepSpeed's accelerator for the cell's device, chosen before the Trainer imports it
        set_launcher_environment(state, also_restored=("DS_ACCELERATOR", "ACCELERATE_USE_DEEPSPEED"))
        super().make_trainer(state, model, max_steps, output, run)
        state.metrics.engine_effective["config"] = self.config(state)
        state.metrics.engine_effective.update(rank_loss_averaging(state, run.trainer))
        # While a ZeRO-3 TrainingArguments is alive, transformers builds every model partitioned
        # (deepspeed.zero.Init). The harness's own models (checkpoints read back, references) are
        # built as a user builds them in a new process: the config is in force in the Trainer's calls.
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()

    def call(self, state, run: TrainerRun, call):
        """A call of the Trainer with its DeepSpeed config in force, as it is during a user's run."""
        from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

        set_hf_deepspeed_config(run.trainer.args.hf_deepspeed_config)
        try:
            return call()
        finally:
            unset_hf_deepspeed_config()

    def hold(self, state, run: TrainerRun) -> None:
        """What the loop holds, read from a callback: inside the Trainer's call, where its config
        is in force, so the models the harness builds for its views (plain copies of the module)
        would be built partitioned, and a quantized base refused ("DeepSpeed Zero-3 is not
        compatible with passing a `device_map`"). They are built as in a new process."""
        from transformers.integrations.deepspeed import (
            deepspeed_config,
            set_hf_deepspeed_config,
            unset_hf_deepspeed_config,
        )

        in_force = deepspeed_config() is not None
        unset_hf_deepspeed_config()
        try:
            super().hold(state, run)
        finally:
            if in_force:
                set_hf_deepspeed_config(run.trainer.args.hf_deepspeed_config)

    def train_began(self, state, run: TrainerRun) -> None:
        # what DeepSpeed made of the config, its optimizer's step count among it, read right after
        # the Trainer built the engine (the probe of optimizer-stepped-at-construction)
        self._record_engine(state, run)
        if run.progress is not None and not run.progress.resumed:  # the master weights before step 1
            run.progress.masters_at_start = self.live_named_master_weights(state, run)

    def step_ended(self, state, run: TrainerRun, loss: float) -> None:
        super().step_ended(state, run, self.whole_batch_loss(state, run, loss))

    def whole_batch_loss(self, state, run: TrainerRun, value: float) -> float:
        """The whole batch's mean loss from a rank's Trainer loss. Where the Trainer averages
        tokens across devices (a model that takes num_items_in_batch), each rank's loss is its
        token sum over the whole batch's count, times the world size; otherwise it is the rank's
        own mean."""
        trainer, group = run.trainer, state.group
        if averages_items_across_ranks(trainer):
            return group.total(value) / group.world_size
        rows = group.rows(state.batch)
        return group.mean(value, state.kind.loss_items(rows))

    def engine(self, run: TrainerRun):
        """The DeepSpeed engine the Trainer trains through (its model_wrapped once train() or
        evaluate() set it up)."""
        engine = run.trainer.model_wrapped
        if not hasattr(engine, "zero_optimization_stage"):
            raise checks.CheckFailure(
                "the Trainer did not train through a DeepSpeed engine", details=type(engine).__name__
            )
        return engine

    def run_loop(self, state, run: TrainerRun) -> None:
        super().run_loop(state, run)
        self._record_engine(state, run)

    def evaluate_live(self, state, run: TrainerRun):
        evaluation = super().evaluate_live(state, run)
        self._record_engine(state, run)
        return evaluation

    def _record_engine(self, state, run: TrainerRun) -> None:
        if "deepspeed" not in state.metrics.engine_effective:  # the cell's first engine; a resumed one is alike
            ds.record_effective(state, self.engine(run))

    def dropout_off_loss(self, state, run: TrainerRun) -> float:
        """The Trainer's first loss with dropout off, through its own arithmetic: each rank's
        compute_loss on its rows with the item count the Trainer passes (its
        _get_num_items_in_batch, gathered over the ranks), made the whole batch's as a step's
        loss is (whole_batch_loss). The kind's own loss would leave out what the Trainer does to
        it: a model that ignores num_items_in_batch, or is handed a count it does not divide by
        (trainer-num-items-overcounts-unmapped-causal-lm), would pass. Before train(): the model
        as built, under the precision's autocast."""
        trainer = run.trainer
        count = getattr(trainer, "_get_num_items_in_batch", None)  # transformers >= 4.46; before: none passed

        def trainers_loss(model, rows):
            items = count([rows], trainer.args.device) if count is not None else None
            loss = trainer.compute_loss(model, dict(rows), num_items_in_batch=items)
            return loss[0] if isinstance(loss, tuple) else loss

        rows = state.group.rows(state.batch)
        value = dropout_off_loss(state, trainer.model, rows, autocast=True, loss=trainers_loss)
        return self.whole_batch_loss(state, run, value)

    def library_evaluation(self, state, run: TrainerRun):
        with generators_kept(state):
            return evaluate_rows(state, self.engine(run).module, autocast=False)

    def live_weights(self, state, run: TrainerRun):
        if not hasattr(run.trainer.model_wrapped, "zero_optimization_stage"):
            return run.trainer.model  # before train(): the model as built
        return ds.plain_copy(state, self.engine(run))

    def live_optimizer_state(self, state, run: TrainerRun) -> dict:
        return ds.optimizer_state(self.engine(run))

    def live_scaler_state(self, state, run: TrainerRun) -> dict | None:
        return ds.scaler_state(self.engine(run))

    def live_master_weights(self, state, run: TrainerRun) -> dict:
        return ds.master_weights(self.engine(run))

    def live_named_master_weights(self, state, run: TrainerRun) -> dict:
        if not hasattr(run.trainer.model_wrapped, "zero_optimization_stage"):
            return {}  # before train(): the model as built, whose parameters are the weights
        return ds.full_master_weights(self.engine(run))

    def live_applied(self, state, run: TrainerRun) -> int:
        wrapped = run.trainer.model_wrapped
        return ds.applied_steps(wrapped) if hasattr(wrapped, "zero_optimization_stage") else 0

    def check_declared(self, state, run: TrainerRun, when: str) -> None:
        if not hasattr(run.trainer.model_wrapped, "zero_optimization_stage"):
            super().check_declared(state, run, when)  # before train(): the precision's, as built
            return
        ds.check_declared(state, self.engine(run), self.weights(state, run), when)

    def dtype_changes(self, state, run: TrainerRun) -> dict:
        """DeepSpeed, set up inside train(), casts the module's parameters to the half dtype its
        config enables, keeping fp32 master weights (check_declared); buffers keep theirs."""
        half = torch.bfloat16 if state.settings.bf16 else torch.float16 if state.settings.fp16 else None
        if half is None:
            return {}
        return {f"parameter {name}": half for name, p in run.trainer.model.named_parameters() if p.is_floating_point()}

    def exported(self, state, run: TrainerRun):
        """The Trainer saves the module's 16-bit weights: a fresh model of the kind in the
        precision with the trained parameters taken from them, as from_pretrained gives them back."""
        weights = self.weights(state, run)
        return ds.trained_into_fresh(state, {n: p for n, p in weights.named_parameters() if p.requires_grad})

    def close(self, state, run: TrainerRun) -> None:
        wrapped = None if run.trainer is None else run.trainer.model_wrapped
        if hasattr(wrapped, "destroy") and hasattr(wrapped, "zero_optimization_stage"):
            wrapped.destroy()


for _stage in (2, 3):
    register_with_compiled_twin(TrainerOnDeepSpeed(_stage))


# engine_effective.rank_loss_averaging: each rank's mean loss, the ranks' gradients averaged equally;
# or each rank's loss over the whole batch's item count (num_items_in_batch, counted across ranks)
EACH_RANKS_MEAN = "each-rank-mean"  # the value catalogue condition rank-means-averaged-over-uneven-shares reads
ITEMS_ACROSS_RANKS = "items-across-ranks"


def averages_items_across_ranks(trainer) -> bool:
    """Whether the Trainer divides each rank's loss by the whole batch's item count
    (average_tokens_across_devices, for a model that takes num_items_in_batch or a compute_loss_func)
    rather than leaving each rank its own mean."""
    counts_items = trainer.model_accepts_loss_kwargs or trainer.compute_loss_func
    return bool(trainer.args.average_tokens_across_devices and counts_items)


def rank_loss_averaging(state, trainer) -> dict:
    """How the Trainer's ranks combine their losses, and each rank's loss items: where each rank
    takes its own mean and the shares are unequal (rows that do not divide over the ranks), the
    gradient weighs the smaller share's items more than the whole batch's mean does (the catalogue's
    condition rank-means-averaged-over-uneven-shares reads these)."""
    from matrix.harness.group import Group

    world = state.group.world_size
    shares = [state.kind.loss_items(Group(rank, world).rows(state.batch)) for rank in range(world)]
    how = ITEMS_ACROSS_RANKS if averages_items_across_ranks(trainer) else EACH_RANKS_MEAN
    return {"rank_loss_averaging": how, "loss_items_per_rank": shares}
