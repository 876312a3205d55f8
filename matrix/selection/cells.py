"""Which cells a run has: every axis's values (from the registries, with the hf: kinds made on
demand so far), the selection options (--model a,b ..., hf:* patterns), enumeration in a stable
order, and the cell a test id names. --shard K/N is matrix/shards/plan.py's."""

from __future__ import annotations

import itertools

from matrix.devices import DEVICES
from matrix.engines import ENGINES
from matrix.grid.cell import Cell, SelectionError
from matrix.grid.modes import MODES
from matrix.models import MODELS
from matrix.models.base import TRAITS
from matrix.precisions.policies import PRECISIONS


def model_traits(model: str, wanted: frozenset[str] | None = None) -> frozenset[str]:
    """The traits of a registered model kind (matrix/models/base.py TRAITS): observed on its
    built model, or declared where the kind declares them (matrix/models/observation.py); none for a
    model name no kind is registered under (a report from another project, say). `wanted`: the
    traits the caller asks about; the one derived from the learning rate, whose search trains
    the model, is established only when asked for (None: every trait)."""
    if model not in MODELS:
        return frozenset()
    from matrix.harness.kind_traits import RATE_TRAIT, kind_traits  # builds the model once per process: torch

    return kind_traits(MODELS[model], with_rate=wanted is None or RATE_TRAIT in wanted)


def trait_names() -> tuple[str, ...]:
    return tuple(TRAITS)


def axis_values() -> dict[str, tuple[str, ...]]:
    """Every axis' values, from the registries: a user's registered items included, and the
    model kinds made on demand so far (hf:<model_type>, once a selection named them)."""
    return {
        "model": (*MODELS, *MODELS.provided()),
        "precision": tuple(PRECISIONS),
        "mode": MODES,
        "device": tuple(DEVICES),
        "engine": tuple(ENGINES),
    }


def named_only(axis: str, value: str) -> bool:
    """Whether a value runs only where a selection names it: a model kind made on demand
    (hf:<model_type>), an engine's compiled twin (<engine>-compile: its own nox session)."""
    if axis == "model":
        return value in MODELS.provided()
    return axis == "engine" and ENGINES[value].compiled


def parse_selection(axis: str, text: str | None) -> tuple[str, ...]:
    """'a,b' -> ('a', 'b'), in the axis' own order; None or '' -> every value of the axis. On the
    model axis, hf:<model_type> and hf:<path> make their kinds, and hf:* every causal-LM type
    (they follow the registered kinds, in the order given)."""
    valid = axis_values()[axis]
    wanted = [value.strip() for value in (text or "").split(",") if value.strip()]
    if not wanted:  # the registered values: a kind made on demand, or a compiled twin, runs only where named
        return tuple(value for value in valid if not named_only(axis, value))
    if axis == "model":
        wanted = expanded(wanted)
        for value in wanted:
            if value not in valid and (reason := made_on_demand(value)):
                raise SelectionError(f"--model: {value!r}: {reason}")
        valid = axis_values()[axis]
    unknown = [value for value in wanted if value not in valid]
    if unknown:
        raise SelectionError(
            f"--{axis}: unknown value{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"valid values: {', '.join(valid)}{' (and hf:<model_type>, hf:<path>)' if axis == 'model' else ''}"
        )
    on_demand = [value for value in wanted if value in MODELS.provided()]
    return tuple(value for value in valid if value in wanted and value not in on_demand) + tuple(on_demand)


def expanded(models: list[str]) -> list[str]:
    """Patterns (hf:*, hf:qwen*) replaced by the names they match, in their factory's order."""
    found = []
    for value in models:
        matches = MODELS.matching(value) if any(c in value for c in "*?[") else None
        if matches == ():
            raise SelectionError(f"--model: {value!r} matches no model kind")
        found += [m for m in (matches or (value,)) if m not in found]
    return found


def made_on_demand(model: str) -> str | None:
    """Make the model kind `model` names if a factory makes such names (hf:<model_type>): None
    when it now exists or no factory claims the name, else why it cannot be made."""
    try:
        MODELS[model]
    except KeyError as error:
        return error.args[0] if error.args and error.args[0] != model else None
    return None


def enumerate_cells(selection: dict[str, tuple[str, ...]]) -> list[Cell]:
    """Every combination of the selected values, grouped by device, engine, mode, then model."""
    return [
        Cell(model=model, precision=precision, mode=mode, device=device, engine=engine)
        for device, engine, mode, model, precision in itertools.product(
            selection["device"], selection["engine"], selection["mode"], selection["model"], selection["precision"]
        )
    ]


def cell_from_id(cell_id: str) -> Cell | None:
    """The cell a test id names (for reports that carry only a node id, such as a crash): the
    other axes' values are read off its end, the model is what precedes them (a registered kind,
    or one a factory makes: hf:qwen2-bf16-mixed-train-cpu-torch)."""
    axes = axis_values()
    for device, engine, mode, precision in itertools.product(
        axes["device"], axes["engine"], axes["mode"], axes["precision"]
    ):
        suffix = f"-{precision}-{mode}-{device}-{engine}"
        if cell_id.endswith(suffix) and len(cell_id) > len(suffix):
            model = cell_id[: -len(suffix)]
            if model in axes["model"] or (made_on_demand(model) is None and model in MODELS):
                return Cell(model=model, precision=precision, mode=mode, device=device, engine=engine)
    return None
