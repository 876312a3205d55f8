"""Exploration: hypothesis searches over the variants the grid does not run.

  exploration.py   - a search over one cell's variants, and a finding shrunk and explained
  strategies.py    - what an exploration draws: the variants a kind and an engine can take
  clock.py         - the explorations' wall-time budget shared out over a run's targets

python -m matrix run --explore runs them; they never slow the default matrix down.
"""

from matrix.results.module_moves import forwarded


def __getattr__(name: str):  # the flat module matrix.explore's names, for one release (docs/extending.md)
    return forwarded("matrix.explore", name, __path__)
