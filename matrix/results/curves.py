"""Loss curves: a training cell's losses step by step, against a reference's, within a row.

Every training cell records the loss of each of its first k steps (schedule.train_steps(): 3, or
the run's --curve-steps N) and compares it, step by step, with two references trained from the
same fresh model on the same batch, each forward drawing the same dropout masks
(schedule.forward_seed):

  the torch engine   the same precision in the hand-written torch loop: what the engine's library
                     does to training, step after step (a gradient never zeroed shows from step 2)
  the fp32 twin      fp32 in the torch loop: what the precision itself does to training

and a run of a fixed selection compares its curves with the golden curves of its stack
(matrix/golden/, `nox -s curves`): what a release did to training.

A curve is compared step by step over the steps both sides took (a grad scaler's skipped attempts
are steps of both). Step s (1-based) passes when |loss - reference| <= atol + rtol * |reference| +
per_step * (s - 1): a row (matrix/checks/tolerances.py) allows rounding at step 1 and its growth as the
runs' weights part. The first step outside the row names the step, the two losses and what the
row allowed.

Standard library only: diff and the reports compare curves from a results.json with nothing but
this module.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

from matrix.results.files import CELL_FIELDS

# the references a curve is compared with, in the order their failures are raised
TORCH_ENGINE = "torch engine"
FP32_TWIN = "fp32 twin"
GOLDEN = "golden"

# Engine families: engines whose libraries compute a training step in another legitimate way than
# the torch loop (the order of their roundings, not the update). Each family's curves are judged by
# rows measured on its own right engines (matrix/checks/tolerances.py, matrix/checks/curve_spread.json), so the
# spread of one family does not loosen the rows of another. An engine's family follows from the
# traits it declares (engines/traits.py curve_family); an engine declaring none is in DEFAULT_FAMILY.
DEFAULT_FAMILY = "torch"
FAMILIES: dict[str, str] = {
    "torch": (
        "the library steps torch's AdamW over the model's own parameters as the torch loop does, under the "
        "precision's autocast or on the weights it cast, and reduces gradients (if at all) as DDP does"
    ),
    "casts-parameters": (
        "the library casts the parameters to the half dtype for its forward and reduces the gradients of the "
        "sharded parameters itself (FSDP2's MixedPrecisionPolicy): norms and adapters run on half weights "
        "where autocast would keep them fp32"
    ),
    "master-weights": (
        "the library's optimizer keeps fp32 master weights of a module it cast to the half dtype and steps "
        "those with the half module's gradients (DeepSpeed's bf16/fp16 optimizers and ZeRO): the forward runs "
        "on half weights without autocast, and each update reaches the module rounded to its dtype"
    ),
}


@dataclass(frozen=True)
class CurveTolerance:
    """What step s of a curve may differ from its reference's: atol + rtol * |reference| +
    per_step * (s - 1)."""

    atol: float
    rtol: float
    per_step: float
    # which row it is, as the reports name it (matrix/checks/tolerances.py: "master-weights bfloat16", the
    # engine family and the row's dtype or scheme); None for a row written by hand (a test's)
    row: str | None = None

    def allowed(self, step: int, reference: float) -> float:
        return self.atol + self.rtol * abs(reference) + self.per_step * (step - 1)

    def as_dict(self) -> dict:
        numbers = {"atol": self.atol, "rtol": self.rtol, "per_step": self.per_step}
        return numbers if self.row is None else {**numbers, "row": self.row}

    @classmethod
    def from_dict(cls, data: dict) -> CurveTolerance:
        row = data.get("row")
        return cls(
            float(data["atol"]), float(data["rtol"]), float(data["per_step"]), row if isinstance(row, str) else None
        )


@dataclass
class Comparison:
    """A curve against one reference, step by step over the steps both took."""

    reference: str  # TORCH_ENGINE, FP32_TWIN or GOLDEN
    reference_losses: list[float]
    tolerance: CurveTolerance
    deviations: list[float] = field(default_factory=list)  # |loss - reference| per step compared
    allowed: list[float] = field(default_factory=list)  # what the row allows at each step
    first_step_outside: int | None = None  # 1-based; None: every step within the row
    worst_step: int | None = None  # the step nearest its limit (largest deviation / allowed)
    worst_share: float | None = None  # that step's deviation as a share of what it allows
    # the half dtype a side's losses were handed over in ({"losses": "bfloat16"}): half a step of
    # it is added to each step's allowance (compare); None: both sides float32
    rounding: dict[str, str] | None = None

    @property
    def held(self) -> bool:
        return self.first_step_outside is None

    def outside(self, losses: list[float]) -> str:
        """The first step outside the row, in words (details of the failure)."""
        step = self.first_step_outside
        value, reference = losses[step - 1], self.reference_losses[step - 1]
        row = self.tolerance
        allowed = self.allowed[step - 1]
        share = abs(value - reference) / allowed if allowed > 0 else math.inf
        rounding = "".join(
            f" + half a {dtype} step, the {side} being {dtype} numbers" for side, dtype in (self.rounding or {}).items()
        )
        return (
            f"step {step}: {value:.6g} vs {reference:.6g}, |difference| {abs(value - reference):.3g} > allowed "
            f"{allowed:.3g}, {share_words(share, row.row)} (atol {row.atol:g} + rtol {row.rtol:g} x |reference| + "
            f"{row.per_step:g} per step after the first{rounding})"
        )

    def as_dict(self) -> dict:
        return {
            "reference": self.reference,
            "reference_losses": self.reference_losses,
            "tolerance": self.tolerance.as_dict(),
            "steps_compared": len(self.deviations),
            "deviations": self.deviations,
            "allowed": self.allowed,
            "first_step_outside": self.first_step_outside,
            "worst_step": self.worst_step,
            "worst_share": self.worst_share,
            **({"rounding": self.rounding} if self.rounding else {}),
        }


def share_words(share: float | None, row: str | None = None) -> str:
    """How much of its row a step used, in words: "97% of the row", "1.9x the master-weights
    bfloat16 row" (`row`: the row's name, CurveTolerance.row)."""
    the_row = f"the {row} row" if row else "the row"
    if share is None or math.isnan(share):
        return f"its share of {the_row} unknown"
    if share == math.inf:
        return f"past {the_row}, which allows nothing"
    if share > 1:
        return f"{share:.1f}x {the_row}" if share < 10 else f"{share:.0f}x {the_row}"
    if 0 < share < 0.001:
        return f"<0.1% of {the_row}"
    return f"{share:.0%} of {the_row}" if share >= 0.1 or share == 0 else f"{share:.1%} of {the_row}"


# a half dtype's significand bits below the sign and exponent: (name, bits kept of float32's 23)
HALF_FORMATS = (("bfloat16", 7), ("float16", 10))


def reported_in(values: list[float]) -> str | None:
    """The half dtype every finite value of a curve is exactly a number of, where one is: the
    engine handed its losses over in that dtype (an fp32 loss lands on a bfloat16 number with
    probability 2^-16 per step). None: a float32 (or wider) curve."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    for name, kept in HALF_FORMATS:
        if all(_exactly_half(v, name, kept) for v in finite):
            return name
    return None


def _exactly_half(value: float, name: str, kept: int) -> bool:
    if value == 0:
        return True
    (bits,) = struct.unpack("<I", struct.pack("<f", value))
    if struct.unpack("<f", struct.pack("<I", bits))[0] != value:
        return False  # not even a float32
    if bits & ((1 << (23 - kept)) - 1):
        return False
    exponent = (bits >> 23) & 0xFF
    return name == "bfloat16" or 127 - 14 <= exponent <= 127 + 15  # float16's normal range


def half_step(dtype: str | None, around: float) -> float:
    """Half the spacing of `dtype`'s numbers at `around`: how far rounding a value into it can
    move it (0 for None, a float32 curve)."""
    if dtype is None or around == 0 or not math.isfinite(around):
        return 0.0
    kept = dict(HALF_FORMATS)[dtype]
    return 2.0 ** (math.floor(math.log2(abs(around))) - kept) / 2


def compare(losses: list[float], reference: list[float], tolerance: CurveTolerance, name: str) -> Comparison:
    """`losses` against `reference`, step by step over the steps both took. A loss that is not
    finite where the reference's is leaves the row at once. A side whose losses are handed over
    in a half dtype (reported_in) was rounded into it: half a step of that dtype at the larger of
    the two losses is added to what the row allows (recorded in `rounding`), so the row keeps judging the
    arithmetic, not the rounding of the number reported."""
    result = Comparison(name, list(reference), tolerance)
    rounded = {"losses": reported_in(list(losses)), "reference": reported_in(list(reference))}
    result.rounding = {side: dtype for side, dtype in rounded.items() if dtype is not None} or None
    for step, (value, expected) in enumerate(zip(losses, reference, strict=False), start=1):
        allowed = tolerance.allowed(step, expected)
        # at the larger of the two: a step's spacing doubles where a power of two lies between them
        allowed += sum(half_step(dtype, max(abs(value), abs(expected))) for dtype in rounded.values())
        deviation = abs(value - expected)
        if math.isnan(deviation):
            deviation = math.inf
        result.deviations.append(deviation)
        result.allowed.append(allowed)
        share = deviation / allowed if allowed > 0 else (0.0 if deviation == 0 else math.inf)
        if result.worst_share is None or share > result.worst_share:
            result.worst_step, result.worst_share = step, share
        if deviation > allowed and result.first_step_outside is None:
            result.first_step_outside = step
    return result


def curve_of(cell: dict) -> tuple[list[float] | None, dict | None]:
    """A results.json cell's curve (the applied steps' losses) and the row it is judged by."""
    curve = (cell.get("metrics") or {}).get("curve") or {}
    return curve.get("losses"), curve.get("golden_tolerance")


# ---------------------------------------------------------------- golden curves

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"
INITIAL_WEIGHTS_DIR = GOLDEN_DIR / "initial"
GOLDEN_FORMAT = 1  # a golden file's run.golden.format
# The golden selection (`nox -s curves`): the built-in kinds that train from saved weights (no
# quantized base), the precisions of every compute dtype but float8 (an extra), the single-process
# engines, GOLDEN_STEPS steps: each cell's curve is data in matrix/golden/curves-<stack>.json.
GOLDEN_STEPS = 8
GOLDEN_SELECTION = (
    "--model",
    "tiny-transformer,tiny-llama,lora,gemma-cache",
    "--precision",
    "fp32,bf16-mixed,fp16-mixed,bf16-true",
    "--engine",
    "torch,accelerate,hf-trainer,lightning",
    "--mode",
    "train",
    "--device",
    "cpu",
)


def golden_path(stack: str, directory: Path = GOLDEN_DIR) -> Path:
    return directory / f"curves-{stack}.json"


def golden_document(results: dict) -> dict:
    """A run's curves as golden curves: a slim run (its header and environment, and per training
    cell its outcome and curve), so that `python -m matrix diff GOLDEN RUN` compares a run with
    them (the curve-moved category, matrix/results/compare.py) as it compares two runs."""
    cells = []
    for cell in results["cells"]:
        curve = (cell.get("metrics") or {}).get("curve") or {}
        if not curve.get("losses") or not curve.get("golden_tolerance"):
            continue
        slim = {key: cell[key] for key in CELL_FIELDS if key != "metrics"}
        slim.update({key: cell[key] for key in ("phase", "known_failure") if cell.get(key) is not None})
        slim["metrics"] = {"curve": {"losses": curve["losses"], "golden_tolerance": curve["golden_tolerance"]}}
        cells.append(slim)
    run = {key: value for key, value in results["run"].items() if key not in ("axes", "command")}
    if run.get("initial_weights"):  # a path on the machine that made them: named in the repository
        run["initial_weights"] = Path(run["initial_weights"]).name
    run["golden"] = {"format": GOLDEN_FORMAT, "made_by": "nox -s curves -- --write"}
    kept = ("python", "platform", "cpu", "packages", "cuda_devices")
    environment = {key: results["environment"].get(key) for key in kept}
    environment["warnings"] = []
    cells.sort(key=lambda c: c["id"])
    return {"schema_version": results["schema_version"], "run": run, "environment": environment, "cells": cells}


def write_golden(document: dict, path: Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=1, sort_keys=False) + "\n")
