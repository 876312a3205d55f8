"""What the phases of every cell share, whatever the engine: the state they hand to each other
(CellState), the phase names of each mode, and the checks they make (training contract,
evaluation against fp32, checkpoint round trip, agreement with the torch engine). Engines
(matrix/engines/) build their phases from these; matrix/execute.py runs them."""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from matrix import checks, declared_dtypes
from matrix.cell import Cell
from matrix.devices import DEVICES, Device
from matrix.models import ModelKind
from matrix.observation import observe
from matrix.precisions import PRECISIONS, Precision, dtype_name
from matrix.results import metrics as typed  # the metrics records: typed.Effective, typed.LossDecrease, ...
from matrix.results.metrics import UNSET, CellMetrics, given
from matrix.signatures import signature_of
from matrix.tolerances import (
    CHECKPOINT_ROUND_TRIP,
    LOSS_FALL_VS_FP32,
    QUANTIZED_VS_UNQUANTIZED,
    LossDecrease,
    eval_loss_tolerance,
    loss_decrease_bound,
    relative_fall,
)

PHASE_NAMES: dict[str, tuple[str, ...]] = {
    "train": ("train_steps", "mid_training_eval", "checkpoint_save", "checkpoint_reload", "resumed_step"),
    "eval": ("evaluate", "checkpoint_save", "checkpoint_reload"),
}
TRAIN_STEPS = 3  # optimizer steps actually applied
# GradScaler starts at 2**16 and halves the scale on every overflow, skipping that step by
# design; on these tiny models the first few fp16 steps overflow. Attempts are capped so
# a scaler that never recovers is a failure, not a hang.
MAX_STEP_ATTEMPTS = 16
# The random numbers of the first training forward (dropout masks) are drawn from this seed in
# every engine, and in the torch engine's yardstick: the cross-engine check compares losses
# computed from the same draws (seed_first_training_forward).
FIRST_FORWARD_SEED = 20261123
# engine_state key: while set, the first-forward hooks (watch_first_forward,
# seed_first_training_forward) let a forward pass that is not the cell's first training one
HOOKS_PAUSED = "first_forward_hooks_paused"


@dataclass
class CellState:
    """What the phases of one cell hand to each other."""

    cell: Cell
    kind: ModelKind
    precision: Precision
    device: torch.device
    workdir: Path
    metrics: CellMetrics  # what the phases measured: the cell record's metrics
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scaler: torch.amp.GradScaler | None = None
    batch: dict | None = None
    outputs_before_save: torch.Tensor | None = None
    engine_state: dict = field(default_factory=dict)  # what an engine keeps between its phases
    # seeded_training_loss of a fresh model: the loss-decrease check's "before" and the
    # cross-engine check's torch-engine yardstick in training, measured once per cell
    loss_before_training: float | None = None
    # time.monotonic() by which the cell must be done (its --cell-timeout), or None: what an
    # engine that waits on other processes (the distributed ones) waits for at most
    deadline: float | None = None

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def device_kind(self) -> Device:
        """The device axis' entry the cell runs on (matrix/devices/)."""
        return DEVICES[self.cell.device]

    def eval_grad_context(self):
        """The grad mode evaluation runs in: no_grad, or inference_mode if the variant says so."""
        return torch.inference_mode() if self.kind.variant.eval_grad_mode == "inference_mode" else torch.no_grad()

    def build(self) -> None:
        self.metrics.kind = kind_record(self.kind, with_rate=self.cell.mode == "train")
        self.model = self.kind.build(self.precision, self.device, self.workdir)
        self.batch = self.kind.batch(self.device)
        self.metrics.effective = effective_settings(self)
        watch_first_forward(self, self.model)
        seed_first_training_forward(self, self.model)
        checks.check_dtypes(self.kind.precision_weights(self.model), self.expected_dtypes(self.model), "after build")
        checks.check_frozen_kept(observe(self.kind).frozen_parameters, self.model, "after build")
        if self.precision.quantization is not None:
            from matrix.quantization import check_storage

            storage = check_storage(self.model, self.precision.quantization, "after build")
            self.metrics.quantized = typed.Quantized(storage=storage)

    def expected_dtypes(self, model) -> dict:
        """The dtype each of the kind's precision weights must have: the precision's, or fp32
        where the architecture declares a module fp32 and from_pretrained obtained the model."""
        weights = self.kind.precision_weights(model)
        if self.precision.quantization is not None:
            from matrix.quantization import storage_expectations

            return storage_expectations(model, weights, self.precision.quantization, self.precision.weights_dtype)
        loaded = self.kind.loaded_in_dtype(self.precision, reloaded=False)
        return declared_dtypes.expected_dtypes(weights, model, self.precision.weights_dtype, loaded)

    @property
    def learning_rate(self) -> float:
        """AdamW's learning rate in every engine: the kind's own, else the one calibrated for it
        (matrix/learning_rate.py); recorded in the cell's metrics."""
        established = kind_learning_rate(self.kind)
        self.metrics.learning_rate = typed.LearningRate.from_dict(established.as_dict())
        return established.value

    def new_optimizer(self, model) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=self.learning_rate)


def kind_learning_rate(kind):
    """The kind's learning rate and its fp32 twin's fall (matrix/learning_rate.py), measured by
    Fp32Training."""
    from matrix.learning_rate import learning_rate

    return learning_rate(kind, Fp32Training)


class Fp32Training:
    """How the learning-rate search measures: fp32 in the torch engine, on the CPU, as a cell
    trains (seeded_training_loss before and after TRAIN_STEPS applied steps of train_step)."""

    @staticmethod
    def state(kind, workdir: Path) -> CellState:
        cpu = torch.device("cpu")
        return CellState(
            cell=Cell(kind.name, "fp32", "train", "cpu", "torch"),
            kind=kind,
            precision=PRECISIONS["fp32"],
            device=cpu,
            workdir=workdir,
            metrics=CellMetrics(),
            batch=kind.batch(cpu),
        )

    @staticmethod
    def loss_before(kind, workdir: Path) -> float:
        """The fp32 model's seeded training loss before any step: the kind's fingerprint."""
        state = Fp32Training.state(kind, workdir)
        return seeded_training_loss(state, fresh_model(state))

    @staticmethod
    def fall(kind, rate: float, workdir: Path):
        """fp32 training of a fresh model at `rate`; the global generators are left as they were."""
        from matrix.learning_rate import Fall

        state = Fp32Training.state(kind, workdir)
        model = fresh_model(state)
        before = seeded_training_loss(state, model)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=rate)
        model.train()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(FIRST_FORWARD_SEED)  # the draws every engine's first training forward makes
            try:
                train_until_applied(state, lambda: train_step(state, model, optimizer, None), TRAIN_STEPS)
            except checks.CheckFailure as failure:  # a non-finite loss, gradient or weight: this rate does not learn
                return Fall(rate, before, None, error=f"{type(failure).__name__}: {failure}")
        return Fall(rate, before, seeded_training_loss(state, model))


RATE_TRAIT = "updates-below-bf16-resolution"
ADAMW_WEIGHT_DECAY = 0.01  # torch.optim.AdamW's default, which every engine trains with
BF16_MANTISSA_BITS = 7
_STALLED: dict[tuple, tuple[str, ...]] = {}


def kind_traits(kind, with_rate: bool = True) -> frozenset[str]:
    """The traits catalogue selectors match (matrix/models/base.py TRAITS): the ones the kind
    declares, else those observed on its model (matrix/observation.py) and, from its learning
    rate, RATE_TRAIT: some trainable tensor held in bf16 cannot move at that rate
    (bf16_stalled_tensors). `with_rate=False` leaves RATE_TRAIT
    out rather than establish the rate (a search that trains: only where a cell asks for it)."""
    from matrix.observation import effective_traits

    traits = set(effective_traits(kind))
    if getattr(kind, "traits", None) is not None or not with_rate:
        return frozenset(traits)
    if bf16_stalled_tensors(kind, kind_learning_rate(kind).value):
        traits.add(RATE_TRAIT)
    return frozenset(traits)


def bf16_stalled_tensors(kind, rate: float) -> tuple[str, ...]:
    """The trainable tensors that AdamW at `rate` cannot move once the weights are bf16 (those the
    kind holds in the precision's dtype: precision_weights): a step of the rate is under half a
    bf16 ulp of the tensor's median weight, or the first step (decoupled
    weight decay, then rate * g / (|g| + eps), which is what Adam's bias-corrected first step
    is) applied to the bf16 weights in fp32 and rounded back to bf16 gives every element back
    unchanged. Gradients from one fp32 training backward of the kind's
    fixed batch; tensors that get none (observation's gradless) are not counted, nor those
    from_pretrained keeps in fp32 (they are bf16 in bf16-true only). Once per kind, variant and
    rate in a process."""
    key = (kind.name, type(kind), kind.variant, rate)
    if key not in _STALLED:
        with torch.random.fork_rng(devices=[]), tempfile.TemporaryDirectory(prefix="matrix-bf16-step-") as scratch:
            cpu = torch.device("cpu")
            model = kind.build(PRECISIONS["fp32"], cpu, Path(scratch))
            model.train()
            kind.loss(model, kind.batch(cpu)).backward()
            held_in_precision = kind.precision_weights(model)  # not peft's fp32 adapters
            gradless = set(observe(kind).gradless_parameters)
            # what from_pretrained keeps in fp32 (declared, or created so) moves in bf16-loaded-mixed
            patterns = declared_dtypes.fp32_patterns(model, torch.bfloat16)
            created = declared_dtypes.created_fp32(model, torch.bfloat16)
            gradless |= {n for n in held_in_precision if declared_dtypes.fp32_reason(n, patterns, created)}
            stalled = []
            for name, p in model.named_parameters():
                if not p.requires_grad or p.grad is None or name in gradless or name not in held_in_precision:
                    continue
                weights = p.detach().to(torch.bfloat16)
                step = weights.float() * (1 - rate * ADAMW_WEIGHT_DECAY)
                step -= rate * p.grad / (p.grad.abs() + 1e-8)
                # the first step rounds away, or a step of the rate is under half a bf16 ulp of the
                # tensor's typical (median) weight: later steps, whose momentum has shrunk them
                # below the rate (a resumed step), round away there (pretrained LayerNorm weights)
                median = p.detach().abs().median().item()
                below = median > 0 and rate < 2.0 ** (math.floor(math.log2(median)) - BF16_MANTISSA_BITS - 1)
                if below or torch.equal(step.to(torch.bfloat16), weights):
                    stalled.append(name)
        _STALLED[key] = tuple(stalled)
    return _STALLED[key]


def kind_record(kind, with_rate: bool) -> typed.KindRecord:
    """What the report records of the cell's model kind: the traits catalogue selectors match
    (RATE_TRAIT in training cells, which establish the rate anyway), the ones it declares (None:
    observed), and what was observed (matrix/observation.py)."""
    declared = getattr(kind, "traits", None)
    return typed.KindRecord(
        traits=sorted(kind_traits(kind, with_rate)),
        declared_traits=sorted(declared) if declared is not None else None,
        observed=observe(kind).as_dict(),
    )


def effective_settings(state: CellState) -> typed.Effective:
    """What is actually in force, not only what the precision's name promises."""
    dtypes: dict[str, int] = {}
    trainable: dict[str, int] = {}
    for p in state.model.parameters():
        dtypes[dtype_name(p.dtype)] = dtypes.get(dtype_name(p.dtype), 0) + p.numel()
        if p.requires_grad:
            trainable[dtype_name(p.dtype)] = trainable.get(dtype_name(p.dtype), 0) + p.numel()
    with state.precision.autocast(state.device_type):
        autocast_on = torch.is_autocast_enabled(state.device_type)
        autocast_dtype = torch.get_autocast_dtype(state.device_type) if autocast_on else None
    scaler = state.precision.make_grad_scaler(state.device_type)
    return typed.Effective(
        parameter_dtypes=dtypes,
        trainable_parameter_dtypes=trainable,
        autocast_dtype=dtype_name(autocast_dtype) if autocast_dtype else None,
        grad_scaler=scaler is not None and scaler.is_enabled(),
        device=str(state.device),
    )


def watch_first_forward(state: CellState, model) -> None:
    """Record the autocast state in force inside the model's first forward.

    The hook fires at the model's Linear layers, inside whatever wrapper an engine puts
    around the model's forward, so it sees what the engine really does (accelerate does not
    autocast to fp16 on a CPU; Lightning turns 16-mixed into bf16 there), not what was asked
    for. It is a global module hook, not one on the model's modules: torch's
    TransformerEncoderLayer leaves its fast path when a module of its own carries a hook, and
    the observation must not change the code path it observes. The first Linear of the model
    actually called reports; then the hook is removed.
    """
    linears = {id(m) for m in model.modules() if isinstance(m, torch.nn.Linear)}

    def observe(module, args):
        if id(module) not in linears or state.engine_state.get(HOOKS_PAUSED):
            return
        enabled = torch.is_autocast_enabled(state.device_type)
        dtype = torch.get_autocast_dtype(state.device_type) if enabled else None
        state.metrics.effective.autocast_dtype_in_forward = dtype_name(dtype) if dtype else None
        state.metrics.effective.first_linear_input_dtype = next(
            (dtype_name(a.dtype) for a in args if isinstance(a, torch.Tensor)), None
        )
        handle.remove()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(observe)
    state.engine_state["first_forward_watch"] = handle


def seed_first_training_forward(state: CellState, model) -> None:
    """Seed the global generator right before the model's first forward in training mode.

    Whatever an engine does before (a Trainer seeds at construction, a sampler draws a
    permutation, accelerate and Lightning set themselves up), the first training forward
    starts from FIRST_FORWARD_SEED, so its dropout masks are the ones the torch engine's
    yardstick draws (torch_engine_loss). A global hook, as in watch_first_forward: a hook on
    the model's own modules would change the code paths it sits on.
    """

    def seed(module, args):
        if module is model and not state.engine_state.get(HOOKS_PAUSED):
            # a library may leave a model in eval mode while training it (dropout off): recorded
            state.metrics.effective.model_training_in_first_forward = module.training
            if module.training:
                torch.manual_seed(FIRST_FORWARD_SEED)
            handle.remove()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(seed)
    state.engine_state["first_training_forward_seed"] = handle


# ---------------------------------------------------------------- shared checks


def evaluate_in_precision(state: CellState, model):
    """Evaluation as the precision defines it: eval mode, no_grad (or the variant's
    inference_mode), the precision's autocast."""
    model.eval()
    with state.eval_grad_context(), state.precision.autocast(state.device_type):
        return state.kind.evaluate(model, state.batch)


def fp32_reference_model(state: CellState, model):
    """A fresh fp32 model of the same kind holding the same weights, upcast.

    Built anew rather than copied, so that nothing an engine wrapped around the model (an
    autocast forward, an output converter) comes along.
    """
    reference = state.kind.build(PRECISIONS["fp32"], state.device, state.workdir)
    reference.load_state_dict({name: tensor.float() for name, tensor in model.state_dict().items()})
    return reference.eval()


def fp32_reference(state: CellState, model):
    """The evaluation of `model`'s weights in fp32 on the cell's batch, no autocast: an fp32
    copy; for a quantized base, the same quantized weights multiplied in fp32 (the quantized
    precision's own error; the quantization's is check_quantization_error's)."""
    if state.precision.quantization is None:
        reference_model = fp32_reference_model(state, model)
        with torch.no_grad():
            return state.kind.evaluate(reference_model, state.batch)
    from matrix.quantization import fp32_compute

    same_base = same_weights_copy(state, model).eval()
    state.metrics.quantized.fp32_reference = "the same quantized base and adapters, fp32 compute, no autocast"
    with torch.no_grad(), fp32_compute(same_base):
        return state.kind.evaluate(same_base, state.batch)


def check_quantization_error(state: CellState, model, value: float, label: str) -> None:
    """The evaluation loss of a quantized cell against the unquantized fp32 model holding the same
    trained adapters (the rest as created), within its scheme's row (matrix/tolerances.py)."""
    from matrix.quantization import copy_float_weights

    twin = state.kind.build(PRECISIONS["fp32"], state.device, state.workdir)
    missing = copy_float_weights(model, twin, trainable_only=True)
    if missing:
        raise checks.CheckFailure(
            "the unquantized model has no place for a trained tensor of the quantized one",
            details=f"{len(missing)} trainable tensors, first {missing[0]}",
        )
    twin.eval()
    with torch.no_grad():
        reference = checks.check_finite_loss(state.kind.evaluate(twin, state.batch).loss, "unquantized fp32 loss")
    tolerance = QUANTIZED_VS_UNQUANTIZED[state.precision.quantization.scheme]
    record = state.metrics.quantized
    record.unquantized_loss = reference
    record.unquantized_deviation_abs = abs(value - reference)
    record.unquantized_tolerance = typed.Tolerance(**tolerance.as_dict())
    checks.check_within_tolerance(f"{label} loss against the unquantized model", value, reference, tolerance)


def check_against_fp32(state: CellState, result, label: str, model=None) -> None:
    """Evaluation loss vs an fp32 copy of the same weights on the same batch, no autocast."""
    model = state.model if model is None else model
    reference = fp32_reference(state, model)
    value = checks.check_finite_loss(result.loss, f"{label} loss")
    ref_value = checks.check_finite_loss(reference.loss, f"fp32 reference {label} loss")
    tolerance = eval_loss_tolerance(state.cell.model, state.precision.compute_dtype)
    metrics = state.metrics
    metrics.eval_loss = value
    metrics.fp32_reference_loss = ref_value
    metrics.fp32_deviation_abs = abs(value - ref_value)
    metrics.fp32_deviation_rel = abs(value - ref_value) / abs(ref_value) if ref_value else None
    metrics.fp32_tolerance = typed.Tolerance(**tolerance.as_dict())
    metrics.eval_logits_dtype = dtype_name(result.logits.dtype)
    for name, extra in result.extras.items():  # a model's extras have fields: eval_cache_type
        setattr(metrics, "eval_" + name, extra)
    deviations = position_deviations(result.logits, reference.logits, state.batch.get("attention_mask"))
    for name, deviation in deviations.items():
        setattr(metrics, name, deviation)
    if result.generated is not None:
        metrics.generated_tokens = result.generated.shape[-1] - state.batch["input_ids"].shape[-1]
        metrics.generation_matches_fp32 = reference.generated is not None and torch.equal(
            result.generated, reference.generated
        )
    checks.check_within_tolerance(f"{label} loss", value, ref_value, tolerance)
    if state.precision.quantization is not None:
        check_quantization_error(state, model, value, label)


def position_deviations(logits: torch.Tensor, reference: torch.Tensor, attention_mask) -> dict:
    """Largest |logit - fp32 logit| at real and at pad positions (attention mask 0).

    No label is predicted from a pad position (models/causal_lm.py next_token_targets), so
    the pad positions' outputs never reach a loss or a check. They are recorded because what
    an attention kernel returns for a fully masked row differs between kernels and dtypes
    (SDPA on CUDA in half precision, docs/GPU.md): a finding to see, not a failure.
    """
    if attention_mask is None or logits.shape[:2] != attention_mask.shape or reference.shape != logits.shape:
        return {}
    difference = (logits.detach().float() - reference.detach().float()).abs().amax(dim=-1)
    pad = attention_mask == 0
    return {
        "real_position_logits_max_abs_deviation": difference[~pad].max().item(),
        "pad_position_logits_max_abs_deviation": difference[pad].max().item() if pad.any() else None,
    }


def train_step(state: CellState, model, optimizer, scaler) -> tuple[float, bool]:
    """One optimizer step over the precision's micro-batches, as the torch engine takes it (the
    way the precisions are defined). Returns (loss, step applied)."""
    optimizer.zero_grad(set_to_none=True)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    accumulation = state.precision.grad_accumulation
    losses = []
    for _ in range(accumulation):
        with state.precision.autocast(state.device_type):
            loss = state.kind.loss(model, state.batch) / accumulation
        losses.append(checks.check_finite_loss(loss, "training loss") * accumulation)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if state.precision.grad_dtype is not None:
            # keep the accumulated gradients in grad_dtype, as SimpleTuner's
            # --gradient_precision does between micro-steps
            for _, p in named:
                if p.grad is not None and p.grad.dtype != state.precision.grad_dtype:
                    p.grad.data = p.grad.data.to(state.precision.grad_dtype)
    value = sum(losses) / len(losses)
    if scaler is None:
        checks.check_finite_gradients(named)
        optimizer.step()
        applied = True
    else:
        scaler.unscale_(optimizer)  # GradScaler refuses fp16 gradients here, by its own rule
        overflow = bool(checks.nonfinite_gradients(named))  # such a step is skipped by design
        scaler.step(optimizer)
        scaler.update()
        applied = not overflow
    checks.check_finite_parameters(named, "after the optimizer step")
    return value, applied


def train_until_applied(state: CellState, step, steps: int) -> list[float]:
    """Call step() -> (loss, applied) until `steps` optimizer steps were applied."""
    losses, skipped = [], 0
    while len(losses) - skipped < steps:
        if len(losses) == MAX_STEP_ATTEMPTS:
            raise checks.NonFiniteValue(
                "gradients kept overflowing: the grad scaler skipped every step",
                details=f"{skipped} of {len(losses)} attempts skipped",
            )
        loss, applied = step()
        losses.append(loss)
        skipped += not applied
    state.metrics.steps_skipped_by_grad_scaler = given(state.metrics.steps_skipped_by_grad_scaler, 0) + skipped
    return losses


def _generators_kept(state: CellState):
    """A context that leaves the global generators (the CPU's and the cell's GPU's) as it found them."""
    return torch.random.fork_rng(devices=state.device_kind.rng_devices(state.device))


def seeded_training_loss(state: CellState, model) -> float:
    """The loss of `model` on the cell's batch measured as its first training forward was:
    train mode, the precision's autocast, the dropout draws seeded with FIRST_FORWARD_SEED, no
    gradients. Two such measurements differ by the weights alone. The global generators are
    left as they were and the model in the mode it was in."""
    was_training = model.training
    model.train()
    try:
        with torch.no_grad(), state.precision.autocast(state.device_type), _generators_kept(state):
            torch.manual_seed(FIRST_FORWARD_SEED)  # the draws the cell's own first forward made
            return state.kind.loss(model, state.batch).float().item()
    finally:
        model.train(was_training)


def fresh_model(state: CellState):
    """The cell's model as every engine starts from it (built deterministically), leaving the
    global generators as they were."""
    with _generators_kept(state):
        return state.kind.build(state.precision, state.device, state.workdir)


def loss_before_training(state: CellState) -> float:
    """seeded_training_loss of a fresh model, measured once per cell."""
    if state.loss_before_training is None:
        state.loss_before_training = seeded_training_loss(state, fresh_model(state))
    return state.loss_before_training


def torch_engine_loss(state: CellState, mode: str) -> float:
    """The loss the torch engine computes first, on a fresh model: the cross-engine yardstick.
    `train-dropout-off`: the training loss of a fresh model with dropout off (eval mode)."""
    if mode == "train":
        return loss_before_training(state)
    if mode == DROPOUT_OFF:
        return dropout_off_loss(state, fresh_model(state), state.batch)
    return evaluate_in_precision(state, fresh_model(state)).loss.float().item()


DROPOUT_OFF = "train-dropout-off"


def dropout_off_loss(state: CellState, model, batch, autocast: bool = True) -> float:
    """The training loss of `model` on `batch` with dropout off: eval mode, which is how every
    library's dropout is switched off (module and functional alike), under the precision's
    autocast (`autocast=False`: the model's forward brings its own), no gradients. The model is
    left in the mode it was in."""
    import contextlib

    was_training = model.training
    model.eval()
    around = state.precision.autocast(state.device_type) if autocast else contextlib.nullcontext()
    state.engine_state[HOOKS_PAUSED] = True  # not the first training forward the hooks wait for
    try:
        with torch.no_grad(), around:
            return state.kind.loss(model, batch).float().item()
    finally:
        state.engine_state[HOOKS_PAUSED] = False
        model.train(was_training)


def stochastic_training_forward(state: CellState) -> bool:
    """Whether the kind's training forward draws random numbers (dropout), as observed."""
    return observe(state.kind).stochastic_training_forward


def record_library_steps(state: CellState, optimizer, library_steps: int) -> None:
    """For an engine whose library runs a fixed number of optimizer steps (the Trainer, Lightning):
    how many of them the grad scaler skipped, read from the optimizer's own step counts (an
    optimizer that did not step does not count). The torch and accelerate loops instead run on
    until TRAIN_STEPS steps were applied (train_until_applied)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps one
    counts = [int(entry["step"]) for entry in inner.state.values() if "step" in entry]
    applied = max(counts, default=0)
    state.metrics.optimizer_steps_applied = applied
    state.metrics.steps_skipped_by_grad_scaler = library_steps - applied


def check_agrees_with_torch_engine(state: CellState, loss: float, mode: str) -> None:
    if state.cell.engine == "torch":
        return
    try:
        reference = torch_engine_loss(state, mode)
    except Exception as exc:  # the yardstick itself fails: that is the torch engine cell's finding
        state.metrics.cross_engine = typed.CrossEngine(torch_engine_error=signature_of("torch engine", exc).text)
        return
    tolerance = eval_loss_tolerance(state.cell.model, state.precision.compute_dtype)
    key = {"train": "first_step_loss", "eval": "eval_loss", DROPOUT_OFF: "first_step_loss_dropout_off"}[mode]
    # how both sides got the same random numbers (dropout)
    random_numbers = {
        "train": f"seeded with {FIRST_FORWARD_SEED} before the first forward",
        "eval": None,  # eval mode draws none
        DROPOUT_OFF: (
            "none: dropout off (eval mode) on both sides, since a batch split across ranks draws other "
            "dropout masks than the whole batch in one process"
        ),
    }[mode]
    state.metrics.cross_engine = typed.CrossEngine(
        spread_abs=abs(loss - reference),
        tolerance=typed.Tolerance(**tolerance.as_dict()),
        random_numbers=random_numbers,
        **{key: loss, f"torch_engine_{key}": reference},
    )
    checks.check_engine_agreement(key.replace("_", " "), loss, reference, tolerance)


def check_resumed_one_step(state: CellState, losses: list[float], checkpoint_model, resumed_model) -> None:
    """A library resumed from the step-3 checkpoint: exactly one step ran, and it moved the
    weights away from the checkpoint's."""
    if len(losses) != 1:
        raise checks.CheckFailure(
            "resuming from the checkpoint did not run exactly the one remaining step",
            details=f"{len(losses)} training steps ran",
        )
    checks.check_parameters_changed(snapshot_trainable(checkpoint_model, state.kind), resumed_model)


def same_weights_copy(state: CellState, model):
    """A fresh model of the kind in the precision, holding `model`'s weights: free of any
    forward wrapper a library put on `model`, so outputs compare like with like."""
    copy_ = state.kind.build(state.precision, state.device, state.workdir)
    if state.precision.quantization is None:
        copy_.load_state_dict(model.state_dict())
        return copy_
    # a quantized base is frozen and quantized alike in every build: the floating tensors carry
    # what training changed (a state dict's quantized weights do not load into plain modules)
    from matrix.quantization import copy_float_weights

    copy_float_weights(model, copy_)
    return copy_


def return_from_library_device(state: CellState, model, library_device: torch.device, by: str, when: str) -> None:
    """Undo the one move a library is known to make when it finishes, record it, and check
    that the model is back on the cell's device.

    Lightning's strategy teardown, at the end of fit() and validate(), moves the
    LightningModule (and its optimizer state) to the CPU. A cell on another device gets its
    model back there, with `placement_restored` in its metrics saying who moved it. Any other
    placement is a PlacementChanged failure `when` the library returned.
    """
    found = sorted(set(checks.tensor_devices(model).values()))
    if library_device != state.device and found == [str(library_device)]:
        model.to(state.device)
        if state.metrics.placement_restored is UNSET:
            state.metrics.placement_restored = []
        state.metrics.placement_restored.append(
            {"after": when, "by": by, "found_on": str(library_device), "moved_back_to": str(state.device)}
        )
    checks.check_placement(model, state.device, f"after {when}")


def snapshot_trainable(model, kind) -> dict[str, torch.Tensor]:
    """The trainable tensors that must change in training: those that get a gradient. A
    parameter the kind's fp32 backward leaves without one (an MoE's e_score_correction_bias,
    which only routes) cannot change in any precision (matrix/observation.py)."""
    gradless = observe(kind).gradless_parameters
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad and not any(n == g or n.endswith("." + g) for g in gradless)
    }


def check_training_contract(state: CellState, model, trainable_before, dtypes_before, weights_check=None) -> None:
    """After training: still on the cell's device; parameters changed, stayed finite, kept
    their dtypes and the precision's; the loss fell (matrix/tolerances.py
    TRAINING_LOSS_DECREASE) between the same seeded measurement before and after training.

    `weights_check(model, when)`: for an engine whose library declares other weight dtypes than
    the precision's (accelerate's FSDP2 keeps fp32 master weights), that declaration's check."""
    checks.check_placement(model, state.device, "after training")
    checks.check_trained_in_train_mode(given(state.metrics.effective.model_training_in_first_forward))
    checks.check_finite_parameters(list(model.named_parameters()), "after training")
    checks.check_parameters_changed(trainable_before, model)
    checks.check_same_dtypes(dtypes_before, model, "after training")
    if weights_check is None:
        checks.check_dtypes(state.kind.precision_weights(model), state.expected_dtypes(model), "after training")
    else:
        weights_check(model, "after training")
    # the fall is measured by the harness, the same way before and after training: the library's
    # own losses are taken before each of its steps, so the last applied step never shows in
    # them, and a grad scaler that skipped the first steps leaves none to see (Trainer, Lightning)
    before, after = loss_before_training(state), seeded_training_loss(state, model)
    measured = {"loss_before_training": before, "loss_after_training": after, "relative": relative_fall(before, after)}
    if state.kind.variant != state.kind.grid_variant:
        # the bound was established on the grid's settings only: a variant (exploration) records
        # its fall unchecked (a drawn LoRA with rank 1 and hidden size 8 falls less in fp32)
        unchecked = typed.LossDecrease(**measured, bound_relative=None, judged_by="unchecked: a variant")
        state.metrics.loss_decrease = unchecked
        return
    bound, judged_by = loss_fall_bound(state)
    state.metrics.loss_decrease = typed.LossDecrease(
        **measured, bound_relative=None if bound is None else bound.min_relative, judged_by=judged_by
    )
    if bound is None:
        return
    if is_fp32_twin(state.precision):
        checks.check_fp32_learns(before, after, bound, state.learning_rate)
    else:
        checks.check_loss_decreased(before, after, bound)


def is_fp32_twin(precision: Precision) -> bool:
    """The precision every other one's loss fall is judged against: fp32 weights and compute."""
    return precision.weights_dtype == torch.float32 and precision.compute_dtype == torch.float32


def loss_fall_bound(state: CellState) -> tuple[LossDecrease | None, str]:
    """How far the cell's training loss must fall, and why: fp32 by the kind's bound (does the
    kind learn at its rate at all?); any other precision by LOSS_FALL_VS_FP32 of its fp32 twin's
    fall, unchecked where the twin itself does not learn (the fp32 cells carry that finding)."""
    absolute = loss_decrease_bound(state.cell.model)
    if is_fp32_twin(state.precision):
        return absolute, f"fp32: the kind's bound {absolute.min_relative:.2%}"
    established = kind_learning_rate(state.kind)
    twin = established.fp32_fall.relative
    if twin < absolute.min_relative:
        return None, (
            f"unchecked: the fp32 twin does not learn at learning rate {established.value:g} "
            f"({established.source}); the fp32 cells fail for it"
        )
    return LossDecrease(LOSS_FALL_VS_FP32 * twin), (
        f"{LOSS_FALL_VS_FP32:g} of the fp32 twin's fall {twin:.2%} (torch engine, cpu, learning rate "
        f"{established.value:g})"
    )


def check_reload(state: CellState, reloaded, evaluate=None, saved=None) -> None:
    """A fresh model from the checkpoint reproduces the dtypes and the outputs, bit for bit.

    `evaluate` must be the way state.outputs_before_save was computed (default: the
    precision's own autocast); `saved`: the model whose dtypes the checkpoint must give back
    (default: the cell's model).
    """
    declared = {}
    if state.kind.loaded_in_dtype(state.precision, reloaded=True):  # from_pretrained applies the declarations
        dtype = state.precision.weights_dtype
        patterns = declared_dtypes.fp32_patterns(reloaded, dtype)
        created = declared_dtypes.created_fp32(reloaded, dtype)
        for kind, tensors in (("parameter", reloaded.named_parameters()), ("buffer", reloaded.named_buffers())):
            for name, _ in tensors:
                if reason := declared_dtypes.fp32_reason(name, patterns, created):
                    declared[f"{kind} {name}"] = reason
    checks.check_same_dtypes(checks.tensor_dtypes(saved or state.model), reloaded, "after reload", declared)
    checks.check_frozen_kept(observe(state.kind).frozen_parameters, reloaded, "after reload")
    adapters = None
    if state.precision.quantization is not None:
        from matrix.quantization import check_storage

        check_storage(reloaded, state.precision.quantization, "after reload")
        if _writes_checkpoints():
            adapters = Path(tempfile.mkdtemp(prefix="quantized-saves-", dir=state.workdir)) / "adapters"
            state.kind.save(reloaded, adapters)  # before any evaluation of `reloaded`, which keeps it as loaded
    outputs = (evaluate or evaluate_in_precision)(state, reloaded).logits
    state.metrics.reload_max_abs_difference = checks.check_outputs_equal(
        "eval logits", state.outputs_before_save, outputs, CHECKPOINT_ROUND_TRIP
    )
    if adapters is not None:
        check_quantized_saves(state, adapters, evaluate or evaluate_in_precision)


def _writes_checkpoints() -> bool:
    """Whether this process writes checkpoints: not a rank other than 0 of a process group, where
    transformers' save_pretrained writes nothing (should_save_on_this_rank, transformers 5.x). The
    quantized saves check a file format, which rank 0 checks for the group."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)


def check_quantized_saves(state: CellState, adapters: Path, evaluate) -> None:
    """The two other ways users save a quantized fine-tune, each read back bit for bit: the
    quantized base itself (save_pretrained of the base, as pre-quantized checkpoints are shared)
    with the adapters over it; and the adapters merged into the quantized base, saved and read
    back. Each starts from the adapters `adapters` holds over a base quantized anew, and is
    evaluated before it is saved, as a user evaluates a model before sharing it. Both run; a
    mismatch in the first is raised after the second was measured too."""
    mismatches = []
    for check in (_check_prequantized_save, _check_merged_save):
        try:
            check(state, adapters, evaluate)
        except checks.CheckpointMismatch as mismatch:  # recorded in the metrics; raised below
            mismatches.append(mismatch)
    if mismatches:
        raise mismatches[0]


def _check_prequantized_save(state: CellState, adapters: Path, evaluate) -> None:
    from matrix.quantization import check_storage

    kind, precision, record = state.kind, state.precision, state.metrics.quantized
    directory = adapters.parent / "quantized-base"
    model = kind.load(adapters, precision, state.device, state.workdir)
    before = evaluate(state, model).logits
    kind.save_quantized_base(model, directory)
    record.prequantized_files = sorted(p.name for p in directory.iterdir())
    again = kind.load_over_quantized_base(directory, adapters, precision, state.device, state.workdir)
    check_storage(again, precision.quantization, "after reading the saved quantized base")
    outputs = evaluate(state, again).logits
    record.prequantized_reload_max_abs_difference = (outputs.float() - before.float()).abs().max().item()
    checks.check_outputs_equal("eval logits over the saved quantized base", before, outputs, CHECKPOINT_ROUND_TRIP)


def _check_merged_save(state: CellState, adapters: Path, evaluate) -> None:
    from matrix.quantization import check_storage

    kind, precision, record = state.kind, state.precision, state.metrics.quantized
    directory = adapters.parent / "merged"
    as_adapters = evaluate(state, kind.load(adapters, precision, state.device, state.workdir)).logits
    merged = kind.merge_quantized(kind.load(adapters, precision, state.device, state.workdir))
    merged_outputs = evaluate(state, merged).logits
    record.merged_deviation_max_abs = (merged_outputs.float() - as_adapters.float()).abs().max().item()
    kind.save_merged(merged, directory)
    reread = kind.load_merged(directory, precision, state.device)
    check_storage(reread, precision.quantization, "after reading the saved merged model")
    outputs = evaluate(state, reread).logits
    record.merged_reload_max_abs_difference = (outputs.float() - merged_outputs.float()).abs().max().item()
    checks.check_outputs_equal("eval logits of the saved merged model", merged_outputs, outputs, CHECKPOINT_ROUND_TRIP)
