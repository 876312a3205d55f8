"""How the harness measures a cell, whatever its engine: evaluation in the precision, the fp32
reference of the same weights, the seeded training loss before and after training, the torch
engine's yardstick, one optimizer step as the precisions define it (and a rank's share of the
loss, loss_weight), and what a library did to the model (the autocast in its first forward, its
placement). Also the fresh models every engine starts from and the copies that hold a run's
weights, the garbage collection between cells, and the learning-rate search's fp32 training
(Fp32Training).

Each runs in the cell's process or in each of its ranks (state.group): a rank measures its rows
and the whole batch's figure comes back, as one process measures it."""

from __future__ import annotations

import contextlib
import weakref

import torch

from matrix.checks import assertions as checks
from matrix.grid.schedule import FIRST_FORWARD_SEED, forward_seed, train_steps
from matrix.harness.cell_state import CellState
from matrix.harness.compiling import plain
from matrix.models.base import PAD_TOKEN_ID, EvalOutput
from matrix.models.observation import observe
from matrix.precisions.policies import PRECISIONS, dtype_name
from matrix.results.metrics import UNSET, Effective

DROPOUT_OFF = "train-dropout-off"  # torch_engine_loss: the training loss with dropout off


# ---------------------------------------------------------------- what is in force


def effective_settings(state: CellState, model) -> Effective:
    """What is actually in force, not only what the precision's name promises."""
    dtypes: dict[str, int] = {}
    trainable: dict[str, int] = {}
    for p in model.parameters():
        dtypes[dtype_name(p.dtype)] = dtypes.get(dtype_name(p.dtype), 0) + p.numel()
        if p.requires_grad:
            trainable[dtype_name(p.dtype)] = trainable.get(dtype_name(p.dtype), 0) + p.numel()
    with state.autocast():
        autocast_on = torch.is_autocast_enabled(state.device_type)
        autocast_dtype = torch.get_autocast_dtype(state.device_type) if autocast_on else None
    scaler = state.new_grad_scaler()
    return Effective(
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
    actually called reports; then the hook is removed (in a compiled twin it stays, and inside a
    graph it records as a side effect the graph replays).
    """
    linears = {id(m) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    observed = []  # read in eager code only: a graph that read it would be guarded on it

    def record_autocast():
        enabled = torch.is_autocast_enabled(state.device_type)
        dtype = torch.get_autocast_dtype(state.device_type) if enabled else None
        state.metrics.effective.autocast_dtype_in_forward = dtype_name(dtype) if dtype else None

    def observe_autocast(module, args):
        if torch.compiler.is_compiling():
            # inside a graph Dynamo traces (a compiled twin): recorded as a side effect the graph
            # replays. What it reads becomes the graph's guards, so it asks the module's type,
            # not which module it is (a guard on each layer's identity gives every layer a graph
            # of its own), and never whether the hook already fired (each later step would
            # compile again: matrix/harness/compiling.py)
            if isinstance(module, torch.nn.Linear) and not state.hooks.paused:
                record_autocast()
            return
        if id(module) not in linears or state.hooks.paused or observed:
            return
        record_autocast()
        state.metrics.effective.first_linear_input_dtype = next(
            (dtype_name(a.dtype) for a in args if isinstance(a, torch.Tensor)), None
        )
        observed.append(True)
        if not state.engine.compiled:
            # a compiled twin keeps the hook to the cell's end: a graph of its layers, compiled
            # while the hook was there, is guarded on the global hooks being what they were
            handle.remove()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(observe_autocast)
    state.hooks.handles.append(handle)


def seed_first_training_forward(state: CellState, model) -> None:
    """Seed the global generator right before each of the model's training forwards in its first
    train_steps() steps: micro-batch m of the attempt at step s (the steps applied before it) from
    schedule.forward_seed(s, m), the first from FIRST_FORWARD_SEED. An attempt a grad scaler
    skipped and the one that retries it draw alike, as a run that did not skip draws once.

    Whatever an engine does between its forwards (a Trainer seeds at construction, a sampler draws a
    permutation every epoch, accelerate and Lightning set themselves up), each of the first steps'
    forwards draws the dropout masks the torch engine's yardsticks draw (torch_engine_loss, its
    reference curve: matrix/results/curves.py). After step k the library's own random numbers run on, as
    its checkpoint saved them: the resumed step is compared with them. A global hook, as in
    watch_first_forward: a hook on the model's own modules would change the code paths it sits on.
    """
    forwards, micro, attempt = 0, 0, 0
    steps = train_steps()

    def seed(module, args):
        nonlocal forwards, micro, attempt
        if torch.compiler.is_compiling():
            # inside a traced graph: seeding there would break it (manual_seed is not traced), and
            # asking which module this is would guard the graph on each module's identity
            return
        if module is not model and (plain(module) is model or _wraps_compiled(state, module, model)):
            module = model  # a compiled twin: seeded at the call around the compiled model, which runs eagerly
        if module is not model or state.hooks.paused:
            return
        if state.engine.owns_loop and state.steps_ended >= steps:
            # a library's loop runs on past step k in one go (a hand-written loop's steps end with
            # train_steps: the pipeline stops the seeding there)
            handle.remove()
            return
        if forwards == 0:
            # a library may leave a model in eval mode while training it (dropout off): recorded
            state.metrics.effective.model_training_in_first_forward = module.training
        if module.training:
            if attempt != state.steps_ended:
                attempt, micro = state.steps_ended, 0
            torch.manual_seed(forward_seed(state.steps_applied, micro))
            forwards, micro = forwards + 1, micro + 1
        elif forwards == 0:
            handle.remove()  # trained in eval mode: no dropout draws to give

    handle = torch.nn.modules.module.register_module_forward_pre_hook(seed)
    state.hooks.handles.append(handle)
    state.hooks.seeds = handle


def _wraps_compiled(state: CellState, module, model) -> bool:
    """A library's wrapper whose `module` is the model, in a compiled twin: a model compiled in
    place (DeepSpeed's engine.compile()) runs its hooks inside the graph, and the wrapper's call
    (DeepSpeedEngine's) is the last eager point before its forward."""
    return state.engine.compiled and getattr(module, "module", None) is model


@contextlib.contextmanager
def harness_forward(state: CellState):
    """A forward the harness makes itself: not the cell's first training forward the hooks wait for."""
    was = state.hooks.paused
    state.hooks.paused = True
    try:
        yield
    finally:
        state.hooks.paused = was


def generators_kept(state: CellState):
    """A context that leaves the global generators (the CPU's and the cell's GPU's) as it found them."""
    return torch.random.fork_rng(devices=state.device_kind.rng_devices(state.device))


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


# ---------------------------------------------------------------- evaluation


def evaluate_in_precision(state: CellState, model):
    """Evaluation as the precision defines it, on the whole batch in this process: eval mode,
    no_grad (or the variant's inference_mode), the precision's autocast."""
    model.eval()
    with state.eval_grad_context(), state.autocast():
        return state.kind.evaluate(model, state.batch)


def evaluate_rows(state: CellState, model, autocast: bool = True) -> EvalOutput:
    """Evaluation of `model` (a library's wrapped module, say) as the precision defines it, each
    rank on its rows, gathered: the whole batch's mean loss and the logits (and generated tokens)
    of every row in order. `autocast=False`: the model's forward brings its own. One process:
    the evaluation itself, untouched."""
    group = state.group
    rows = group.rows(state.batch)
    model.eval()
    around = state.autocast() if autocast else contextlib.nullcontext()
    with state.eval_grad_context(), around:
        result = state.kind.evaluate(model, rows)
    if not group.distributed:
        return result
    mine = {
        "loss": result.loss.detach().float().item(),
        "items": state.kind.loss_items(rows),
        "logits": result.logits.detach().cpu(),
        "generated": None if result.generated is None else result.generated.cpu(),
        "extras": result.extras,
    }
    every = group.gather(mine)
    total = sum(part["items"] for part in every)
    loss = sum(part["loss"] * part["items"] for part in every) / total
    generated = (
        None if mine["generated"] is None else joined_generations([p["generated"] for p in every]).to(state.device)
    )
    return EvalOutput(
        loss=torch.tensor(loss),
        logits=torch.cat([p["logits"] for p in every]).to(state.device),
        generated=generated,
        extras=mine["extras"],
    )


def joined_generations(parts: list[torch.Tensor], pad: int = PAD_TOKEN_ID) -> torch.Tensor:
    """The ranks' generate() outputs as one generate() over the whole batch gives them: it runs until
    every row has finished and fills a finished row with the pad token, so a rank whose rows all
    stopped early (at the end-of-sequence token) holds a shorter output, padded here to the longest."""
    longest = max(part.shape[-1] for part in parts)
    return torch.cat([torch.nn.functional.pad(part, (0, longest - part.shape[-1]), value=pad) for part in parts])


def fp32_reference_model(state: CellState, model):
    """A fresh fp32 model of the same kind holding the same weights, upcast.

    Built anew rather than copied, so that nothing an engine wrapped around the model (an
    autocast forward, an output converter) comes along.
    """
    reference = state.scratch_model(PRECISIONS["fp32"])
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
    from matrix.precisions.quantization import fp32_compute

    same_base = same_weights_copy(state, model).eval()
    state.metrics.quantized.fp32_reference = "the same quantized base and adapters, fp32 compute, no autocast"
    with torch.no_grad(), fp32_compute(same_base):
        return state.kind.evaluate(same_base, state.batch)


def position_deviations(logits: torch.Tensor, reference: torch.Tensor, attention_mask) -> dict:
    """Largest |logit - fp32 logit| at real and at pad positions (attention mask 0).

    No label is predicted from a pad position (models/causal_lm.py next_token_targets), so
    the pad positions' outputs never reach a loss or a check. They are recorded because what
    an attention kernel returns for a fully masked row differs between kernels and dtypes
    (SDPA on CUDA in half precision, docs/gpu-runs/h100-2026-11-22): a finding to see, not a failure.
    """
    if attention_mask is None or logits.shape[:2] != attention_mask.shape or reference.shape != logits.shape:
        return {}
    difference = (logits.detach().float() - reference.detach().float()).abs().amax(dim=-1)
    pad = attention_mask == 0
    return {
        "real_position_logits_max_abs_deviation": difference[~pad].max().item(),
        "pad_position_logits_max_abs_deviation": difference[pad].max().item() if pad.any() else None,
    }


# ---------------------------------------------------------------- models the harness makes


def fresh_model(state: CellState):
    """The cell's model as every engine starts from it (CellState.fresh_model)."""
    return state.fresh_model()


def same_weights_copy(state: CellState, model):
    """A fresh model of the kind in the precision, holding `model`'s weights: free of any
    forward wrapper a library put on `model`, so outputs compare like with like (a scratch
    model: compared, never saved)."""
    copy_ = state.scratch_model()
    if state.precision.quantization is None:
        copy_.load_state_dict(model.state_dict())
        return copy_
    # a quantized base is frozen and quantized alike in every build: the floating tensors carry
    # what training changed (a state dict's quantized weights do not load into plain modules)
    from matrix.precisions.quantization import copy_float_weights

    copy_float_weights(model, copy_)
    return copy_


def model_holding(state: CellState, weights: dict[str, torch.Tensor], into=None):
    """A fresh model of the kind in the precision holding `weights` (a state dict; over a quantized
    base, its floating tensors) in their own dtypes: a tensor whose dtype the fresh model does not
    have replaces the parameter's or buffer's data, so tied parameters stay tied.

    `into`: a model an earlier call returned for the same run, filled again rather than built
    again (a view read at every step of a run): every tensor `weights` names is replaced, and each
    module is put back in the train or eval mode it was built in."""
    if into is None:
        model = fresh_model(state)
        _BUILT_MODES[model] = {name: module.training for name, module in model.named_modules()}
    else:
        model = into
        modes = _BUILT_MODES[model]
        for name, module in model.named_modules():
            module.training = modes[name]
    found = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for name, tensor in weights.items():
            target = found.get(name)
            if target is None or not target.is_floating_point():
                continue
            value = tensor.to(state.device)
            if target.dtype == value.dtype and target.shape == value.shape:
                target.copy_(value)
            else:
                target.data = value
    return model


_BUILT_MODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model_holding's models


def snapshot_trainable(model, kind) -> dict[str, torch.Tensor]:
    """The trainable tensors that must change in training: those that get a gradient. A
    parameter the kind's fp32 backward leaves without one (an MoE's e_score_correction_bias,
    which only routes) cannot change in any precision (matrix/models/observation.py)."""
    gradless = observe(kind).gradless_parameters
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad and not any(n == g or n.endswith("." + g) for g in gradless)
    }


# ---------------------------------------------------------------- training losses


def seeded_training_loss(state: CellState, model) -> float:
    """The loss of `model` on the cell's batch measured as its first training forward was:
    train mode, the precision's autocast, the dropout draws seeded with FIRST_FORWARD_SEED, no
    gradients. Two such measurements differ by the weights alone. The global generators are
    left as they were and the model in the mode it was in."""
    was_training = model.training
    model.train()
    try:
        with torch.no_grad(), state.autocast(), generators_kept(state), harness_forward(state):
            torch.manual_seed(FIRST_FORWARD_SEED)  # the draws the cell's own first forward made
            return state.kind.loss(model, state.batch).float().item()
    finally:
        model.train(was_training)


def loss_before_training(state: CellState) -> float:
    """seeded_training_loss of a fresh model: once per cell, and once per process for a kind,
    precision and device (a fresh model and the batch are built deterministically)."""
    if state.loss_before_training is None:
        state.loss_before_training = _once(state, "train", lambda: seeded_training_loss(state, fresh_model(state)))
    return state.loss_before_training


# (kind type, kind name, variant, precision, device, what) -> the measurement on a fresh model
_FRESH_MEASUREMENTS: dict[tuple, float] = {}


def _once(state: CellState, what: str, measure) -> float:
    """A measurement of a fresh model of the cell's kind and precision on its device, made once per
    process: it depends on nothing else (every build and batch is seeded)."""
    from matrix.models.initial_weights import current as initial_weights

    key = (type(state.kind), state.kind.name, state.kind.variant, state.precision, str(state.device), what)
    key += (initial_weights(),)  # a run's saved initial weights, where it has some
    if key not in _FRESH_MEASUREMENTS:
        _FRESH_MEASUREMENTS[key] = measure()
    return _FRESH_MEASUREMENTS[key]


def dropout_off_loss(state: CellState, model, batch, autocast: bool = True, loss=None) -> float:
    """The training loss of `model` on `batch` with dropout off: eval mode, which is how every
    library's dropout is switched off (module and functional alike), under the precision's
    autocast (`autocast=False`: the model's forward brings its own), no gradients. The model is
    left in the mode it was in. `loss(model, batch)`: the loss as the engine's library computes
    it (the Trainer's compute_loss); None: the kind's, as the harness's own loops compute it."""
    was_training = model.training
    model.eval()
    around = state.autocast() if autocast else contextlib.nullcontext()
    try:
        with torch.no_grad(), around, harness_forward(state):
            return (loss or state.kind.loss)(model, batch).float().item()
    finally:
        model.train(was_training)


def dropout_off_rows_loss(state: CellState, model, autocast: bool = True) -> float:
    """dropout_off_loss of `model` (a library's wrapped module), each rank on its rows: the whole batch's."""
    rows = state.group.rows(state.batch)
    return state.group.mean(dropout_off_loss(state, model, rows, autocast), state.kind.loss_items(rows))


def stochastic_training_forward(state: CellState) -> bool:
    """Whether the kind's training forward draws random numbers (dropout), as observed."""
    return observe(state.kind).stochastic_training_forward


def torch_engine_loss(state: CellState, mode: str) -> float:
    """The loss the torch engine computes first, on a fresh model: the cross-engine yardstick.
    `train-dropout-off`: the training loss of a fresh model with dropout off (eval mode)."""
    if mode == "train":
        return loss_before_training(state)
    if mode == DROPOUT_OFF:
        return _once(state, mode, lambda: dropout_off_loss(state, fresh_model(state), state.batch))

    def evaluation() -> float:
        with harness_forward(state):
            return evaluate_in_precision(state, fresh_model(state)).loss.float().item()

    return _once(state, mode, evaluation)


# ---------------------------------------------------------------- one optimizer step


# ---------------------------------------------------------------- fp32 in the torch engine
