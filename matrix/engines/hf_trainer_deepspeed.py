"""The hf-trainer-zero2 and hf-trainer-zero3 engines: the transformers Trainer with a DeepSpeed
config (TrainingArguments(deepspeed=...)), the path most DeepSpeed users take, on the run's group
of ranks (gloo on CPU, nccl on CUDA), each rank feeding the Trainer its rows of the batch.

The config is the one Hugging Face's documentation recommends: ZeRO stage 2 or 3, "auto" for
what the Trainer fills in (batch sizes, bf16/fp16 from its --bf16/--fp16, which the precision
sets as in the hf-trainer engine), the Trainer's own AdamW (no optimizer section), and at stage 3
the 16-bit weights gathered for save_model. The Trainer averages tokens across devices, so each
rank's loss is its share of the whole batch's mean, which DeepSpeed's averaged gradients make the
whole batch's step.

The phases are the hf-trainer engine's (train() runs the steps, evaluates and saves at step 3;
resume_from_checkpoint), with DeepSpeed's weights read as the deepspeed-zero* engines read them
(matrix/engines/deepspeed_zero.py).
"""

from __future__ import annotations

import torch

from matrix import checks, resume
from matrix.engines import deepspeed_zero as zero
from matrix.engines.accelerate_loop import reset_accelerate
from matrix.engines.base import Unsupported, one_switch_unsupported, register, run_tagged
from matrix.engines.distributed import (
    DistributedEngine,
    barrier,
    check_first_step,
    set_launcher_environment,
    shard_rows,
    sharded_dropout_off_loss,
)
from matrix.engines.hf_trainer import TRAINER_RANDOM_NUMBERS, Rows, _trainer, forward_skip_reason
from matrix.phases import (
    TRAIN_STEPS,
    CellState,
    check_against_fp32,
    check_agrees_with_torch_engine,
    check_reload,
    check_resumed_one_step,
    check_training_contract,
    evaluate_in_precision,
    fresh_model,
    record_library_steps,
    seed_first_training_forward,
    snapshot_trainable,
)
from matrix.precisions import Precision


def ds_config(state: CellState) -> dict:
    """The DeepSpeed config handed to TrainingArguments, "auto" where the Trainer fills it in."""
    stage = state.metrics.engine_settings["zero_stage"]
    zero: dict = {"stage": stage}
    if stage == 3:
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
    if state.metrics.engine_settings.get("communication_data_type"):
        config["communication_data_type"] = state.metrics.engine_settings["communication_data_type"]
    return config


def _deepspeed_trainer(state: CellState, context, model, max_steps: int, output: str = "trainer"):
    zero._deepspeed(state)  # DeepSpeed's accelerator for the cell's device, chosen before the Trainer imports it
    set_launcher_environment(state, context, also_restored=("DS_ACCELERATOR", "ACCELERATE_USE_DEEPSPEED"))
    state.engine_state.setdefault("rows", Rows(state.batch))
    rows = len(shard_rows(state.batch, 0, context.world_size)["input_ids"])
    trainer = _trainer(
        state,
        model,
        max_steps,
        output,
        output_dir=str(state.engine_state["shared_dir"] / output),  # every rank writes its part there
        deepspeed=ds_config(state),
        per_device_train_batch_size=rows,
        per_device_eval_batch_size=rows,
        # each rank its contiguous rows, the last rank fewer where they do not divide, as the other
        # distributed engines split the batch: accelerate's default (even_batches) would repeat the
        # first rows on the last rank, and the step would train on another batch than theirs
        accelerator_config={"even_batches": False},
    )
    state.metrics.engine_effective["config"] = ds_config(state)
    # the optimizer's state and the loss scaler (fp16) are DeepSpeed's, in the engine the Trainer
    # wraps the model in
    tracker = state.engine_state["tracker"]
    tracker.optimizer_state_of = lambda t: zero.optimizer_state(t.model_wrapped)
    tracker.scaler_state_of = lambda t: zero._scaler_state(t.model_wrapped)
    # While a ZeRO-3 TrainingArguments is alive, transformers builds every model partitioned
    # (deepspeed.zero.Init). The harness's own models (checkpoints read back, references) are
    # built as a user builds them in a new process: the config is in force in the Trainer's calls.
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    return trainer


def _calling(trainer, call):
    """trainer's `call` with its DeepSpeed config in force, as it is during a user's run."""
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    def run():
        set_hf_deepspeed_config(trainer.args.hf_deepspeed_config)
        try:
            return call()
        finally:
            unset_hf_deepspeed_config()

    return run


def _engine(trainer):
    """The DeepSpeed engine the Trainer trains through (its model_wrapped once train() set it up)."""
    engine = trainer.model_wrapped
    if not hasattr(engine, "zero_optimization_stage"):
        raise checks.CheckFailure("the Trainer did not train through a DeepSpeed engine", details=type(engine).__name__)
    return engine


def _keep(state: CellState, engine):
    """The cell's DeepSpeed engine, released when the cell ends (deepspeed_zero.destroy_engines)."""
    engines = state.engine_state.setdefault("engines", [])
    if not any(e is engine for e in engines):
        engines.append(engine)
    return engine


def _whole_batch_loss(state: CellState, context, trainer, value: float) -> float:
    """The whole batch's mean loss from a rank's Trainer loss. Where the Trainer averages tokens
    across devices (a model that takes num_items_in_batch), each rank's loss is its token sum over
    the whole batch's count, times the world size; otherwise it is the rank's own mean."""
    import torch.distributed as dist

    from matrix.engines.distributed import global_mean

    if trainer.args.average_tokens_across_devices and (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func):
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total)
        return total.item() / context.world_size
    return global_mean(value, state.kind.loss_items(shard_rows(state.batch, context.rank, context.world_size)))


def rank_train_steps(state: CellState, context) -> None:
    state.build()
    trainable = snapshot_trainable(state.model, state.kind)
    dropout_off = sharded_dropout_off_loss(state, context, state.model)
    trainer = _deepspeed_trainer(state, context, state.model, TRAIN_STEPS)
    run_tagged(_calling(trainer, trainer.train), state.engine_state["tracker"])
    engine = state.engine_state["engine"] = _keep(state, _engine(trainer))
    zero.record_effective(state, engine)
    losses = trainer.training_losses
    for loss in losses:
        checks.check_finite_loss(torch.tensor(loss), "training loss")
    state.metrics.train_losses = [_whole_batch_loss(state, context, trainer, loss) for loss in losses]
    record_library_steps(state, trainer.optimizer, trainer.state.global_step)
    check_first_step(state, state.metrics.train_losses, dropout_off)
    plain = zero.plain_copy(state, engine)
    check_training_contract(
        state,
        plain,
        trainable,
        checks.tensor_dtypes(plain),
        weights_check=lambda model, when: zero.check_declared_dtypes(state, engine, model, when),
    )


def rank_mid_training_eval(state: CellState, context) -> None:
    metrics = state.engine_state["tracker"].eval_metrics
    if metrics is None:
        raise checks.CheckFailure("the Trainer ran no evaluation on its step schedule")
    state.metrics.trainer_eval_loss = metrics.get("eval_loss")
    engine = state.engine_state["engine"]
    result = zero._evaluate(state, context, engine)
    check_against_fp32(state, result, "mid-training eval", model=zero.plain_copy(state, engine))


def rank_evaluate(state: CellState, context) -> None:
    state.build()
    trainer = _deepspeed_trainer(state, context, state.model, TRAIN_STEPS)
    tracker = state.engine_state["tracker"]
    tracker.phase = "evaluate"
    metrics = run_tagged(_calling(trainer, trainer.evaluate), tracker)
    state.metrics.trainer_eval_loss = metrics.get("eval_loss")
    engine = state.engine_state["engine"] = _keep(state, _engine(trainer))
    zero.record_effective(state, engine)
    result = zero._evaluate(state, context, engine)
    check_against_fp32(state, result, "eval", model=zero.plain_copy(state, engine))
    check_agrees_with_torch_engine(state, result.loss.item(), "eval")


def _checkpoint_dir(state: CellState):
    shared = state.engine_state["shared_dir"]
    return shared / "trainer" / f"checkpoint-{TRAIN_STEPS}" if state.cell.mode == "train" else shared / "saved-model"


def rank_checkpoint_save(state: CellState, context) -> None:
    trainer, engine = state.engine_state["trainer"], state.engine_state["engine"]
    if state.cell.mode == "eval":
        _calling(trainer, lambda: trainer.save_model(str(_checkpoint_dir(state))))()  # every rank: a collective
    else:
        resume.remember_point(state, zero.optimizer_state(engine), zero._scaler_state(engine))
    barrier()  # rank 0 writes the weights: every rank reads them once it is done
    directory = _checkpoint_dir(state)
    if not directory.is_dir():
        raise checks.CheckFailure("the Trainer wrote no checkpoint on its save schedule")
    state.metrics.checkpoint_files = sorted(p.name for p in directory.iterdir())
    # the Trainer saves the module's 16-bit weights: what from_pretrained must give back
    saved = fresh_model(state)
    zero.copy_trained(saved, zero.module_state(state, engine))
    state.engine_state["saved_in_precision"] = saved
    state.outputs_before_save = evaluate_in_precision(state, saved).logits


def rank_checkpoint_reload(state: CellState, context) -> None:
    reloaded = state.kind.load(_checkpoint_dir(state), state.precision, state.device, state.workdir)
    check_reload(state, reloaded, saved=state.engine_state["saved_in_precision"])
    state.engine_state["reloaded"] = reloaded


def rank_resumed_step(state: CellState, context) -> None:
    reset_accelerate(state)  # a resumed run is a new process
    model = state.kind.build(state.precision, state.device, state.workdir)
    trainer = _deepspeed_trainer(state, context, model, TRAIN_STEPS + 1)
    tracker = state.engine_state["tracker"]
    resuming = _calling(trainer, lambda: trainer.train(resume_from_checkpoint=str(_checkpoint_dir(state))))
    run_tagged(resuming, tracker)
    state.metrics.resumed_losses = [_whole_batch_loss(state, context, trainer, v) for v in trainer.training_losses]
    engine = _keep(state, _engine(trainer))
    check_resumed_one_step(
        state, trainer.training_losses, state.engine_state["reloaded"], zero.plain_copy(state, engine)
    )

    def uninterrupted():  # TRAIN_STEPS + 1 steps from the start, with the same schedule
        reset_accelerate(state)
        again = fresh_model(state)
        seed_first_training_forward(state, again)  # the first forward's draws, as in train_steps
        run = _deepspeed_trainer(state, context, again, TRAIN_STEPS + 1, output="uninterrupted")
        _calling(run, run.train)()
        return run.training_losses[TRAIN_STEPS:], zero._tensors(state, _keep(state, _engine(run)))

    resume.check_library_resume(
        state,
        (tracker.optimizer_at_begin, tracker.scaler_state_at_begin),
        trainer.training_losses,
        zero._tensors(state, engine),
        uninterrupted,
        TRAINER_RANDOM_NUMBERS,
    )


class TrainerDeepSpeedEngine(DistributedEngine):
    """The Trainer with a DeepSpeed config of one ZeRO stage."""

    rank_train_steps = staticmethod(rank_train_steps)
    rank_mid_training_eval = staticmethod(rank_mid_training_eval)
    rank_checkpoint_save = staticmethod(rank_checkpoint_save)
    rank_checkpoint_reload = staticmethod(rank_checkpoint_reload)
    rank_resumed_step = staticmethod(rank_resumed_step)
    rank_evaluate = staticmethod(rank_evaluate)

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.name = f"hf-trainer-zero{stage}"
        self.axis_position = 9 + stage  # after deepspeed-zero0 ... deepspeed-zero3
        self.description = (
            f"transformers Trainer with a DeepSpeed ZeRO-{stage} config (TrainingArguments(deepspeed=...)), "
            "save and resume_from_checkpoint through DeepSpeed"
        )

    def kind_skip_reason(self, kind) -> str | None:
        return forward_skip_reason(kind)

    def device_skip_reason(self, device) -> str | None:
        return zero.ENGINES_BY_STAGE[self.stage].device_skip_reason(device)

    def precision_device_skip_reason(self, precision: Precision, device) -> str | None:
        return zero.ENGINES_BY_STAGE[self.stage].precision_device_skip_reason(precision, device)

    def derive_settings(self, precision: Precision) -> dict | Unsupported:
        unsupported = one_switch_unsupported(self.name, "a TrainingArguments setting", precision)
        if unsupported:
            return unsupported
        return zero.ENGINES_BY_STAGE[self.stage].derive_settings(precision)

    def rank_cleanup(self, state: CellState) -> None:
        if "trainer" in state.engine_state:
            reset_accelerate(state)
        zero.destroy_engines(state)


for _stage in (2, 3):
    register(TrainerDeepSpeedEngine(_stage))
