"""Checks a matrix run of this example, as `nox -s downstream` runs it: exit status 1, with one
line per broken expectation, unless the run shows what the example is for.

    python check_results.py REPORT_DIR [--checkout DIR]

REPORT_DIR is the run's --report-dir (its `latest` run is read) or a results.json. Run it from
this directory with the Python that ran the matrix: it imports `matrix` the way pytest did.
--checkout names the matrix's source checkout, whose matrix/ the imported package must not be.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import shlex
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from downstream_models import CATALOGUE
from downstream_models.bag_classifier import BagClassifier

import matrix

HERE = Path(__file__).resolve().parent
PACKAGE_DATA = (
    "catalogue/known_failures.toml",
    "releases/stacks.toml",
    "results/results.schema.json",
    "checks/curve_spread.json",
)


def entries(text: str) -> list[dict]:
    return tomllib.loads(text).get("entry", [])


def selected_by_trait(entry: dict, cell: dict, traits: frozenset[str]) -> bool:
    """Whether one of the entry's selectors that names traits, and no model, matches the cell:
    the entry reaches this kind through its trait alone (the format of matrix/catalogue/known_failures.toml)."""
    for selector in entry["cells"]:
        if "trait" not in selector or "model" in selector:
            continue
        if all(_holds(axis, values, cell, traits) for axis, values in selector.items()):
            return True
    return False


def _holds(axis: str, values: list, cell: dict, traits: frozenset[str]) -> bool:
    """One key of a selector: a trait, `not_<axis>` (any value but those), or an axis."""
    if axis == "trait":
        return bool(set(values) & traits)
    if axis.startswith("not_"):
        return cell[axis.removeprefix("not_")] not in values
    return cell[axis] in values


def rerun(cell: dict) -> int:
    """The cell's recorded re-run command, with this Python's pytest; --no-report keeps it from
    writing a reports/ folder into the example."""
    command = shlex.split(cell["rerun"])
    if command[0] != "pytest":
        raise SystemExit(f"{cell['id']}: rerun does not start with pytest: {cell['rerun']}")
    print(f"re-running {cell['id']} ({cell['outcome']}): {cell['rerun']}", flush=True)
    return subprocess.run([sys.executable, "-m", *command, "--no-report", "-q"], cwd=HERE).returncode


def check(results: dict, checkout: Path | None) -> list[str]:
    problems = []
    kind = BagClassifier()
    cells = [c for c in results["cells"] if c["model"] == kind.name]
    by_outcome: dict[str, list[dict]] = {}
    for cell in results["cells"]:
        by_outcome.setdefault(cell["outcome"], []).append(cell)
    print("outcomes:", {outcome: len(found) for outcome, found in sorted(by_outcome.items())})

    # (a) the downstream kind ran
    passed = [c for c in cells if c["outcome"] == "passed"]
    if not passed:
        problems.append(f"no {kind.name} cell passed ({len(cells)} selected)")

    # (b) this project's own entry explained failures
    own_ids = {e["id"] for e in entries(CATALOGUE.read_text())}
    claims = {}
    for cell in cells:
        if cell["outcome"] == "known":
            claims.setdefault(cell["known_failure"]["id"], []).append(cell["id"])
    for entry_id, claimed in sorted(claims.items()):
        print(f"{entry_id} claimed {len(claimed)}: {', '.join(sorted(claimed))}")
    if not own_ids & set(claims):
        problems.append(f"no {kind.name} cell is known through this project's entries ({', '.join(sorted(own_ids))})")

    # (c) a built-in entry reached this kind through a trait the harness observed on it (the kind
    # declares none; every record carries what the catalogue matched)
    traits = frozenset(next(c["metrics"]["kind"]["traits"] for c in cells if "kind" in c["metrics"]))
    builtin = entries(importlib.resources.files("matrix").joinpath("catalogue", "known_failures.toml").read_text())
    by_trait = [
        (entry["id"], cell["id"])
        for entry in builtin
        for cell in cells
        if cell["outcome"] == "known"
        and cell["known_failure"]["id"] == entry["id"]
        and selected_by_trait(entry, cell, traits)
    ]
    for entry_id, cell_id in by_trait:
        print(f"built-in {entry_id} claimed {cell_id} through the trait")
    if not by_trait:
        problems.append(f"no built-in entry selecting by trait ({', '.join(sorted(traits))}) claimed a cell")

    # (d) nothing unexplained
    for cell in by_outcome.get("failed", []):
        problems.append(f"new failure: {cell['id']}: {cell['signature']['text']}")

    # (e) the matrix is the installed wheel, carrying its data
    package = Path(matrix.__file__).resolve().parent
    print(f"matrix imported from {package}")
    if checkout is not None and package.is_relative_to((checkout / "matrix").resolve()):
        problems.append(f"matrix was imported from the checkout ({package}), not from the installed wheel")
    for name in PACKAGE_DATA:
        if not importlib.resources.files("matrix").joinpath(name).is_file():
            problems.append(f"the installed matrix package lacks {name}")

    # (f) the recorded re-run commands work: one passed cell, and one this project's entry explains
    known_own = [c for c in cells if c["outcome"] == "known" and c["known_failure"]["id"] in own_ids]
    for cell in passed[:1] + known_own[:1]:
        status = rerun(cell)
        if status != 0:
            problems.append(f"re-running {cell['id']} exited {status}: {cell['rerun']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="the run's --report-dir, or a results.json")
    parser.add_argument("--checkout", type=Path, help="the matrix's source checkout")
    args = parser.parse_args(argv)
    path = args.report if args.report.suffix == ".json" else args.report / "latest" / "results.json"
    problems = check(json.loads(path.read_text()), args.checkout)
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    print("downstream example: all checks passed" if not problems else f"{len(problems)} check(s) failed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
