"""What the harness establishes about a model kind once per process, for every cell of it: the
learning rate it trains at (matrix/harness/learning_rate.py, measured by fp32 in the torch engine), the
traits catalogue selectors match (observed on the model, matrix/models/observation.py, and one that
follows from the rate), and the record of both that every cell carries."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch

from matrix.harness.fp32_training import Fp32Training
from matrix.models import declared_dtypes
from matrix.models.observation import generators_of, measurement_device, observe
from matrix.precisions.policies import PRECISIONS
from matrix.results.metrics import KindRecord

RATE_TRAIT = "updates-below-bf16-resolution"
ADAMW_WEIGHT_DECAY = 0.01  # torch.optim.AdamW's default, which every engine trains with
BF16_MANTISSA_BITS = 7
_STALLED: dict[tuple, tuple[str, ...]] = {}


def kind_learning_rate(kind):
    """The kind's learning rate and its fp32 twin's fall (matrix/harness/learning_rate.py), measured by
    Fp32Training."""
    from matrix.harness.learning_rate import learning_rate

    return learning_rate(kind, Fp32Training)


_TWIN_FALLS: dict[tuple, float] = {}


def fp32_twin_fall(kind, rate: float, steps: int) -> float:
    """The fp32 twin's relative loss fall after `steps` applied AdamW steps at `rate` (torch engine,
    measured as the learning-rate search measures its own, which is the TRAIN_STEPS one); once
    per kind, variant, rate and steps in a process."""
    key = (type(kind), kind.name, kind.variant, rate, steps)
    if key not in _TWIN_FALLS:
        with tempfile.TemporaryDirectory(prefix="matrix-fp32-twin-") as scratch:
            _TWIN_FALLS[key] = Fp32Training.fall(kind, rate, Path(scratch), steps=steps).relative
    return _TWIN_FALLS[key]


def kind_traits(kind, with_rate: bool = True) -> frozenset[str]:
    """The traits catalogue selectors match (matrix/models/base.py TRAITS): the ones the kind
    declares, else those observed on its model (matrix/models/observation.py) and, from its learning
    rate, RATE_TRAIT: some trainable tensor held in bf16 cannot move at that rate
    (bf16_stalled_tensors). `with_rate=False` leaves RATE_TRAIT
    out rather than establish the rate (a search that trains: only where a cell asks for it)."""
    from matrix.models.observation import effective_traits

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
        device = measurement_device(kind)
        with (
            torch.random.fork_rng(devices=generators_of(device)),
            tempfile.TemporaryDirectory(prefix="matrix-bf16-step-") as scratch,
        ):
            cpu = device
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


def established_for(kind) -> dict:
    """What this process established of `kind` beyond its observation and rate (the tensors its
    rate stalls in bf16, its fp32 twin's falls), each under the key it was established for: a rank
    takes them from its driver (remember_established) rather than train the fp32 model again."""
    return {
        "stalled": {key: value for key, value in _STALLED.items() if key[:3] == (kind.name, type(kind), kind.variant)},
        "falls": {key: value for key, value in _TWIN_FALLS.items() if key[:3] == (type(kind), kind.name, kind.variant)},
    }


def remember_established(established: dict) -> None:
    """Take another process's established_for() as this one's (a rank's, from its driver)."""
    _STALLED.update(established["stalled"])
    _TWIN_FALLS.update(established["falls"])


def kind_record(kind, with_rate: bool) -> KindRecord:
    """What the report records of the cell's model kind: the traits catalogue selectors match
    (RATE_TRAIT in training cells, which establish the rate anyway), the ones it declares (None:
    observed), and what was observed (matrix/models/observation.py)."""
    declared = getattr(kind, "traits", None)
    return KindRecord(
        traits=sorted(kind_traits(kind, with_rate)),
        declared_traits=sorted(declared) if declared is not None else None,
        observed=observe(kind).as_dict(),
    )
