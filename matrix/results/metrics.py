"""A cell's metrics, typed: what its phases measured (CellState.metrics, matrix/harness/pipeline.py) and what
results.json's `cells[].metrics` holds. Standard library only: the readers of a results.json
(diff, Markdown) read it with nothing but this module.

Every field of every record starts UNSET and is written by the phase that measures it, as far as
the cell got; `as_dict()` writes the fields that were set, None included (a null says "measured:
none", an absent key "not measured": `effective.autocast_dtype_in_forward` is absent when no
Linear module ran). `from_dict()` reads a results.json cell's metrics back; keys this version does
not know (an older or a newer schema's) are kept in `extra` and written back by `as_dict()`, so
a diff or merge across versions loses nothing. A writer cannot make up a key: the records have
slots, and assigning a field that does not exist raises.

The `metrics` part of results.schema.json is metrics_schema() (tests/test_metrics.py checks it
and that reports/README.md names every field).
"""

# no `from __future__ import annotations`: the fields' annotations are read at run time, they are
# what from_dict() reads nested records by and what metrics_schema() writes
import dataclasses
import types
import typing
from dataclasses import dataclass, field


class _Unset:
    """The value of a field no phase has written (distinct from None, which is written as null)."""

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:
        return "UNSET"  # one instance across processes (a rank's metrics come back pickled)


UNSET = _Unset()


def given(value, default=None):
    """`value`, or `default` where it is UNSET."""
    return default if value is UNSET else value


# a field's annotated type -> its JSON type; a float is written as a number or, not finite, as
# "nan" / "inf" / "-inf" (results.json is strict JSON)
JSON_TYPES = {float: ["number", "string"], int: ["integer"], bool: ["boolean"], str: ["string"], list: ["array"]}
JSON_TYPES[dict] = ["object"]


def recorded_float(value) -> float | None:
    """A float as results.json writes it (a number, or "nan" / "inf" / "-inf"), None where the
    value is not one (absent, a bool, another string)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:
            return float("inf")
    return None


def at_step(values, step) -> object:
    """values[step - 1] of a per-step list (a curve's losses, deviations), None where it has no such step."""
    if isinstance(values, list) and isinstance(step, int) and not isinstance(step, bool) and 1 <= step <= len(values):
        return values[step - 1]
    return None


def _value_type(f: dataclasses.Field) -> type:
    """`X` of a field annotated `X | None`."""
    (value_type,) = [t for t in typing.get_args(f.type) if t is not types.NoneType]
    return value_type


@dataclass(slots=True)
class Record:
    """A record of named fields, each UNSET until written; unknown keys read back go to `extra`."""

    extra: dict = field(default_factory=dict, repr=False)  # keys this version does not know, kept as read

    def as_dict(self) -> dict:
        out = {}
        for f in _fields(type(self)):
            value = getattr(self, f.name)
            if value is not UNSET:
                out[f.name] = value.as_dict() if isinstance(value, Record) else value
        return {**out, **self.extra}

    @classmethod
    def from_dict(cls, data: dict):
        known = {f.name: f for f in _fields(cls)}
        values, extra = {}, {}
        for key, value in data.items():
            f = known.get(key)
            if f is None:
                extra[key] = value
                continue
            value_type = _value_type(f)
            if issubclass(value_type, Record) and isinstance(value, dict):
                value = value_type.from_dict(value)
            values[key] = value
        return cls(**values, extra=extra)

    def update(self, other: "Record") -> None:
        """Take every field `other` set (a rank's metrics into the cell's)."""
        for f in _fields(type(self)):
            value = getattr(other, f.name)
            if value is not UNSET:
                setattr(self, f.name, value)
        self.extra.update(other.extra)


def _fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.name != "extra"]


@dataclass(slots=True)
class Tolerance(Record):
    """A tolerance as matrix/checks/tolerances.py Tolerance.as_dict() writes it: |a - b| <= atol + rtol * |b|."""

    atol: float | None = UNSET
    rtol: float | None = UNSET


@dataclass(slots=True)
class KindRecord(Record):
    """What the report records of the cell's model kind (matrix/harness/kind_traits.py kind_record)."""

    traits: list | None = UNSET  # the traits catalogue selectors match
    declared_traits: list | None = UNSET  # the traits the kind declares; null: observed
    observed: dict | None = UNSET  # matrix/models/observation.py Observation.as_dict()


@dataclass(slots=True)
class Effective(Record):
    """What is actually in force, not only what the precision's name promises (matrix/harness/measurements.py)."""

    parameter_dtypes: dict | None = UNSET  # dtype -> element count, every parameter
    trainable_parameter_dtypes: dict | None = UNSET  # dtype -> element count, trainable ones
    autocast_dtype: str | None = UNSET  # the precision's autocast context's dtype, null: off
    grad_scaler: bool | None = UNSET  # the precision's grad scaler is enabled (what the harness would make)
    # the engine's run held a loss scaler after training (Engine.scaler_state): what the loop did
    grad_scaler_in_run: bool | None = UNSET
    device: str | None = UNSET  # the torch device the cell ran on
    autocast_dtype_in_forward: str | None = UNSET  # in force in the model's first forward
    first_linear_input_dtype: str | None = UNSET  # the first Linear module's input dtype
    model_training_in_first_forward: bool | None = UNSET  # train mode in the first training forward
    # torch.get_float32_matmul_precision() refused when the cell's phases ended (the legacy and
    # per-backend fp32 precision APIs were mixed in this process: Inductor writes the new one);
    # read in the process that ran the phases, so a distributed engine's ranks are not seen
    legacy_matmul_getter_refused: bool | None = UNSET


@dataclass(slots=True)
class LearningRate(Record):
    """The learning rate the cell trained at (matrix/harness/learning_rate.py LearningRate.as_dict())."""

    value: float | None = UNSET  # AdamW's learning rate
    source: str | None = UNSET  # declared | calibrated
    fp32_fall: dict | None = UNSET  # the fp32 twin's fall at that rate
    fp32_learns: bool | None = UNSET  # the fp32 twin's fall reaches the kind's bound
    bound_relative: float | None = UNSET  # the kind's bound on the relative fall
    tried: list | None = UNSET  # the search's falls, one per rate tried
    cached: bool | None = UNSET  # read from the calibration cache


@dataclass(slots=True)
class Distributed(Record):
    """How a distributed engine's cell ran on its group of ranks (matrix/engines/distributed.py)."""

    world_size: int | None = UNSET  # ranks in the group
    backend: str | None = UNSET  # the process group's backend: gloo | nccl
    group_started_for_this_cell: bool | None = UNSET  # the group was (re)started for this cell
    group_start_s: float | None = UNSET  # seconds the group took to start
    begin_cell_s: float | None = UNSET  # seconds the ranks took to set the cell up
    rank_first_step_losses: list | None = UNSET  # each rank's loss of the first training step


@dataclass(slots=True)
class CrossEngine(Record):
    """The cell's first-step (or eval) loss against the torch engine's on a fresh model
    (matrix/harness/pipeline.py check_agrees_with_torch_engine); only one pair of losses is set."""

    first_step_loss: float | None = UNSET  # this engine's first training step's loss
    torch_engine_first_step_loss: float | None = UNSET  # the torch engine's
    eval_loss: float | None = UNSET  # this engine's eval loss
    torch_engine_eval_loss: float | None = UNSET  # the torch engine's
    first_step_loss_dropout_off: float | None = UNSET  # first step, dropout off (a distributed engine)
    torch_engine_first_step_loss_dropout_off: float | None = UNSET  # the torch engine's
    spread_abs: float | None = UNSET  # |loss - torch engine's loss|
    tolerance: Tolerance | None = UNSET  # what spread the check allows
    random_numbers: str | None = UNSET  # how both sides got the same draws (dropout), null: none drawn
    torch_engine_error: str | None = UNSET  # the torch engine's own failure there, instead


@dataclass(slots=True)
class CurveComparison(Record):
    """A training cell's losses step by step against one reference's (matrix/results/curves.py)."""

    reference: str | None = UNSET  # "torch engine" (the same precision) or "fp32 twin"
    reference_losses: list | None = UNSET  # the reference's losses, step by step
    tolerance: dict | None = UNSET  # the row: atol, rtol, per_step (matrix/checks/tolerances.py)
    steps_compared: int | None = UNSET  # the steps both took
    deviations: list | None = UNSET  # |loss - reference loss| per step compared
    allowed: list | None = UNSET  # what the row allows at each step
    first_step_outside: int | None = UNSET  # 1-based, null: every step within the row
    worst_step: int | None = UNSET  # the step nearest its limit
    worst_share: float | None = UNSET  # its deviation as a share of what the row allows there
    # the half dtype a side's losses were handed over in ({"losses": "bfloat16"}): half a step of it
    # is in `allowed` (matrix/results/curves.py compare)
    rounding: dict | None = UNSET
    unchecked: str | None = UNSET  # why the curve was not compared with this reference
    reference_error: str | None = UNSET  # the reference's own failure (its signature text), instead


@dataclass(slots=True)
class Curve(Record):
    """The training loss curve (the applied steps' losses) against the torch engine's and the fp32 twin's."""

    steps: int | None = UNSET  # step k: the steps trained before the checkpoint
    losses: list | None = UNSET  # the loss of each applied step (train_losses less the attempts a scaler skipped)
    random_numbers: str | None = UNSET  # how every side drew the same dropout masks
    torch_engine: CurveComparison | None = UNSET  # against the torch engine at the same precision
    fp32_twin: CurveComparison | None = UNSET  # against fp32 in the torch engine
    golden_tolerance: dict | None = UNSET  # the row a golden or an earlier run's curve is judged by


@dataclass(slots=True)
class LossDecrease(Record):
    """The training loss's fall, measured alike before and after training (check_training_contract)."""

    loss_before_training: float | None = UNSET  # seeded training loss of the fresh model
    loss_after_training: float | None = UNSET  # the same measurement after training
    relative: float | None = UNSET  # (before - after) / before
    bound_relative: float | None = UNSET  # the fall required, null: unchecked
    judged_by: str | None = UNSET  # what the bound is (fp32's own, a share of the fp32 twin's) or why none


@dataclass(slots=True)
class Quantized(Record):
    """A quantized base (matrix/precisions/quantization.py): its storage, its two deviations, its saves."""

    storage: dict | None = UNSET  # quantized layers, their storage dtype, what stayed unquantized
    fp32_reference: str | None = UNSET  # what the cell's fp32_reference_loss is computed from
    unquantized_loss: float | None = UNSET  # the unquantized fp32 model with the same adapters
    unquantized_deviation_abs: float | None = UNSET  # |eval_loss - unquantized_loss|
    unquantized_tolerance: Tolerance | None = UNSET  # what that deviation may be
    prequantized_files: list | None = UNSET  # the files of the base saved quantized
    prequantized_reload_max_abs_difference: float | None = UNSET  # eval logits, before vs over the reread base
    merged_deviation_max_abs: float | None = UNSET  # eval logits, merged into the base vs as adapters
    merged_reload_max_abs_difference: float | None = UNSET  # eval logits, merged model saved vs reread


@dataclass(slots=True)
class Float8Record(Record):
    """float8 training (matrix/precisions/float8.py): what was converted, and how far its outputs are from fp32."""

    converted: list | None = UNSET  # the Float8Linear layers of the run's model, observed after prepare
    left_out: dict | None = UNSET  # the Linear layers left in high precision -> why
    converted_by: str | None = UNSET  # who converted them: the harness as users do, or the library


@dataclass(slots=True)
class Compiled(Record):
    """torch.compile (matrix/harness/compiling.py): what was compiled, per phase, and the eager twin's agreement."""

    how: str | None = UNSET  # how the engine's library compiles the model
    graphs_by_phase: dict | None = UNSET  # phase -> graphs Dynamo compiled in it
    graphs_per_training_step: list | None = UNSET  # graphs compiled in each of the first run's steps
    frames_run_eagerly: int | None = UNSET  # frames Dynamo gave up on (they ran eagerly)
    graph_breaks: dict | None = UNSET  # graph break reason -> count, over the cell
    recompile_reasons: list | None = UNSET  # the guards that failed, over the cell
    cache: dict | None = UNSET  # Inductor's FX graph cache and AOTAutograd's cache: hits and misses
    eager_logits_dtype: str | None = UNSET  # the eager twin's eval logits dtype
    eager_loss: float | None = UNSET  # the same weights evaluated eagerly (the eager twin)
    eager_deviation_abs: float | None = UNSET  # |compiled eval loss - eager eval loss|
    eager_logits_max_abs_difference: float | None = UNSET  # the largest |compiled logit - eager logit|
    eager_tolerance: Tolerance | None = UNSET  # what the loss deviation may be (matrix/checks/tolerances.py)
    comparison: str | None = UNSET  # within a tolerance row, or bit for bit under emulate_precision_casts


@dataclass(slots=True)
class Resume(Record):
    """A resumed step k+1 against the same run uninterrupted (matrix/harness/resume.py)."""

    optimizer_state_tensors: int | None = UNSET  # optimizer state tensors held at the save (this rank's)
    optimizer_state_restored: bool | None = UNSET  # all of them back bit for bit after the reload
    scaler_state_restored: bool | None = UNSET  # the grad scaler's state back (null: no scaler)
    judged: str | None = UNSET  # bit for bit (a deterministic device) or within tolerance, and why
    tolerance: Tolerance | None = UNSET  # the losses' tolerance where not bit for bit
    tensor_tolerance: Tolerance | None = UNSET  # the tensors' tolerance where not bit for bit
    step_losses: list | None = UNSET  # the resumed step's losses, every attempt
    uninterrupted_step_losses: list | None = UNSET  # the uninterrupted run's step k+1 losses
    loss_difference_abs: float | None = UNSET  # the largest |resumed - uninterrupted| loss
    tensors_compared: int | None = UNSET  # parameters, master weights and optimizer state compared
    tensors_differing: int | None = UNSET  # of those, how many differ (beyond tolerance)
    tensors_max_abs_difference: float | None = UNSET  # the largest difference of any of them
    random_numbers: str | None = UNSET  # how both sides of step k+1 got the same draws


@dataclass(slots=True)
class CellMetrics(Record):
    """What a cell's phases measured, as far as the cell got."""

    declared: dict | None = UNSET  # the precision's settings (Precision.settings())
    variant: dict | None = UNSET  # the settings an exploration ran the cell with
    engine_settings: dict | None = UNSET  # what the precision is called in the engine
    policy_contradictions: list | None = UNSET  # the precision's settings that contradict each other
    kind: KindRecord | None = UNSET  # the model kind: traits, what was observed
    effective: Effective | None = UNSET  # what is really in force
    learning_rate: LearningRate | None = UNSET  # in a training cell
    engine_effective: dict | None = UNSET  # what the engine made of the precision, engine by engine
    distributed: Distributed | None = UNSET  # a distributed engine's group of ranks
    train_losses: list | None = UNSET  # the losses of the training steps, as the engine saw them
    rank_first_step_loss: float | None = UNSET  # rank 0's own loss of the first step (its rows)
    grad_scale: float | None = UNSET  # the torch engine's GradScaler scale after training
    optimizer_steps_applied: int | None = UNSET  # steps applied of a library's fixed number
    steps_skipped_by_grad_scaler: int | None = UNSET  # steps the grad scaler skipped (overflow)
    trainer_eval_loss: float | None = UNSET  # the HF Trainer's own eval_loss
    eval_loss: float | None = UNSET  # evaluation loss in the precision
    fp32_reference_loss: float | None = UNSET  # the same weights' loss in fp32, no autocast
    fp32_deviation_abs: float | None = UNSET  # |eval_loss - fp32_reference_loss|
    fp32_deviation_rel: float | None = UNSET  # that, relative to the reference
    fp32_tolerance: Tolerance | None = UNSET  # what deviation the check allows
    quantized: Quantized | None = UNSET  # a quantized base's storage, deviations and saves
    float8: Float8Record | None = UNSET  # float8 training: the converted layers, the SQNR against fp32
    compiled: Compiled | None = UNSET  # torch.compile: graphs, breaks, recompiles, the eager twin
    eval_logits_dtype: str | None = UNSET  # the dtype of the eval logits
    logits_sqnr_db: float | None = UNSET  # eval logits vs the fp32 reference's: SQNR, dB (null: identical)
    eval_cache_type: str | None = UNSET  # a causal LM's KV cache class in evaluation
    real_position_logits_max_abs_deviation: float | None = UNSET  # largest |logit - fp32 logit|, real tokens
    pad_position_logits_max_abs_deviation: float | None = UNSET  # the same at pad positions, null: no pad
    generated_tokens: int | None = UNSET  # tokens a causal LM generated
    generation_matches_fp32: bool | None = UNSET  # the same tokens as fp32's
    cross_engine: CrossEngine | None = UNSET  # against the torch engine
    curve: Curve | None = UNSET  # the training loss curve against the torch engine's and the fp32 twin's
    placement_restored: list | None = UNSET  # a library's move of the model undone: after, by, ...
    library_seconds: float | None = UNSET  # inside the engine's library calls: the cell's floor (library_clock.py)
    loss_decrease: LossDecrease | None = UNSET  # the training loss's fall and its bound
    checkpoint_files: list | None = UNSET  # the files the checkpoint wrote
    accelerate_state_files: list | None = UNSET  # accelerate's save_state files (accelerate-fsdp2)
    dcp_files: int | None = UNSET  # files torch.distributed.checkpoint wrote (fsdp2)
    deepspeed_checkpoint_files: list | None = UNSET  # the files DeepSpeed's save_checkpoint wrote
    reload_max_abs_difference: float | None = UNSET  # eval logits, saved vs reloaded model
    dcp_reload_max_abs_difference: float | None = UNSET  # the same through the sharded checkpoint (before issue 35)
    resume_reload_max_abs_difference: float | None = UNSET  # eval logits, the run as saved vs the engine's resumed run
    resumed_losses: list | None = UNSET  # the loss of the step resumed from the checkpoint
    resume: Resume | None = UNSET  # the resumed step against the same run uninterrupted


RECORDS = (
    CellMetrics,
    KindRecord,
    Effective,
    LearningRate,
    Distributed,
    CrossEngine,
    Curve,
    CurveComparison,
    LossDecrease,
    Tolerance,
    Resume,
)


def field_names(record: "type[Record]" = CellMetrics) -> list[str]:
    """Every field of `record` and, as parent.child, of the records it holds."""
    names = []
    for f in _fields(record):
        names.append(f.name)
        if issubclass(_value_type(f), Record):
            names += [f"{f.name}.{child}" for child in field_names(_value_type(f))]
    return names


def metrics_schema(record: "type[Record]" = CellMetrics) -> dict:
    """The JSON Schema of `record` as as_dict() writes it: results.schema.json's `metrics`. Every
    field may be absent (not measured) or null; other keys are allowed (an older run's)."""
    properties = {}
    for f in _fields(record):
        value_type = _value_type(f)
        if issubclass(value_type, Record):
            properties[f.name] = {"oneOf": [{"type": "null"}, metrics_schema(value_type)]}
        else:
            properties[f.name] = {"type": [*JSON_TYPES[value_type], "null"]}
    return {"type": "object", "description": (record.__doc__ or "").split("\n")[0], "properties": properties}
