"""The pytest plugin (entry point `pytest11: matrix`, or `-p matrix.plugin` from a checkout). This
package is the module pytest registers: it names the hooks and fixtures below.

  hooks.py         - the hooks: options added, configuration, the matrix's tests parametrized with
                     the cells, their environment while they run, collection
  session.py       - the matrix's side of a session: pytest's stash, options read back checked,
                     activate() (registries, selection, catalogue: once per process, when first needed)
  parametrize.py   - the cells a session runs (selection, --shard, --order-seed) and their skip marks
  fixtures.py      - test_cell's fixtures: isolated_torch_state, established_kind
  recorder.py      - the recording of a run as pytest reports its cells (the controller's)
  cases.py         - the matrix's two tests, test_cell and test_explore (cases/ imports them)

Importing it imports pytest, the standard library and the matrix's torch-free modules only.
"""

from matrix.plugin.fixtures import established_kind, isolated_torch_state
from matrix.plugin.hooks import (
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_generate_tests,
    pytest_runtest_protocol,
)
from matrix.results.module_moves import forwarded

__all__ = [
    "established_kind",
    "isolated_torch_state",
    "pytest_addoption",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_generate_tests",
    "pytest_runtest_protocol",
]


def __getattr__(name: str):  # the flat module matrix.plugin's other names, for one release (docs/extending.md)
    return forwarded("matrix.plugin", name, __path__)
