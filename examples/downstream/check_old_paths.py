"""This project was written against the matrix's flat package, before its modules moved into one
folder per layer: it imports matrix.variants, matrix.pytest_cases and matrix.catalogue's
register(). Those paths keep working for one release, each with a DeprecationWarning that names
the new one. `nox -s downstream` runs this after the matrix run: exit status 1, with a line per
old path that does not, else 0.

    python check_old_paths.py
"""

from __future__ import annotations

import importlib
import sys
import warnings

# the old module paths this project uses, and the modules they became
MODULES = {"matrix.variants": "matrix.grid.variants", "matrix.pytest_cases": "matrix.plugin.cases"}
# a name of an old module that is a folder now, and the module that has it
NAMES = {("matrix.catalogue", "register"): "matrix.catalogue.entries"}


def warned_about(caught, new: str) -> bool:
    return any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught)


def main() -> int:
    problems = []
    for old, new in MODULES.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        if module is not importlib.import_module(new):
            problems.append(f"{old} is not {new}")
        if not warned_about(caught, new):
            problems.append(f"importing {old} did not warn that it is {new} now")
    for (old, name), new in NAMES.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = getattr(importlib.import_module(old), name)
        if value is not getattr(importlib.import_module(new), name):
            problems.append(f"{old}.{name} is not {new}.{name}")
        if not warned_about(caught, new):
            problems.append(f"{old}.{name} did not warn that it is {new}.{name} now")
    for problem in problems:
        print(problem)
    print(f"{len(MODULES) + len(NAMES)} old paths checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
