"""Running a cell: its phases (matrix/harness/pipeline.py) with its engine, in this process or in the
ranks of a process group (run_cell), and the record that says how it went, classified against the
known-failure catalogue (run_and_record). No pytest here: the pytest plugin (matrix/plugin/hooks.py) and
`python -m matrix replay` both call these.

train: train_steps -> mid_training_eval -> checkpoint_save -> checkpoint_reload -> resumed_step
eval:  evaluate -> checkpoint_save -> checkpoint_reload

The first phase that raises ends the cell; its exception becomes the signature. Where a library
runs several phases in one call (Trainer.train() steps, evaluates and saves) and fails in a later
one than the harness is in, the exception carries the phase the library was in (`matrix_phase`),
and the phases before it count as passed. Phases after the failing one are recorded as not run.
Each phase's time is recorded. Nothing is caught that is not recorded.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from matrix.catalogue.entries import Catalogue, Entry, classify
from matrix.devices import DEVICES, poisoning_error
from matrix.engines import ENGINES
from matrix.execute import ranks
from matrix.grid.cell import Cell
from matrix.grid.packages import MissingPackage
from matrix.grid.variants import Variant
from matrix.harness import pipeline
from matrix.harness.cell_state import CellState
from matrix.harness.garbage import settle_garbage
from matrix.harness.pipeline import PHASE_NAMES
from matrix.models import MODELS
from matrix.precisions.policies import PRECISIONS, PolicyContradiction, validate
from matrix.results.metrics import CellMetrics
from matrix.results.records import CellRecord, known_failure_record
from matrix.results.signatures import Signature, is_failure, signature_of

DEADLINE_SHARE = 0.9


@dataclass
class CellResult:
    cell: Cell
    outcome: str  # passed | failed
    phase: str | None = None  # the phase that failed
    signature: Signature | None = None
    message: str | None = None  # the exception's own message, unnormalized
    traceback: str | None = None
    duration_s: float = 0.0
    phases: dict[str, str] = field(default_factory=dict)  # phase -> passed | failed | not run
    phase_seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds it took, as far as it got
    metrics: CellMetrics = field(default_factory=CellMetrics)


def _record_failure(result: CellResult, phase: str, exc: BaseException) -> None:
    result.outcome, result.phase = "failed", phase
    result.signature = signature_of(phase, exc)
    result.message = f"{type(exc).__name__}: {exc}"
    if getattr(exc, "details", None):
        result.message += f" ({exc.details})"
    result.traceback = "".join(traceback.format_exception(exc))
    if getattr(exc, "remote_traceback", None):  # raised in another process (a rank): its own traceback
        result.traceback += "\nraised in the rank as:\n" + exc.remote_traceback


def run_cell(
    cell: Cell,
    workdir: Path,
    device_index: int = 0,
    run_contradictory: bool = False,
    variant: Variant | None = None,
    timeout_s: float | None = None,
    blocked: BaseException | None = None,
    after_phase: Callable[[str], None] | None = None,
) -> CellResult:
    """Run a cell's phases. A precision policy that contradicts itself fails in the
    `configure` phase before any step runs, unless run_contradictory, which runs it anyway to
    record what the stack itself raises. A cell whose engine, kind or quantized base needs a package
    that is not installed fails there too (MissingPackage: the line its skip gives), before any
    library is imported. `device_index` picks one of an indexed device (cuda:N).
    `variant` replaces the model kind's grid settings
    (raises InvalidVariant for settings the kind cannot take). `timeout_s`: the cell's own limit;
    an engine that waits on other processes gives up at DEADLINE_SHARE of it, so that it, not
    the harness's kill, records which process did not answer. `blocked`: what stops the cell before
    it starts (its kind's one-time work ran out of its budget, matrix/harness/kind_setup.py), recorded as
    the failure of the `kind_setup` phase. `after_phase(name)` is called after each phase, and after
    `configure` (a watch over the process-global state, matrix/harness/global_state.py)."""
    settle_garbage()  # before anything of the cell exists
    kind = MODELS[cell.model] if variant is None else MODELS[cell.model].with_variant(variant)
    precision = PRECISIONS[cell.precision]
    if kind.variant.grad_accumulation is not None:
        precision = dataclasses.replace(precision, grad_accumulation=kind.variant.grad_accumulation)
    engine = ENGINES[cell.engine]
    state = CellState.begin(
        cell,
        kind,
        precision,
        DEVICES[cell.device].torch_device(device_index),
        workdir,
        engine=engine,
        deadline=None if timeout_s is None else time.monotonic() + DEADLINE_SHARE * timeout_s,
    )
    if variant is not None:
        state.metrics.variant = kind.variant.only(kind.variant_fields)
    names = PHASE_NAMES[cell.mode]
    result = CellResult(cell=cell, outcome="passed", metrics=state.metrics)
    result.phases = {name: "not run" for name in names}
    start = time.perf_counter()
    if blocked is not None:
        _record_failure(result, "kind_setup", blocked)
        return result
    if precision.contradictions():
        state.metrics.policy_contradictions = precision.contradictions()
        if not run_contradictory:
            try:
                validate(precision)
            except PolicyContradiction as exc:
                _record_failure(result, "configure", exc)
                return result
    try:  # a package the engine, the kind or its quantized base needs: named at once, not from inside a rank
        engine.require()
        kind.require(precision)
    except MissingPackage as exc:
        _record_failure(result, "configure", exc)
        return result
    run_phase = ranks.run_phase if engine.distributed else pipeline.run_phase
    after_phase = after_phase or (lambda name: None)
    after_phase("configure")
    try:
        for name in names:
            began = time.perf_counter()
            try:
                run_phase(state, name)
            except BaseException as exc:  # recorded: signature, message and full traceback
                if not is_failure(exc):
                    raise
                failed = getattr(exc, "matrix_phase", None) or name
                if failed not in names[names.index(name) :]:
                    failed = name  # a phase outside this mode's remaining ones
                for earlier in names[names.index(name) : names.index(failed)]:
                    result.phases[earlier] = "passed"
                _record_failure(result, failed, exc)
                result.phases[failed] = "failed"
                break
            finally:
                result.phase_seconds[name] = round(time.perf_counter() - began, 4)
                after_phase(name)
            result.phases[name] = "passed"
    finally:
        _record_matmul_getter(state)
        _end(state)
    result.duration_s = round(time.perf_counter() - start, 4)
    return result


def _record_matmul_getter(state: CellState) -> None:
    """Whether the phases left the legacy fp32 matmul precision getter refusing (what a cell
    condition of the catalogue reads), before anything of the cell is put back."""
    from matrix.harness.global_state import legacy_matmul_getter_refuses
    from matrix.results.metrics import Effective, given

    if given(state.metrics.effective) is None:
        state.metrics.effective = Effective()
    state.metrics.effective.legacy_matmul_getter_refused = legacy_matmul_getter_refuses()


def _end(state: CellState) -> None:
    """Whatever the cell leaves behind goes: its hooks, its runs, the library's global state."""
    state.hooks.remove()  # a cell whose hooks never fired leaves no global hook behind
    engine = state.engine
    if engine.distributed:
        ranks.end_cell(state)
        return
    try:
        for run in (state.run, state.restored):
            if run is not None:
                engine.close(state, run)
    finally:
        engine.cleanup(state)


@dataclass(frozen=True)
class RecordedCell:
    """A cell run and classified: its record, the catalogue entries in force for it (a known
    failure is one of them), and the process-poisoning error it hit, if any."""

    record: CellRecord
    result: CellResult
    claims: list[Entry]
    entry: Entry | None
    poison: str | None

    @property
    def outcome(self) -> str:
        return self.record.outcome


def hardware_not_holding(entry: Entry, outcome: str) -> list[str] | None:
    """An inapplicable cell's entry: its hardware conditions that do not hold on this machine."""
    if outcome != "inapplicable":
        return None
    from matrix.catalogue.entries import local_context

    return [str(requirement) for requirement in entry.unmet(local_context(), "hardware")]


def run_and_record(
    cell: Cell,
    workdir: Path,
    catalogue: Catalogue,
    installed: dict[str, str | None],
    *,
    device_index: int = 0,
    run_contradictory: bool = False,
    rerun: str | None = None,
    timeout_s: float | None = None,
    claims: list[Entry] | None = None,
    blocked: BaseException | None = None,
    after_phase: Callable[[str], None] | None = None,
) -> RecordedCell:
    """Run the cell and make its record: passed, or failed as a catalogue entry in force says
    (known), or failed as none says (failed: new), or passed against an entry's claim (fixed), or
    passed where an entry's hardware condition does not hold here (inapplicable).
    `claims`: the entries in force for the cell, where the caller has asked already."""
    if claims is None:
        claims = catalogue.in_force(cell, installed)
    result = run_cell(
        cell,
        workdir,
        device_index,
        run_contradictory=run_contradictory,
        timeout_s=timeout_s,
        blocked=blocked,
        after_phase=after_phase,
    )
    signature = result.signature
    # an entry whose hardware condition does not hold here: a pass it selects is not applicable here
    inapplicable = catalogue.inapplicable(cell, installed) if result.outcome == "passed" else []
    outcome, entry = classify(
        result.outcome, signature.text if signature else None, claims, result.metrics.as_dict(), inapplicable
    )
    record = CellRecord.of(
        cell,
        outcome,
        phase=result.phase,
        phases=result.phases,
        signature=signature.as_dict() if signature else None,
        message=result.message,
        traceback=result.traceback,
        known_failure=known_failure_record(entry, not_holding=hardware_not_holding(entry, outcome)) if entry else None,
        duration_s=result.duration_s,
        phase_seconds=result.phase_seconds,
        metrics=result.metrics,
        **DEVICES[cell.device].placement(device_index),
        rerun=rerun,
    )
    poison = poisoning_error(result.message) if result.outcome == "failed" else None
    return RecordedCell(record, result, claims, entry, poison)


KEPT_OUTCOMES = ("failed",)  # a failure the catalogue does not explain: its files are the evidence


def tidy_workdir(workdir: Path, outcome: str, *, keep: bool = False) -> bool:
    """Remove the cell's working directory once its record is made, unless the outcome is a new
    failure or `keep` is asked for. It holds the cell's checkpoints and exports and its ranks'
    files: for a real pretrained model that is hundreds of MB a cell, and a run that kept every
    cell's filled a CI disk (No space left on device). A run's disk use is bounded by its new
    failures. True when the directory was removed."""
    if keep or outcome in KEPT_OUTCOMES or not workdir.exists():
        return False
    shutil.rmtree(workdir)
    return True
