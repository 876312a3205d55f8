"""The assertions a cell makes. Each failure is a CheckFailure whose message is stable
(the measured numbers are normalized away by the signature, so one kind of failure gives
one signature), and each check records what it measured in the cell's metrics."""

from __future__ import annotations

import math

import torch

from matrix.checks.tolerances import LossDecrease, Tolerance, relative_fall


class CheckFailure(AssertionError):
    """A numeric or contract failure found by the matrix itself (not raised by the stack).

    str() is the stable message the signature is computed from; `details` names the tensors
    involved (they differ from model to model for the same bug) and goes to the report.
    """

    def __init__(self, message: str, details: str | None = None) -> None:
        super().__init__(message)
        self.details = details


class NonFiniteValue(CheckFailure):
    pass


class OutOfTolerance(CheckFailure):
    pass


class ParametersUnchanged(CheckFailure):
    pass


class DtypeContractBroken(CheckFailure):
    pass


class FrozenParameterThawed(CheckFailure):
    pass


class CheckpointMismatch(CheckFailure):
    pass


class ResumeDiverged(CheckFailure):
    """The step resumed from a checkpoint is not the step the uninterrupted run takes."""


class EngineDisagreement(CheckFailure):
    pass


class CurveDiverged(CheckFailure):
    """A training loss curve left its reference's row at some step (matrix/results/curves.py)."""


class TrainedInEvalMode(CheckFailure):
    """The model was not in training mode in its first training forward: dropout was off."""


class LossNotDecreasing(CheckFailure):
    """Training ran, but the loss on the fixed batch did not fall as far as fp32's does."""


class PlacementChanged(CheckFailure):
    """The model is no longer (wholly) on the cell's device: placement is part of a cell's
    contract, like its dtypes."""


def check_finite_loss(loss: torch.Tensor, what: str) -> float:
    value = loss.detach().float().item()
    if not math.isfinite(value):
        raise NonFiniteValue(f"{what} is {value}")
    return value


# the dtypes whose tensors nonfinite_names sums first (in float32: an overflow only sends a tensor to
# the element-by-element test)
_SUMMABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def nonfinite_names(named_tensors) -> list[str]:
    """The names, in order, of the tensors holding a NaN or an infinity. A NaN or an infinity makes
    any sum of a tensor's elements non-finite, so a tensor whose sum is finite has none: each is
    summed (one reduction, where torch.isfinite(t).all() writes a mask of the whole tensor and reduces
    that: on a real model's weights, after every step, more than the step), and only those whose sum is not
    finite (or overflowed) are tested element by element, as is every other tensor (a quantized or
    float8 subclass, an integer dtype). A DTensor sharded or replicated on a one-dimensional mesh (FSDP2's
    parameters and gradients) is summed in its local part, and its mesh's ranks add their sums in one
    all-reduce, where the element-by-element test reduces each tensor across the ranks on its own;
    every rank comes to the same answer."""
    named = list(named_tensors)
    suspect = [True] * len(named)
    groups: dict[tuple, list[tuple[int, torch.Tensor]]] = {}  # (device, mesh) -> (index, sum)
    for index, (_, tensor) in enumerate(named):
        if tensor.dtype not in _SUMMABLE:
            continue
        if type(tensor) in (torch.Tensor, torch.nn.Parameter):
            local, mesh = tensor.detach(), None
        elif _is_sharded_or_replicated(tensor):
            local, mesh = tensor.detach().to_local(), tensor.device_mesh
        else:
            continue
        groups.setdefault((local.device, mesh), []).append((index, local.sum(dtype=torch.float32)))
    for (_, mesh), sums in groups.items():
        added = torch.stack([value for _, value in sums])
        if mesh is not None:
            torch.distributed.all_reduce(added, group=mesh.get_group())
        for (index, _), finite in zip(sums, torch.isfinite(added).tolist(), strict=True):
            suspect[index] = not finite
    return [
        name for (name, tensor), check in zip(named, suspect, strict=True) if check and not torch.isfinite(tensor).all()
    ]


def _is_sharded_or_replicated(tensor) -> bool:
    """A DTensor whose elements are each held whole by some rank (Shard or Replicate on a one-dimensional
    mesh; not Partial, whose elements are sums still to be taken across the ranks)."""
    placements = getattr(tensor, "placements", None)
    mesh = getattr(tensor, "device_mesh", None)
    if placements is None or mesh is None or mesh.ndim != 1 or not hasattr(tensor, "to_local"):
        return False
    return all(placement.is_shard() or placement.is_replicate() for placement in placements)


def nonfinite_gradients(parameters) -> list[str]:
    return nonfinite_names((name, p.grad) for name, p in parameters if p.grad is not None)


def check_finite_gradients(parameters) -> None:
    bad = nonfinite_gradients(parameters)
    if bad:
        raise NonFiniteValue("gradients are not finite", details=f"{len(bad)} tensors, first {bad[0]}")


def check_finite_parameters(parameters, when: str) -> None:
    bad = nonfinite_names(parameters)
    if bad:
        raise NonFiniteValue(f"parameters are not finite {when}", details=f"{len(bad)} tensors, first {bad[0]}")


def check_within_tolerance(what: str, value: float, reference: float, tolerance: Tolerance) -> None:
    if not math.isfinite(value):
        raise NonFiniteValue(f"{what} is {value} (fp32 reference {reference})")
    if not tolerance.allows(value, reference):
        raise OutOfTolerance(
            f"{what} {value:.6g} is off the fp32 reference {reference:.6g} by {abs(value - reference):.3g} "
            f"(allowed: atol {tolerance.atol:g} + rtol {tolerance.rtol:g} * |reference|)"
        )


def check_trained_in_train_mode(training_in_first_forward: bool | None) -> None:
    if training_in_first_forward is False:
        raise TrainedInEvalMode("the model was in eval mode in its first training forward (dropout off)")


def check_loss_decreased(before: float, after: float, bound: LossDecrease) -> float:
    """The relative fall of the training loss on the fixed batch from before training to after
    it; raises when it is below the bound (a share of the fp32 twin's fall)."""
    fallen = relative_fall(before, after)
    if not bound.allows(before, after):
        raise LossNotDecreasing(
            "the training loss fell less than its fp32 twin's bound over training",
            details=f"{before:.6g} -> {after:.6g}: {fallen:.2%}, bound {bound.min_relative:.2%}",
        )
    return fallen


def check_fp32_learns(before: float, after: float, bound: LossDecrease, learning_rate: float) -> float:
    """fp32 itself must learn at the kind's learning rate: when it does not, the cause is the
    model, its batch or its rate, not a precision, and the message says so."""
    fallen = relative_fall(before, after)
    if not bound.allows(before, after):
        raise LossNotDecreasing(
            "fp32 training did not lower the loss by the bound: the model does not learn at its learning rate",
            details=f"learning rate {learning_rate:g}; {before:.6g} -> {after:.6g}: {fallen:.2%}, "
            f"bound {bound.min_relative:.2%}",
        )
    return fallen


def check_parameters_changed(before: dict[str, torch.Tensor], model, masters_before=None, masters_after=None) -> None:
    """Every tensor of `before` changed in `model`. Where the optimizer steps a master copy the
    parameters are cast from (`masters_after`, by name: DeepSpeed's fp32 weights under its bf16 and
    fp16 modes), a parameter changed if its master did: a half-precision copy rounds a step below
    half its ulp back while the master holds it. Where no master was read before (`masters_before`),
    the parameters are compared: the master is not the parameter as built where the library rounds
    that to its half dtype before copying it up (DeepSpeed's bf16)."""
    after = dict(model.named_parameters())
    masters_before, masters_after = masters_before or {}, masters_after or {}

    def unchanged(name: str, old: torch.Tensor) -> bool:
        master = masters_after.get(name)
        earlier = masters_before.get(name)
        if master is not None and earlier is not None:
            return torch.equal(earlier, master)
        return torch.equal(old, after[name].detach())

    unchanged = sorted(name for name, old in before.items() if unchanged(name, old))
    if unchanged:
        raise ParametersUnchanged(
            "trainable tensors did not change in training",
            details=f"{len(unchanged)} of {len(before)}, first {unchanged[0]}",
        )


def check_frozen_kept(frozen: tuple[str, ...], model, when: str) -> None:
    """The parameters the model is created frozen with (requires_grad=False) are still frozen."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    thawed = [name for name in frozen if name in trainable]
    if thawed:
        raise FrozenParameterThawed(
            f"{when}: a parameter the model is created with requires_grad=False is trainable",
            details=f"{len(thawed)} of {len(frozen)}, first {thawed[0]}",
        )


def check_dtypes(weights: dict[str, torch.Tensor], expected, what: str) -> None:
    """Every weight has the expected dtype: one for all, or per name (dtype, the architecture's
    declaration that asks for it or None), as matrix/models/declared_dtypes.py expected_dtypes gives."""
    if isinstance(expected, torch.dtype):
        expected = dict.fromkeys(weights, (expected, None))
    wrong = {name: p.dtype for name, p in weights.items() if p.dtype != expected[name][0]}
    if wrong:
        name, dtype = next(iter(wrong.items()))
        want, declared = expected[name]
        because = f" ({fp32_declaration(declared)})" if declared else ""
        raise DtypeContractBroken(
            f"{what}: weights are {dtype}, not {want}{because}",
            details=f"{len(wrong)} of {len(weights)}, first {name}",
        )


def tensor_dtypes(model) -> dict[str, torch.dtype]:
    """Parameters and buffers (a buffer such as RoPE's inv_freq changes outputs too)."""
    found = {f"parameter {name}": p.dtype for name, p in model.named_parameters()}
    found.update({f"buffer {name}": b.dtype for name, b in model.named_buffers()})
    return found


def tensor_devices(model) -> dict[str, str]:
    """Parameter and buffer name -> the device it is on (as str(torch.device))."""
    found = {f"parameter {name}": str(p.device) for name, p in model.named_parameters()}
    found.update({f"buffer {name}": str(b.device) for name, b in model.named_buffers()})
    return found


def check_placement(model, device: torch.device, when: str) -> None:
    """Every parameter and buffer is on the cell's device."""
    elsewhere = {name: found for name, found in tensor_devices(model).items() if found != str(device)}
    if elsewhere:
        name, found = next(iter(elsewhere.items()))
        raise PlacementChanged(
            f"{when}: the model is on {found}, not on the cell's device {device}",
            details=f"{len(elsewhere)} tensors elsewhere, first {name}",
        )


def fp32_declaration(reason: str) -> str:
    """How a failure names why a weight must be fp32: a _keep_in_fp32_modules pattern, or the
    class's own construction (matrix/models/declared_dtypes.py)."""
    if reason.startswith(("created in fp32", "bitsandbytes", "prepare_model_for_kbit_training")):
        return reason  # the class's own construction, or a quantized base's (matrix/precisions/quantization.py)
    return f"the class keeps {reason!r} in fp32: _keep_in_fp32_modules"


def check_same_dtypes(before: dict[str, torch.dtype], model, what: str, declared: dict[str, str] | None = None) -> None:
    """Every tensor of `before` kept its dtype, but those `declared` ('parameter NAME' -> the
    pattern its class keeps in fp32 with): they must be fp32 (a reload by from_pretrained)."""
    declared = declared or {}
    after = tensor_dtypes(model)
    wanted = {name: torch.float32 if name in declared else dtype for name, dtype in before.items()}
    changed = sorted(name for name in before if after.get(name) != wanted[name])
    if changed:
        name = changed[0]
        kind = name.split()[0]
        because = f", not {wanted[name]} ({fp32_declaration(declared[name])})" if name in declared else ""
        raise DtypeContractBroken(
            f"{what}: a {kind} was {before[name]}, is now {after.get(name)}{because}",
            details=f"{len(changed)} tensors changed dtype, first {name}",
        )


def check_outputs_equal(what: str, expected: torch.Tensor, actual: torch.Tensor, tolerance: Tolerance) -> float:
    if expected.dtype != actual.dtype:
        raise CheckpointMismatch(f"{what}: dtype {actual.dtype} after reload, {expected.dtype} before")
    if expected.shape != actual.shape:
        raise CheckpointMismatch(f"{what}: shape changed across reload")
    before_bad, after_bad = ~torch.isfinite(expected.float()), ~torch.isfinite(actual.float())
    if before_bad.any() and torch.equal(before_bad, after_bad):
        # NaN on both sides compares unequal with itself, and counts no value "differing": say what it is
        raise NonFiniteValue(
            f"{what} are not finite, before and after reload alike",
            details=f"{int(before_bad.sum())} of {expected.numel()} values non-finite on both sides",
        )
    difference = (expected.float() - actual.float()).abs()
    differing = ~(difference <= tolerance.atol + tolerance.rtol * expected.float().abs())  # NaN counts
    if bool(differing.any()):
        finite = difference[~(before_bad | after_bad)]
        worst = finite.max().item() if finite.numel() else float("nan")
        nonfinite = int((before_bad ^ after_bad).sum())
        raise CheckpointMismatch(
            f"{what} differ after reload",
            details=f"{int(differing.sum())} of {difference.numel()} values"
            + (f" ({nonfinite} finite on one side only)" if nonfinite else "")
            + f", max abs difference {worst:.3g}",
        )
    return difference.max().item() if difference.numel() else 0.0


def optimizer_state(optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as named tensors ("group 0, parameter 3: exp_avg"),
    in this process's own shards where parameters are sharded (a DTensor's local part)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps one
    found = {}
    for g, group in enumerate(inner.param_groups):
        for i, parameter in enumerate(group["params"]):
            for key, value in inner.state.get(parameter, {}).items():
                if isinstance(value, torch.Tensor):
                    local = value.to_local() if hasattr(value, "to_local") else value
                    found[f"group {g}, parameter {i}: {key}"] = local.detach().clone()
    return found


def check_optimizer_state_restored(saved: dict[str, torch.Tensor], optimizer) -> None:
    """Every tensor of the optimizer's state before the save is back after the reload, bit for
    bit: a resumed run whose Adam moments are lost (or stale) trains differently, silently.
    `optimizer`: the reloaded optimizer, or its optimizer_state() taken right after the reload."""
    restored = optimizer if isinstance(optimizer, dict) else optimizer_state(optimizer)
    missing = [name for name in saved if name not in restored]
    if missing:
        raise CheckpointMismatch(
            "optimizer state missing after reload",
            details=f"{len(missing)} of {len(saved)} tensors, first {missing[0]}",
        )
    different = [name for name, value in saved.items() if not torch.equal(value, restored[name].to(value.device))]
    if different:
        raise CheckpointMismatch(
            "optimizer state differs after reload",
            details=f"{len(different)} of {len(saved)} tensors, first {different[0]}",
        )


def check_engine_agreement(what: str, value: float, torch_engine_value: float, tolerance: Tolerance) -> None:
    if not math.isfinite(value) and not math.isfinite(torch_engine_value):
        raise NonFiniteValue(
            f"{what} is not finite in this engine nor in the torch engine",
            details=f"{value} vs {torch_engine_value}",
        )
    if not math.isfinite(value) or not tolerance.allows(value, torch_engine_value):
        raise EngineDisagreement(
            f"{what} disagrees with the torch engine's beyond tolerance",
            details=f"{value:.6g} vs {torch_engine_value:.6g} (atol {tolerance.atol:g}, rtol {tolerance.rtol:g})",
        )
