"""A learning rate at which a model kind learns, established on fp32 in the torch engine.

A rate that suits the tiny random models (1e-2) raises a pretrained model's loss, and then
every precision's cell would be blamed for what fp32 does too. So a kind that does not set
`learning_rate` gets one by a short search: from the largest candidate down, the first rate
at which fp32 training in the torch engine (on the CPU, TRAIN_STEPS AdamW steps on the kind's
fixed batch) lowers the loss by the kind's bound (matrix/checks/tolerances.py), measured as every
cell measures it (matrix/harness/measurements.py: seeded_training_loss before and after, Fp32Training).
A kind that sets its rate keeps it; its fp32 fall at that rate is measured the same way.

That fp32 fall is the precision cells' yardstick: a precision's loss fall is judged against
its fp32 twin's (matrix/harness/pipeline.py check_training_contract). Where no candidate learns, the kind gets the
largest candidate; the fp32 cells then fail, naming it, and the other precisions record their
fall unchecked.

The search runs once per kind and stack: its result is cached on disk under the cache
directory (MATRIX_CACHE_DIR, else $XDG_CACHE_HOME/precision-matrix, else
~/.cache/precision-matrix), keyed by the kind, its variant, the installed versions and the
fp32 model's loss before training (a changed model or batch measures anew), and recorded in
every cell that trains (metrics `learning_rate`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

CANDIDATES = (1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5)
CACHE_FORMAT = 1


@dataclass(frozen=True)
class Fall:
    """fp32 training at `rate` in the torch engine: the seeded loss before and after."""

    rate: float
    before: float
    after: float | None  # None: training did not finish (a non-finite loss or weights)
    error: str | None = None

    @property
    def relative(self) -> float:
        from matrix.checks.tolerances import relative_fall

        return float("-inf") if self.after is None else relative_fall(self.before, self.after)


@dataclass(frozen=True)
class LearningRate:
    value: float
    source: str  # declared | calibrated
    fp32_fall: Fall  # the fp32 twin at `value`
    tried: tuple[Fall, ...] = ()  # the search's candidates, largest first, up to the chosen one
    bound: float = 0.0  # the kind's minimum relative fall (tolerances.loss_decrease_bound)
    cached: bool = False

    @property
    def fp32_learns(self) -> bool:
        return self.fp32_fall.relative >= self.bound

    def as_dict(self) -> dict:
        return {
            "value": self.value,
            "source": self.source,
            "fp32_fall": _fall_dict(self.fp32_fall),
            "fp32_learns": self.fp32_learns,
            "bound_relative": self.bound,
            "tried": [_fall_dict(f) for f in self.tried],
            "cached": self.cached,
        }


def _fall_dict(fall: Fall) -> dict:
    relative = fall.relative
    return {**dataclasses.asdict(fall), "relative": relative if relative != float("-inf") else None}


def _fall_from(data: dict) -> Fall:
    return Fall(rate=data["rate"], before=data["before"], after=data["after"], error=data.get("error"))


def cache_dir() -> Path:
    if os.environ.get("MATRIX_CACHE_DIR"):
        return Path(os.environ["MATRIX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "precision-matrix"


_RATES: dict[tuple, LearningRate] = {}


def learning_rate(kind, measure) -> LearningRate:
    """The kind's learning rate and its fp32 fall, once per kind and process (and per stack on disk).
    A variant of a kind (exploration) trains at its grid kind's rate. `measure` trains: its
    loss_before(kind, workdir) is the fp32 model's seeded loss before training, its
    fall(kind, rate, workdir) the Fall of fp32 training at `rate` (measurements.Fp32Training)."""
    if (kind.name, type(kind)) not in _RATES:
        grid = kind if kind.variant == kind.grid_variant else kind.with_variant(kind.grid_variant)
        _RATES[(kind.name, type(kind))] = _establish(grid, measure)
    return _RATES[(kind.name, type(kind))]


def remember(kind, established: LearningRate) -> None:
    """Take another process's learning rate for the kind as this one's (a rank's, from its driver)."""
    _RATES[(kind.name, type(kind))] = established


def _cache_key(kind, before: float, declared: float | None) -> str:
    from matrix.grid.packages import installed_versions

    material = {
        "format": CACHE_FORMAT,
        "kind": kind.name,
        "class": f"{type(kind).__module__}.{type(kind).__qualname__}",
        "variant": repr(kind.variant),
        "declared": declared,
        "candidates": CANDIDATES,
        "loss_before_training": repr(before),
        "versions": installed_versions(),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]


def _read_cache(path: Path) -> LearningRate | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # absent, or written by another process just now: measured anew
    return LearningRate(
        value=data["value"],
        source=data["source"],
        fp32_fall=_fall_from(data["fp32_fall"]),
        tried=tuple(_fall_from(f) for f in data["tried"]),
        bound=data["bound_relative"],
        cached=True,
    )


def _write_cache(path: Path, found: LearningRate) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps(found.as_dict(), indent=1))
    scratch.replace(path)  # atomic: a concurrent reader sees the whole file or none


def _establish(kind, measure) -> LearningRate:
    from matrix.checks.tolerances import loss_decrease_bound

    bound = loss_decrease_bound(kind.name).min_relative
    declared = getattr(kind, "learning_rate", None)
    with tempfile.TemporaryDirectory(prefix="matrix-lr-") as scratch:
        workdir = Path(scratch)
        key = _cache_key(kind, measure.loss_before(kind, workdir), declared)
        # a kind's name may hold a path (hf:path/to/config.json): only its safe characters
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in kind.name)
        path = cache_dir() / "learning-rates" / f"{safe}-{key}.json"
        cached = _read_cache(path)
        if cached is not None:
            return cached
        if declared:
            found = LearningRate(declared, "declared", measure.fall(kind, declared, workdir), bound=bound)
        else:
            tried = []
            for rate in CANDIDATES:
                tried.append(measure.fall(kind, rate, workdir))
                if tried[-1].relative >= bound:
                    break
            chosen = tried[-1] if tried[-1].relative >= bound else tried[0]
            found = LearningRate(chosen.rate, "calibrated", chosen, tuple(tried), bound=bound)
    _write_cache(path, found)
    return found
