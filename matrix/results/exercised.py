"""Whether a cell exercised the precision it was asked for (standard library only).

A precision declares an autocast dtype (results.json `metrics.declared.autocast_dtype`); the
cell records the autocast really in force in the model's first forward
(`metrics.effective.autocast_dtype_in_forward`, matrix/harness/measurements.py). Where the two differ,
the engine ran something else than the precision's name says: on a CPU, accelerate and the
Trainer run fp16 mixed precision without autocast, Lightning turns 16-mixed into bf16-mixed. Such
a cell can pass every check and still say nothing about the precision it is filed under, so the
reports mark it and say what ran. Likewise a precision that declares a grad scaler
(`declared.grad_scaler`) where the engine's run held none after training
(`effective.grad_scaler_in_run`, Engine.scaler_state).
"""

from __future__ import annotations

from matrix.results.metrics import UNSET, CellMetrics, Effective, given


def _autocast(dtype: str | None) -> str:
    return "without autocast" if dtype is None else f"with {dtype} autocast"


def ran_instead(cell: dict) -> str | None:
    """'without autocast' / 'with bfloat16 autocast' where the autocast in force in the cell's
    first forward is not the one its precision declares, 'without a grad scaler' where the
    precision declares one and the engine's run held none after training (a loop that leaves it
    out, accelerate's fp16 on a CPU), both where both; None where the cell ran what was declared,
    or where nothing says (no forward observed, no declaration recorded: an older run, a cell that
    failed early)."""
    metrics = CellMetrics.from_dict(cell.get("metrics") or {})
    declared = given(metrics.declared)
    if not isinstance(declared, dict):
        return None
    effective = given(metrics.effective) or Effective()
    actual = effective.autocast_dtype_in_forward
    instead = []
    if "autocast_dtype" in declared and actual is not UNSET and actual != declared["autocast_dtype"]:
        instead.append(_autocast(actual))
    if declared.get("grad_scaler") is True and effective.grad_scaler_in_run is False:
        instead.append("without a grad scaler")
    return " and ".join(instead) or None


def asked_and_ran(cell: dict) -> str:
    """'fp16-mixed asks for float16 autocast and a grad scaler; under accelerate on cpu the model's
    first forward ran without autocast' (for a cell that did not exercise its precision:
    ran_instead is not None)."""
    declared = given(CellMetrics.from_dict(cell.get("metrics") or {}).declared) or {}
    asked = declared.get("autocast_dtype")
    scaler = " and a grad scaler" if declared.get("grad_scaler") is True else ""
    return (
        f"{cell['precision']} asks for {'no autocast' if asked is None else asked + ' autocast'}{scaler}; "
        f"under {cell['engine']} on {cell['device']} the model's first forward ran {ran_instead(cell)}"
    )


def not_exercised_line(cell: dict) -> str | None:
    """One sentence for a cell whose precision was not exercised: what was asked for and what
    ran (the autocast and the parameters' dtypes); None for a cell that exercised it."""
    instead = ran_instead(cell)
    if instead is None:
        return None
    effective = given(CellMetrics.from_dict(cell.get("metrics") or {}).effective) or Effective()
    parameters = given(effective.parameter_dtypes)
    weights = f", parameters {', '.join(sorted(parameters))}" if isinstance(parameters, dict) and parameters else ""
    return asked_and_ran(cell) + weights


def passed_without_precision(cells: list[dict]) -> list[dict]:
    """The passed cells that did not exercise their precision (counted among the passed)."""
    return [cell for cell in cells if cell.get("outcome") == "passed" and ran_instead(cell) is not None]
