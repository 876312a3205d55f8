"""The checks of a compiled twin and of a float8 precision: what Dynamo compiled in each phase
recorded, the compiled evaluation against its eager twin's (logits dtype and the compiled-vs-eager
row), and a float8 run's layers really converted (matrix/precisions/float8.py)."""

from __future__ import annotations

from matrix.checks import assertions as checks
from matrix.harness.cell_state import CellState
from matrix.harness.round_trips import evaluate_as_run
from matrix.precisions.policies import dtype_name
from matrix.results.metrics import Float8Record, Tolerance


def check_float8_converted(state: CellState, run) -> None:
    """A float8 cell's model, as the engine's library holds it after prepare, has float8 layers
    (converted by the harness as users do, or by the library): which ones, and which Linear
    layers were left out and why, go to the record. A run holding none is not training in float8."""
    if state.precision.float8 is None:
        return
    from matrix.precisions.float8 import record

    held = record(state.engine.weights(state, run))
    by = (
        "the library (its own fp8 setting)"
        if state.engine.converts_float8
        else "the harness, as users convert before the library"
    )
    state.metrics.float8 = Float8Record(**held, converted_by=by)
    if not held["converted"]:
        raise checks.CheckFailure(
            "float8: the run's model holds no float8 layer after prepare",
            details=f"{len(held['left_out'])} Linear layers left in high precision",
        )


def record_compiled(state: CellState) -> None:
    """What Dynamo compiled so far in a compiled twin's cell, in its record."""
    for name, value in state.compile_watch.record().items():
        setattr(state.metrics.compiled, name, value)


def check_against_eager(state: CellState, result) -> None:
    """A compiled twin's evaluation against its eager twin: the same weights evaluated without
    compile, as the run evaluates. The logits' dtype is the same (Inductor's own tests require
    it); the loss is within the compiled-vs-eager row of the precision's compute dtype."""
    if not state.engine.compiled:
        return
    from matrix.checks.tolerances import compiled_vs_eager_tolerance
    from matrix.harness.compiling import eager as eager_stance

    engine = state.engine
    with eager_stance():  # every compiled module runs eagerly, one compiled in place (FSDP2's layers) too
        if engine.owns_loop:  # the library's evaluation was taken after step k: the weights held there
            eager = evaluate_as_run(state, engine.exported(state, state.run))
        else:  # the engine's own evaluation of the run, nothing compiled
            eager = engine.checked_evaluation(engine.evaluate(state, state.run))
    record = state.metrics.compiled
    tolerance = compiled_vs_eager_tolerance(state.precision.compute_dtype)
    value = checks.check_finite_loss(result.loss, "compiled eval loss")
    reference = checks.check_finite_loss(eager.loss, "eager twin's eval loss")
    record.eager_logits_dtype = dtype_name(eager.logits.dtype)
    record.eager_loss = reference
    record.eager_deviation_abs = abs(value - reference)
    record.eager_logits_max_abs_difference = (result.logits.float() - eager.logits.float()).abs().max().item()
    record.eager_tolerance = Tolerance(**tolerance.as_dict())
    record.comparison = "within the compiled-vs-eager row of its compute dtype (Inductor fuses away roundings)"
    # a loop the library owns evaluates through wrappers the plain model lacks (the Trainer's
    # accelerate returns fp32 logits): there the dtypes are recorded, and compared only in a loop
    # whose evaluation is the harness's own through the run's module
    if not state.engine.owns_loop and result.logits.dtype != eager.logits.dtype:
        raise checks.DtypeContractBroken(
            "compiled eval logits have another dtype than the eager twin's",
            details=f"compiled {dtype_name(result.logits.dtype)}, eager {dtype_name(eager.logits.dtype)}",
        )
    checks.check_within_tolerance("compiled eval loss against the eager twin", value, reference, tolerance)
