"""Property-based exploration of one target cell: hypothesis draws variants (matrix/explore/strategies.py)
and checks the property

    a variant that runs in fp32 runs in the target's precision too, within the precision's
    tolerance of the fp32 result (each cell's own check against an fp32 copy of its weights)

with the target's model, mode, device and engine. A variant that breaks it is shrunk to a
minimal one and becomes a finding: its signature, whether the catalogue knows it, the minimal
variant, which of its settings are needed (each reverted to the base alone), and the command
that replays it. After a finding the search goes on with that signature accepted, to find
other failures, until the budget or the number of findings is spent.

Budget: `examples` variants at most per target (hypothesis' max_examples), `seconds` of wall
time; once the time is spent, no new variant runs and hypothesis keeps the smallest failure
it already has. With a seed and an examples budget the search is deterministic.
"""

from __future__ import annotations

import shlex
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from random import Random

from hypothesis import HealthCheck, Phase, Verbosity, find, settings
from hypothesis.errors import NoSuchExample

from matrix.catalogue.entries import Catalogue
from matrix.engines import ENGINES
from matrix.execute.cell_run import CellResult, run_cell
from matrix.explore.strategies import base_variant, explored_fields, variants
from matrix.grid.cell import Cell
from matrix.grid.variants import InvalidVariant, Variant, to_json
from matrix.models import MODELS
from matrix.results.records import known_failure_record

REFERENCE_PRECISION = "fp32"


@dataclass(frozen=True)
class Budget:
    examples: int = 50  # variants tried per target, at most
    seconds: float = 60.0  # wall time per target
    seed: int = 0
    findings: int = 3  # distinct failures per target, at most


@dataclass
class Finding:
    result: CellResult  # the minimal variant's run in the target precision
    variant: Variant
    differs_from_base: dict
    known_as: str | None
    needed: dict[str, str] = field(default_factory=dict)  # setting -> why it is (not) needed
    replay: str = ""
    repro: str | None = None

    @property
    def status(self) -> str:
        return "known" if self.known_as else "new"


@dataclass
class Exploration:
    target: Cell
    budget: Budget
    fields: tuple[str, ...]
    base: Variant
    examples_run: int = 0  # variants run in the target precision
    fp32_runs: int = 0
    fp32_failures: int = 0  # variants whose fp32 run failed: not findings, counted here
    fp32_failure_examples: dict = field(default_factory=dict)  # signature text -> one such variant
    stopped_by: str = "examples"
    wall_s: float = 0.0
    findings: list[Finding] = field(default_factory=list)


def replay_command(target: Cell, variant: Variant, fields: tuple[str, ...], plugins: tuple[str, ...] = ()) -> str:
    """`plugins`: the run's -p arguments, without which a plugin's model kind is unknown."""
    return shlex.join(["python", "-m", "matrix", "replay", *plugins, target.id, "--variant", to_json(variant, fields)])


def known_entry(catalogue: Catalogue, installed: dict, target: Cell, signature_text: str):
    """The catalogue entry that explains this failure: one that selects the target first, then
    any entry in force on these versions with the same signature."""
    matching = [e for e in catalogue.entries if e.versions_hold(installed) and e.matches(signature_text)]
    return next((e for e in matching if e.selects(target)), matching[0] if matching else None)


class Search:
    """The runs of one exploration, each variant run at most once per precision."""

    def __init__(self, target: Cell, budget: Budget, workdir: Path, device_index: int) -> None:
        self.target, self.budget, self.workdir, self.device_index = target, budget, workdir, device_index
        self.reference = Cell(target.model, REFERENCE_PRECISION, target.mode, target.device, target.engine)
        self.results: dict[tuple[str, Variant], CellResult] = {}
        self.deadline = time.monotonic() + budget.seconds
        self.runs = 0

    @property
    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def run(self, cell: Cell, variant: Variant) -> CellResult:
        key = (cell.precision, variant)
        if key not in self.results:
            self.runs += 1
            directory = self.workdir / f"run-{self.runs}"
            try:
                self.results[key] = run_cell(cell, directory, self.device_index, variant=variant)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
        return self.results[key]

    @property
    def examples_run(self) -> int:
        """Distinct variants run in the target precision."""
        return sum(precision == self.target.precision for precision, _ in self.results)

    def ran(self, cell: Cell, variant: Variant) -> bool:
        return (cell.precision, variant) in self.results

    def failure(self, variant: Variant) -> CellResult | None:
        """The target's failure for a variant that passes in fp32; None if it passes, or if
        fp32 fails too (the property says nothing then)."""
        if self.run(self.reference, variant).outcome != "passed":
            return None
        result = self.run(self.target, variant)
        return result if result.outcome == "failed" else None


def explore(
    target: Cell,
    budget: Budget,
    workdir: Path,
    catalogue: Catalogue,
    installed: dict,
    device_index: int = 0,
    plugins: tuple[str, ...] = (),
) -> Exploration:
    kind, engine = MODELS[target.model], ENGINES[target.engine]
    fields = explored_fields(kind, engine)
    started = time.monotonic()
    search = Search(target, budget, workdir, device_index)
    exploration = Exploration(target=target, budget=budget, fields=fields, base=base_variant(kind, engine))
    strategy = variants(kind, engine)
    accepted: set[str] = set()  # signatures already reported by this exploration

    def violates(variant: Variant) -> bool:
        if not search.ran(search.target, variant) and search.out_of_time:
            return False  # no new runs once the time is spent; shrinking keeps what it has
        result = search.failure(variant)
        return result is not None and result.signature.text not in accepted

    round_number = 0
    while len(exploration.findings) < budget.findings:
        remaining = budget.examples - search.examples_run
        if remaining <= 0 or search.out_of_time:
            break
        quiet = settings(
            database=None,
            max_examples=remaining,
            deadline=None,
            phases=(Phase.generate, Phase.shrink),
            suppress_health_check=list(HealthCheck),
            verbosity=Verbosity.quiet,
        )
        try:
            seed = Random(f"{budget.seed}:{target.id}:{round_number}")
            minimal = find(strategy, violates, settings=quiet, random=seed)
        except NoSuchExample:
            break
        round_number += 1
        signature = search.failure(minimal).signature.text
        accepted.add(signature)
        minimal = simplify(search, kind, minimal, exploration.base, fields, signature)
        result = search.failure(minimal)
        entry = known_entry(catalogue, installed, target, result.signature.text)
        finding = Finding(
            result=result,
            variant=minimal,
            differs_from_base=minimal.differences(exploration.base, fields),
            known_as=entry.id if entry else None,
            replay=replay_command(target, minimal, fields, plugins),
        )
        if target.engine == "torch" and not result.signature.exc_type.startswith("matrix."):
            finding.repro = shlex.join(
                ["python", "-m", "matrix", "repro", *plugins, target.id, "--variant", to_json(minimal, fields)]
            )
        finding.needed = why_needed(search, kind, minimal, exploration.base, fields, result)
        exploration.findings.append(finding)

    exploration.examples_run = search.examples_run
    fp32 = [r for (p, _), r in search.results.items() if p == REFERENCE_PRECISION]
    exploration.fp32_runs, exploration.fp32_failures = len(fp32), sum(r.outcome != "passed" for r in fp32)
    for (precision, variant), run in search.results.items():
        if precision == REFERENCE_PRECISION and run.outcome != "passed":
            exploration.fp32_failure_examples.setdefault(run.signature.text, variant.only(fields))
    exploration.stopped_by = "seconds" if search.out_of_time else "examples"
    if len(exploration.findings) == budget.findings:
        exploration.stopped_by = "findings"
    exploration.wall_s = round(time.monotonic() - started, 2)
    return exploration


def revert_candidates(variant: Variant, base: Variant, name: str) -> list[Variant]:
    """`variant` with one setting put back towards the base's, in the ways that keep the rest
    of it meaningful (the batch keeps its rows when its padding goes; coupled sizes go back
    together when one alone would be invalid)."""
    if name == "padding" and base.padding == "none":
        return [variant.replace(padding="none", pad_counts=(0,) * variant.batch_size)]
    if name == "pad_counts":
        rows = [variant.replace(pad_counts=variant.pad_counts[:keep]) for keep in range(1, variant.batch_size)]
        unpadded = [variant.replace(pad_counts=(0,) * variant.batch_size)] if any(variant.pad_counts) else []
        return rows + unpadded
    if name == "seq_len":
        return [
            variant.replace(
                seq_len=base.seq_len, pad_counts=tuple(min(pad, base.seq_len - 1) for pad in variant.pad_counts)
            )
        ]
    if name in ("hidden_size", "num_heads", "num_kv_heads"):
        sizes = {"hidden_size": base.hidden_size, "num_heads": base.num_heads, "num_kv_heads": base.num_kv_heads}
        return [variant.replace(**{name: sizes[name]}), variant.replace(**sizes)]
    return [variant.replace(**{name: getattr(base, name)})]


def _valid(kind, variant: Variant) -> str | None:
    try:
        kind.check_variant(variant)
    except InvalidVariant as error:
        return str(error)
    return None


def simplify(search: Search, kind, variant: Variant, base: Variant, fields, signature: str) -> Variant:
    """Revert, one at a time, the settings hypothesis' shrinking left different from the
    base, keeping each revert that keeps the same failure; until none does."""
    progress = True
    while progress:
        progress = False
        for name in variant.differences(base, fields):
            for candidate in revert_candidates(variant, base, name):
                if candidate == variant or _valid(kind, candidate):
                    continue
                failure = search.failure(candidate)
                if failure is not None and failure.signature.text == signature:
                    variant, progress = candidate, True
                    break
            if progress:
                break
    return variant


def why_needed(search: Search, kind, minimal: Variant, base: Variant, fields, result: CellResult) -> dict[str, str]:
    """For each setting where the minimal variant differs from the base: revert it alone and
    say what happens. Runs even when the time budget is spent (a handful of cells)."""
    explained = {}
    for name in minimal.differences(base, fields):
        candidate = revert_candidates(minimal, base, name)[-1]
        problem = _valid(kind, candidate)
        if problem:
            explained[name] = f"cannot be reverted alone ({problem})"
            continue
        if search.run(search.reference, candidate).outcome != "passed":
            explained[name] = "reverted, fp32 fails too: no verdict"
            continue
        after = search.run(search.target, candidate)
        if after.outcome == "passed":
            explained[name] = "needed: reverted alone, the cell passes"
        elif after.signature.text != result.signature.text:
            explained[name] = f"needed: reverted alone, it fails differently ({after.signature.id})"
        else:
            explained[name] = "not needed: reverted alone, the same failure"
    return explained


def exploration_record(exploration: Exploration, catalogue: Catalogue) -> dict:
    """One explored target (matrix/explore/exploration.py): its budget, what ran, and each finding."""
    findings = []
    for finding in exploration.findings:
        entry = catalogue.by_id(finding.known_as) if finding.known_as else None
        findings.append(
            {
                "status": finding.status,
                "signature": finding.result.signature.as_dict(),
                "phase": finding.result.phase,
                "message": finding.result.message,
                "known_failure": known_failure_record(entry) if entry else None,
                "variant": finding.variant.only(exploration.fields),
                "differs_from_base": finding.differs_from_base,
                "needed": finding.needed,
                "replay": finding.replay,
                "repro": finding.repro,
                "metrics": finding.result.metrics.as_dict(),
            }
        )
    budget = exploration.budget
    return {
        "target": exploration.target.id,
        **exploration.target.axes(),
        "skip_reason": None,
        "budget": {
            "examples": budget.examples,
            "seconds": budget.seconds,
            "seed": budget.seed,
            "findings": budget.findings,
        },
        "explored_fields": list(exploration.fields),
        "base_variant": exploration.base.only(exploration.fields),
        "examples_run": exploration.examples_run,
        "fp32_runs": exploration.fp32_runs,
        "fp32_failures": exploration.fp32_failures,
        "fp32_failure_examples": exploration.fp32_failure_examples,
        "stopped_by": exploration.stopped_by,
        "wall_s": exploration.wall_s,
        "findings": findings,
    }
