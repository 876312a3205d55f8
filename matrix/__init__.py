"""Mixed-precision regression matrix for the PyTorch LLM stack.

The package's folders are its layers, bottom to top: a module imports its own folder and the
folders below it, never one above (matrix/tools/import_graph.py LAYERS; tests/test_import_graph.py
fails on an upward import). Each folder's __init__.py maps its modules.

  grid/            - what a cell is: its axes, the registry, the settings the grid holds constant,
                     the schedule, the packages a value needs
  results/         - torch-free: records, signatures, curves' records, recording, every report
                     format, diff
  shards/          - a run split across machines (--shard K/N), and the merge of their reports
  checks/          - what a cell asserts, and the tolerances as data
  precisions/      - the precision axis: its policies, float8 training, quantized bases
  devices/         - the device axis, one file per device, and the machine's fingerprint
  models/          - the model axis, one file per kind; what the harness observes of a kind
  harness/         - a cell's phases and every check, for every engine; the cell's state,
                     measurements, references, resume, a kind's one-time work
  engines/         - the engine axis, one file per engine; libraries/ several engines share
  selection/       - the grid enumerated over the registries: --model a,b, the cell an id names
  catalogue/       - the known failures, their selectors and conditions
  execute/         - running a cell, in this process or on the ranks of a process group
  explore/         - hypothesis exploration of the variants the grid does not run
  run/             - python -m matrix run: the crash-surviving supervisor; the options table
  plugin/          - pytest: hooks, fixtures, the matrix's two tests
  releases/        - stacks, sweeps, bisection, standalone repro scripts and triage
  tools/           - the bench, the import graph, the curve spread's measurement
  golden/          - data: the golden curves of each stack (curves-<stack>.json) and the initial
                     weights they start from (initial/<kind>.safetensors), written by nox -s curves
  __main__.py      - python -m matrix: run, fold, bisect, sweep, releases, repro, triage, replay,
                     diff, merge, curves, compatibility

The flat package's module paths (matrix.grid.cell, matrix.harness.pipeline, ...) still import, with a
DeprecationWarning, for one release: results/module_moves.py says where each went.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from pathlib import Path

from matrix.results.module_moves import new_name


def _in_package(fullname: str) -> bool:
    """Whether a module of that name is in the package's own folders (not through an alias)."""
    place = Path(__path__[0]).joinpath(*fullname.split(".")[1:])
    return place.with_suffix(".py").is_file() or (place / "__init__.py").is_file()


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The flat package's old module paths (matrix.grid.cell, matrix.harness.pipeline, ...) resolved to the
    modules they became, with a DeprecationWarning, for one release (docs/extending.md). A path
    that exists in the package (matrix.checks.assertions, a folder now) is never aliased."""

    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname) if fullname.startswith("matrix.") else None
        if new is None or _in_package(fullname):
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=new)

    def create_module(self, spec):
        warnings.warn(
            f"{spec.name} is {spec.origin} now; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(spec.origin)
        self._kept_spec = module.__spec__  # importlib sets the alias's spec on it: put back below
        return module

    def exec_module(self, module):
        module.__spec__ = self._kept_spec


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
