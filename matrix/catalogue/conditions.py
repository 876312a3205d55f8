"""Named conditions a catalogue entry can be in force under: `when = ["cpu-avx512-bf16",
"not:curve-steps-at-least-4"]` in matrix/catalogue/known_failures.toml (all must hold).

An entry's `cells` say where a failure was seen; its `when` says when the mechanism applies. Each
condition reads one of three things (`reads`):

  hardware - what decides a kernel on this machine: the CPU capability torch dispatches on, the
             CPU's own features, what an installed library detects (bitsandbytes), the CUDA
             devices' compute capability. The facts are the report's `environment.hardware`
             (matrix/devices/: each device's hardware_facts()). An entry whose hardware condition
             does not hold claims no cell here: a cell it selects that passes is "inapplicable"
             (not applicable here), never "fixed".
  run      - the run's settings: the steps its training cells train (--curve-steps).
  cell     - what the cell itself observed (its metrics, as results.json writes them) or a cheap
             probe of the mechanism an engine records: decided once the cell ran. Before it ran
             the condition is taken to hold (the entry may claim the cell); a cell whose metrics
             say otherwise is not claimed.

A condition is a name, a description, what it reads and `holds(context)`. Users add their own with
register() from their plugin (before the catalogue is read: an entry naming an unknown condition
is an error). A family of names with a number (`curve-steps-at-least-<n>`) is one registered
pattern. Standard library only: conditions read facts, they do not measure them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

READS = ("hardware", "run", "cell")
NEGATION = "not:"


class UnknownCondition(KeyError):
    """A `when` names a condition no one registered."""


@dataclass(frozen=True)
class Context:
    """What conditions read. `metrics` is the cell's metrics as results.json writes them (a plain
    dict), None before the cell ran."""

    hardware: Mapping = field(default_factory=dict)
    run: Mapping = field(default_factory=dict)
    metrics: Mapping | None = None


@dataclass(frozen=True)
class Condition:
    name: str
    description: str
    reads: str  # hardware | run | cell
    holds: Callable[[Context], bool]

    def __post_init__(self) -> None:
        if self.reads not in READS:
            raise ValueError(f"condition {self.name!r}: reads {self.reads!r}, expected one of {', '.join(READS)}")


@dataclass(frozen=True)
class Family:
    """Conditions named by a pattern with one number: `make(n)` is the condition of that name."""

    pattern: str  # a regular expression with one group of digits
    description: str
    make: Callable[[int, str], Condition]


CONDITIONS: dict[str, Condition] = {}
FAMILIES: list[Family] = []


def register(condition: Condition | Family) -> Condition | Family:
    if isinstance(condition, Family):
        FAMILIES.append(condition)
        return condition
    if condition.name in CONDITIONS and CONDITIONS[condition.name] is not condition:
        raise ValueError(f"condition {condition.name!r} is registered already")
    CONDITIONS[condition.name] = condition
    return condition


def lookup(name: str) -> Condition:
    if name in CONDITIONS:
        return CONDITIONS[name]
    for family in FAMILIES:
        found = re.fullmatch(family.pattern, name)
        if found:
            return family.make(int(found.group(1)), name)
    known = ", ".join([*CONDITIONS, *(f.pattern.replace(r"(\d+)", "<n>") for f in FAMILIES)])
    raise UnknownCondition(f"unknown condition {name!r} (registered: {known})")


@dataclass(frozen=True)
class Requirement:
    """One item of an entry's `when`: a condition, or its negation (`not:name`)."""

    condition: Condition
    negated: bool = False

    @classmethod
    def parse(cls, text: str) -> Requirement:
        negated = text.startswith(NEGATION)
        return cls(lookup(text.removeprefix(NEGATION) if negated else text), negated)

    @property
    def reads(self) -> str:
        return self.condition.reads

    def met(self, context: Context) -> bool:
        return self.condition.holds(context) != self.negated

    def __str__(self) -> str:
        return f"{NEGATION if self.negated else ''}{self.condition.name}"


def unmet(requirements, context: Context, reads: str) -> list[Requirement]:
    """The requirements reading `reads` that do not hold in `context`."""
    return [r for r in requirements if r.reads == reads and not r.met(context)]


def nested(mapping: Mapping | None, path: str):
    """mapping['a']['b'] for 'a.b'; None where any part is missing."""
    value = mapping
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


# ---------------------------------------------------------------- hardware


def _cpu_capability_at_least_avx512(context: Context) -> bool:
    capability = context.hardware.get("cpu_capability") or ""
    return capability.upper().startswith("AVX512")


register(
    Condition(
        "cpu-avx512",
        "torch dispatches its CPU kernels at AVX512 or better (torch.backends.cpu.get_cpu_capability(); "
        "ATEN_CPU_CAPABILITY=avx2 lowers it)",
        "hardware",
        _cpu_capability_at_least_avx512,
    )
)
register(
    Condition(
        "cpu-avx512-bf16",
        "the CPU has AVX512-BF16 (torch.cpu._is_avx512_bf16_supported(): the CPU's own feature, "
        "whatever torch dispatches on)",
        "hardware",
        lambda c: bool(c.hardware.get("cpu_avx512_bf16")),
    )
)
register(
    Condition(
        "cpu-amx",
        "the CPU has AMX tiles (torch.cpu._is_amx_tile_supported())",
        "hardware",
        lambda c: bool(c.hardware.get("cpu_amx_tile")),
    )
)
register(
    Condition(
        "cpu-avx512-vnni",
        "the CPU has AVX512-VNNI (torch.cpu._is_vnni_supported())",
        "hardware",
        lambda c: bool(c.hardware.get("cpu_vnni")),
    )
)
register(
    Condition(
        "cpu-onednn-fp16",
        "oneDNN computes float16 on this CPU (torch.ops.mkldnn._is_mkldnn_fp16_supported(): AVX512-FP16 or "
        "AMX-FP16); DeepSpeed's CPU accelerator lists float16 among its supported dtypes by the same answer",
        "hardware",
        lambda c: bool(c.hardware.get("cpu_onednn_fp16")),
    )
)
register(
    Condition(
        "bnb-cpu-avx512-bf16",
        "bitsandbytes' own detection says the CPU has AVX512-BF16 (bitsandbytes.functional."
        "has_avx512bf16()): its 4-bit layers then repack their weights for its CPU kernel in inference",
        "hardware",
        lambda c: bool(c.hardware.get("bitsandbytes_cpu_avx512_bf16")),
    )
)
register(
    Condition(
        "mkl-reproducible-off",
        "the run's MKL computed without its reproducible mode (MKL_CBWR unset or empty: the matrix sets it to "
        "AUTO, matrix/devices/cpu.py REPRODUCIBLE_BLAS): the same weights may then round differently at another "
        "memory alignment",
        "hardware",
        lambda c: not c.hardware.get("mkl_cbwr"),
    )
)


def _cuda_capability_at_least(major: int, minor: int) -> Callable[[Context], bool]:
    def holds(context: Context) -> bool:
        capabilities = context.hardware.get("cuda_compute_capabilities") or []
        selected = context.hardware.get("selected_cuda_device") or 0
        if not capabilities or selected >= len(capabilities):
            return False
        found = tuple(int(part) for part in str(capabilities[selected]).split("."))
        return found >= (major, minor)

    return holds


for _major, _minor in ((7, 5), (8, 0), (8, 9), (9, 0)):
    register(
        Condition(
            f"cuda-sm{_major}{_minor}",
            f"the selected CUDA device's compute capability is {_major}.{_minor} or higher",
            "hardware",
            _cuda_capability_at_least(_major, _minor),
        )
    )


# ---------------------------------------------------------------- run


def _curve_steps_at_least(steps: int, name: str) -> Condition:
    return Condition(
        name,
        f"the run's training cells train {steps} steps or more before their checkpoint (--curve-steps): "
        "a failure only a curve that long shows",
        "run",
        lambda c: int(c.run.get("train_steps") or 0) >= steps,
    )


register(
    Family(r"curve-steps-at-least-(\d+)", "the run's training cells train <n> steps or more", _curve_steps_at_least)
)


# ---------------------------------------------------------------- cell


def _optimizer_stepped_at_construction(context: Context) -> bool:
    if context.metrics is None:
        return True  # not run yet: the probe decides once the engine started
    steps = nested(context.metrics, "engine_effective.optimizer_steps_at_construction")
    return isinstance(steps, int) and not isinstance(steps, bool) and steps > 0


register(
    Condition(
        "optimizer-stepped-at-construction",
        "the library's optimizer has stepped before the first training step: the torch optimizer's step "
        "count right after the engine was built (engine_effective.optimizer_steps_at_construction, which "
        "the deepspeed engines record after deepspeed.initialize) is above 0",
        "cell",
        _optimizer_stepped_at_construction,
    )
)


def _rank_means_over_uneven_shares(context: Context) -> bool:
    if context.metrics is None:
        return True  # not run yet: the engine records how its ranks combine their losses
    how = nested(context.metrics, "engine_effective.rank_loss_averaging")
    shares = nested(context.metrics, "engine_effective.loss_items_per_rank")
    # "each-rank-mean": matrix/engines/hf_trainer_deepspeed.py EACH_RANKS_MEAN (this layer reads records, no engine)
    return how == "each-rank-mean" and isinstance(shares, list) and len(set(shares)) > 1


register(
    Condition(
        "rank-means-averaged-over-uneven-shares",
        "the library's ranks each took the mean loss over their own share of the batch and their gradients were "
        "averaged equally (engine_effective.rank_loss_averaging), and the shares' loss items differ "
        "(engine_effective.loss_items_per_rank): the step weighs the smaller share's items more than the whole "
        "batch's mean does",
        "cell",
        _rank_means_over_uneven_shares,
    )
)


def _autocast_float16_in_forward(context: Context) -> bool:
    if context.metrics is None:
        return True  # not run yet: the cell's first forward decides
    return nested(context.metrics, "effective.autocast_dtype_in_forward") == "float16"


register(
    Condition(
        "autocast-float16-in-forward",
        "the model's first forward ran under float16 autocast on its device (effective.autocast_dtype_in_forward, "
        "what the harness saw at the model's first Linear): an op that computes in fp32 inside it is cast to fp16 "
        "(accelerate runs fp16 without autocast on a CPU, Lightning turns it into bf16 there)",
        "cell",
        _autocast_float16_in_forward,
    )
)


def _grad_scaler_skipped_steps(context: Context) -> bool:
    if context.metrics is None:
        return True  # not run yet: the run's grad scaler decides
    skipped = nested(context.metrics, "steps_skipped_by_grad_scaler")
    return isinstance(skipped, int) and not isinstance(skipped, bool) and skipped > 0


register(
    Condition(
        "grad-scaler-skipped-steps",
        "the run's grad scaler (torch's, or the library's own loss scaler) skipped at least one step whose "
        "gradients overflowed (steps_skipped_by_grad_scaler above 0): a library whose loop runs a fixed number "
        "of steps applies fewer",
        "cell",
        _grad_scaler_skipped_steps,
    )
)


def _legacy_matmul_getter_refused(context: Context) -> bool:
    if context.metrics is None:
        return True  # not run yet: what the cell's compile writes decides
    return nested(context.metrics, "effective.legacy_matmul_getter_refused") is True


register(
    Condition(
        "legacy-matmul-getter-refused",
        "torch.get_float32_matmul_precision() refused when the cell's phases ended "
        "(effective.legacy_matmul_getter_refused): the process mixed the legacy and per-backend fp32 "
        "precision APIs, as Inductor's per-backend write makes it",
        "cell",
        _legacy_matmul_getter_refused,
    )
)


def _aot_autograd_cache_served(context: Context) -> bool:
    if context.metrics is None:
        return True  # not run yet: what the cache holds when the cell compiles decides
    hits = nested(context.metrics, "compiled.cache.aot_autograd_hits")
    return isinstance(hits, int) and not isinstance(hits, bool) and hits > 0


register(
    Condition(
        "aot-autograd-cache-served",
        "AOTAutograd served at least one of the cell's compiled graphs from its cache "
        "(compiled.cache.aot_autograd_hits above 0): a graph compiled earlier, in this process or another "
        "sharing the cache directory, possibly under another autocast dtype",
        "cell",
        _aot_autograd_cache_served,
    )
)
