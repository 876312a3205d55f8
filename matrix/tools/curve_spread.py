"""The measured spread of right engines' loss curves: what the curve rows are derived from.

    python -m matrix.tools.curve_spread RUN [RUN ...] [-o matrix/checks/curve_spread.json]

reads the results.json of each RUN (a report directory or the file) and writes, per reference
(the torch engine, the fp32 twin), engine family (curves.FAMILIES) and row (tolerances.curve_row_key:
the compute dtype, or a quantized base's scheme against the fp32 twin), the largest deviation of
a right engine from its reference, in units of the rows' shape (tolerances.CURVE_FORM): the cell,
the step, the two numbers, and how many comparisons it is the largest of. matrix/checks/tolerances.py
derives every curve row from that file (CURVE_SAFETY times the largest), so the file is the one
place the measurement lives; rerun this after a run of the cells whose rows should change.

A right engine: a comparison that was made (not unchecked, its reference trained), of a cell that
is not a new failure, and that no catalogue entry in force claims with a CurveDiverged signature
(an entry whose mechanism moves the curve: DeepSpeed ZeRO-0's AdamW stepped at construction claims
every ZeRO-0 cell whose probe reads a step, passing or not). The entries are judged with the
versions the run recorded, its curve length and each cell's metrics; a hardware condition is taken
to hold (a wrong engine is left out on any machine).

A row the runs given do not measure keeps what the file held for it, and the run it names stays
listed (float8's: its cells need torchao, measured where it was installed).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from matrix.checks.tolerances import CURVE_SPREAD_FILE, curve_form, curve_row_key
from matrix.results import curves

# the comparisons of a cell's curve record (results.json metrics.curve), by reference
REFERENCES = {"torch_engine": curves.TORCH_ENGINE, "fp32_twin": curves.FP32_TWIN}
FORMAT = 1


@dataclass
class Worst:
    share: float
    entry: dict


def results_of(path: Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "latest" / "results.json" if (path / "latest").exists() else path / "results.json"
    return json.loads(path.read_text())


def row_of(cell: dict, reference: str) -> str | None:
    """The row a cell's curve was judged in against `reference` (against_references.curve_compute_dtype's rule):
    None for a precision not registered here."""
    from matrix.checks.tolerances import curve_row_dtype
    from matrix.precisions.policies import PRECISIONS

    precision = PRECISIONS.get(cell["precision"])
    if precision is None:
        return None
    effective = (cell.get("metrics") or {}).get("effective") or {}
    dtype = curve_row_dtype(precision.compute_dtype, effective.get("autocast_dtype_in_forward"))
    scheme = precision.quantization.scheme if precision.quantization is not None else None
    return curve_row_key(dtype, scheme if reference == curves.FP32_TWIN else None)


def family_of(engine: str) -> str:
    from matrix.catalogue.entries import engine_traits_of
    from matrix.engines.traits import curve_family

    return curve_family(engine_traits_of(engine))


def curve_entries_claiming(cell: dict, run: dict, packages: dict, reference: str, catalogue=None) -> list[str]:
    """The catalogue entries in force for the cell (but for hardware) whose signature is this
    reference's CurveDiverged: the cell's engine is not a right one there. `catalogue`: the built-in
    one and those registered (catalogue.assemble()) where not given."""
    from matrix.catalogue.conditions import Context
    from matrix.catalogue.entries import assemble
    from matrix.selection.cells import Cell

    text = f"train_steps: matrix.checks.CurveDiverged: the training loss curve leaves the {reference}'s at step <n>"
    subject = Cell(cell["model"], cell["precision"], cell["mode"], cell["device"], cell["engine"])
    settings = Context(run={"train_steps": run.get("curve_steps")}, metrics=cell.get("metrics"))
    return [
        entry.id
        for entry in (catalogue or assemble()).entries
        if entry.matches(text)
        and entry.selects(subject)
        and entry.versions_hold(packages)
        and not entry.unmet(settings, "run")
        and not entry.unmet(settings, "cell")
    ]


def measure(documents: list[dict]) -> tuple[dict[tuple[str, str, str], dict], list[dict], set[str]]:
    """(reference, family, row) -> the spread entry; the comparisons left out, with why; and the
    model kinds whose right engines were measured (the rows hold for them: matrix/checks/tolerances.py)."""
    from matrix.catalogue.entries import assemble

    catalogue = assemble()
    worst: dict[tuple[str, str, str], Worst] = {}
    counts: dict[tuple[str, str, str], int] = {}
    left_out = []
    kinds: set[str] = set()
    for document in documents:
        run, packages = document["run"], document["environment"].get("packages") or {}
        for cell in document["cells"]:
            curve = (cell.get("metrics") or {}).get("curve") or {}
            for field, reference in REFERENCES.items():
                comparison = curve.get(field) or {}
                deviations, losses = comparison.get("deviations"), comparison.get("reference_losses")
                if not deviations or not losses:
                    continue
                why = None
                if cell.get("outcome") == "failed":
                    why = f"a new failure ({cell.get('signature') or cell.get('phase')}): look at it first"
                elif claimed := curve_entries_claiming(cell, run, packages, reference, catalogue):
                    why = f"a known wrong engine here: {', '.join(claimed)}"
                if why:
                    left_out.append({"run": run["id"], "cell": cell["id"], "reference": reference, "why": why})
                    continue
                row = row_of(cell, reference)
                if row is None:
                    continue
                key = (reference, family_of(cell["engine"]), row)
                counts[key] = counts.get(key, 0) + 1
                kinds.add(cell["model"])
                for step, (deviation, expected) in enumerate(zip(deviations, losses, strict=False), start=1):
                    share = deviation / curve_form(step, expected)
                    if key not in worst or share > worst[key].share:
                        worst[key] = Worst(
                            share,
                            {
                                "cell": cell["id"],
                                "run": run["id"],
                                "curve_steps": run.get("curve_steps"),
                                "step": step,
                                "deviation": deviation,
                                "reference_loss": expected,
                            },
                        )
    spread = {
        key: {
            "reference": key[0],
            "family": key[1],
            "row": key[2],
            "comparisons": counts[key],
            "worst": w.entry,
        }
        for key, w in worst.items()
    }
    return spread, left_out, kinds


def run_line(document: dict) -> dict:
    run, environment = document["run"], document["environment"]
    packages = environment.get("packages") or {}
    return {
        "id": run["id"],
        "command": run.get("command"),
        "curve_steps": run.get("curve_steps"),
        "cpu": environment.get("cpu"),
        "packages": {name: version for name, version in packages.items() if version},
    }


def document_of(documents: list[dict], previous: dict | None, command: str) -> dict:
    spread, left_out, kinds = measure(documents)
    # a row these runs do not measure keeps its entry, and the runs it names stay listed
    kept = [e for e in (previous or {}).get("spread", []) if (e["reference"], e["family"], e["row"]) not in spread]
    named = {e["worst"]["run"] for e in kept}
    runs = [run_line(d) for d in documents]
    runs += [r for r in (previous or {}).get("runs", []) if r["id"] in named and r["id"] not in {n["id"] for n in runs}]
    entries = sorted([*spread.values(), *kept], key=lambda e: (e["reference"], e["family"], e["row"]))
    return {
        "format": FORMAT,
        "about": (
            "The largest deviation of a right engine's loss curve from its reference, per reference, engine family "
            "and row; matrix/checks/tolerances.py derives the curve rows from it. "
            "Written by python -m matrix.tools.curve_spread."
        ),
        "made_by": command,
        "form": (
            "a row is CURVE_SAFETY x the largest |loss - reference| / CURVE_FORM.allowed(step, reference), "
            "in CURVE_FORM's shape (matrix/checks/tolerances.py)"
        ),
        "runs": runs,
        # the kinds measured: a row derived here holds for them; another kind (an architecture, a
        # user's model) is judged by the rows written before any measurement (tolerances.py)
        "kinds": sorted(kinds | set((previous or {}).get("kinds", []))),
        "spread": entries,
        "left_out": left_out,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m matrix.tools.curve_spread", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="report directories or results.json files")
    parser.add_argument("-o", "--output", type=Path, default=CURVE_SPREAD_FILE, help=f"default: {CURVE_SPREAD_FILE}")
    args = parser.parse_args(argv)
    documents = []
    for path in args.runs:
        try:
            documents.append(results_of(path))
        except (OSError, ValueError) as error:
            print(f"python -m matrix.tools.curve_spread: {path}: {error}", file=sys.stderr)
            return 2
    previous = json.loads(args.output.read_text()) if args.output.exists() else None
    command = "python -m matrix.tools.curve_spread " + " ".join(str(p) for p in args.runs)
    document = document_of(documents, previous, command)
    args.output.write_text(json.dumps(document, indent=1) + "\n")
    print(
        f"written: {args.output} ({len(spread_rows := document['spread'])} rows, "
        f"{sum(e['comparisons'] for e in spread_rows)} comparisons of right engines, "
        f"{len(document['left_out'])} left out)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
